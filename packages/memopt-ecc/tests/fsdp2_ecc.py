"""Models, optimizers, losses and the rank process of test_fsdp2_gloo.py (importable by name, so
the spawned ranks find them; picked by ``functools.partial`` of plain values)."""

from __future__ import annotations

import torch

import memopt_ecc
from memopt_core.testing import fsdp2_worker

OPTIMIZERS = {
    "FlashAdamW": dict(lr=1e-2, weight_decay=0.01),
    "FlashAdam": dict(lr=1e-2, weight_decay=0.01),
    "FlashLion": dict(lr=1e-3, weight_decay=0.01),
    "FlashSGDW": dict(lr=1e-2, momentum=0.9, weight_decay=0.01),
    "FlashSGD": dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
}
#: job name -> its optimizer, in a rank process (kept for :func:`worker` to save its state)
_TRAINED: dict[str, torch.optim.Optimizer] = {}


def make_model() -> torch.nn.Module:
    """bf16 layers whose every shard over 2 ranks starts on a 32-element q8 block."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 128))
    return model.to(torch.bfloat16)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    return getattr(memopt_ecc, name)(params, **OPTIMIZERS[name])


def loss_of(model, step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s half of step ``step``'s batch of 8."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 32, generator=g).to(torch.bfloat16)
    dev = next(model.parameters()).device
    return model(x[4 * rank : 4 * rank + 4].to(dev)).float().pow(2).mean()


def prepare(job: str, released: bool, model, optimizer) -> None:
    """A job's ``prepare``: keeps its optimizer for :func:`worker`; enables gradient release."""
    _TRAINED[job] = optimizer
    if released:
        memopt_ecc.enable_gradient_release(model, optimizer)


def state_of(optimizer) -> list[dict[str, torch.Tensor]]:
    """Each parameter's optimizer state as the optimizer holds it (a sharded parameter's: its
    local shard's, blocked fields flat), on the CPU, in parameter order."""
    return [
        {k: v.detach().cpu() for k, v in optimizer.state[p].items()}
        for g in optimizer.param_groups
        for p in g["params"]
    ]


def worker(rank: int, world: int, init_file: str, out: str, jobs, device: str = "cpu") -> None:
    """:func:`memopt_core.testing.fsdp2_worker`, then each job's :func:`state_of` to
    ``{out}/{job}-state-rank{rank}.pt`` (local tensors: no collective needed)."""
    fsdp2_worker(rank, world, init_file, out, jobs, device)
    for job, optimizer in _TRAINED.items():
        torch.save(state_of(optimizer), f"{out}/{job}-state-rank{rank}.pt")
