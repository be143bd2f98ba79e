"""Shared fixtures of memopt-core's tests: ``device`` (cpu, and cuda marked ``gpu``; see
:mod:`memopt_core.device_fixture`), ``fresh_backends`` and ``mesh`` (a one-rank gloo mesh). The tests folder goes on ``sys.path``
so spawned ranks of the distributed tests import their models (``fsdp2_models.py``) by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from memopt_core.device_fixture import device

sys.path.insert(0, str(Path(__file__).parent))

__all__ = ["device", "fresh_backends", "mesh"]


@pytest.fixture
def fresh_backends():
    """Rediscover the backend registry before and after the test (for monkeypatched entry points)."""
    from memopt_core import backends

    backends._registry = None
    yield backends
    backends._registry = None


@pytest.fixture
def mesh(tmp_path):
    """A one-rank gloo process group and its 1-D CPU mesh (DTensors in one process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
