"""Models, optimizers and losses of test_fsdp2_gloo.py (importable by name, so the spawned
ranks find them; picked by ``functools.partial`` of plain values)."""

from __future__ import annotations

import torch

import memopt_ecc

OPTIMIZERS = {
    "FlashAdamW": dict(lr=1e-2, weight_decay=0.01),
    "FlashLion": dict(lr=1e-3, weight_decay=0.01),
    "FlashSGDW": dict(lr=1e-2, momentum=0.9, weight_decay=0.01),
}


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


def release(model, optimizer) -> None:
    memopt_ecc.enable_gradient_release(model, optimizer)
