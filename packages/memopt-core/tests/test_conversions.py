"""memopt_core.conversions: which codecs run a conversion (a backend's standalone kernels or the
reference), and that every path gives the reference's bits."""

from __future__ import annotations

import pytest
import torch
from fake_backends import FakeEntryPoint, RecordingBackend, install

from memopt_core import MemOptimizer, conversions
from memopt_core.formats import master_codec, moment_codec
from memopt_core.testing import bits


class ReferenceKernels:
    """Standalone codecs with the ops modules' signatures, computed whole by the reference; the
    calls are recorded so a test sees which path ran."""

    def __init__(self):
        self.calls = []

    def encode_moment(self, fmt, x):
        self.calls.append(("encode_moment", fmt, x.numel()))
        return moment_codec(fmt).encode(x)

    def decode_moment(self, fmt, fields):
        self.calls.append(("decode_moment", fmt, fields[""].numel()))
        return moment_codec(fmt).decode(fields)

    def encode_master(self, fmt, x, param_dtype=torch.bfloat16):
        self.calls.append(("encode_master", fmt, x.numel()))
        return master_codec(fmt, param_dtype).encode(x)

    def decode_master(self, fmt, param, code=None):
        self.calls.append(("decode_master", fmt, param.numel()))
        return master_codec(fmt, param.dtype).decode(param, code)


class CodecBackend(RecordingBackend):
    def __init__(self, name="cpu", usable=True, probe_error=False):
        super().__init__(name, usable=usable)
        self.kernels, self.probe_error = ReferenceKernels(), probe_error

    def codecs(self, device):
        if self.probe_error:
            raise RuntimeError("probe failed")
        return self.kernels if device.type == "cpu" else None


@pytest.fixture
def codec_backend(monkeypatch, fresh_backends):
    monkeypatch.delenv("MEMOPT_BACKEND", raising=False)
    backend = CodecBackend()
    install(monkeypatch, FakeEntryPoint("cpu", backend))
    return backend


def _values(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-30, 10, n)
    if n > 3:
        x[1], x[2] = float("nan"), float("inf")
    return x


def _same(a, b):
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "q8_signed", "q8_sqrt"])
@pytest.mark.parametrize("n", [0, 32, 96])
def test_moments_use_the_backend_and_keep_the_bits(codec_backend, fmt, n):
    codec = moment_codec(fmt)
    x = _values(n).abs() if fmt == "q8_sqrt" else _values(n)
    fields = conversions.encode_moment(codec, x)
    for k, v in codec.encode_sliced(x).items():
        _same(fields[k], v)
    _same(conversions.decode_moment(codec, fields), codec.decode_sliced(fields))
    assert [c[0] for c in codec_backend.kernels.calls] == ["encode_moment", "decode_moment"]


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [
        ("fp32", torch.float32),
        ("none", torch.bfloat16),
        ("ecc24", torch.bfloat16),
        ("ecc32", torch.bfloat16),
    ],
)
def test_masters_use_the_backend_and_keep_the_bits(codec_backend, fmt, dtype):
    codec = master_codec(fmt, dtype)
    x = _values(1000)
    low, code = conversions.encode_master(codec, x)
    ref_low, ref_code = codec.encode(x)
    _same(low, ref_low)
    if ref_code is not None:
        _same(code, ref_code)
    _same(conversions.decode_master(codec, low, code), codec.decode_sliced(ref_low, ref_code))
    # encode_into, in slices of 64 elements: each slice is one kernel call
    out_low = torch.empty_like(ref_low)
    out_code = torch.empty_like(ref_code) if ref_code is not None else None
    codec_backend.kernels.calls.clear()
    conversions.encode_master_into(codec, x, out_low, out_code, slice_elems=64)
    _same(out_low, ref_low)
    if ref_code is not None:
        _same(out_code, ref_code)
    sizes = [c[2] for c in codec_backend.kernels.calls]
    assert sizes == [64] * 15 + [40]


def test_forced_torch_backend_means_the_reference(codec_backend, monkeypatch):
    monkeypatch.setenv("MEMOPT_BACKEND", "torch")
    assert conversions.codec_kernels("cpu") is None
    codec = moment_codec("q8_signed")
    x = _values(64)
    fields = conversions.encode_moment(codec, x)
    _same(conversions.decode_moment(codec, fields), codec.decode_sliced(fields))
    assert codec_backend.kernels.calls == []


@pytest.mark.parametrize("case", ["unusable", "probe_error"])
def test_a_backend_that_cannot_answer_leaves_the_reference(monkeypatch, fresh_backends, case):
    monkeypatch.delenv("MEMOPT_BACKEND", raising=False)
    backend = CodecBackend(usable=case != "unusable", probe_error=case == "probe_error")
    install(monkeypatch, FakeEntryPoint("cpu", backend))
    assert conversions.codec_kernels("cpu") is None
    codec = master_codec("ecc24", torch.bfloat16)
    x = _values(64)
    low, code = conversions.encode_master(codec, x)
    ref_low, ref_code = codec.encode(x)
    _same(low, ref_low)
    _same(code, ref_code)
    assert backend.kernels.calls == []


def test_backends_without_codecs_on_the_device_leave_the_reference(codec_backend):
    assert conversions.codec_kernels("cpu") is codec_backend.kernels
    assert conversions.codec_kernels("meta") is None  # the fake answers only for CPU tensors


def test_tensor_subclasses_take_the_reference(codec_backend):
    """A subclass (a sharded DTensor) keeps its bytes elsewhere than data_ptr()."""

    class Sub(torch.Tensor):
        pass

    codec = moment_codec("bf16")
    x = _values(64).as_subclass(Sub)
    conversions.encode_moment(codec, x)
    assert codec_backend.kernels.calls == []


def test_fresh_ecc_state_is_encoded_through_the_backend(codec_backend):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(100).to(torch.bfloat16))
    opt = MemOptimizer([p], rule="adam", master="ecc24", moments="q8", backend="torch")
    opt.init_state()
    assert ("encode_master", "ecc24", 100) in codec_backend.kernels.calls
    _, ref_code = master_codec("ecc24", torch.bfloat16).encode(p.detach().float())
    _same(opt.state[p]["master_code"].reshape(-1)[:100], ref_code)
    assert not opt.state[p]["master_code"].any()  # a bf16 weight needs no correction
