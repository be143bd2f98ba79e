"""Ranks of ``test_sharded_finite.py``: ``max_over_shards`` and ``check_numerics``' non-finite
gradient check on a parameter sharded over two processes, where the NaN lies in rank 1's shard."""

from __future__ import annotations

import json

import torch

from memopt_core import MemOptimizer, NumericsError
from memopt_core.sharding import max_over_shards
from memopt_core.testing import init_rank, leave_group


def _maxima(rank: int, mesh) -> list[list[float]]:
    """Rows of a sharded owner, a plain one and another sharded one, each rank's differing."""
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = distribute_tensor(torch.zeros(4), mesh, [Shard(0)])
    owners = [sharded, torch.zeros(4), sharded]
    nan_on_1 = float("nan") if rank else 0.0
    rows = torch.tensor([[rank, -rank], [10.0 + rank, 0], [-5 * rank, nan_on_1]])
    return max_over_shards(owners, rows).tolist()


def _nan_step(mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.linspace(-1, 1, 64)
    grad = torch.randn(64, generator=torch.Generator().manual_seed(0))
    grad[40] = float("nan")  # in rank 1's half
    p = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    q = torch.nn.Parameter(torch.ones(8))  # unsharded, finite: not named
    opt = MemOptimizer([p, q], lr=1e-2, moments="q8", check_numerics=True)
    p.grad = distribute_tensor(grad, mesh, [Shard(0)])
    q.grad = torch.ones(8)
    before = p.to_local().clone()
    try:
        opt.step()
        raised = None
    except NumericsError as e:
        raised = str(e)
    return {
        "raised": raised,
        "changed": not torch.equal(before, p.to_local()) or not torch.equal(q, torch.ones(8)),
    }


def worker(rank: int, world: int, init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    init_rank(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    result = {"maxima": _maxima(rank, mesh), "nan": _nan_step(mesh)}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    leave_group()
