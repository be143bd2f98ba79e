"""Chunk-table plumbing shared by the fused step kernels.

A launch covers one group: program ``pid`` of a persistent grid walks chunks ``pid, pid + nprog,
...`` of core's chunk table (int64 rows ``(slot, start, length, arena offset)``); a slot table
(int64 rows ``(param address, grad address, grad kind, tensor id, index base)``, one per
tensor of the step, indexed by the chunk's slot column: the tensor's position in the step) gives
each chunk's tensors. The index base is the random-word index of the tensor's element 0
(``GroupStep.index_bases``: a shard's offset in its whole tensor, else 0), so stochastic rounding
draws chunk element ``i``'s words at index ``base + start + i``. A chunk is processed
in tiles of ``[ROWS, 32]`` elements, one row per 32-element quantization block; ``BS`` is the
arena's padding unit (32 for blocked moments, 1 otherwise) so a chunk's arena part ends at
``length`` rounded up to ``BS``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from memopt_kernels_triton.kernels import codecs as C
from memopt_kernels_triton.kernels.rng import fold_index, r24_of, stream_key, stream_word


@triton.jit
def chunk_info(
    chunk_ptr, slot_ptr, c, BS: tl.constexpr, ALIGNED: tl.constexpr, ARENA_ALIGNED: tl.constexpr
):
    """``(start, length, padded, aoff, param address, grad address, grad kind, tensor id, index
    base, slot)`` of chunk ``c`` (int64 scalars except ``length``/``padded``, int32: a chunk is
    below 2**31). The grad kind is 1 for a float32 gradient, 2 for a float16 one beside a float32
    parameter, else 0 (bfloat16, or the parameter's 16-bit dtype).

    ``ALIGNED``: the launcher checked that every parameter and gradient address is a multiple of
    16 bytes and every chunk start a multiple of 32 elements; saying so lets Triton load and store
    a thread's elements of a row with one vector access. Blocked arenas (``BS`` 32) are aligned
    by construction (whole 32-element blocks); ``ARENA_ALIGNED``: the launcher checked that every
    tensor of an unblocked arena starts at a multiple of 8 elements (so does every chunk), which
    does the same for the states there."""
    row = chunk_ptr + c * 4  # n_chunks < 2**29
    slot = tl.load(row)
    start = tl.load(row + 1)
    length = tl.load(row + 2).to(tl.int32)
    aoff = tl.load(row + 3)
    srow = slot_ptr + slot * 5
    paddr = tl.load(srow)
    gaddr = tl.load(srow + 1)
    gkind = tl.load(srow + 2)
    tid = tl.load(srow + 3)
    base = tl.load(srow + 4)
    padded = (length + (BS - 1)) // BS * BS
    if BS == 32:
        aoff = tl.multiple_of(aoff, 32)
    elif ARENA_ALIGNED:
        aoff = tl.multiple_of(aoff, 8)
    if ALIGNED:
        start = tl.multiple_of(start, 32)
    return start, length, padded, aoff, paddr, gaddr, gkind, tid, base, slot


@triton.jit
def whole_tiles(length, limit, ROWS: tl.constexpr):
    """End of the chunk's whole tiles: the tiles below it hold only real elements, so their masks
    can be per row (:func:`row_masks`) and Triton vectorizes their accesses; the rest of the chunk
    (below ``limit``) is one partial tile (:func:`tail_masks`). 0 when ``limit`` is 0 (a skipped
    step)."""
    return tl.minimum(length // (ROWS * 32) * (ROWS * 32), limit)


@triton.jit
def row_masks(t, lofs, limit, ROWS: tl.constexpr):
    """``(offs, emask, amask, rmask)`` of the tile at chunk element ``t`` when every row is either
    wholly real or wholly past ``limit`` (a multiple of 32): element offsets ``[ROWS, 32]``, the
    element and arena masks (both ``rmask[:, None]``: constant along a row, which keeps accesses
    vectorizable) and the row mask ``[ROWS]`` for the blocks' scale bytes."""
    rmask = t + tl.arange(0, ROWS) * 32 < limit
    return t + lofs, rmask[:, None], rmask[:, None], rmask


@triton.jit
def tail_masks(t, lofs, length, padded, ROWS: tl.constexpr, BS: tl.constexpr):
    """:func:`row_masks` for the chunk's partial last tile: real elements below ``length``, arena
    elements below ``padded`` (whole blocks when ``BS`` is 32)."""
    offs = t + lofs
    rmask = t + tl.arange(0, ROWS) * 32 < padded
    if BS == 32:  # noqa: SIM108 (constexpr branch)
        amask = rmask[:, None]
    else:
        amask = offs < padded
    return offs, offs < length, amask, rmask


@triton.jit
def master_ptrs(paddr, code_ptr, start, aoff, MASTER: tl.constexpr, ALIGNED: tl.constexpr):
    """Typed parameter pointer at the chunk's first element and master-code pointer at its arena
    offset."""
    return C.param_pointer(paddr, MASTER, ALIGNED) + start, code_ptr + aoff


@triton.jit
def hyper_word(hyper_ptr, slot, HSTRIDE, k: tl.constexpr):
    """Word ``k`` of the device scalars of the step's tensor ``slot``: row ``slot`` of a
    ``[tensors, HSTRIDE]`` table (a device step computes one row per tensor), or the one row
    every tensor shares when ``HSTRIDE`` is 0."""
    return tl.load(hyper_ptr + slot * HSTRIDE + k)


@triton.jit
def hyper_f32(hyper_ptr, slot, HSTRIDE, k: tl.constexpr):
    """:func:`hyper_word` read as the fp32 value whose bits it holds."""
    return hyper_word(hyper_ptr, slot, HSTRIDE, k).to(tl.float32, bitcast=True)


@triton.jit
def rounding_words(
    offs, origin, k0, k1, k2, k3, MASTER: tl.constexpr, FMT1: tl.constexpr,
    FMT2: tl.constexpr, NEED_RAND: tl.constexpr,
):  # fmt: skip
    """``(r0, r1, r2)``: the tile's 24-bit rounding words (``r24``) of the streams its formats
    round, 0 for the others: the master's (stream 0) for bf16, fp16 and ECC-24 masters, the first
    and second moment's (streams 1, 2) unless fp32 or absent (``FMT_NONE``). ``origin`` is the
    random-word index of the chunk's element 0 and ``k0..k3`` its tensor's step keys."""
    r0 = 0
    r1 = 0
    r2 = 0
    if NEED_RAND:
        y = fold_index(origin + offs, k3)
        if MASTER == C.MASTER_BF16 or MASTER == C.MASTER_FP16 or MASTER == C.MASTER_ECC24:
            r0 = r24_of(stream_word(y, stream_key(k0)))
        if FMT1 != C.FMT_FP32 and FMT1 != C.FMT_NONE:
            r1 = r24_of(stream_word(y, stream_key(k1)))
        if FMT2 != C.FMT_FP32 and FMT2 != C.FMT_NONE:
            r2 = r24_of(stream_word(y, stream_key(k2)))
    return r0, r1, r2


@triton.jit
def gradient_and_decay(
    g, x, inv, l2, decay, gkind, MASTER: tl.constexpr, UNSCALE: tl.constexpr,
    MAXIMIZE: tl.constexpr, HAS_L2: tl.constexpr, HAS_DECAY: tl.constexpr,
):  # fmt: skip
    """``(g, x)`` after the steps every rule starts with, in core's order: unscale (a
    GradScaler's ``inv_scale``), negate (maximize), add L2 (``l2 * x``; with ``HAS_L2 == 2``
    only where ``l2 != 0``, as core's rule tests it: a device word may be 0, and ``g + 0 * x``
    would turn a ``-0`` gradient into ``+0``), decay ``x``. A 16-bit
    gradient (``gkind`` 0 beside a 16-bit master; 0 or 2 beside a float32 one, as
    :func:`~memopt_kernels_triton.kernels.codecs.load_grad_of_f32` reads it) is unscaled as
    ``GradScaler.unscale_`` does it: the fp32 product rounded to nearest even in the
    gradient's dtype."""
    if UNSCALE:
        g = g * inv
        if MASTER != C.MASTER_FP32:
            if gkind == 0:
                if MASTER == C.MASTER_FP16:
                    g = C.fp16_widen(C.fp16_round(C.f32_bits(g), 0, False))
                else:
                    g = C.bf16_widen(C.bf16_round(C.f32_bits(g), 0, False))
        else:
            if gkind == 0:
                g = C.bf16_widen(C.bf16_round(C.f32_bits(g), 0, False))
            elif gkind == 2:
                g = C.fp16_widen(C.fp16_round(C.f32_bits(g), 0, False))
    if MAXIMIZE:
        g = C.neg(g)
    if HAS_L2 == 2:
        g = tl.where(l2 != 0.0, g + l2 * x, g)
    elif HAS_L2:
        g = g + l2 * x
    if HAS_DECAY:
        x = x * decay
    return g, x
