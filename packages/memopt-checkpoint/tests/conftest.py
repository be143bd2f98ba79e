"""Shared fixtures and helpers of memopt-checkpoint's tests.

``device``: every test that takes it runs once per device: ``cpu`` always, ``cuda`` marked
``gpu`` and skipped (with the reason) where CUDA is absent, so a GPU test never turns into a
silent pass on a CPU machine (nox -s gpu_tests selects ``-m gpu`` and fails without a GPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# shared helpers (checkpoint_testutil.py) import by name under --import-mode=importlib
sys.path.insert(0, str(Path(__file__).parent))

_NO_CUDA = not torch.cuda.is_available()

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(_NO_CUDA, reason="needs a CUDA device")],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """The device a test runs on (parametrized: cpu, cuda)."""
    return torch.device(request.param)
