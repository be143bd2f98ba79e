"""q8 moments: q8_signed is block e4m3; q8_sqrt stores sqrt(v) as unsigned e4m4 with E8M0 scales."""

from __future__ import annotations

import pytest
import torch

from memopt_core import rng
from memopt_core.errors import FormatError
from memopt_core.formats import StateSpec, moment_codec
from memopt_core.reference import correctly_rounded_sqrt
from memopt_core.testing import q8_sqrt_threshold_cases

SIGNED, SQRT, E4M3 = moment_codec("q8_signed"), moment_codec("q8_sqrt"), moment_codec("fp8_e4m3")
B = 32
REL_S = 2.0**-5  # half an ulp of 5 significant bits
REL_V = (1 + REL_S) ** 2 * (1 + 2.0**-24) - 1  # q*q, one rounding


def gen(seed):
    return torch.Generator().manual_seed(seed)


def second_moments(nblocks: int, seed: int = 0, lo: float = -30, hi: float = 30) -> torch.Tensor:
    g = gen(seed)
    mag = 10.0 ** (torch.rand(nblocks, generator=g) * (hi - lo) + lo)
    return (torch.randn(nblocks, B, generator=g) ** 2 * mag[:, None]).flatten()


def q_of(fields) -> torch.Tensor:
    """The decoded sqrt: sqrt(RN(q*q)) == q, so the correctly rounded sqrt of the decoded v."""
    return correctly_rounded_sqrt(SQRT.decode(fields))


