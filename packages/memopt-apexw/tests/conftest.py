"""Shared fixtures of memopt-apexw's tests: ``device`` (cpu, and cuda marked ``gpu``) from
:mod:`memopt_core.device_fixture`; helpers in ``apexw_testutil.py``.

Without CUDA, ``TRITON_INTERPRET=1`` is set before anything imports triton, so the tests of the
Triton path (prepared launches) run on CPU tensors in Triton's interpreter where it is installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

from memopt_core.device_fixture import device

sys.path.insert(0, str(Path(__file__).parent))

__all__ = ["device", "no_mode_cache"]


@pytest.fixture(autouse=True)
def no_mode_cache(tmp_path, monkeypatch):
    """Every test gets its own mode-cache file (no test reads a decision another one wrote) and
    no backend forced by ``MEMOPT_BACKEND`` (ApexW honours it)."""
    monkeypatch.setenv("MEMOPT_APEXW_CACHE", str(tmp_path / "apexw-modes.json"))
    monkeypatch.delenv("MEMOPT_BACKEND", raising=False)
