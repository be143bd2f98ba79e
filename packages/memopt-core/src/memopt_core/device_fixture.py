"""The ``device`` pytest fixture the memopt packages' tests share (needs pytest; tests only).

Every test that takes ``device`` runs once per device: ``cpu`` always, ``cuda`` marked ``gpu``
and skipped (with the reason) where CUDA is absent, so a GPU test never turns into a silent pass
on a CPU machine (``nox -s gpu_tests`` selects ``-m gpu`` and fails without a GPU). A package's
``tests/conftest.py`` imports it: ``from memopt_core.device_fixture import device``; its pytest
configuration must declare the ``gpu`` marker.
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["DEVICES", "device"]

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


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """The device a test runs on (parametrized: cpu, cuda)."""
    return torch.device(request.param)
