"""The Flash* family's eager ``step()`` replays core's cached step
(:mod:`memopt_core.cached_step`) while parameters and gradients keep their addresses: bit for bit
the ordinary step, also with what the family adds (float32 gradients of bfloat16 parameters,
``check_numerics``' resolution check, bfloat16 models with float32 layers)."""

from __future__ import annotations

import pytest
import torch
from ecc_testutil import assert_same_state

from memopt_core import NumericsError
from memopt_ecc import FlashAdam, FlashAdamW, FlashLion, FlashSGD, FlashSGDW

CONFIGS = {
    "adamw": (FlashAdamW, dict(lr=1e-3)),
    "adam-fp32-moments": (FlashAdam, dict(lr=1e-3, quantize=False, weight_decay=0.01)),
    "lion-ecc32": (FlashLion, dict(lr=1e-4, master_weight_bits=32, weight_decay=0.1)),
    "sgd-nesterov": (FlashSGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    "sgdw-no-master": (
        FlashSGDW,
        dict(lr=1e-2, momentum=0.5, master_weight_bits=None, weight_decay=0.1),
    ),
}


def uncached(cls):
    """``cls`` whose step always takes the ordinary path."""

    class Uncached(cls):
        def step(self, closure=None):  # type: ignore[override]
            with torch.no_grad():
                self._update(None)

    return Uncached


class Net(torch.nn.Module):
    """bfloat16 layers around a float32 one: two state groups of interleaved parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(12, 40).bfloat16()
        self.b = torch.nn.Linear(40, 40)
        self.c = torch.nn.Linear(40, 3).bfloat16()

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        return self.c(self.b(h.float()).bfloat16())


def make_model(device, seed=0):
    torch.manual_seed(seed)
    return Net().to(device)


def loss_of(model, step, device):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(16, 12, generator=gen).to(device, torch.bfloat16)
    return model(x).float().square().mean() * (1 + step % 3)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_loop_bit_exact(device, name, fused):
    cls, kw = CONFIGS[name]
    models = [make_model(device), make_model(device)]
    opts = [
        c(m.parameters(), fused=fused, **kw)
        for c, m in zip((cls, uncached(cls)), models, strict=True)
    ]
    for step in range(1, 25):
        for model, opt in zip(models, opts, strict=True):
            loss_of(model, step, device).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)  # gradients stay at their addresses
    params = [list(m.parameters()) for m in models]
    assert_same_state(opts[0], params[0], opts[1], params[1])
    assert opts[0]._cached_steps[None].replays == 23
    assert float(opts[0].state[params[0][0]]["step"]) == 24


def test_float32_gradients_of_bfloat16_parameters(device):
    """Gradients switching between bfloat16 and float32 at the same addresses: a replay must
    not read one dtype as the other."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(33,), (4, 9), (100,)]
    a = [torch.randn(s, generator=gen).to(device, torch.bfloat16).requires_grad_() for s in shapes]
    b = [p.detach().clone().requires_grad_() for p in a]
    opt, ref = FlashAdamW(a, lr=1e-2), uncached(FlashAdamW)(b, lr=1e-2)
    bufs = [torch.zeros(p.numel(), device=device) for p in a]  # bf16 views share their start
    for p in a + b:
        p.grad_dtype = None  # lets torch store a float32 gradient of a bfloat16 tensor
    for step in range(1, 15):
        dtype = torch.float32 if 5 <= step < 10 else torch.bfloat16
        g = torch.Generator().manual_seed(100 + step)
        for p, q, buf in zip(a, b, bufs, strict=True):
            v = torch.randn(p.shape, generator=g).to(device, dtype)
            view = buf if dtype == torch.float32 else buf.view(torch.bfloat16)
            p.grad = view[: p.numel()].view(p.shape).copy_(v)
            q.grad = v.clone()
        before = opt._cached_steps.get(None)
        opt.step()
        ref.step()
        if step in (5, 10):
            assert opt._cached_steps[None] is not before  # resolved again for the new dtype
        elif step > 1:
            assert opt._cached_steps[None] is before  # replayed
        assert_same_state(opt, a, ref, b)


def test_resolution_check_runs_on_replayed_steps(device):
    p = torch.linspace(1.0, 1.5, 64, device=device).bfloat16().requires_grad_()
    opt = FlashAdamW([p], lr=1e-2, stochastic_rounding=False, check_numerics=True)
    p.grad = torch.ones_like(p)
    for _ in range(3):
        opt.step()
    cached = opt._cached_steps[None]
    before = p.detach().clone()
    opt.param_groups[0]["lr"] = 1e-6  # below ECC-24's resolution at these weights
    with pytest.raises(NumericsError, match="below the master format's resolution"):
        opt.step()
    assert torch.equal(p.detach(), before)
    assert int(opt.state[p]["step"]) == 3
    opt.param_groups[0]["lr"] = 1e-2
    opt.step()
    assert opt._cached_steps[None] is cached
    assert int(opt.state[p]["step"]) == 4
