"""Standalone C++ codecs and rounding words vs memopt-core's reference: the same bits.

Inputs mix random bit patterns (every exponent, subnormals, NaN payloads, infinities) with
log-normal values over many decades, exact zeros of both signs and near-overflow values; each
case runs on every instruction set this CPU supports.
"""

from __future__ import annotations

import pytest
import torch

from memopt_core import conversions
from memopt_core.formats import master_codec, moment_codec
from memopt_core.formats.registry import MOMENT_FORMATS
from memopt_core.rng import STREAM_FIRST, STREAM_MASTER, stream_words
from memopt_core.testing import (
    MASTER_IDS,
    MASTERS,
    assert_moment_conversions_exact,
    bits,
    master_patterns,
    q8_sqrt_threshold_cases,
    record_codec_calls,
)
from memopt_kernels_cpu import ops, set_chunk_size, set_isa, set_num_threads, supported_isas

ISAS = supported_isas()


def sample(n: int, seed: int) -> torch.Tensor:
    """``n`` fp32 test values: a quarter random bit patterns, 64 specials (zeros of both signs,
    infinities, NaN, the smallest subnormal, near-overflow), two tiny 32-blocks, the rest
    log-normal over many decades. Below 256 elements, a random selection of those."""
    g = torch.Generator().manual_seed(seed)
    m = max(n, 256)
    x = torch.randn(m, generator=g) * torch.exp(8 * torch.randn(m, generator=g))
    q = m // 4
    patterns = torch.randint(-(2**31), 2**31, (q,), generator=g, dtype=torch.int64)
    x[:q] = patterns.to(torch.int32).view(torch.float32)
    special = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -3e38, 3.4e38]
    )
    x[q : q + 64] = special.repeat(8)
    x[m // 2 : m // 2 + 64] *= 1e-30  # tiny blocks: scales must not underflow
    return x if n == m else x[torch.randperm(m, generator=g)[:n]]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize("fmt", MOMENT_FORMATS)
@pytest.mark.parametrize("n", [32, 32 * 1031])
def test_moment_codecs(fmt, sr, isa, n):
    set_isa(isa)
    codec = moment_codec(fmt)
    x = sample(n, seed=n + len(fmt))
    if not codec.signed:
        x = x.abs()
    rand = stream_words(3, 9, torch.arange(n), 4)[STREAM_FIRST] if sr else None
    ref = codec.encode(x, rand=rand)
    got = ops.encode_moment(fmt, x, rand=rand)
    for key in ref:
        assert torch.equal(bits(got[key]), bits(ref[key])), f"{fmt} field {key!r} ({isa})"
    assert torch.equal(bits(ops.decode_moment(fmt, ref)), bits(codec.decode(ref))), isa


@pytest.mark.parametrize("isa", ISAS)
def test_q8_sqrt_rounding_at_its_threshold(isa):
    """q8_sqrt's stochastic rounding (integer arithmetic on s's fraction between its codes) at
    every code, with words within two of the decision's threshold on both sides: an off-by-one
    in the comparison shows here."""
    set_isa(isa)
    codec = moment_codec("q8_sqrt")
    v, _, r = q8_sqrt_threshold_cases(seed=2)
    want = codec.encode(v, rand=r)
    got = ops.encode_moment("q8_sqrt", v, rand=r)
    for key in want:
        assert torch.equal(bits(got[key]), bits(want[key])), f"field {key!r} ({isa})"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "q8_signed", "q8_sqrt"])
def test_moment_decode_of_every_code_at_every_scale(fmt, isa):
    """Every code byte at every scale byte, 255 included (no encoder writes it; its factor is
    inf in every backend, so 0 * inf is NaN, with the device's NaN bits): the reference composed
    2**128 exactly there, where this decoder gave inf and NaN (audit round 6's GPU probe)."""
    set_isa(isa)
    codec = moment_codec(fmt)
    codes = torch.arange(256).to(torch.uint8).repeat(256)
    scales = torch.arange(256).to(torch.uint8).repeat_interleave(8)  # 8 blocks per scale byte
    fields = {"": codes.view(codec.fields[""].dtype), "scale": scales}
    want = codec.decode(fields)
    got = ops.decode_moment(fmt, fields)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(bits(got.nan_to_num(0.0)), bits(want.nan_to_num(0.0)))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize(("fmt", "dtype"), MASTERS, ids=MASTER_IDS)
