"""Standalone codec kernels over flat vectors: moment encode/decode (q8 quantize/dequantize,
bf16, fp8), master encode/decode (ECC-24/32 split and merge, bf16/fp16 rounding) and the raw
stochastic-rounding words. Used for checkpoints, fp32 export and to test the inlined codecs against core's reference.

Tiles are ``[ROWS, 32]``; ``n`` is the vector length (a multiple of 32 for blocked formats, which
``ops.py`` checks). Stochastic rounding words come from a tensor (``RAND == 1``: int32 words, the
reference's ``rand`` bit-cast) or drawn in the kernel (``RAND == 2``: stream ``STREAM`` of
``(seed, tensor_id, index, step)`` as :mod:`~memopt_kernels_triton.kernels.rng` computes it,
``index`` the element's position; only that stream's word is computed).
"""

from __future__ import annotations

import triton
import triton.language as tl

from memopt_kernels_triton.kernels import codecs as C
from memopt_kernels_triton.kernels.rng import (
    fold_index,
    r24_of,
    step_keys,
    stream_key,
    stream_word,
)


@triton.jit
def _tile(ROWS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)  # global block indices
    return rows[:, None] * 32 + tl.arange(0, 32)[None, :]


@triton.jit
def _scales(n, ROWS: tl.constexpr):
    """Scale offsets and row mask of the program's blocks (``n`` is a whole number of blocks)."""
    soffs = C.scale_offsets(tl.program_id(0).to(tl.int64) * ROWS, ROWS)
    return soffs, soffs * 32 < n


@triton.jit
def _words(rand_ptr, offs, mask, seed, tensor_id, step, RAND: tl.constexpr, STREAM: tl.constexpr):
    if RAND == 1:
        w = tl.load(rand_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
    elif RAND == 2:
        k0, k1, k2, k3 = step_keys(seed, tensor_id, step)
        if STREAM == 0:
            key = k0
        elif STREAM == 1:
            key = k1
        else:
            key = k2
        w = stream_word(fold_index(offs, k3), stream_key(key))
    else:
        w = tl.zeros(offs.shape, tl.uint32)
    return r24_of(w)


@triton.jit(do_not_specialize=["n", "seed", "tensor_id", "step"])
def moment_encode_kernel(
    x_ptr,
    code_ptr,
    scale_ptr,
    rand_ptr,
    n,
    seed,
    tensor_id,
    step,
    FMT: tl.constexpr,
    RAND: tl.constexpr,
    STREAM: tl.constexpr,
    ROWS: tl.constexpr,
):
    offs = _tile(ROWS)
    emask = offs < n
    x = tl.load(x_ptr + offs, mask=emask, other=0.0)
    r24 = _words(rand_ptr, offs, emask, seed, tensor_id, step, RAND, STREAM)
    if FMT == C.FMT_Q8SQRT:  # noqa: SIM108 (constexpr branch)
        s = tl.sqrt_rn(x)
    else:
        s = x
    soffs, rmask = _scales(n, ROWS)
    C.store_moment(x, code_ptr, scale_ptr, offs, soffs, rmask, emask, r24, FMT, RAND != 0, s)


@triton.jit(do_not_specialize=["n"])
def moment_decode_kernel(code_ptr, scale_ptr, out_ptr, n, FMT: tl.constexpr, ROWS: tl.constexpr):
    offs = _tile(ROWS)
    emask = offs < n
    soffs, rmask = _scales(n, ROWS)
    m = C.load_moment(code_ptr, scale_ptr, offs, soffs, rmask, emask, FMT)
    tl.store(out_ptr + offs, m, mask=emask)


@triton.jit(do_not_specialize=["n", "seed", "tensor_id", "step"])
def master_encode_kernel(
    x_ptr,
    p_ptr,
    code_ptr,
    rand_ptr,
    n,
    seed,
    tensor_id,
    step,
    MASTER: tl.constexpr,
    RAND: tl.constexpr,
    STREAM: tl.constexpr,
    ROWS: tl.constexpr,
):
    offs = _tile(ROWS)
    emask = offs < n
    x = tl.load(x_ptr + offs, mask=emask, other=0.0)
    r24 = _words(rand_ptr, offs, emask, seed, tensor_id, step, RAND, STREAM)
    C.store_master(x, p_ptr, code_ptr, offs, emask, emask, r24, MASTER, RAND != 0)


@triton.jit(do_not_specialize=["n"])
def master_decode_kernel(p_ptr, code_ptr, out_ptr, n, MASTER: tl.constexpr, ROWS: tl.constexpr):
    offs = _tile(ROWS)
    emask = offs < n
    x = C.load_master(p_ptr, code_ptr, offs, emask, emask, MASTER)
    tl.store(out_ptr + offs, x, mask=emask)


@triton.jit(do_not_specialize=["n", "seed", "tensor_id", "step"])
def stream_words_kernel(index_ptr, out_ptr, n, seed, tensor_id, step, BLOCK: tl.constexpr):
    """Words ``out[s, i]`` (int32 bit patterns) of streams ``s`` = 0, 1, 2 of element ``index[i]``
    (int64)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    n64 = n.to(tl.int64)  # n is an int32 argument below 2**31; 2 * n must not wrap
    mask = offs < n64
    idx = tl.load(index_ptr + offs, mask=mask, other=0)
    k0, k1, k2, k3 = step_keys(seed, tensor_id, step)
    y = fold_index(idx, k3)
    tl.store(out_ptr + offs, stream_word(y, stream_key(k0)).to(tl.int32, bitcast=True), mask=mask)
    tl.store(
        out_ptr + n64 + offs, stream_word(y, stream_key(k1)).to(tl.int32, bitcast=True), mask=mask
    )
    tl.store(
        out_ptr + 2 * n64 + offs,
        stream_word(y, stream_key(k2)).to(tl.int32, bitcast=True),
        mask=mask,
    )
