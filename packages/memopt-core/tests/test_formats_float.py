"""bf16 moments: bit-level RNE equals torch's cast, stochastic rounding follows the shared rule."""

from __future__ import annotations

import pytest
import torch

from memopt_core import rng
from memopt_core.formats import moment_codec
from memopt_core.formats.bits import bits_to_f32

BF16 = moment_codec("bf16")


def rand_bits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 2**32, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64
    )


def edge_values() -> torch.Tensor:
    f = torch.finfo(torch.float32)
    b = torch.finfo(torch.bfloat16)
    v = [
        0.0,
        -0.0,
        f.max,
        -f.max,
        f.tiny,
        f.tiny / 2,
        2.0**-149,
        -(2.0**-149),
        b.max,
        -b.max,
        1.0,
        -1.0,
    ]
    pats = [
        0x3F808000,
        0x3F818000,
        0x3F80_7FFF,
        0x3F80_8001,
        0x7F7F7FFF,
        0x7F7F8000,
        0x007F8000,
        0x00008000,
    ]
    extra = bits_to_f32(torch.tensor(pats + [p | 0x80000000 for p in pats], dtype=torch.int64))
    return torch.cat([torch.tensor(v), extra, torch.tensor([float("inf"), float("-inf")])])


def round_trip(codec, x, rand=None):
    return codec.decode(codec.encode(x, rand=rand))


def test_rne_equals_torch_cast():
    x = torch.cat([bits_to_f32(rand_bits(1 << 18)), edge_values(), torch.randn(4096)])
    got = BF16.encode(x)[""]
    assert got.dtype == torch.bfloat16
    fin = ~x.isnan()
    assert torch.equal(got[fin].view(torch.int16), x[fin].to(torch.bfloat16).view(torch.int16))
    assert got[x.isnan()].isnan().all()
    assert torch.equal(round_trip(BF16, x)[fin], x[fin].to(torch.bfloat16).float())


@pytest.mark.parametrize("n", [0, 32, 33 * 32, 7])
def test_sizes(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    fields = BF16.allocate(n)
    assert fields[""].shape == (n,)
    assert not BF16.decode(fields).any()
    assert torch.equal(round_trip(BF16, x), x.to(torch.bfloat16).float())
    assert BF16.bytes_per_element() == 2


def sr_draws(codec, x, draws, seed=0, stream=rng.STREAM_FIRST):
    """Decoded values of ``draws`` independent SR encodings of x: shape (draws, len(x))."""
    out = []
    for d in range(draws):
        r = rng.uniform_bits(seed, 0, torch.arange(x.numel()), d, stream)
        out.append(round_trip(codec, x, r))
    return torch.stack(out)


def neighbours(codec, x):
    """(lo, hi) magnitudes' signed values: rand=2**32-1 never rounds up, rand=0 always does when inexact."""
    never = torch.full(x.shape, 2**32 - 1, dtype=torch.int64)
    always = torch.zeros(x.shape, dtype=torch.int64)
    return round_trip(codec, x, never), round_trip(codec, x, always)


def check_sr_unbiased(codec, x, draws=400):
    """Each draw is one of the two neighbours; the mean is within 5 sigma (+ the 2**-24 quantization
    of frac24) of x; the share of round-ups equals the fraction."""
    lo, hi = neighbours(codec, x)
    d = sr_draws(codec, x, draws).double()
    assert ((d == lo) | (d == hi)).all()
    gap = (hi.double() - lo.double()).abs()
    err = (d.mean(0) - x.double()).abs()
    assert (err <= 5 * gap / 2 / draws**0.5 + gap * 2**-24 + 1e-300).all()
    total_sigma = (gap**2 / 4).sum().sqrt() / draws**0.5  # aggregate bias over all elements
    assert (d.mean(0) - x.double()).sum().abs() <= 5 * total_sigma + gap.sum() * 2**-24


def test_sr_unbiased_and_exact_values_fixed():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, generator=g) * torch.logspace(-30, 30, 512)
    check_sr_unbiased(BF16, x)
    on_grid = x.to(torch.bfloat16).float()
    assert torch.equal(sr_draws(BF16, on_grid, 3), on_grid.expand(3, -1))