def nearest_e4m4(s: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Independent reference in double: s * 2**-k rounded (half even) to 4 mantissa bits, emin -14."""
    y = s.double() * torch.exp2(-k.double())
    e = torch.floor(torch.log2(y)).clamp(min=-14)
    ulp = torch.exp2(e - 4)
    q = torch.where(y > 0, torch.round(y / ulp) * ulp, torch.zeros_like(y))
    q = torch.where((q == 0) & (y > 0), 2.0**-18, q)  # a positive v never gets code 0
    return q * torch.exp2(k.double())


def test_layout_and_bytes():
    assert SQRT.signed is False
    assert SIGNED.signed is True
    assert SQRT.fields[""].dtype == torch.uint8
    assert SQRT.fields["scale"].per_block
    spec = StateSpec(moments="q8")
    assert (spec.first.name, spec.second.name, spec.block_size) == ("q8_signed", "q8_sqrt", B)
    assert spec.first.bytes_per_element() + spec.second.bytes_per_element() == 2.0625
    with pytest.raises(FormatError):
        SQRT.encode(torch.ones(B + 1))


@pytest.mark.parametrize("sr", [False, True])
def test_signed_is_block_e4m3(sr):
    x = torch.randn(64 * B, generator=gen(1)) * 1e-3
    r = rng.uniform_bits(3, 0, torch.arange(x.numel()), 1, 1) if sr else None
    a, b = SIGNED.encode(x, rand=r), E4M3.encode(x, rand=r)
    assert torch.equal(a[""].view(torch.uint8), b[""].view(torch.uint8))
    assert torch.equal(a["scale"], b["scale"])


def test_sqrt_codes_and_scales():
    v = torch.cat([second_moments(900), torch.tensor([0.0, -0.0, 1.0, 2.0**-149] + [4.0] * 28)])
    f = SQRT.encode(v)
    k = f["scale"].to(torch.int64) - 127
    s = correctly_rounded_sqrt(v)
    smax = s.view(-1, B).amax(1).double()
    assert (smax * torch.exp2(-k.double()) <= 1.875).all()
    assert ((smax * torch.exp2(1 - k.double()) > 1.875) | (k == -127)).all()
    q = q_of(f)
    assert torch.equal(q.double(), nearest_e4m4(s, k.repeat_interleave(B)))
    assert torch.equal(SQRT.decode(f), q * q)
    assert not SQRT.decode(f).signbit().any()
    assert (f[""] <= 0xFE).all()


@pytest.mark.parametrize("sr", [False, True])
def test_error_bounds(sr):
    v = torch.cat([second_moments(900, 2), second_moments(50, 3, -30, -29)])
    r = rng.uniform_bits(4, 0, torch.arange(v.numel()), 1, rng.STREAM_SECOND) if sr else None
    f = SQRT.encode(v, rand=r)
    s, q = correctly_rounded_sqrt(v).double(), q_of(f).double()
    smax = s.view(-1, B).amax(1).repeat_interleave(B)
    # s: half an ulp of 5 bits where the scaled s is normal, else <= half the spacing 2**(-18+k)
    b = torch.maximum(s * REL_S, smax * 2.0**-18 / 1.875) * (2 if sr else 1)
    assert ((q - s).abs() <= b).all()
    normal = s * 2.0 ** -(f["scale"].double().repeat_interleave(B) - 127) >= 2.0**-14
    rel_v = ((SQRT.decode(f).double() - v.double()) / v.double()).abs()[normal]
    assert rel_v.max() <= ((1 + 2 * REL_S) ** 2 * (1 + 2.0**-24) - 1 if sr else REL_V)


def test_tiny_second_moments():
    v = (1.0 + torch.rand(64 * B, generator=gen(5))) * 1e-30
    d = SQRT.decode(SQRT.encode(v))
    assert (d > 0).all()
    assert (((d.double() - v.double()) / v.double()).abs() <= REL_V).all()


def test_outlier_keeps_neighbours():
    """A 1000x gradient outlier (1e6x in v) leaves its neighbours' v non-zero and within REL_V;
    linear e4m3 on v would flush them to zero, which is why q8 stores sqrt(v)."""
    g = 1.0 + 0.1 * torch.randn(8 * B, generator=gen(6))
    g[::B] = 1000.0  # one outlier per block
    v = g * g
    d = SQRT.decode(SQRT.encode(v))
    small = torch.ones_like(v, dtype=torch.bool)
    small[::B] = False
    assert (d[small] > 0).all()
    assert (((d.double() - v.double()) / v.double()).abs()[small] <= REL_V).all()
    assert (E4M3.decode(E4M3.encode(v))[small] == 0).all()


@pytest.mark.parametrize("sr", [False, True])
def test_positive_v_below_the_smallest_code_is_stored_as_it(sr):
    """Next to an element 2**20 times larger in s, a positive v rounds below code 1: it is
    stored as code 1 (the smallest positive value), never 0, so Adam's step for it is smaller
    than fp32's, not m / eps. Zeros stay zero."""
    v = torch.full((2 * B,), 1e-14)
    v[::B] = 1.0  # s = 1 against s = 1e-7: beyond the code's 2**18
    v[1::B] = 0.0
    r = rng.uniform_bits(4, 0, torch.arange(v.numel()), 1, rng.STREAM_SECOND) if sr else None
    f = SQRT.encode(v, rand=r)
    tiny = v == 1e-14
    assert (f[""][tiny] == 1).all()
    assert (f[""][v == 0] == 0).all()
    k = f["scale"].to(torch.int64) - 127
    smallest = (2.0 ** (-18 + k.double())).repeat_interleave(B) ** 2
    assert torch.equal(SQRT.decode(f)[tiny].double(), smallest[tiny])
    assert (SQRT.decode(f)[tiny] > v[tiny]).all()


def test_nonfinite_isolated():
    v = second_moments(4, 7, -2, 2)
    pos = [3, 40, 77, 100]
    bad, clean = v.clone(), v.clone()
    bad[pos] = torch.tensor([float("nan"), float("inf"), -1.0, float("nan")])
    clean[pos] = 0.0
    fb, fc = SQRT.encode(bad), SQRT.encode(clean)
    assert torch.equal(fb["scale"], fc["scale"])
    keep = torch.ones_like(v, dtype=torch.bool)
    keep[pos] = False
    db = SQRT.decode(fb)
    assert torch.equal(db[keep], SQRT.decode(fc)[keep])
    assert db[pos].isnan().all()


def test_sr_unbiased_in_v_and_reproducible():
    """SR picks one of the two codes around sqrt(v), with the probability that makes q*q unbiased."""
    v = second_moments(8, 8, -3, 3)
    v[:4] *= 1e-6  # subnormal range of the block
    draws = 800
    dec = lambda r: SQRT.decode(SQRT.encode(v, rand=r)).double()  # noqa: E731
    vs = torch.stack(
        [dec(rng.uniform_bits(5, 0, torch.arange(v.numel()), d, 2)) for d in range(draws)]
    )
    lo, hi = dec(torch.full(v.shape, 2**32 - 1)), dec(torch.zeros(v.shape, dtype=torch.int64))
    assert ((vs == lo) | (vs == hi)).all()
    assert (lo <= v.double()).all()
    assert (hi >= v.double()).all()
    s, ql, qh = (correctly_rounded_sqrt(t.float()).double() for t in (v, lo, hi))
    assert (ql <= s).all()
    assert (qh >= s).all()
    gap = hi - lo
    assert ((vs.mean(0) - v.double()).abs() <= 5 * gap / 2 / draws**0.5 + gap * 2**-23).all()
    total_sigma = (gap**2 / 4).sum().sqrt() / draws**0.5  # all elements together: no bias
    assert (vs.mean(0) - v.double()).sum().abs() <= 5 * total_sigma
    r1 = rng.uniform_bits(5, 0, torch.arange(v.numel()), 0, 2)
    r2 = rng.uniform_bits(6, 0, torch.arange(v.numel()), 0, 2)
    a, b, c = SQRT.encode(v, rand=r1), SQRT.encode(v, rand=r1), SQRT.encode(v, rand=r2)
    assert torch.equal(a[""], b[""])
    assert (a[""] != c[""]).sum() > v.numel() // 4
    grid = SQRT.decode(SQRT.encode(v))  # q*q of on-grid q: never moves under SR
    assert torch.equal(
        SQRT.decode(SQRT.encode(grid, rand=torch.zeros(v.shape, dtype=torch.int64))), grid
    )


def test_sr_rounds_up_with_the_probability_that_keeps_v_unbiased():
    """At every code and random fractions towards the next one, SR rounds up iff ``r >> 8`` lies
    below ``p * 2**24``, where ``p = (s*s - lo*lo) / (hi*hi - lo*lo)`` makes ``E[q*q] = s*s``:
    words two below and one above the threshold decide as ``p`` says (integer rounding of the
    threshold aside)."""
    v, p, r = q8_sqrt_threshold_cases(seed=1)
    got = SQRT.encode(v, rand=r)
    lo = SQRT.encode(v, rand=torch.full_like(r, 2**32 - 1))  # the largest word never rounds up
    assert (got["scale"] == 127).all()
    up = got[""].to(torch.int64) - lo[""].to(torch.int64)
    case = torch.arange(v.numel()) % B != 0  # each block's first element fixes its scale
    t = p * 2**24
    r24 = (r >> 8).double()
    below, above = case & (r24 <= t - 1), case & (r24 >= torch.floor(t) + 1)
    assert below.sum() > v.numel() // 4
    assert above.sum() > v.numel() // 4
    assert (up[below] == 1).all()
    assert (up[above] == 0).all()


@pytest.mark.parametrize("n", [0, B, 33 * B])
def test_sizes(n):
    v = torch.rand(n, generator=gen(n))
    f = SQRT.encode(v)
    assert f[""].shape == (n,)
    assert f["scale"].shape == (n // B,)
    assert not SQRT.decode(SQRT.allocate(n)).any()


@pytest.mark.parametrize("fmt", ["q8_sqrt", "q8_signed", "fp8_e4m3", "bf16"])
def test_stochastic_words_of_any_shape_in_flattened_order(fmt):
    """The kernels read ``rand`` in x's flattened order, whatever its shape. The reference
    wanted x's shape in some codecs and the flat shape in the blocked ones, and refused every
    2-D x in q8_sqrt's stochastic rounding (its inner words were shaped like x, its rounding
    flat)."""
    codec = moment_codec(fmt)
    x = torch.rand(2, 3 * B, generator=torch.Generator().manual_seed(0))
    words = rng.uniform_bits(5, 1, torch.arange(x.numel()), 2, rng.STREAM_SECOND)
    flat = codec.encode(x.reshape(-1), rand=words)
    for r in (words, words.view(x.shape), words.view(-1, 1)):
        got = codec.encode(x, rand=r)
        assert got[""].shape == x.shape
        for k in flat:
            assert torch.equal(got[k].reshape(-1), flat[k].reshape(-1)), k
    with pytest.raises(
        FormatError, match=rf"rand must be an int64 tensor of {x.numel()} .* got list"
    ):
        codec.encode(x, rand=words.tolist())
    with pytest.raises(FormatError, match=r"got torch\.int64\(5,\)"):
        codec.encode(x, rand=words[:5])


def test_codec_lookups_name_what_they_take():
    from memopt_core.errors import ConfigError
    from memopt_core.formats import master_codec

    with pytest.raises(ConfigError, match=r"torch\.bfloat16, not 'bfloat16'"):
        master_codec("ecc24", "bfloat16")  # read "got bfloat16 parameters: cast to bfloat16"
    with pytest.raises(ConfigError, match=r"a moment format is one of .* got \['q8'\]"):
        moment_codec(["q8"])  # unhashable: a bare TypeError from the cache
