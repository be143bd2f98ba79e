"""Shared fixtures of memopt-kernels-triton's tests.

Where CUDA is absent the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` is set
here, before any kernel module is imported (Triton reads it when a kernel is decorated). Where
CUDA is present and ``TRITON_INTERPRET`` is unset the kernels compile for the GPU.

``device``: ``cpu`` (the interpreter; skipped with the reason when this session compiles for
CUDA) and ``cuda`` (marked ``gpu``; skipped with the reason without a CUDA device or under the
interpreter), so a GPU test never turns into a silent pass on a CPU machine.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")
_MISSING = [m for m in ("triton", "numpy") if importlib.util.find_spec(m) is None]
_MISSING_REASON = (
    f"needs {' and '.join(_MISSING)} (the Triton interpreter runs kernels through numpy): "
    'pip install "packages/memopt-kernels-triton[test]" from a checkout'
)

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not INTERPRETING, reason="CPU tensors run under TRITON_INTERPRET=1 only"
        ),
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA device"),
            pytest.mark.skipif(
                INTERPRETING, reason="GPU tests compile kernels: unset TRITON_INTERPRET"
            ),
        ],
    ),
]


def pytest_collection_modifyitems(config, items):
    if not _MISSING:
        return
    skip = pytest.mark.skip(reason=_MISSING_REASON)
    for item in items:
        if {"device", "ops"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """The device a test runs on (parametrized: cpu under the interpreter, cuda)."""
    return torch.device(request.param)


@pytest.fixture
def ops():
    """``memopt_kernels_triton.ops`` (imports triton)."""
    from memopt_kernels_triton import ops as module

    return module


class LaunchCounter:
    """The fused kernel launches since the last :meth:`take`: ``PreparedStep.launch`` (host
    scalars, one group) and ``launch_hyper`` (per-tensor device words: a merged launch), each
    with the number of tensors it covered. The launches still run."""

    def __init__(self, monkeypatch, ops) -> None:
        self.calls: list[tuple[str, int]] = []
        for name in ("launch", "launch_hyper"):
            original = getattr(ops.PreparedStep, name)

            def spy(this, *a, _original=original, _name=name, **k):
                self.calls.append((_name, this.n_slots))
                return _original(this, *a, **k)

            monkeypatch.setattr(ops.PreparedStep, name, spy)

    def take(self) -> list[tuple[str, int]]:
        out, self.calls = self.calls, []
        return out


@pytest.fixture
def launches(monkeypatch, ops) -> LaunchCounter:
    """Counts the fused kernel launches of the test (:class:`LaunchCounter`)."""
    return LaunchCounter(monkeypatch, ops)