def test_sr_reproducible_and_seeded():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    r = lambda seed: rng.uniform_bits(seed, 5, torch.arange(x.numel()), 1, rng.STREAM_SECOND)  # noqa: E731
    a = BF16.encode(x, rand=r(0))[""]
    assert torch.equal(a.view(torch.int16), BF16.encode(x, rand=r(0))[""].view(torch.int16))
    b = BF16.encode(x, rand=r(1))[""]
    assert (a != b).sum() > 1000  # about half of the elements round the other way


def test_sr_rule_is_exact():
    """frac24 = low16 << 8: rounding up iff (r >> 8) < frac24, checked at the threshold."""
    x = bits_to_f32(torch.tensor([0x3F801234, 0xBF801234], dtype=torch.int64))
    t = 0x1234 << 8
    up = lambda r: BF16.encode(x, rand=torch.tensor([r, r]))[""].view(torch.int16).tolist()  # noqa: E731
    assert up((t - 1) << 8) == [0x3F81, 0xBF81 - 0x10000]
    assert up(t << 8) == [0x3F80, 0xBF80 - 0x10000]


def test_words_outside_32_bits_count_modulo_2_32():
    """A negative (int32-style) word always rounded up in the reference and a word >= 2**32
    never did, where the kernels take the low 32 bits: three backends, three answers."""
    x = torch.full((4,), 1.0 + 2.0**-9)  # halfway between two bf16 numbers: frac24 = 2**23
    words = torch.tensor([-1, -(2**31), 2**32 + 5, 2**40], dtype=torch.int64)
    got = BF16.encode(x, rand=words)[""]
    want = BF16.encode(x, rand=words & 0xFFFFFFFF)[""]
    assert torch.equal(got, want)
    assert got.view(torch.int16).tolist() == [0x3F80, 0x3F80, 0x3F81, 0x3F81]


def test_wrong_rand_rejected():
    from memopt_core.errors import FormatError

    with pytest.raises(FormatError):
        BF16.encode(torch.ones(4), rand=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(FormatError):
        BF16.encode(torch.ones(4, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "fmt",
    [
        "bf16",
        "fp8_e4m3",
        "fp8_e5m2",
        "q8_signed",
        "q8_sqrt",
        "none-bf16",
        "none-fp16",
        "ecc24",
        "ecc32",
    ],
)
def test_cuda_bits_equal_cpu(fmt):
    """The reference codecs give the same bits on CUDA as on the CPU (RNE and SR, NaN included)."""
    from memopt_core.formats import master_codec

    n = 32 * 4096
    g = torch.Generator().manual_seed(0)
    scale = 10.0 ** torch.randint(-30, 30, (n // 32,), generator=g).repeat_interleave(32)
    xs = [bits_to_f32(rand_bits(n)), torch.randn(n, generator=g) * scale]
    if fmt == "q8_sqrt":
        xs.append(xs[1].abs())
    r = rng.uniform_bits(3, 1, torch.arange(n), 7, 2)

    def flat(out):
        out = out if isinstance(out, (tuple, list)) else list(out.values())
        return [t.cpu().contiguous().view(torch.uint8) for t in out if t is not None]

    for x in xs:
        for rand in (None, r):
            rc = None if rand is None else rand.cuda()
            if fmt in ("ecc24", "ecc32") or fmt.startswith("none"):
                dtype = torch.float16 if fmt == "none-fp16" else torch.bfloat16
                c = master_codec(fmt.split("-")[0], dtype)
                a, b = c.encode(x, rand=rand), c.encode(x.cuda(), rand=rc)
                da, db = c.decode(*a), c.decode(*b)
            else:
                c = moment_codec(fmt)
                a, b = c.encode(x, rand=rand), c.encode(x.cuda(), rand=rc)
                da, db = c.decode(a), c.decode(b)
            assert all(torch.equal(u, v) for u, v in zip(flat(a), flat(b), strict=False))
            assert torch.equal(da.view(torch.int32), db.cpu().view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_fp32_encoders_refuse_other_dtypes(dtype):
    """The fp32 moment and master encoders refuse what every other encoder and both kernel
    backends refuse: they rounded a float64 input silently (1e300 became inf)."""
    from memopt_core.errors import FormatError
    from memopt_core.formats import master_codec

    x = torch.tensor([1e300 if dtype == torch.float64 else 1.0, 2.0], dtype=dtype)
    with pytest.raises(FormatError, match=f"codecs encode float32 tensors, got {dtype}"):
        moment_codec("fp32").encode(x)
    with pytest.raises(FormatError, match=f"codecs encode float32 tensors, got {dtype}"):
        master_codec("fp32", torch.float32).encode(x)
