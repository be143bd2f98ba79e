"""Models, optimizers and losses of test_fsdp2_gloo.py (importable by name, so the spawned
ranks find them; picked by ``functools.partial`` of plain values)."""

from __future__ import annotations

import torch

from memopt_apexw import ApexW

#: name -> (parameter dtype, ApexW kwargs)
CONFIGS = {
    "fp32-bf16state": (torch.float32, {"state": "bf16"}),
    "bf16-ecc24-q8": (torch.bfloat16, {"state": "q8"}),
    "bf16-ecc32-bf16state-torch": (
        torch.bfloat16,
        {"state": "bf16", "master": "ecc32", "mode": "torch"},
    ),
}


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    """Layers whose every shard over 2 ranks starts on a 32-element q8 block."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 128))
    return model.to(dtype)


def make_optimizer(name: str, params) -> ApexW:
    return ApexW(params, lr=1e-2, weight_decay=0.01, mode_cache=None, **CONFIGS[name][1])


def loss_of(dtype: torch.dtype, model, step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s half of step ``step``'s batch of 8."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 32, generator=g).to(dtype)
    dev = next(model.parameters()).device
    return model(x[4 * rank : 4 * rank + 4].to(dev)).float().pow(2).mean()
