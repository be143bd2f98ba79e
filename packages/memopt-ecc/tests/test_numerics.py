"""Small updates are not lost, and ``check_numerics`` raises exactly when they would be.

The measurement behind the default (docs/ecc.md): bf16 weights in [1, 1.5], Adam with a constant
gradient (so every step is ``lr``), 200 steps, against fp32 AdamW. ECC-24 rounded to nearest
cannot move them at lr 1e-5 or 1e-6 (half its resolution there is 2**-16 ~ 1.5e-5); ECC-24 with
stochastic rounding (the default) and ECC-32 move them as fp32 does.
"""

from __future__ import annotations

import math

import pytest
import torch

from memopt_core import NumericsError
from memopt_core.formats import master_codec
from memopt_ecc import (
    FlashAdamW,
    FlashLion,
    FlashSGD,
    enable_gradient_release,
    fp32_master,
    master_resolution,
    significant_bits,
)

N = 256
STEPS = 200


def near_one(device, dtype=torch.bfloat16, n=N):
    """Weights in [1, 1.5], exactly representable in bf16."""
    return torch.linspace(1.0, 1.5, n).bfloat16().to(device=device, dtype=dtype)


def adam_drift(device, lr, dtype=torch.bfloat16, steps=STEPS, **kwargs):
    """Mean movement of the master weights after ``steps`` Adam steps of gradient -1."""
    x0 = near_one(device, dtype)
    p = x0.clone().requires_grad_()
    opt = FlashAdamW([p], lr=lr, weight_decay=0.0, **kwargs)
    for _ in range(steps):
        p.grad = torch.full_like(p, -1.0)
        opt.step()
    return (fp32_master(opt, p) - x0.float()).mean().item()


# -------------------------------------------------------------------------- the formula
def test_resolution_formula():
    bf = torch.bfloat16
    assert significant_bits("ecc24", bf, False) == 16
    assert significant_bits("ecc24", bf, True) == 24
    assert significant_bits("ecc32", bf, False) == 24
    assert significant_bits("none", bf, False) == 8
    assert significant_bits("none", torch.float16, False) == 11
    assert significant_bits("fp32", torch.float32, False) == 24
    assert master_resolution(1.25, "ecc24", bf, False) == 2.0**-15
    assert master_resolution(1.25, "ecc24", bf, True) == 2.0**-23
    assert master_resolution(1.25, "ecc32", bf, False) == 2.0**-23
    assert master_resolution(1.25, "none", bf, False) == 2.0**-7
    assert master_resolution(1.25, "none", torch.float16, False) == 2.0**-10
    assert master_resolution(1.25, "fp32", torch.float32, False) == 2.0**-23
    assert master_resolution(0.75, "ecc24", bf, False) == 2.0**-16
    assert master_resolution(1e6, "ecc24", bf, False) == 2.0 ** (19 - 15)
    assert master_resolution(0.0, "ecc24", bf, False) == 2.0**-141  # subnormal spacing
    assert master_resolution(1e-5, "none", torch.float16, False) == 2.0**-24


@pytest.mark.parametrize(("master", "sig"), [("ecc24", 16), ("ecc32", 24)])
def test_resolution_is_the_codec_grid(master, sig):
    """Encoding x + 0.49 * res leaves the decoded weight at x; x + 0.51 * res moves it one step."""
    codec = master_codec(master, torch.bfloat16)
    x = torch.tensor([1.0 + k * 2.0**-10 for k in range(8)] + [0.6, 3.0, 100.5, 1e-20])
    x = codec.decode(*codec.encode(x))  # on the master's grid
    res = torch.tensor([master_resolution(v, master, torch.bfloat16, False) for v in x.tolist()])
    assert res[0].item() == 2.0 ** (1 - sig)
    assert torch.equal(codec.decode(*codec.encode(x + 0.49 * res)), x)
    assert torch.equal(codec.decode(*codec.encode(x + 0.51 * res)), x + res)


# ---------------------------------------------------------------------- small updates
@pytest.mark.parametrize("lr", [1e-5, 3e-6, 1e-6])
def test_small_updates_survive_in_the_default_configuration(lr, device):
    fp32 = adam_drift(device, lr, dtype=torch.float32, quantize=False)
    assert fp32 == pytest.approx(STEPS * lr, rel=0.1)
    # ECC-24 rounded to nearest: every update is below half a 24-bit step: nothing moves
    assert adam_drift(device, lr, quantize=False, stochastic_rounding=False) == 0.0
    # ECC-32 is exactly fp32: the same drift to the bit
    assert adam_drift(device, lr, master_weight_bits=32, quantize=False) == fp32
    # the default (ECC-24, stochastic rounding, q8 moments) and ECC-24 SR with fp32 moments
    # move them as fp32 AdamW does, on average (measured ratios 0.98-1.04)
    for kwargs in (dict(), dict(quantize=False)):
        ratio = adam_drift(device, lr, **kwargs) / fp32
        assert 0.9 <= ratio <= 1.1, (kwargs, ratio)


