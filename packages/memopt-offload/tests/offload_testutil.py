"""Twin training for AdamBridge's tests: the same model trained by AdamBridge and by a reference.

The reference is core's ``MemOptimizer`` on its pure-torch backend over host copies of the
masters (fp32, or bf16 + ECC-24 code for ``"bf16-ecc24"`` and ``"compact"``), fed the same bf16
gradients, with the device weights rewritten from the masters after each step exactly as
AdamBridge's upload does (round to nearest even). Both models compute the same forward and
backward, so every step's gradients, masters and weights must be equal bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

from memopt_core.optimizer import MemOptimizer
from memopt_offload import PRECISIONS

#: update -> extra AdamBridge arguments of the tests that run both updates: the device update with
#: 2 KiB buckets, so that its tests cut the 33x48 and 48x31 weights into pieces
BOTH = {"host": {}, "device": {"bucket_mb": 0.002}}


def both_updates(host_precision: str = "bf16"):
    """Parametrize a test over ``(precision, update)``: the host update at ``host_precision``,
    the device update at its one precision (``bf16-ecc24``)."""
    return pytest.mark.parametrize(
        ("precision", "update"), [(host_precision, "host"), ("bf16-ecc24", "device")]
    )


def make_model(device, *, width: int = 48, dtype=torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(33, width),
        torch.nn.GELU(),
        torch.nn.LayerNorm(width),
        torch.nn.Linear(width, 31),
    )
    return model.to(device=device, dtype=dtype)


def batch(step: int, device, dtype=torch.bfloat16, n: int = 8, d: int = 33) -> Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, d, generator=g).to(device=device, dtype=dtype)


def loss_of(model: torch.nn.Module, x: Tensor) -> Tensor:
    return model(x).float().pow(2).mean()


class Reference:
    """Reference AdamW over host masters of ``model``'s trainable parameters."""

    def __init__(self, model: torch.nn.Module, precision: str, groups=None, seed: int = 0, **kw):
        moments, master = PRECISIONS[precision]
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters: dict[int, Tensor] = {}
        for p in self.params:
            keep_bf16 = master == "ecc24" and p.dtype == torch.bfloat16
            m = p.detach().to("cpu", torch.bfloat16 if keep_bf16 else torch.float32).clone()
            self.masters[id(p)] = m.requires_grad_(True)
        if groups is None:
            host_groups = [{"params": [self.masters[id(p)] for p in self.params]}]
        else:
            host_groups = [
                {**{k: v for k, v in g.items() if k != "params"},
                 "params": [self.masters[id(p)] for p in g["params"] if p.requires_grad]}
                for g in groups
            ]  # fmt: skip
        kw.setdefault("weight_decay", 0.01)  # AdamBridge's default, as torch.optim.AdamW's
        self.opt = MemOptimizer(
            host_groups,
            rule="adamw",
            moments=moments,
            master=master,
            stochastic_rounding=True,
            seed=seed,
            backend="torch",
            **kw,
        )

    def step(self, coef: float | None = None) -> None:
        """One update from the model's current gradients (scaled by ``coef`` like AdamBridge's
        clipping: the host bf16 gradient multiplied in place), then the weights from the masters."""
        grads = {}
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad.detach().to("cpu").clone()
            if coef is not None and coef < 1.0:
                g.mul_(coef)
            grads[self.masters[id(p)]] = g
        with torch.no_grad():
            self.opt.step_parameters(list(grads), grads=grads)
            for p in self.params:
                p.copy_(self.masters[id(p)])


class Tied(torch.nn.Module):
    """An embedding whose weight is also the output head's (one tensor, two modules), as in
    language models with tied embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def clone_model(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module, what: str = "") -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        if not torch.equal(p.detach().cpu().view(torch.int16 if p.dtype != torch.float32 else torch.int32),
                           q.detach().cpu().view(torch.int16 if q.dtype != torch.float32 else torch.int32)):  # fmt: skip
            diff = (p.detach().float() - q.detach().float()).abs().max().item()
            raise AssertionError(f"{what}: parameter {name} differs (max abs diff {diff})")


def train_pair(model, ref_model, opt, ref, steps, device, *, hooks, start=0, dtype=torch.bfloat16):
    """``steps`` steps of AdamBridge and the reference on :func:`batch` inputs from ``start``
    with :func:`loss_of` (hooks attached for the run when ``hooks``)."""
    if hooks:
        opt.attach_hooks(model)
    xs = [batch(t, device, dtype) for t in range(start, start + steps)]
    step_pair(model, ref_model, opt, ref, xs, hooks=hooks, loss=loss_of, start=start)
    if hooks:
        opt.detach_hooks()


def _summed(model: torch.nn.Module, x: Tensor) -> Tensor:
    return model(x).float().sum()


def step_pair(model, ref_model, opt, ref, xs, *, hooks=True, loss=_summed, start=0):
    """One step of AdamBridge and the reference per input (``loss``: by default the model's
    output summed); the weights must agree bit for bit after each."""
    for t, x in enumerate(xs, start):
        loss(model, x).backward()
        loss(ref_model, x).backward()
        if hooks:
            opt.step_sync()
        else:
            opt.step()
            opt.zero_grad()
        ref.step()
        ref_model.zero_grad()
        assert_same_params(model, ref_model, f"step {t}")


class OddSizes(torch.nn.Module):
    """0-d, empty, 1-element and 33-element parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(()))
        self.b = torch.nn.Parameter(torch.zeros(0, 3))
        self.c = torch.nn.Parameter(torch.randn(1))
        self.d = torch.nn.Parameter(torch.randn(33))

    def forward(self, x):
        return (self.a * x).sum() + (self.c * x[:1]).sum() + (self.d * x).sum() ** 2 + self.b.sum()
