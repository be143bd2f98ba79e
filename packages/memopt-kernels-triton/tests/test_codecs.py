"""Standalone codec kernels and the inlined codecs vs memopt-core's reference codecs, bit for bit."""

from __future__ import annotations

import pytest
import torch

from memopt_core import conversions, rng
from memopt_core.errors import ConfigError, FormatError
from memopt_core.formats import master_codec, moment_codec
from memopt_core.testing import (
    MASTERS,
    assert_moment_conversions_exact,
    master_patterns,
    record_codec_calls,
)
from memopt_kernels_triton.backend import BACKEND

MOMENTS = ["fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "q8_signed", "q8_sqrt"]


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).cpu()


def values(n_blocks: int, device, *, seed: int = 0) -> torch.Tensor:
    """Blocks of 32 covering the awkward cases: specials, subnormals, decades of range, ties."""
    assert n_blocks >= 8
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_blocks * 32, generator=g) * torch.exp(
        torch.randn(n_blocks * 32, generator=g) * 8
    )
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 3e38])
    x[32:64] = torch.randn(32, generator=g) * 1e-40  # subnormal block
    x[64:96] = 0.0  # all-zero block
    x[96:128] = torch.randn(32, generator=g) * 1e30
    x[128:160] = torch.randn(32, generator=g) * 1e-30
    x[160] = 1e6  # outlier next to small values
    # exact ties of bf16 / the ECC-24 split / e4m3 grids
    x[192:200] = torch.tensor(
        [
            0x3F808000,
            0x3F818000,
            0x3F800080,
            0x3F800180,
            0x3F880000,
            0x3F980000,
            0x7F7FFFFF,
            0x00000001,
        ],
        dtype=torch.int32,
    ).view(torch.float32)
    return x.to(device)


def rand_words(n: int, device, seed: int = 3) -> torch.Tensor:
    return rng.uniform_bits(seed, 11, torch.arange(n), 5, 1).to(device)


@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize("fmt", MOMENTS)
def test_moment_encode_decode(ops, device, fmt, sr):
    x = values(12, device)
    if fmt == "q8_sqrt":
        x = x.abs()
        x[300] = -1.0  # a negative v: NaN code
    codec = moment_codec(fmt)
    r = rand_words(x.numel(), device) if sr else None
    got = ops.encode_moment(fmt, x, rand=r)
    want = codec.encode(x.cpu(), rand=None if r is None else r.cpu())
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype
        assert got[k].shape == want[k].shape
        assert torch.equal(bits(got[k]), bits(want[k])), k
    dec = ops.decode_moment(fmt, {k: v.to(device) for k, v in want.items()})
    assert torch.equal(bits(dec), bits(codec.decode(want)))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "q8_signed", "q8_sqrt", "bf16"])
