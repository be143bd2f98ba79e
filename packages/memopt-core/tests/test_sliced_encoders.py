"""Sliced encoders and decoders (``MasterCodec.encode_into`` / ``decode_sliced``,
``MomentCodec.encode_sliced`` / ``decode_sliced``): the bits of one whole-tensor ``encode`` or
``decode``, with temporaries bounded by a slice (what a 136M-element embedding needs when the
optimizer creates its state or exports fp32 weights)."""

from __future__ import annotations

import pytest
import torch

from memopt_core.formats import MOMENT_FORMATS, master_codec, moment_codec
from memopt_core.formats.bits import bits_to_f32
from memopt_core.testing import MASTER_IDS, MASTERS


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (NaN-safe)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    return a.dtype == b.dtype and torch.equal(
        a.view(ints[a.element_size()]), b.view(ints[b.element_size()])
    )


def _values(n: int, seed: int) -> torch.Tensor:
    """Random finite fp32 values over the whole exponent range, with zeros and negatives."""
    g = torch.Generator().manual_seed(seed)
    x = bits_to_f32(torch.randint(0, 2**32, (n,), generator=g))
    return torch.where(x.isfinite(), x, torch.zeros(()))


@pytest.mark.parametrize(("name", "dtype"), MASTERS, ids=MASTER_IDS)
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000])
def test_master_encode_into_equals_encode(name, dtype, n):
    codec = master_codec(name, dtype)
    x = _values(n, seed=n).view(-1, 1) if n % 2 else _values(n, seed=n)
    want_p, want_c = codec.encode(x.reshape(-1))
    param = torch.full((n,), 7, dtype=want_p.dtype).view(x.shape)
    code = None if want_c is None else torch.full((n,), 7, dtype=want_c.dtype)
    codec.encode_into(x, param, code, slice_elems=64)
    assert _same(param.reshape(-1), want_p)
    if code is not None:
        assert torch.equal(code, want_c)
    want_x = codec.decode(want_p, want_c)
    assert _same(codec.decode_sliced(want_p, want_c, slice_elems=64), want_x)
    assert _same(codec.decode_sliced(want_p.view(x.shape), want_c, slice_elems=5), want_x)
    if want_c is not None:  # the code alone, as the optimizer's state creation asks for it
        code2 = torch.zeros_like(want_c)
        codec.encode_into(x, None, code2, slice_elems=5)
        assert torch.equal(code2, want_c)


def test_master_encode_into_refuses_wrong_sizes():
    codec = master_codec("ecc24", torch.bfloat16)
    with pytest.raises(ValueError, match="elements"):
        codec.encode_into(torch.ones(10), None, torch.zeros(9, dtype=torch.uint8))
    with pytest.raises(ValueError, match="positive"):
        codec.encode_into(torch.ones(10), None, torch.zeros(10, dtype=torch.uint8), slice_elems=0)


@pytest.mark.parametrize("name", MOMENT_FORMATS)
@pytest.mark.parametrize("blocks", [0, 1, 3, 7])
def test_moment_encode_sliced_equals_encode(name, blocks):
    codec = moment_codec(name)
    n = blocks * 32
    x = _values(n, seed=blocks).abs() if not codec.signed else _values(n, seed=blocks)
    x = (
        x * 2.0**-100
    )  # squares of the huge ones would overflow v's encoders to inf: keep them finite
    want = codec.encode(x)
    got = codec.encode_sliced(x, slice_elems=64)
    assert got.keys() == want.keys()
    for k in want:
        assert _same(got[k], want[k]), k
    assert _same(codec.decode_sliced(want, slice_elems=64), codec.decode(want).reshape(-1))
    if codec.block_size > 1:  # a slice must hold whole blocks
        with pytest.raises(ValueError, match="multiple"):
            codec.encode_sliced(x, slice_elems=codec.block_size + 1)
        with pytest.raises(ValueError, match="multiple"):
            codec.decode_sliced(want, slice_elems=codec.block_size + 1)
