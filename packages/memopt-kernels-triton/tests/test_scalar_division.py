"""The Adam kernel's division by ``bc2_sqrt`` through a reciprocal computed once per chunk
(``kernels.division``) against the correctly rounded division ``tl.div_rn`` it replaces, on the
GPU (the interpreter keeps ``div_rn``: no inline PTX there): every fp32 significand of the
dividend at exponents across the range of square roots of fp32 values, for the divisors Adam's
bias correction takes (plain, and decay-normalized up to 16) and for random and edge divisors in
the accepted range; and the special dividends (signed zeros, infinity, NaN)."""

from __future__ import annotations

import math

import pytest
import torch

from memopt_core.reference import adam_bias_table, adam_scalars, decay_norm_period

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
D = pytest.importorskip("memopt_kernels_triton.kernels.division")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        not D.FAST_SCALAR_DIVISION.value,
        reason="under TRITON_INTERPRET the kernels divide with div_rn (no inline PTX)",
    ),
]

#: exponent fields of the dividends: sqrt(v) for fp32 v lies in [2**-75, 2**64]
EXPONENT_FIELDS = (52, 53, 64, 100, 126, 127, 128, 150, 180, 190, 191)
SIGNIFICANDS = 1 << 23
BLOCK = 1024


@triton.jit
def mismatch_kernel(b_ptr, field_ptr, n_fields, out_ptr, BLOCK: tl.constexpr):
    """For divisor ``b_ptr[i]`` (program axis 0) and a block of significands (axis 1): how many
    dividends of those significands, at every exponent field, divide differently."""
    b = tl.load(b_ptr + tl.program_id(0))
    rb = D.divisor_reciprocal(b)
    sig = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(n_fields):
        field = tl.load(field_ptr + i)
        a = ((field << 23) | sig).to(tl.float32, bitcast=True)
        got = D.div_rn_by(a, b, rb).to(tl.int32, bitcast=True)
        want = tl.div_rn(a, b).to(tl.int32, bitcast=True)
        bad += (got != want).to(tl.int32)
    tl.atomic_add(out_ptr + tl.program_id(0), tl.sum(bad, axis=0))


@triton.jit
def quotients_kernel(a_ptr, b_ptr, got_ptr, want_ptr, n, BLOCK: tl.constexpr):
    """Both quotients of the dividends ``a_ptr[:n]`` by divisor ``b_ptr[program]``."""
    pid = tl.program_id(0)
    b = tl.load(b_ptr + pid)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=1.0)
    tl.store(got_ptr + pid * n + offs, D.div_rn_by(a, b, D.divisor_reciprocal(b)), mask=mask)
    tl.store(want_ptr + pid * n + offs, tl.div_rn(a, b), mask=mask)


def _in_range(b: torch.Tensor) -> torch.Tensor:
    return (b >= 2.0**-60) & (b <= 16.0)


