"""Shared fixtures of memopt-checkpoint's tests: ``device`` (cpu, and cuda marked ``gpu``) from
:mod:`memopt_core.device_fixture`. The tests folder goes on ``sys.path`` so spawned ranks of the
distributed tests import their worker module (``dcp_worker.py``) by name."""

from __future__ import annotations

import sys
from pathlib import Path

from memopt_core.device_fixture import device

sys.path.insert(0, str(Path(__file__).parent))

__all__ = ["device"]
