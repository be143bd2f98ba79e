"""The reference rules against torch.optim, and the reference's own exactness promises.

torch fuses multiply-adds (lerp, addcmul, addcdiv, add(alpha=)) while the reference rounds every
operation separately (DESIGN section 4), so the two agree within a bound, not bit for bit. The bound
is ``4 * eps32 * (|p| + path)`` per element after 100+ steps, where ``path`` is the total distance
the parameter travelled: a few ulps of what moved. A wrong formula (say, a missing bias correction)
misses it by orders of magnitude, which ``test_bound_catches_a_wrong_rule`` proves.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from memopt_core import reference as R

EPS32 = torch.finfo(torch.float32).eps
STEPS = 120
N = 4099


def _grads(seed: int, steps: int = STEPS, n: int = N):
    gen = torch.Generator().manual_seed(seed)
    for t in range(steps):
        # Alternate scales so both the eps-dominated and the v-dominated regimes are exercised.
        yield torch.randn(n, generator=gen) * (1e-3 if t % 3 == 0 else 1.0)


def _run_torch(opt_cls, p0, kwargs, seed):
    p = torch.nn.Parameter(p0.clone())
    opt = opt_cls([p], foreach=False, **kwargs)
    path = torch.zeros_like(p0)
    for g in _grads(seed):
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        path += (p.detach() - before).abs()
    return p.detach(), path


def _assert_close(ours, theirs, path):
    bound = 4 * EPS32 * (theirs.abs() + path)
    excess = ((ours - theirs).abs() - bound).max().item()
    assert excess <= 0, (
        f"reference differs from torch by more than 4 ulps of the movement ({excess})"
    )


ADAM_CASES = [
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, maximize=True),
]


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("case", ADAM_CASES)
def test_adam_matches_torch(case, decoupled):
    p0 = torch.randn(N, generator=torch.Generator().manual_seed(1))
    theirs, path = _run_torch(torch.optim.AdamW if decoupled else torch.optim.Adam, p0, case, 7)
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    hyper = {k: val for k, val in case.items() if k != "maximize"}
    for t, g in enumerate(_grads(7), start=1):
        s = R.adam_scalars(
            **hyper, step=t, decoupled=decoupled, maximize=case.get("maximize", False)
        )
        p, m, v = R.adam(p, g, m, v, s)
    _assert_close(p, theirs, path)


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    dict(lr=0.02, momentum=0.8, dampening=0.3, weight_decay=1e-3, maximize=True),
]


@pytest.mark.parametrize("case", SGD_CASES)
def test_sgd_matches_torch(case):
    p0 = torch.randn(N, generator=torch.Generator().manual_seed(2))
    theirs, path = _run_torch(torch.optim.SGD, p0, case, 11)
    p, buf = p0.clone(), None
    for t, g in enumerate(_grads(11), start=1):
        p, buf = R.sgd(p, g, buf, R.sgd_scalars(**case), first_step=t == 1)
    _assert_close(p, theirs, path)


def test_bound_catches_a_wrong_rule():
    # Adam without bias correction: the test's bound must reject it.
    case = ADAM_CASES[0]
    p0 = torch.randn(N, generator=torch.Generator().manual_seed(1))
    theirs, path = _run_torch(torch.optim.AdamW, p0, case, 7)
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    for t, g in enumerate(_grads(7), start=1):
        s = R.adam_scalars(**case, step=t, decoupled=True)
        s = dataclasses.replace(s, step_size=case["lr"], bc2_sqrt=1.0)
        p, m, v = R.adam(p, g, m, v, s)
    with pytest.raises(AssertionError, match="more than 4 ulps"):
        _assert_close(p, theirs, path)


def test_lion_follows_the_paper():
    # Lion (Chen et al. 2023, Algorithm 2) written independently, in fp64 so rounding is moot.
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(64, generator=gen, dtype=torch.float64)
    m = torch.zeros_like(p)
    ref_p, ref_m = p.clone(), m.clone()
    lr, b1, b2, wd = 1e-3, 0.9, 0.99, 0.1
    for _ in range(20):
        g = torch.randn(64, generator=gen, dtype=torch.float64)
        p, m = R.lion(p, g, m, R.lion_scalars(lr=lr, betas=(b1, b2), weight_decay=wd))
        update = torch.sign(b1 * ref_m + (1 - b1) * g)
        ref_p = ref_p * (1 - lr * wd) - lr * update
        ref_m = b2 * ref_m + (1 - b2) * g
    torch.testing.assert_close(p, ref_p, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(m, ref_m, rtol=1e-12, atol=1e-15)


def test_lion_maximize_and_zero_update():
    p, g, m = torch.ones(3), torch.tensor([1.0, -1.0, 0.0]), torch.zeros(3)
    s = R.lion_scalars(lr=0.5, betas=(0.9, 0.99), maximize=True)
    new_p, _ = R.lion(p, g, m, s)
    # maximize flips the gradient: the parameter climbs it; sign(0) leaves the third alone.
    assert torch.equal(new_p, torch.tensor([1.5, 0.5, 1.0]))


def test_decouple_lr_scales_decay_by_lr_over_initial_lr():
    s = R.adam_scalars(
        lr=0.5e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.1,
        step=1,
        decoupled=True,
        initial_lr=1e-3,
    )
    assert s.decay == 1 - 0.5 * 0.1
    assert (
        R.adam_scalars(
            lr=0.5e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, step=1, decoupled=True
        ).decay
        == 1 - 0.5e-3 * 0.1
    )
    with pytest.raises(ValueError, match="positive initial lr"):
        R.decay_factor(1e-3, 0.1, 0.0)


def test_sqrt_is_correctly_rounded():
    x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(5)) * 100
    r = R.correctly_rounded_sqrt(x)
    # Correctly rounded: r is the fp32 value nearest to sqrt(x), checked exactly in fp64
    # (|r^2 - x| is minimal among r and its two fp32 neighbours).
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    down = torch.nextafter(r, torch.zeros_like(r))
    err = lambda y: (y.double() - x.double().sqrt()).abs()  # noqa: E731
    assert bool((err(r) <= err(up)).all() and (err(r) <= err(down)).all())


def test_rules_do_not_modify_inputs_and_check_dtypes():
    p, g, m, v = (torch.randn(8) for _ in range(4))
    copies = [t.clone() for t in (p, g, m, v)]
    R.adam(
        p,
        g,
        m,
        v,
        R.adam_scalars(
            lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, step=3, decoupled=False
        ),
    )
    assert all(torch.equal(a, b) for a, b in zip((p, g, m, v), copies, strict=True))
    with pytest.raises(TypeError, match="float32 or float64"):
        R.lion(p.half(), g.half(), m.half(), R.lion_scalars(lr=1e-3, betas=(0.9, 0.99)))
    with pytest.raises(ValueError, match="one dtype and shape"):
        R.lion(p, g[:4], m, R.lion_scalars(lr=1e-3, betas=(0.9, 0.99)))
    with pytest.raises(ValueError, match="step counts from 1"):
        R.adam_scalars(
            lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, step=0, decoupled=True
        )


def test_round_to_float32_matches_torch():
    """Kernel launches round every scalar to fp32 without tensors (``round_to_float32``): it
    must be torch's rounding exactly, signed zeros, subnormals and overflow included."""
    rng = random.Random(0)
    values = [rng.uniform(-1, 1) * 10 ** rng.uniform(-50, 45) for _ in range(20000)]
    values += [3.4028235677973366e38, 3.4028236e38, -1e39, 1e-46, 7.006e-46, 1.4e-45, 0.0, -0.0]
    for v in values:
        got = R.round_to_float32(v)
        want = torch.tensor(v, dtype=torch.float32).item()
        assert got == want, v
        assert math.copysign(1.0, got) == math.copysign(1.0, want), v


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.5, 0.9), (0.0, 0.99), (0.99, 0.9999)])
def test_bias_table_saturates_at_exactly_one_and_matches_adam_scalars(betas):
    """The capturable step reads its bias corrections from ``adam_bias_table`` (last entry for
    every later step): the table must end where both corrections are exactly 1.0, and agree
    with ``adam_scalars`` bit for bit there and beyond (mutation testing: a table ended early
    passed every CPU test)."""
    bc1, bc2 = R.adam_bias_table(*betas)
    last = len(bc1) - 1
    assert bc1[last] == 1.0
    assert bc2[last] == 1.0
    for step in (1, 2, last, last + 1, last + 1000):
        s = R.adam_scalars(
            lr=0.1, betas=betas, eps=1e-8, weight_decay=0.0, step=step, decoupled=True
        )
        k = min(step, last)
        assert s.step_size == 0.1 / bc1[k]
        assert s.bc2_sqrt == bc2[k]


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.0, 0.99), (0.95, 0.9999), (0.999, 0.5)])
def test_bias_tables_equal_their_definition_at_every_entry(betas):
    """Each table stops taking pows where its beta saturates (a cycled beta1 then costs its
    own few hundred pows): every entry still equals ``1.0 - beta**k`` (bc2: its sqrt)."""
    bc1, bc2 = R.adam_bias_table(*betas)
    assert len(bc1) == len(bc2) == R.adam_bias_last(*betas) + 1
    b1, b2 = betas
    assert bc1 == tuple(1.0 - b1**k for k in range(len(bc1)))
    assert bc2 == tuple(math.sqrt(1.0 - b2**k) for k in range(len(bc2)))