def divisors() -> torch.Tensor:
    """Adam's ``bc2_sqrt`` (rounded to fp32, as the launcher passes it) at steps 1..50 and a
    sample of later ones for common and extreme ``beta2``, and its decay-normalized form
    (``adam_scalars(normalized=True)``, up to 16: the 8-bit second moments) over the first
    periods and a sample of later steps, the range's ends, significands of all ones and zeros,
    and log-uniform random divisors in [2**-60, 1] and in (1, 16]."""
    values: list[float] = [1.0, 2.0**-60, 1.0 - 2.0**-24, 0.5, 0.75]
    values += [16.0, 16.0 - 2.0**-20, 1.0 + 2.0**-23, 2.0, 4.0 - 2.0**-22, 8.0, 11.3137085]
    for beta2 in (0.0, 0.5, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9995, 0.9999, 0.99999):
        table = adam_bias_table(0.9, beta2)[1]
        steps = list(range(1, min(51, len(table)))) + list(range(51, len(table), 997))
        values += [table[k] for k in steps]
    for beta2 in (0.3, 0.5, 0.9, 0.99, 0.999, 0.9999):
        period = decay_norm_period(beta2)
        last = len(adam_bias_table(0.9, beta2)[1]) - 1
        steps = list(range(1, min(2 * period + 2, 100)))  # the first periods
        steps += list(range(100, last + period, max(1, (last + period) // 60)))  # ~60 more
        steps += [period - 1, period, period + 1, last + period - 1]
        values += [_normalized_bc2(beta2, k) for k in steps if k >= 1]
    values.append(math.sqrt(1.0 - (1.0 - 2.0**-53)))  # the smallest bc2_sqrt: beta2 = 1 - 2**-53
    b = torch.tensor(values, dtype=torch.float64).float()
    g = torch.Generator().manual_seed(0)
    rnd = torch.pow(2.0, -60.0 * torch.rand(256, generator=g, dtype=torch.float64)).float()
    above = torch.pow(2.0, 4.0 * torch.rand(128, generator=g, dtype=torch.float64)).float()
    ones = (torch.randint(67, 131, (24,), generator=g, dtype=torch.int32) << 23) | 0x7FFFFF
    zeros = torch.randint(67, 131, (24,), generator=g, dtype=torch.int32) << 23
    b = torch.cat([b, rnd, above, ones.view(torch.float32), zeros.view(torch.float32)])
    b = torch.unique(b[_in_range(b)])
    assert b.numel() > 600
    assert int((b > 1.0).sum()) > 150
    return b


def _normalized_bc2(beta2: float, step: int) -> float:
    s = adam_scalars(
        lr=1.0, betas=(0.9, beta2), eps=1e-8, weight_decay=0.0, step=step, decoupled=True,
        normalized=True,
    )  # fmt: skip
    return s.bc2_sqrt


def test_every_significand_divides_as_div_rn():
    b = divisors().cuda()
    fields = torch.tensor(EXPONENT_FIELDS, dtype=torch.int32, device="cuda")
    out = torch.zeros(b.numel(), dtype=torch.int32, device="cuda")
    mismatch_kernel[(b.numel(), SIGNIFICANDS // BLOCK)](b, fields, len(fields), out, BLOCK=BLOCK)
    bad = out.cpu()
    assert int(bad.sum()) == 0, {float(x): int(n) for x, n in zip(b.cpu(), bad, strict=True) if n}


def test_special_dividends():
    inf, nan = float("inf"), float("nan")
    a = torch.tensor([0.0, -0.0, inf, nan, 2.0**-75, 2.0**64, 1.0, 3.0], device="cuda")
    b = torch.tensor([1.0, 2.0**-60, 1e-8, 0.3, 0.999, 16.0, 3.7], device="cuda")
    got = torch.empty(b.numel(), a.numel(), device="cuda")
    want = torch.empty_like(got)
    quotients_kernel[(b.numel(),)](a, b, got, want, a.numel(), BLOCK=16)
    both_nan = got.isnan() & want.isnan()
    same = (got.view(torch.int32) == want.view(torch.int32)) | both_nan
    assert bool(same.all()), (got, want)
    # the signs of zeros and the infinity survive (what the max and the negated remainder keep)
    assert torch.equal(
        got[:, 1].view(torch.int32).cpu(), torch.full((b.numel(),), -(2**31), dtype=torch.int32)
    )
    assert bool((got[:, 2] == inf).all())
    assert bool(got[:, 3].isnan().all())


@triton.jit
def in_range_kernel(b_ptr, out_ptr):
    i = tl.program_id(0)
    tl.store(out_ptr + i, D.divisor_in_range(tl.load(b_ptr + i)).to(tl.int8))


def test_divisor_range():
    """The range the kernels take the reciprocal path in: 2**-60 <= b <= 16 (a
    decay-normalized ``bc2_sqrt`` reaches 16)."""
    b = torch.tensor(
        [
            0.0,
            2.0**-61,
            2.0**-60,
            1e-8,
            1.0,
            1.0 + 2.0**-23,
            16.0,
            16.0 + 2.0**-19,
            float("inf"),
            float("nan"),
            -1.0,
        ]
    ).cuda()
    out = torch.empty(b.numel(), dtype=torch.int8, device="cuda")
    in_range_kernel[(b.numel(),)](b, out)
    assert out.cpu().tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0]
