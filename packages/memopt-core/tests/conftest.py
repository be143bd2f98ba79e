"""Shared fixtures of memopt-core's tests: ``device`` (cpu, and cuda marked ``gpu``; see
:mod:`memopt_core.device_fixture`) and ``fresh_backends``. The tests folder goes on ``sys.path``
so spawned ranks of the distributed tests import their models (``fsdp2_models.py``) by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from memopt_core.device_fixture import device

sys.path.insert(0, str(Path(__file__).parent))

__all__ = ["device", "fresh_backends"]


@pytest.fixture
def fresh_backends():
    """Rediscover the backend registry before and after the test (for monkeypatched entry points)."""
    from memopt_core import backends

    backends._registry = None
    yield backends
    backends._registry = None