@pytest.mark.parametrize("n", [0, 1, 31, 33, 4097])
def test_master_codecs(fmt, dtype, sr, isa, n):
    set_isa(isa)
    codec = master_codec(fmt, dtype)
    x = sample(n, seed=n)
    rand = stream_words(3, 9, torch.arange(n), 4)[STREAM_MASTER] if sr else None
    p_ref, c_ref = codec.encode(x, rand=rand)
    p, c = ops.encode_master(fmt, x, dtype, rand=rand)
    assert torch.equal(bits(p), bits(p_ref)), isa
    assert (c is None) == (c_ref is None)
    if c is not None:
        assert torch.equal(bits(c), bits(c_ref)), isa
    assert torch.equal(bits(ops.decode_master(fmt, p_ref, c_ref)), bits(codec.decode(p_ref, c_ref)))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("fmt", "dtype"), MASTERS, ids=MASTER_IDS)
def test_master_decode_of_arbitrary_patterns(fmt, dtype, isa):
    # every parameter pattern class and code, and zeros beside carrying codes (stale codes)
    set_isa(isa)
    codec = master_codec(fmt, dtype)
    param, code = master_patterns(codec, 4096, seed=4)
    assert torch.equal(bits(ops.decode_master(fmt, param, code)), bits(codec.decode(param, code)))


def test_ecc32_round_trip_is_exact_for_every_exponent():
    # every sign/exponent with random mantissas: decode(encode(x)) == x bit for bit
    exps = torch.arange(0, 255, dtype=torch.int64).repeat_interleave(64)
    man = torch.randint(0, 2**23, exps.shape, generator=torch.Generator().manual_seed(1))
    u = (exps << 23) | man
    u = torch.cat([u, u | (1 << 31)])
    x = torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)
    for isa in ISAS:
        set_isa(isa)
        p, c = ops.encode_master("ecc32", x)
        assert torch.equal(bits(ops.decode_master("ecc32", p, c)), bits(x)), isa


def assert_words(got, want, what):
    assert len(got) == len(want) == 3, what
    for k in range(3):
        assert got[k].dtype == want[k].dtype == torch.int64, what
        assert torch.equal(got[k], want[k]), (what, k)


@pytest.mark.parametrize("isa", ISAS)
def test_stream_words(isa):
    # scattered indices: one-element runs, and negative ones (their high word is 2**32 - 1)
    set_isa(isa)
    index = torch.cat(
        [
            torch.arange(100),
            torch.randint(0, 2**40, (1000,), generator=torch.Generator().manual_seed(3)),
            torch.tensor([2**32 - 1, 2**32, 2**62 - 1, -1, -(2**40) - 3]),
        ]
    )
    got = ops.stream_words(0xDEADBEEF, 77, index, 12345)
    assert_words(got, stream_words(0xDEADBEEF, 77, index, 12345), isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 33, 1000, 1025])
def test_stream_words_of_every_run_length(isa, n):
    # consecutive indices run through the fused step's vector generator (8 lanes AVX2, 16
    # AVX-512, then a scalar tail): lengths around those widths, starting at, before and across
    # multiples of 2**32 (where the generator cuts a run) and at large indices, random keys
    set_isa(isa)
    g = torch.Generator().manual_seed(n)
    starts = [0, 5, 2**31 + 9, 2**32 - 5, 2**32 - n // 2, 2**33 - 1, 2**40 + 3, 2**62 - n, -n // 2]
    for start in starts:
        seed, tensor_id, step = (int(v) for v in torch.randint(0, 2**32, (3,), generator=g))
        index = torch.arange(start, start + n)
        got = ops.stream_words(seed, tensor_id, index, step)
        assert_words(got, stream_words(seed, tensor_id, index, step), (isa, start, seed))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("start", "n"),
    [(2**32 - 5, 40), (2**33 - 5, 40), (2**32 - 40, 3000), (2**33 - 7, 3000), (3 * 2**32 - 1, 2)],
)
def test_stream_words_across_the_32_bit_index_boundary(isa, start, n):
    # the index's high word changes mid-run: y restarts from the new high word's K3 multiple
    # (a tensor of 2**32+ elements is too large for a CPU test)
    set_isa(isa)
    index = torch.arange(start, start + n)
    for seed, tensor_id, step in [(5, 6, 7), (2**32 - 1, 0, 1), (0x9E3779B9, 2**31, 2**32 - 1)]:
        got = ops.stream_words(seed, tensor_id, index, step)
        assert_words(got, stream_words(seed, tensor_id, index, step), (isa, seed))


