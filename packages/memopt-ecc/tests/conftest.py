"""Shared fixtures of memopt-ecc's tests: ``device`` (cpu, and cuda marked ``gpu``) from
:mod:`memopt_core.device_fixture`."""

from __future__ import annotations

import sys
from pathlib import Path

from memopt_core.device_fixture import device

# shared helpers (ecc_testutil.py, ddp_worker.py) import by name under --import-mode=importlib
sys.path.insert(0, str(Path(__file__).parent))

__all__ = ["device"]