# ---------------------------------------------------------------------- check_numerics
CONFIGS = {
    # name: (kwargs, param dtype, lrs that must raise among 1e-3, 1e-4, 1e-5, 1e-6)
    "ecc24-nearest": (dict(stochastic_rounding=False), torch.bfloat16, {1e-5, 1e-6}),
    "ecc24-sr": (dict(), torch.bfloat16, set()),
    "ecc32": (dict(master_weight_bits=32, stochastic_rounding=False), torch.bfloat16, set()),
    "bf16-nearest": (
        dict(master_weight_bits=None, stochastic_rounding=False),
        torch.bfloat16,
        {1e-3, 1e-4, 1e-5, 1e-6},
    ),
    "bf16-sr": (dict(master_weight_bits=None), torch.bfloat16, set()),
    "fp32": (dict(), torch.float32, set()),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("lr", [1e-3, 1e-4, 1e-5, 1e-6])
def test_check_numerics_raises_exactly_when_updates_are_lost(config, lr, device):
    kwargs, dtype, raising = CONFIGS[config]
    x0 = near_one(device, dtype, n=64)
    kw = dict(kwargs, quantize=False, lr=lr, weight_decay=0.0)

    # ground truth without the check: does the master move at all? (Stochastic rounding moves
    # an element with probability ~ lr / spacing per step: bf16 at lr 1e-6 needs ~10**4 tries.)
    sr = kwargs.get("stochastic_rounding", True) and dtype != torch.float32
    n, steps = (4096, 10) if sr else (64, 3)
    start = near_one(device, dtype, n=n)
    p = start.clone().requires_grad_()
    opt = FlashAdamW([p], **kw)
    for _ in range(steps):
        p.grad = torch.full_like(p, -1.0)
        opt.step()
    moved = (fp32_master(opt, p) != start.float()).any().item()
    assert moved == (lr not in raising)

    q = x0.clone().requires_grad_()
    checked = FlashAdamW([q], check_numerics=True, **kw)
    q.grad = torch.full_like(q, -1.0)
    if lr in raising:
        with pytest.raises(NumericsError, match="below the master format's resolution"):
            checked.step()
        assert torch.equal(q.detach(), x0)  # nothing changed
        assert all(int(s["step"]) == 0 for s in checked.state.values())
    else:
        checked.step()
        assert int(checked.state[q]["step"]) == 1


@pytest.mark.parametrize(("lr", "lost"), [(1e-5, False), (6e-6, True)])
def test_check_numerics_at_a_power_of_two_counts_the_grid_below_it(lr, lost, device):
    """Weights at exactly 1.0 (norm gains at init): a step down lands on the grid below 1.0,
    whose spacing is half the one above. ECC-24 round to nearest at lr 1e-5 moves them down
    (1.0 -> 0.99995 in three steps), where the check raised with the spacing above 1.0."""
    kw = dict(lr=lr, weight_decay=0.0, stochastic_rounding=False, quantize=False)
    ones = torch.ones(64, device=device, dtype=torch.bfloat16)
    p = ones.clone().requires_grad_()
    plain = FlashAdamW([p], **kw)
    for _ in range(3):
        p.grad = torch.ones_like(p)  # a positive gradient: the step goes down
        plain.step()
    assert bool((fp32_master(plain, p) < 1.0).all()) != lost
    q = ones.clone().requires_grad_()
    checked = FlashAdamW([q], check_numerics=True, **kw)
    q.grad = torch.ones_like(q)
    if lost:
        with pytest.raises(NumericsError, match="below the master format's resolution"):
            checked.step()
    else:
        checked.step()


def test_check_numerics_at_fp32_resolution(device):
    """Stochastic rounding and fp32 masters are limited by fp32's own rounding of x + u."""
    half_ulp = 2.0**-24  # at weights in [1, 2)
    for kwargs, dtype in ((dict(), torch.float32), (dict(), torch.bfloat16)):
        for lr, lost in ((0.5 * half_ulp, True), (4 * half_ulp, False)):
            p = near_one(device, dtype, n=64).requires_grad_()
            opt = FlashAdamW([p], lr=lr, weight_decay=0.0, check_numerics=True, **kwargs)
            p.grad = torch.full_like(p, -1.0)
            if lost:
                with pytest.raises(NumericsError):
                    opt.step()
                opt.check_numerics = False
                before = fp32_master(opt, p)
                opt.step()
                assert torch.equal(fp32_master(opt, p), before)  # truly lost
            else:
                opt.step()


def test_check_numerics_sgd_and_lion(device):
    x0 = near_one(device, n=64)
    # Lion steps by exactly lr
    p = x0.clone().requires_grad_()
    lion = FlashLion([p], lr=1e-5, stochastic_rounding=False, check_numerics=True)
    p.grad = torch.ones_like(p)
    with pytest.raises(NumericsError, match="resolution"):
        lion.step()
    lion.param_groups[0]["lr"] = 1e-4
    lion.step()
    # SGD steps by lr * |g|: lr 1e-3 with gradients of 1e-3 is 1e-6 (lost), of 1.0 is 1e-3
    q = x0.clone().requires_grad_()
    sgd = FlashSGD([q], lr=1e-3, stochastic_rounding=False, check_numerics=True)
    q.grad = torch.full_like(q, 1e-3)
    with pytest.raises(NumericsError, match="resolution"):
        sgd.step()
    q.grad = torch.ones_like(q)
    sgd.step()
    assert (fp32_master(sgd, q) != x0.float()).all()
    # momentum amplifies the steady step by 1 / (1 - momentum): 1e-3 * 1e-3 * 10 = 1e-5, lost
    # under ECC-24 RNE (half step 1.5e-5); with 1e-3 * 1e-2 * 10 = 1e-4 it is not
    r = x0.clone().requires_grad_()
    mom = FlashSGD([r], lr=1e-3, momentum=0.9, stochastic_rounding=False, check_numerics=True)
    r.grad = torch.full_like(r, 1e-3)
    with pytest.raises(NumericsError):
        mom.step()
    r.grad = torch.full_like(r, 1e-2)
    mom.step()
    # an all-zero gradient (a parameter unused in this batch) asks for no step: not an error
    # (its momentum buffer still moves it, by what the earlier steps were checked for)
    r.grad = torch.zeros_like(r)
    mom.step()


def test_check_numerics_still_refuses_non_finite_gradients(device):
    p = near_one(device, n=64).requires_grad_()
    # lr 1e-6 would also fail the resolution check: the non-finite gradient is reported first
    opt = FlashAdamW([p], lr=1e-6, stochastic_rounding=False, check_numerics=True)
    g = torch.ones_like(p)
    g[3] = math.nan
    p.grad = g
    with pytest.raises(NumericsError, match="non-finite gradient"):
        opt.step()
    assert torch.equal(p.detach(), near_one(device, n=64))


def test_check_numerics_allows_zero_lr_and_names_parameters(device):
    p = near_one(device, n=64).requires_grad_()
    opt = FlashAdamW(
        [("blocks.0.weight", p)], lr=0.0, stochastic_rounding=False, check_numerics=True
    )
    p.grad = torch.ones_like(p)
    opt.step()  # a dummy step is allowed
    opt.param_groups[0]["lr"] = 1e-6
    with pytest.raises(NumericsError, match=r"'blocks.0.weight'.*resolution 3.05e-05"):
        opt.step()


def test_check_numerics_also_guards_step_parameters(device):
    """The release hooks update through step_parameters(): the same check runs there."""
    p = near_one(device, n=64).requires_grad_()
    q = near_one(device, n=64).requires_grad_()
    opt = FlashAdamW([p, q], lr=1e-6, stochastic_rounding=False, check_numerics=True)
    p.grad = torch.ones_like(p)
    q.grad = torch.ones_like(q)
    with pytest.raises(NumericsError, match="below the master format's resolution"):
        opt.step_parameters([p])
    assert torch.equal(p.detach(), near_one(device, n=64))
    assert p not in opt.state or int(opt.state[p]["step"]) == 0
    opt.param_groups[0]["lr"] = 1e-2
    opt.step_parameters([p])
    assert int(opt.state[p]["step"]) == 1
    assert int(opt.state[q]["step"]) == 0


def test_check_numerics_runs_under_gradient_release(device):
    """The release hooks free p.grad and pass the gradient to step_parameters(grads=...): the
    resolution check reads it there."""
    model = torch.nn.Linear(64, 1, bias=False).to(device)
    with torch.no_grad():
        model.weight.copy_(near_one(device, dtype=torch.float32, n=64))
    model.bfloat16()
    opt = FlashAdamW(
        model.parameters(),
        lr=1e-6,
        weight_decay=0.0,
        stochastic_rounding=False,
        check_numerics=True,
    )
    handle = enable_gradient_release(model, opt)
    x = torch.ones(4, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(NumericsError, match="below the master format's resolution"):
        model(x).float().sum().backward()
    assert torch.equal(model.weight.detach().view(-1), near_one(device, n=64))
    assert int(opt.state[model.weight]["step"]) == 0
    # grads= also reaches the check without release
    p = near_one(device, n=64).requires_grad_()
    opt = FlashAdamW([p], lr=1e-6, stochastic_rounding=False, check_numerics=True)
    with pytest.raises(NumericsError, match="below the master format's resolution"):
        opt.step_parameters([p], grads={p: torch.ones_like(p)})
    handle.remove()
