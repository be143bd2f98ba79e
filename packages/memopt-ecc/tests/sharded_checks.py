"""Ranks of ``test_sharded_checks.py``: ``check_numerics`` on sharded parameters, where one
rank's shard alone holds what makes one process refuse the step, and a one-process state dict
loaded into a sharded optimizer."""

from __future__ import annotations

import json
import warnings

import torch

import memopt_ecc
from memopt_core import MemOptimizer, NumericsError, StateDictError
from memopt_core.testing import init_rank, leave_group


def _weights() -> torch.Tensor:
    # rank 0's half near 1.25 (ECC-24 to nearest loses a step of 1e-5 there), rank 1's near 1e-3
    return torch.cat([torch.full((32,), 1.25), torch.full((32,), 1e-3)]).bfloat16()


def _gradient(nan_at: int | None = None) -> torch.Tensor:
    g = torch.randn(64, generator=torch.Generator().manual_seed(0)).bfloat16()
    if nan_at is not None:
        g[nan_at] = float("nan")
    return g


def _try_step(make_opt, mesh, nan_at: int | None) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    p = torch.nn.Parameter(distribute_tensor(_weights(), mesh, [Shard(0)]))
    opt = make_opt([p])
    p.grad = distribute_tensor(_gradient(nan_at), mesh, [Shard(0)])
    before = p.to_local().clone()
    try:
        opt.step()
        raised = None
    except NumericsError as e:
        raised = str(e)
    return {"raised": raised, "changed": not torch.equal(before, p.to_local())}


def _released(rank: int) -> dict:
    """fully_shard + gradient release (each parameter in its own hook): the resolution check
    raises inside backward; a rank that stepped on would wait in the next reduce-scatter."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 64)).bfloat16()
    with torch.no_grad():
        model[1].weight[:32].fill_(1.25)  # rank 0's rows
        model[1].weight[32:].fill_(1e-3)
    for m in model:
        fully_shard(m)
    fully_shard(model)
    opt = memopt_ecc.FlashAdamW(
        model.parameters(), lr=1e-5, check_numerics=True, stochastic_rounding=False
    )
    handle = memopt_ecc.enable_gradient_release(model, opt, bucket_mb=0)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank)).bfloat16()
    try:
        model(x).float().square().mean().backward()
        raised = None
    except NumericsError as e:
        raised = str(e)
    handle.remove()
    return {"raised": raised}


def _whole_state(mesh) -> dict:
    """A one-process optimizer's state dict loaded into a sharded one: refused, saying how."""
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.nn.Parameter(torch.randn(70, generator=torch.Generator().manual_seed(1)))
    one = MemOptimizer([full], lr=1e-2, moments="q8")
    full.grad = torch.ones(70)
    one.step()
    p = torch.nn.Parameter(distribute_tensor(full.detach().clone(), mesh, [Shard(0)]))
    try:
        MemOptimizer([p], lr=1e-2, moments="q8").load_state_dict(one.state_dict())
        return {"raised": None}
    except StateDictError as e:
        return {"raised": str(e)}


def worker(rank: int, world: int, init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    init_rank(rank, world, init_file)
    warnings.simplefilter("ignore")  # round to nearest on purpose
    mesh = init_device_mesh("cpu", (world,))

    def flash(lr: float):
        return lambda ps: memopt_ecc.FlashAdamW(
            ps, lr=lr, check_numerics=True, stochastic_rounding=False
        )

    result = {
        "resolution": _try_step(flash(1e-5), mesh, None),
        "nan-flash": _try_step(flash(1e-2), mesh, 40),  # in rank 1's shard
        "released": _released(rank),
        "whole-state": _whole_state(mesh),
    }
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    leave_group()