def test_moment_decode_every_code(ops, device, fmt):
    codec = moment_codec(fmt)
    if fmt == "bf16":
        codes = torch.arange(-(2**15), 2**15, 7, dtype=torch.int32).to(torch.int16)
        fields = {"": codes.view(torch.bfloat16)}
    else:
        codes = torch.arange(256, dtype=torch.int32).repeat(16).to(torch.uint8)
        g = torch.Generator().manual_seed(1)
        scales = torch.randint(0, 255, (codes.numel() // 32,), generator=g).to(torch.uint8)
        # 255, which no encoder writes, makes inf and 0 * inf = NaN, whose bits are the device's
        scales[:5] = torch.tensor([0, 1, 254, 127, 255], dtype=torch.uint8)
        fields = {"": codes.view(codec.fields[""].dtype), "scale": scales}
    want = codec.decode(fields)
    got = ops.decode_moment(fmt, {k: v.to(device) for k, v in fields.items()}).cpu()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(bits(got.nan_to_num(0.0)), bits(want.nan_to_num(0.0)))


@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize(("fmt", "dtype"), MASTERS, ids=[f"{m}-{str(d)[6:]}" for m, d in MASTERS])
def test_master_encode_decode(ops, device, fmt, dtype, sr):
    x = values(10, device, seed=2)
    codec = master_codec(fmt, dtype)
    r = rand_words(x.numel(), device) if sr else None
    p, c = ops.encode_master(fmt, x, dtype, rand=r)
    wp, wc = codec.encode(x.cpu(), rand=None if r is None else r.cpu())
    assert p.dtype == wp.dtype
    assert torch.equal(bits(p), bits(wp))
    assert (c is None) == (wc is None)
    if wc is not None:
        assert c.dtype == wc.dtype
        assert torch.equal(bits(c), bits(wc))
    # decode arbitrary bit patterns (every parameter pattern class, every code, zeros beside
    # carrying codes)
    param, code = master_patterns(codec, 4096, seed=4)
    want = codec.decode(param, code)
    got = ops.decode_master(fmt, param.to(device), None if code is None else code.to(device))
    assert torch.equal(bits(got), bits(want))


def test_ecc_and_q8_shorthands(ops, device):
    x = values(8, device, seed=5)
    x32 = x.clone()
    p, c = ops.ecc_encode(x32, 32)
    back = ops.ecc_decode(p, c)
    finite = ~torch.isnan(x32)
    assert torch.equal(bits(back[finite]), bits(x32[finite]))  # ECC-32 is exact
    p24, c24 = ops.ecc_encode(x, 24)
    assert c24.dtype == torch.uint8
    assert torch.equal(
        bits(ops.ecc_decode(p24, c24)),
        bits(master_codec("ecc24", torch.bfloat16).decode(p24.cpu(), c24.cpu())),
    )
    codes, scales = ops.q8_quantize(x)
    assert torch.equal(
        bits(ops.q8_dequantize(codes, scales)),
        bits(moment_codec("q8_signed").decode({"": codes.cpu(), "scale": scales.cpu()})),
    )
    v = x.abs()
    codes, scales = ops.q8_quantize(v, second_moment=True)
    assert codes.dtype == torch.uint8
    assert scales.numel() == v.numel() // 32
    got = ops.q8_dequantize(codes, scales, second_moment=True)
    assert torch.equal(
        bits(got), bits(moment_codec("q8_sqrt").decode({"": codes.cpu(), "scale": scales.cpu()}))
    )


def test_ecc32_roundtrip_random_patterns(ops, device):
    g = torch.Generator().manual_seed(9)
    u = torch.randint(-(2**31), 2**31, (1 << 14,), generator=g, dtype=torch.int64).to(torch.int32)
    x = u.view(torch.float32).to(device)
    finite = ~torch.isnan(x)
    p, c = ops.ecc_encode(x, 32)
    assert torch.equal(bits(ops.ecc_decode(p, c)[finite]), bits(x[finite]))


def test_stream_words(ops, device):
    idx = torch.tensor(
        [0, 1, 2, 31, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 5, 123456789012, 2**62 + 9]
    )
    for seed, tid, step in [(0, 0, 0), (0xDEADBEEF, 2**32 + 7, 2**31 + 3), (12345, 3, 1)]:
        got = ops.stream_words(seed, tid, idx.to(device), step)
        want = rng.stream_words(seed, tid, idx, step)
        assert len(got) == 3
        for a, b in zip(got, want, strict=True):
            assert a.dtype == torch.int64
            assert torch.equal(a.cpu(), b)


# runs of indices starting near or crossing a multiple of 2**32 (the high word folds in with K3)
RUN_STARTS = [0, 2**32 - 5, 2**33 - 5, 2**40 + 3, 2**62 - 2000]
RUN_SIZES = [0, 1, 31, 33, 1025]


@pytest.mark.parametrize("size", RUN_SIZES)
@pytest.mark.parametrize("start", RUN_STARTS)
def test_stream_words_index_runs(ops, device, start, size):
    idx = torch.arange(start, start + size, dtype=torch.int64)
    seed, tid, step = 2**32 - 5, 2**31 + 17, 7
    got = ops.stream_words(seed, tid, idx.to(device), step)
    want = rng.stream_words(seed, tid, idx, step)
    for s, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == idx.shape
        assert torch.equal(a.cpu(), b), s
        # each stream is the one uniform_bits draws alone
        assert torch.equal(b, rng.uniform_bits(seed, tid, idx, step, s))


def test_stream_words_across_2_pow_32():
    """The reference's words of a run crossing 2**32 differ from those of the low words alone:
    the high word is folded in (so a kernel that drops it fails the run tests above)."""
    lo = torch.arange(2**32 - 5, 2**32 + 40, dtype=torch.int64)
    w = rng.stream_words(1, 2, lo, 3)[0]
    w_low = rng.stream_words(1, 2, lo & 0xFFFFFFFF, 3)[0]
    assert torch.equal(w[:5], w_low[:5])
    assert (w[5:] != w_low[5:]).all()


def test_stream_words_shape_and_device(ops, device):
    idx = torch.arange(2**32 - 6, 2**32 + 6, dtype=torch.int64).view(3, 4)
    got = ops.stream_words(5, 6, idx.to(device), 7)
    want = rng.stream_words(5, 6, idx, 7)
    for a, b in zip(got, want, strict=True):
        assert a.shape == (3, 4)
        assert a.device == idx.to(device).device
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("stream", [0, 1, 2])
@pytest.mark.parametrize("fmt", ["bf16", "q8_signed", "q8_sqrt", "fp8_e5m2"])
def test_in_kernel_rounding(ops, device, fmt, stream):
    x = values(8, device, seed=7).abs()
    seed, tid, step = 77, 2**31 + 5, 9
    got = ops.encode_moment(fmt, x, rng=(seed, tid, step, stream))
    r = rng.uniform_bits(seed, tid, torch.arange(x.numel()), step, stream)
    want = moment_codec(fmt).encode(x.cpu(), rand=r)
    for k in want:
        assert torch.equal(bits(got[k]), bits(want[k])), k


@pytest.mark.parametrize("stream", [0, 1, 2])
@pytest.mark.parametrize(("fmt", "dtype"), [("ecc24", torch.bfloat16), ("none", torch.float16)])
def test_in_kernel_master_rounding(ops, device, fmt, dtype, stream):
    x = values(8, device, seed=8)
    seed, tid, step = 2**32 - 1, 4, 2**31 + 1
    p, c = ops.encode_master(fmt, x, dtype, rng=(seed, tid, step, stream))
    r = rng.uniform_bits(seed, tid, torch.arange(x.numel()), step, stream)
    wp, wc = master_codec(fmt, dtype).encode(x.cpu(), rand=r)
    assert torch.equal(bits(p), bits(wp))
    if wc is None:
        assert c is None
    else:
        assert torch.equal(bits(c), bits(wc))


@pytest.mark.parametrize("stream", [3, -1, 1.0, True, None])
def test_in_kernel_rounding_refuses_other_streams(ops, device, stream):
    x = torch.ones(32, device=device)
    with pytest.raises(ValueError, match=r"stream is 0 \(master\), 1 \(first moment\)"):
        ops.encode_moment("bf16", x, rng=(1, 2, 3, stream))
    with pytest.raises(ValueError, match="stream"):
        ops.encode_master("ecc24", x, rng=(1, 2, 3, stream))
    with pytest.raises(ConfigError, match="seed, tensor_id, step, stream"):
        ops.encode_moment("bf16", x, rng=(1, 2, 3))


def test_empty_and_shapes(ops, device):
    e = torch.zeros(0, device=device)
    f = ops.encode_moment("q8_signed", e)
    assert f[""].numel() == 0
    assert f["scale"].numel() == 0
    assert ops.decode_moment("q8_signed", f).numel() == 0
    p, c = ops.encode_master("ecc24", e)
    assert p.numel() == 0
    assert c.numel() == 0
    x = torch.randn(64, device=device).view(8, 8)
    f = ops.encode_moment("bf16", x)
    assert f[""].shape == (8, 8)
    p, c = ops.encode_master("ecc32", x)
    assert p.shape == (8, 8)
    assert c.shape == (8, 8)


def test_bad_inputs(ops, device):
    with pytest.raises(FormatError, match="whole blocks of 32"):
        ops.encode_moment("q8_signed", torch.ones(33, device=device))
    with pytest.raises(FormatError, match="float32"):
        ops.encode_moment("bf16", torch.ones(32, device=device, dtype=torch.float64))
    with pytest.raises(ConfigError, match="unknown moment format"):
        ops.encode_moment("q4", torch.ones(32, device=device))
    with pytest.raises(ConfigError, match="bfloat16"):
        ops.encode_master("ecc24", torch.ones(32, device=device), torch.float16)
    with pytest.raises(FormatError, match="code"):
        ops.decode_master("ecc24", torch.ones(32, device=device, dtype=torch.bfloat16))
    with pytest.raises(FormatError, match="int64"):
        ops.encode_moment("bf16", torch.ones(32, device=device), rand=torch.ones(32, device=device))
    with pytest.raises(ConfigError, match="24 or 32"):
        ops.ecc_encode(torch.ones(32, device=device), 16)
    with pytest.raises(ConfigError, match="either"):
        ops.encode_moment(
            "bf16",
            torch.ones(32, device=device),
            rand=torch.zeros(32, dtype=torch.int64, device=device),
            rng=(0, 0, 0, 0),
        )
    with pytest.raises(ConfigError, match=r"24 or 32 bits \(an int\), got 24.0"):
        ops.ecc_encode(torch.ones(32, device=device), 24.0)
    # as core's codec: a format without a code refuses one
    with pytest.raises(FormatError, match="'fp32' has no code"):
        ops.decode_master(
            "fp32", torch.ones(32, device=device), torch.zeros(32, dtype=torch.uint8, device=device)
        )


def test_non_tensor_arguments(ops, device):
    x = torch.ones(32, device=device)
    p, c = ops.ecc_encode(x)
    with pytest.raises(ConfigError, match=r"x must be a torch\.Tensor, got list"):
        ops.encode_moment("bf16", [1.0])
    with pytest.raises(ConfigError, match=r"param must be a torch\.Tensor, got list"):
        ops.ecc_decode([1], c)
    with pytest.raises(ConfigError, match=r"code must be a torch\.Tensor, got list"):
        ops.ecc_decode(p, [1])
    with pytest.raises(ConfigError, match=r"field 'scale' of 'q8_signed' must be a torch\.Tensor"):
        ops.q8_dequantize(torch.zeros(32, dtype=torch.float8_e4m3fn, device=device), [0])
    with pytest.raises(FormatError, match=r"rand must be an int64 tensor of 32 .* got list"):
        ops.encode_moment("bf16", x, rand=[0] * 32)
    with pytest.raises(ConfigError, match=r"index must be a torch\.Tensor"):
        ops.stream_words(1, 2, [1, 2], 3)
    with pytest.raises(ConfigError, match=r"rng's seed must be an int, got float 1\.5"):
        ops.encode_master("fp32", x, torch.float32, rng=(1.5, 0, 1, 0))
    with pytest.raises(ConfigError, match="rng is"):
        ops.encode_master("fp32", x, torch.float32, rng=5)
    # a tensor seed reached the kernel as its address, a bool and float indices passed
    with pytest.raises(ConfigError, match=r"seed must be an int, got Tensor"):
        ops.stream_words(torch.tensor(1), 2, torch.arange(4, device=device), 3)
    with pytest.raises(ConfigError, match=r"rng's seed must be an int, got Tensor"):
        ops.encode_moment("bf16", x, rng=(torch.tensor(1), 2, 3, 1))
    with pytest.raises(ConfigError, match=r"seed must be an int, got bool"):
        ops.stream_words(True, 2, torch.arange(4, device=device), 3)
    for index in (torch.tensor([2.7], device=device), torch.tensor([True], device=device)):
        with pytest.raises(FormatError, match=r"index must be an integer tensor"):
            ops.stream_words(1, 2, index, 3)
    # devices: the code and rand were never checked (a meta one failed inside torch)
    with pytest.raises(ConfigError, match=r"code is on meta; param is on"):
        ops.decode_master("ecc24", p, torch.empty(32, dtype=torch.uint8, device="meta"))
    with pytest.raises(ConfigError, match=r"rand is on meta; the encoded tensor is on"):
        ops.encode_moment("bf16", x, rand=torch.empty(32, dtype=torch.int64, device="meta"))


def test_fields_layouts_and_empty_inputs_are_checked(ops, device, monkeypatch):
    """What the CPU ops refused and these let through (audit of 2026-12-06)."""
    x = torch.ones(32, device=device)
    codes, scales = ops.q8_quantize(x)
    # a tuple of fields: "missing ['', 'scale']", though both were passed
    with pytest.raises(FormatError, match=r"fields must be a mapping .* got tuple"):
        ops.decode_moment("q8_signed", (codes, scales))
    # a sparse tensor was "a Tensor without memory of its own", with advice about steps
    with pytest.raises(ConfigError, match=r"x is a torch\.sparse_coo tensor; .* dense"):
        ops.encode_moment("bf16", x.to_sparse())
    # an empty x skipped the check of rand
    with pytest.raises(
        FormatError, match=r"rand must be an int64 tensor of 0 .* got torch\.int64\(5,\)"
    ):
        ops.encode_moment("bf16", x[:0], rand=torch.zeros(5, dtype=torch.int64, device=device))
    with pytest.raises(FormatError, match=r"rand must be an int64 tensor of 0"):
        ops.encode_master("ecc24", x[:0], rand=torch.zeros(5, dtype=torch.int64, device=device))
    # scales on another device than the codes (cuda:1 and cuda:0) reached the kernel as the
    # other GPU's address; with one device here, meta stands in for the other one
    monkeypatch.setattr(ops, "_check_device", lambda t, what: None)
    with pytest.raises(ConfigError, match=r"field 'scale' of 'q8_signed' is on meta; the codes"):
        ops.q8_dequantize(codes, torch.empty(1, dtype=torch.uint8, device="meta"))


def pattern_soup(n_blocks: int, device, *, seed: int = 0) -> torch.Tensor:
    """Random fp32 bit patterns (every exponent, subnormals, inf, NaN), and blocks whose elements
    span up to 2**-200 of their maximum (underflow after the block scaling)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(-(2**31), 2**31, (n_blocks * 32,), generator=g, dtype=torch.int64)
    x = u.to(torch.int32).view(torch.float32).clone()
    half = n_blocks // 2 * 32
    mant = torch.rand(half, generator=g) + 0.5
    expo = torch.randint(-149, 128, (half // 32, 1), generator=g) - torch.randint(
        0, 200, (half // 32, 32), generator=g
    )
    y = (mant.double() * torch.pow(2.0, expo.reshape(-1).double())).float()
    y[::32] = torch.where(torch.rand(half // 32, generator=g) < 0.5, 3e38, 1e-40)
    x[:half] = y * torch.where(torch.rand(half, generator=g) < 0.5, -1.0, 1.0)
    return x.to(device)


@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8_e5m2", "q8_sqrt"])
def test_moment_codecs_on_bit_pattern_soup(ops, device, fmt, sr):
    x = pattern_soup(64, device, seed=11)
    if fmt == "q8_sqrt":
        x = x.abs()
    codec = moment_codec(fmt)
    r = rand_words(x.numel(), device, seed=5) if sr else None
    got = ops.encode_moment(fmt, x, rand=r)
    want = codec.encode(x.cpu(), rand=None if r is None else r.cpu())
    for k in want:
        assert torch.equal(bits(got[k]), bits(want[k])), k


@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize(
    ("fmt", "dtype"), MASTERS[1:], ids=[f"{m}-{str(d)[6:]}" for m, d in MASTERS[1:]]
)
def test_master_codecs_on_bit_pattern_soup(ops, device, fmt, dtype, sr):
    x = pattern_soup(64, device, seed=12)
    r = rand_words(x.numel(), device, seed=6) if sr else None
    p, c = ops.encode_master(fmt, x, dtype, rand=r)
    wp, wc = master_codec(fmt, dtype).encode(x.cpu(), rand=None if r is None else r.cpu())
    assert torch.equal(bits(p), bits(wp))
    if wc is not None:
        assert torch.equal(bits(c), bits(wc))


def test_backend_offers_its_codecs_for_cuda_tensors_only(ops):
    """memopt_core.conversions asks ``codecs(device)``: the interpreter's CPU tensors are left to
    the CPU backend or the reference (the interpreter would take minutes on a model's state)."""
    assert BACKEND.codecs(torch.device("cuda")) is ops
    assert BACKEND.codecs(torch.device("cuda", 1)) is ops
    assert BACKEND.codecs(torch.device("cpu")) is None


@pytest.mark.parametrize("fmt", MOMENTS)
def test_core_conversions_run_these_kernels(ops, device, monkeypatch, fmt):
    """State dicts and fp32 export (memopt_core.conversions) run these kernels on CUDA tensors,
    with the reference's bits."""
    if device.type != "cuda":
        pytest.skip("CPU tensors are not converted by these kernels (test above)")
    monkeypatch.delenv("MEMOPT_BACKEND", raising=False)
    assert conversions.codec_kernels("cuda") is ops
    calls = record_codec_calls(monkeypatch, ops)
    codec = moment_codec(fmt)
    x = values(33, device)
    if not codec.signed:
        x = x.abs()
    assert_moment_conversions_exact(codec, x)
    for mfmt, dtype in MASTERS:
        master = master_codec(mfmt, dtype)
        low = torch.empty(x.numel(), dtype=dtype, device=device)
        code = (
            torch.empty(x.numel(), dtype=master.code_dtype, device=device)
            if master.code_dtype is not None
            else None
        )
        conversions.encode_master_into(master, x, low, code, slice_elems=100)
        ref_low, ref_code = master.encode(x)
        assert torch.equal(bits(low), bits(ref_low)), mfmt
        if code is not None:
            assert torch.equal(bits(code), bits(ref_code)), mfmt
        back = conversions.decode_master(master, low, code)
        assert torch.equal(bits(back), bits(master.decode(ref_low, ref_code))), mfmt
    per_master = ["encode_master"] * 11 + ["decode_master"]
    assert calls == ["encode_moment", "decode_moment"] + per_master * len(MASTERS)
