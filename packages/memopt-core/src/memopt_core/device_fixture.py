"""The ``device`` pytest fixture the memopt packages' tests share (needs pytest; tests only).

Every test that takes ``device`` runs once per device: ``cpu`` always, ``cuda`` marked ``gpu``
and skipped (with the reason) where CUDA is absent, so a GPU test never turns into a silent pass
on a CPU machine (``nox -s gpu_tests`` selects ``-m gpu`` and fails without a GPU). A package's
``tests/conftest.py`` imports it: ``from memopt_core.device_fixture import device``; its pytest
configuration must declare the ``gpu`` marker.

Distributed tests parametrize over :data:`DIST_DEVICES`: ``cpu`` (2 processes over gloo) and
``cuda`` (NCCL, one GPU per rank), marked ``gpu(min_devices=2)`` by :func:`gpus` and skipped with
the reason on hosts with fewer GPUs.
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["DEVICES", "DIST_DEVICES", "device", "gpus"]


def gpus(n: int) -> list[pytest.MarkDecorator]:
    """Marks of a test that needs ``n`` CUDA devices: ``gpu(min_devices=n)`` (selected by
    ``-m gpu``) and a skip saying so where fewer are present."""
    return [
        pytest.mark.gpu(min_devices=n),
        pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA devices"),
    ]


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]

#: devices of the 2-rank distributed tests: gloo on the CPU, NCCL on 2 GPUs
DIST_DEVICES = ["cpu", pytest.param("cuda", marks=gpus(2))]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """The device a test runs on (parametrized: cpu, cuda)."""
    return torch.device(request.param)
