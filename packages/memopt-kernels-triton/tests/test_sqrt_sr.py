"""``q8_sqrt``'s stochastic-rounding decision without a division (``codecs.sqrt_sr_up``) against
the division it replaces: ``r24 < floor(RN(num / den) * 2**24)`` with torch's correctly rounded
fp32 division, on random and adversarial ``(num, den, r24)``: quotients at and next to every
rounding boundary, power-of-two thresholds, subnormal operands, the ends of ``r24``."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
C = pytest.importorskip("memopt_kernels_triton.kernels.codecs")


@triton.jit
def sqrt_sr_up_kernel(num_ptr, den_ptr, r24_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    num = tl.load(num_ptr + offs, mask=mask, other=0.0)
    den = tl.load(den_ptr + offs, mask=mask, other=1.0)
    r24 = tl.load(r24_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, C.sqrt_sr_up(num, den, r24).to(tl.int8), mask=mask)


def kernel_up(num, den, r24, device) -> torch.Tensor:
    out = torch.empty(num.numel(), dtype=torch.int8, device=device)
    block = 1024
    sqrt_sr_up_kernel[(triton.cdiv(num.numel(), block),)](
        num.to(device), den.to(device), r24.to(device), out, num.numel(), BLOCK=block
    )
    return out.cpu().bool()


def division_up(num, den, r24) -> torch.Tensor:
    """The rule the kernel had: frac24 = floor(RN(num / den) * 2**24) (fp32 division, correctly
    rounded on the CPU), clamped to [0, 2**24] as core's ``frac24``."""
    frac = num / den
    frac24 = torch.floor(frac.double() * 2.0**24).clamp(0, 2**24).to(torch.int64)
    return r24.to(torch.int64) < frac24


def f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def cases(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    r24 = torch.randint(0, 2**24, (n,), generator=g, dtype=torch.int32)
    # thresholds that are powers of two (the predecessor lies half as far) and the ends
    special = torch.tensor([0, 1, 2, 3, 2**23 - 1, 2**23, 2**24 - 2, 2**24 - 1], dtype=torch.int32)
    r24[: n // 8] = (1 << torch.randint(0, 25, (n // 8,), generator=g)).to(torch.int32) - 1
    r24[n // 8 : n // 8 + 8 * 64] = special.repeat(64)
    # den: q8_sqrt's shape (2j+1) * 2**e, any positive pattern, and subnormals
    j = torch.randint(0, 32, (n,), generator=g)
    e = torch.randint(-140, 100, (n,), generator=g)
    den = ((2 * j + 1).double() * torch.pow(2.0, e.double())).float()
    any_bits = torch.randint(1, 0x7F800000, (n,), generator=g, dtype=torch.int64)
    pick = torch.randint(0, 4, (n,), generator=g)
    den = torch.where(pick == 1, f32(any_bits), den)
    den = torch.where(pick == 2, f32(torch.randint(1, 0x800000, (n,), generator=g)), den)
    # num: at the rounding boundary below t = (r24 + 1) * 2**-24, and some ulps around it
    t = (r24.double() + 1) * 2.0**-24
    pred = f32(t.float().view(torch.int32) - 1).double()
    mid = (t + pred) / 2
    near = (mid * den.double()).float()  # nearest fp32 to the boundary quotient times den
    step = torch.randint(-3, 4, (n,), generator=g, dtype=torch.int32)
    num = f32(near.view(torch.int32) + step)
    # and plain random quotients in [0, 1]
    rnd = torch.rand(n, generator=g, dtype=torch.float64)
    num = torch.where(pick == 3, (rnd * den.double()).float(), num)
    return num, den, r24


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decision_equals_division(device, seed):
    num, den, r24 = cases(1 << 16, seed)
    keep = (den > 0) & torch.isfinite(den) & torch.isfinite(num) & (num >= 0)
    num, den, r24 = num[keep], den[keep], r24[keep]
    want = division_up(num, den, r24)
    got = kernel_up(num, den, r24, device)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [
        (num[i].item(), den[i].item(), r24[i].item(), want[i].item()) for i in bad[:5]
    ]
    # the boundary cases are there: both answers occur next to the boundary
    assert 0.2 < want.double().mean().item() < 0.8


def test_decision_edges(device):
    one = torch.tensor([1.0])
    tiny = f32(torch.tensor([1]))  # 2**-149
    num = torch.cat(
        [one, one, one, tiny, tiny, one * 0, -one, one, f32(torch.tensor([0x3F7FFFFF]))]
    )
    den = torch.cat([one, one, one, tiny, tiny * 3, one, one, one * float("inf"), one])
    r24 = torch.tensor([2**24 - 1, 0, 2**23, 2**24 - 1, 2**24 // 3 - 1, 0, 0, 0, 2**24 - 1])
    r24 = r24.to(torch.int32)
    # num == den: frac 1 rounds up even for the largest r24; 0, negatives and x/inf never do;
    # 1 - 2**-24 rounds up unless r24 is the largest
    want = torch.tensor([True, True, True, True, True, False, False, False, False])
    assert torch.equal(division_up(num, den, r24), want)
    assert torch.equal(kernel_up(num, den, r24, device), want)
