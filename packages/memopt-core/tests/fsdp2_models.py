"""Models, optimizers and losses of test_sharded.py (importable by name, so the spawned ranks
find them): module-level functions only, picked by ``functools.partial`` of plain values."""

from __future__ import annotations

import torch

from memopt_core import MemOptimizer

#: name -> (parameter dtype, MemOptimizer kwargs)
CONFIGS = {
    "adamw-fp32": (torch.float32, dict(rule="adamw", master="fp32", moments="fp32")),
    "adamw-bf16-sr": (torch.float32, dict(rule="adamw", master="fp32", moments="bf16")),
    "adamw-ecc24-bf16": (torch.bfloat16, dict(rule="adamw", master="ecc24", moments="bf16")),
    "adamw-ecc24-q8": (torch.bfloat16, dict(rule="adamw", master="ecc24", moments="q8")),
    "sgd-ecc32-q8": (torch.bfloat16, dict(rule="sgd", master="ecc32", moments="q8", momentum=0.9)),
    "lion-none-q8": (torch.bfloat16, dict(rule="lion", master="none", moments="q8")),
}
#: layer sizes: "aligned" shards every tensor on 32-element block boundaries over 2 ranks;
#: "uneven" has a bias cut mid-block and a weight with an odd number of rows; "one-row" ends in a
#: layer of one output, whose weight and bias leave rank 1 an empty shard
SHAPES = {"aligned": (32, 64, 128), "uneven": (24, 40, 7), "one-row": (32, 64, 1)}


def make_model(shape: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    a, b, c = SHAPES[shape]
    model = torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.GELU(), torch.nn.Linear(b, c))
    return model.to(dtype)


def make_optimizer(name: str, params) -> MemOptimizer:
    kw = dict(CONFIGS[name][1])
    return MemOptimizer(params, lr=1e-2, weight_decay=0.01, seed=3, **kw)


def loss_of(shape: str, dtype: torch.dtype, model, step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s loss at ``step``: its half of the step's batch of 8."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, SHAPES[shape][0], generator=g).to(dtype)
    dev = next(model.parameters()).device
    return model(x[4 * rank : 4 * rank + 4].to(dev)).float().pow(2).mean()
