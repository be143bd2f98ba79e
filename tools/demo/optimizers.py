"""The optimizer configurations the demo compares: one list, each entry skipped when unimportable.

To add an optimizer, append an :class:`OptimizerConfig` to :data:`CONFIGS`; ``module`` is imported
first, and a failed import skips the entry with the reason printed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Params = Iterable[nn.Parameter]


@dataclass(frozen=True)
class Hyper:
    """The hyperparameters every configuration gets, so the comparison is like for like."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    seed: int = 0


@dataclass(frozen=True)
class OptimizerConfig:
    """One line of the comparison."""

    name: str  # the --optimizers name
    label: str  # the table and legend label
    module: str  # imported first; its absence skips the entry
    build: Callable[[Any, Params, Hyper], torch.optim.Optimizer]  # (module, params, hyper)
    param_dtype: torch.dtype = torch.float32  # the model copy is cast to this before training
    description: str = ""


def _torch_adamw(_: Any, params: Params, h: Hyper) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=h.lr, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay)


def _memopt(master: str, moments: str) -> Callable[[Any, Params, Hyper], torch.optim.Optimizer]:
    def build(mod: Any, params: Params, h: Hyper) -> torch.optim.Optimizer:
        return mod.MemOptimizer(
            params,
            rule="adamw",
            lr=h.lr,
            betas=h.betas,
            eps=h.eps,
            weight_decay=h.weight_decay,
            master=master,
            moments=moments,
            seed=h.seed,
        )

    return build


def _flash_adamw(mod: Any, params: Params, h: Hyper) -> torch.optim.Optimizer:
    return mod.FlashAdamW(
        params,
        lr=h.lr,
        betas=h.betas,
        eps=h.eps,
        weight_decay=h.weight_decay,
        master_weight_bits=24,
        quantize=True,
    )


def _adambridge(precision: str) -> Callable[[Any, Params, Hyper], torch.optim.Optimizer]:
    def build(mod: Any, params: Params, h: Hyper) -> torch.optim.Optimizer:
        return mod.AdamBridge(
            params,
            lr=h.lr,
            betas=h.betas,
            eps=h.eps,
            weight_decay=h.weight_decay,
            precision=precision,
            seed=h.seed,
        )

    return build


CONFIGS: tuple[OptimizerConfig, ...] = (
    OptimizerConfig(
        "adamw", "torch AdamW fp32", "torch", _torch_adamw, description="the reference"
    ),
    OptimizerConfig(
        "memopt-q8",
        "memopt q8 moments",
        "memopt_core.optimizer",
        _memopt("none", "q8"),
        description="fp32 params, blockwise 8-bit moments",
    ),
    OptimizerConfig(
        "memopt-bf16",
        "memopt bf16 moments",
        "memopt_core.optimizer",
        _memopt("none", "bf16"),
        description="fp32 params, bf16 moments with stochastic rounding",
    ),
    OptimizerConfig(
        "flash-adamw",
        "memopt_ecc FlashAdamW",
        "memopt_ecc",
        _flash_adamw,
        param_dtype=torch.bfloat16,
        description="bf16 params + 8-bit error correction (ECC-24, SR) + q8 moments",
    ),
    OptimizerConfig(
        "adambridge-bf16",
        "memopt_offload AdamBridge bf16",
        "memopt_offload",
        _adambridge("bf16"),
        param_dtype=torch.bfloat16,
        description="bf16 params; host fp32 master + bf16 moments (SR), step() without hooks",
    ),
    OptimizerConfig(
        "adambridge-compact",
        "memopt_offload AdamBridge compact",
        "memopt_offload",
        _adambridge("compact"),
        param_dtype=torch.bfloat16,
        description="bf16 params; host ECC-24 master + q8 moments (SR), step() without hooks",
    ),
)


def by_name(names: Iterable[str]) -> list[OptimizerConfig]:
    """The configurations named, in the order given; unknown names raise with the valid ones."""
    table = {c.name: c for c in CONFIGS}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; choose from {sorted(table)}")
    return [table[n] for n in names]


def load(config: OptimizerConfig) -> Any:
    """The config's module, or raise ImportError saying why it cannot be used."""
    try:
        return importlib.import_module(config.module)
    except ImportError as exc:
        raise ImportError(f"{config.module} cannot be imported ({exc})") from exc


def available(
    configs: Iterable[OptimizerConfig],
) -> tuple[list[OptimizerConfig], dict[str, str]]:
    """Split configurations into the importable ones and ``{name: reason}`` for the rest."""
    usable: list[OptimizerConfig] = []
    skipped: dict[str, str] = {}
    for config in configs:
        try:
            load(config)
        except ImportError as exc:
            skipped[config.name] = str(exc)
        else:
            usable.append(config)
    return usable, skipped


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state: ``opt.state_bytes()`` where offered, else its state tensors."""
    method = getattr(opt, "state_bytes", None)
    if callable(method):
        return int(method())
    return sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