@pytest.mark.parametrize("isa", ISAS)
def test_stream_words_on_several_threads(isa):
    # the binding splits the indices over the pool and reassembles the three rows
    set_isa(isa)
    set_num_threads(3)
    set_chunk_size(32)
    index = torch.arange(2**32 - 1000, 2**32 + 1001)
    assert_words(ops.stream_words(1, 2, index, 3), stream_words(1, 2, index, 3), isa)


def test_stream_words_differ_between_streams_steps_and_tensors():
    # the control: the comparisons above cannot pass by accident on constant or shared words
    index = torch.arange(2**32 - 64, 2**32 + 64)
    w = ops.stream_words(1, 2, index, 3)
    assert not torch.equal(w[0], w[1])
    assert not torch.equal(w[1], w[2])
    assert w[0].unique().numel() == index.numel()  # distinct y here, and lowbias32 is a bijection
    assert not torch.equal(ops.stream_words(1, 2, index, 4)[0], w[0])
    assert not torch.equal(ops.stream_words(1, 5, index, 3)[0], w[0])


def test_codecs_read_the_negative_bit_of_a_view():
    """``x.conj().imag`` of one element is contiguous, and its memory holds the opposite sign."""
    x = torch.tensor([1 + 2j]).conj().imag
    assert x.is_neg()
    for fmt in ("fp32", "bf16"):
        want = moment_codec(fmt).encode(x.resolve_neg())[""]  # the reference reads bit patterns
        assert torch.equal(ops.encode_moment(fmt, x)[""], want), fmt
    low, _ = ops.encode_master("fp32", x, torch.float32)
    assert low.item() == -2.0


@pytest.mark.parametrize("fmt", MOMENT_FORMATS)
def test_core_conversions_run_these_codecs(monkeypatch, fmt):
    """memopt_core.conversions (state dicts, fp32 export) takes this package's codecs for CPU
    tensors and gives the reference's bits."""
    monkeypatch.delenv("MEMOPT_BACKEND", raising=False)
    assert conversions.codec_kernels("cpu") is ops
    calls = record_codec_calls(monkeypatch, ops)
    codec = moment_codec(fmt)
    x = sample(32 * 33, seed=7)
    if not codec.signed:
        x = x.abs()
    assert_moment_conversions_exact(codec, x)
    master = master_codec("ecc24", torch.bfloat16)
    low = torch.empty(x.numel(), dtype=torch.bfloat16)
    code = torch.empty(x.numel(), dtype=torch.uint8)
    conversions.encode_master_into(master, x, low, code, slice_elems=100)  # 11 slices
    ref_low, ref_code = master.encode(x)
    assert torch.equal(bits(low), bits(ref_low))
    assert torch.equal(bits(code), bits(ref_code))
    back = conversions.decode_master(master, low, code)
    assert torch.equal(bits(back), bits(master.decode(ref_low, ref_code)))
    assert calls == ["encode_moment", "decode_moment"] + ["encode_master"] * 11 + ["decode_master"]


def test_codecs_under_a_foreign_default_device():
    """The outputs are made on the CPU whatever ``torch.set_default_device`` says (with "cuda"
    the C++ would otherwise write to device memory; "meta" stands in for it here)."""
    x = sample(128, 3)
    rand = torch.randint(0, 2**32, (128,), dtype=torch.int64)
    expect = (
        ops.encode_moment("q8_signed", x, rand=rand),
        ops.encode_master("ecc24", x, torch.bfloat16, rand=rand),
        ops.stream_words(7, 3, torch.arange(100), 5),
    )
    torch.set_default_device("meta")
    try:
        got = (
            ops.encode_moment("q8_signed", x, rand=rand),
            ops.encode_master("ecc24", x, torch.bfloat16, rand=rand),
            ops.stream_words(7, 3, torch.arange(100, device="cpu"), 5),
        )
        decoded = (
            ops.decode_moment("q8_signed", got[0]),
            ops.decode_master("ecc24", *got[1]),
        )
    finally:
        torch.set_default_device(None)
    assert all(torch.equal(bits(got[0][k]), bits(expect[0][k])) for k in expect[0])
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got[1], expect[1], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got[2], expect[2], strict=True))
    assert torch.equal(bits(decoded[0]), bits(ops.decode_moment("q8_signed", expect[0])))
    assert torch.equal(bits(decoded[1]), bits(ops.decode_master("ecc24", *expect[1])))
