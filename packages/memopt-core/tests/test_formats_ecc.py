"""Master formats: 'none' (bf16/fp16 rounding), ECC-32 (exact) and ECC-24 (16 significant bits)."""

from __future__ import annotations

import pytest
import torch

from memopt_core import rng
from memopt_core.errors import ConfigError
from memopt_core.formats import master_codec
from memopt_core.formats.bits import bits_to_f32, f32_to_bits

ECC32 = master_codec("ecc32", torch.bfloat16)
ECC24 = master_codec("ecc24", torch.bfloat16)
F32 = torch.finfo(torch.float32)


def pats(*p: int) -> torch.Tensor:
    return bits_to_f32(torch.tensor(p, dtype=torch.int64))


def random_f32(n: int, seed: int = 0) -> torch.Tensor:
    x = bits_to_f32(torch.randint(0, 2**32, (n,), generator=torch.Generator().manual_seed(seed)))
    return x[x.isfinite()]


def edges() -> torch.Tensor:
    v = [0.0, -0.0, F32.max, -F32.max, F32.tiny, -F32.tiny, 2.0**-149, -(2.0**-149), 1.0, 3.0e38]
    return torch.cat(
        [torch.tensor(v), pats(0x7F7F8000, 0x7F7FFFFF, 0x7F7F7FFF, 0x007FFFFF, 0x3F808000)]
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_registry():
    assert (ECC32.code_dtype, ECC24.code_dtype) == (torch.int16, torch.uint8)
    assert master_codec("none", torch.float16).param_dtype == torch.float16
    with pytest.raises(ConfigError):
        master_codec("ecc32", torch.float16)


# --------------------------------------------------------------------------- ECC-32
def test_ecc32_exhaustive_low_halves():
    tops = [
        s | e << 7 | m
        for s in (0, 0x8000)
        for e in (0, 1, 2, 60, 126, 127, 128, 200, 253, 254)
        for m in (0, 1, 0x40, 0x7F)
    ]
    low = torch.arange(1 << 16)
    x = bits_to_f32((torch.tensor(tops)[:, None] << 16 | low).flatten())
    p, c = ECC32.encode(x)
    assert p.dtype == torch.bfloat16
    assert c.dtype == torch.int16
    assert same_bits(ECC32.decode(p, c), x)


@pytest.mark.parametrize(("exp_field", "sign"), [(0, 1), (1, -1), (127, 1), (254, -1)])
def test_ecc32_all_mantissas(exp_field, sign):
    x = sign * bits_to_f32(exp_field << 23 | torch.arange(1 << 23))
    assert same_bits(ECC32.decode(*ECC32.encode(x)), x)


def test_ecc32_param_is_nearest_ties_away():
    x = torch.cat([random_f32(1 << 18), edges(), -edges()])
    p, c = ECC32.encode(x)
    assert same_bits(ECC32.decode(p, c), x)
    u = f32_to_bits(x)
    tie = (u & 0xFFFF) == 0x8000
    rne = x.to(torch.bfloat16)
    pi, ri = p.view(torch.int16), rne.view(torch.int16)
    assert torch.equal(pi[~tie], ri[~tie])  # RNE everywhere but on exact ties
    odd = ((u >> 16) & 1) == 1
    assert torch.equal(pi[tie & odd], ri[tie & odd])  # ties of odd tops go up in both
    # on ties the parameter is the neighbour away from zero
    assert (p[tie].float().abs() > x[tie].abs()).all()


def test_ecc32_specials():
    x = torch.tensor([F32.max, -F32.max, float("inf"), float("-inf"), 0.0, -0.0])
    p, c = ECC32.encode(x)
    assert torch.equal(p.float(), torch.tensor([float("inf"), float("-inf")] * 2 + [0.0, 0.0]))
    assert same_bits(ECC32.decode(p, c), x)
    n = pats(0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0x7F80FFFF)
    p, c = ECC32.encode(n)
    assert p.isnan().all()
    assert ECC32.decode(p, c).isnan().all()


@pytest.mark.parametrize("codec", [ECC32, ECC24], ids=["ecc32", "ecc24"])
def test_decode_is_shaped_like_the_parameter(codec):
    """A (n,) code beside a (n, 1) parameter broadcast to (n, n) values; a (8, 8) code beside
    a (64,) parameter raised torch's size mismatch. The kernels decode both by element."""
    x = random_f32(64, seed=5)[:48]
    p, c = codec.encode(x)
    for shape, code_shape in (((48, 1), (48,)), ((48,), (6, 8)), ((6, 8), (48, 1))):
        got = codec.decode(p.reshape(shape), c.reshape(code_shape))
        assert got.shape == shape
        assert same_bits(got.reshape(-1), codec.decode(p, c))


@pytest.mark.parametrize(
    ("codec", "carrying"),
    [(ECC32, range(0x8000, 0x10000)), (ECC24, range(0x80, 0x100))],
    ids=["ecc32", "ecc24"],
)
def test_a_zero_parameter_with_a_carrying_code_decodes_to_that_zero(codec, carrying):
    """No encode pairs +-0 with a carrying code; the pair is left when a weight is zeroed in
    place (nn.init.zeros_) after its code was written. Undoing the carry borrowed through the
    sign: +0 decoded to a negative NaN pattern, -0 to a positive one (KERNEL_API 5)."""
    for x in (torch.zeros(1), -torch.zeros(1), random_f32(4096, seed=3)):
        p, c = codec.encode(x)  # what encodes make: never a carry beside +-0
        zero = (p.view(torch.int16).to(torch.int64) & 0x7FFF) == 0
        assert not ((c.to(torch.int64) & (0x8000 if codec is ECC32 else 0x80)) != 0)[zero].any()
    codes = torch.tensor(list(carrying), dtype=torch.int64)
    code = codes.to(torch.int32).to(torch.int16) if codec is ECC32 else codes.to(torch.uint8)
    for zero in (0.0, -0.0):
        param = torch.full((len(codes),), zero, dtype=torch.bfloat16)
        got = codec.decode(param, code)
        assert same_bits(got, torch.full_like(got, zero)), zero
    # the codes that do not carry are kept below the zero: tiny values of its sign
    low = torch.arange(0x8000 if codec is ECC32 else 0x80, dtype=torch.int64)
    code = low.to(torch.int16) if codec is ECC32 else low.to(torch.uint8)
    got = codec.decode(torch.zeros(len(low), dtype=torch.bfloat16), code)
    assert torch.equal(f32_to_bits(got), low if codec is ECC32 else low << 8)


# --------------------------------------------------------------------------- ECC-24
def nearest16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to 16 significant bits (ties to even) in double: the independent reference."""
    xd = x.double()
    e = torch.floor(torch.log2(xd.abs())).clamp(min=-126)
    ulp = torch.exp2(e - 15)
    return torch.round(xd / ulp) * ulp


def test_ecc24_rne_bound():
    x = torch.cat([random_f32(1 << 18, 1), edges(), -edges()])
    x = x[x != 0]
    p, c = ECC24.encode(x)
    y = ECC24.decode(p, c)
    big = x.abs() >= F32.max * (
        1 - 2.0**-17
    )  # saturating: 0x7F7FFF80.. keep the largest 24-bit pattern
    assert torch.equal(y[~big].double(), nearest16(x[~big]))
    assert torch.equal(y[big].abs(), pats(0x7F7FFF00).expand(int(big.sum())))
    normal = x.abs() >= F32.tiny
    rel = ((y.double() - x.double()) / x.double()).abs()
    assert rel[normal].max().item() <= 2.0**-16
    assert (y.double() - x.double())[~normal].abs().max().item() <= 2.0**-142  # half of 2**-141
    # the parameter is the nearest bf16 of the 24-bit value, ties away from zero
    tie = (f32_to_bits(y) & 0xFFFF) == 0x8000
    assert torch.equal(p[~tie].view(torch.int16), y[~tie].to(torch.bfloat16).view(torch.int16))
    assert tie.any()
    assert (p[tie].float().abs() > y[tie].abs()).all()


def test_ecc24_layout_and_specials():
    x = pats(0x3F81_2345, 0xBF81_80FF, 0x3F81_8080, 0x3F81_8180)  # RNE on the low byte, ties even
    p, c = ECC24.encode(x)
    assert c.dtype == torch.uint8
    assert c.tolist() == [0x23, 0x81, 0x80, 0x82]
    assert p.view(torch.int16).tolist() == [0x3F81, 0xBF82 - 0x10000, 0x3F82, 0x3F82]
    assert same_bits(ECC24.decode(p, c), pats(0x3F812300, 0xBF818100, 0x3F818000, 0x3F818200))
    s = torch.tensor([F32.max, -F32.max, float("inf"), float("-inf"), 0.0, -0.0])
    p, c = ECC24.encode(s)
    y = ECC24.decode(p, c)
    assert y[:2].isfinite().all()
    assert same_bits(y[2:], s[2:])
    n = pats(0x7FC00000, 0x7F800001, 0xFF80FFFF)
    assert ECC24.decode(*ECC24.encode(n)).isnan().all()


def test_ecc24_sr_unbiased_and_reproducible():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, generator=g) * 10.0 ** torch.randint(-20, 20, (256,), generator=g)
    draws = 400
    ys = []
    for d in range(draws):
        r = rng.uniform_bits(11, 0, torch.arange(x.numel()), d, rng.STREAM_MASTER)
        ys.append(ECC24.decode(*ECC24.encode(x, rand=r)).double())
    y = torch.stack(ys)
    lo = ECC24.decode(*ECC24.encode(x, rand=torch.full(x.shape, 2**32 - 1))).double()
    hi = ECC24.decode(*ECC24.encode(x, rand=torch.zeros(x.shape, dtype=torch.int64))).double()
    assert ((y == lo) | (y == hi)).all()
    gap = (hi - lo).abs()
    assert ((y.mean(0) - x.double()).abs() <= 5 * gap / 2 / draws**0.5 + gap * 2**-24).all()
    assert (gap <= x.double().abs() * 2.0**-15).all()  # SR error < one 16-bit ulp
    r = rng.uniform_bits(11, 0, torch.arange(x.numel()), 0, rng.STREAM_MASTER)
    a, b = ECC24.encode(x, rand=r), ECC24.encode(x, rand=r)
    assert torch.equal(a[1], b[1])
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16))


# --------------------------------------------------------------------------- 'none'
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_none_master_equals_cast(dtype):
    m = master_codec("none", dtype)
    fi = torch.finfo(dtype)
    x = torch.cat(
        [
            random_f32(1 << 18, 2),
            torch.randn(4096) * 1e-5,
            torch.tensor(
                [
                    fi.max,
                    -fi.max,
                    fi.max * 1.001,
                    fi.tiny,
                    fi.tiny / 3,
                    fi.smallest_normal * 2**-10,
                    65520.0,
                    65519.0,
                    float("inf"),
                    float("-inf"),
                    0.0,
                    -0.0,
                ]
            ),
        ]
    )
    p, code = m.encode(x)
    assert code is None
    assert p.dtype == dtype
    assert torch.equal(p.view(torch.int16), x.to(dtype).view(torch.int16))
    assert torch.equal(m.decode(p, None), x.to(dtype).float())
    n = pats(0x7FC00000, 0xFF800001, 0x7FFFFFFF)
    assert m.encode(n)[0].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_none_master_sr_unbiased(dtype):
    m = master_codec("none", dtype)
    x = torch.randn(256, generator=torch.Generator().manual_seed(4)) * 3
    x[:8] = torch.tensor(
        [1e-6, -3e-7, 6e-8, 1e-8, 1.0, 0.0, 60000.0, -(2.0**-20)]
    )  # fp16 subnormals too
    draws = 400
    y = torch.stack(
        [
            m.encode(x, rand=rng.uniform_bits(5, 1, torch.arange(256), d, 0))[0].double()
            for d in range(draws)
        ]
    )
    lo = m.encode(x, rand=torch.full(x.shape, 2**32 - 1))[0].double()
    hi = m.encode(x, rand=torch.zeros(x.shape, dtype=torch.int64))[0].double()
    assert ((y == lo) | (y == hi)).all()
    gap = (hi - lo).abs()
    assert ((y.mean(0) - x.double()).abs() <= 5 * gap / 2 / draws**0.5 + gap * 2**-24).all()
    assert (lo.abs() <= x.double().abs()).all()
    assert (hi.abs() >= x.double().abs()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_none_master_decode_is_exact_widening(dtype):
    """Every 16-bit pattern (NaN payloads included) widens like the CPU cast, on the bit pattern."""
    p = torch.arange(-(2**15), 2**15).to(torch.int16).view(dtype)
    got = master_codec("none", dtype).decode(p, None)
    assert torch.equal(got.view(torch.int32), p.float().view(torch.int32))
