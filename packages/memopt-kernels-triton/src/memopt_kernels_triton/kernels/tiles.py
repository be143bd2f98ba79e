"""Chunk-table plumbing shared by the fused step kernels.

A launch covers one group: program ``pid`` of a persistent grid walks chunks ``pid, pid + nprog,
...`` of core's chunk table (int64 rows ``(slot, start, length, arena offset)``); a slot table
(int64 rows ``(param address, grad address, grad is float32, tensor id, index base)``, one per
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


@triton.jit
def chunk_info(chunk_ptr, slot_ptr, c, BS: tl.constexpr):
    """``(start, length, padded, aoff, param address, grad address, grad kind, tensor id, index
    base, slot)`` of chunk ``c`` (int64 scalars except ``length``/``padded``, int32: a chunk is
    below 2**31)."""
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
    return start, length, padded, aoff, paddr, gaddr, gkind, tid, base, slot


@triton.jit
def tile_masks(t, lofs, length, padded):
    """Offsets ``[ROWS, 32]`` of the tile starting at chunk element ``t``, with the real-element
    and the arena (whole blocks) masks."""
    offs = t + lofs
    return offs, offs < length, offs < padded


@triton.jit
def ahead_masks(t, lofs, length, limit, ROWS: tl.constexpr):
    """Offsets, real-element and arena masks, scale offsets and lane-0 mask for loading the
    tile at chunk element ``t`` one tile ahead of its math: nothing at or past ``limit`` (the
    chunk's arena end, or 0 for a skipped step) is read, so the load after a chunk's last tile
    touches no memory."""
    offs = t + lofs
    amask = offs < limit
    soffs, first = C.scale_offsets(t // 32, ROWS)
    return offs, (offs < length) & amask, amask, soffs, first


@triton.jit
def master_ptrs(paddr, code_ptr, start, aoff, MASTER: tl.constexpr):
    """Typed parameter pointer at the chunk's first element and master-code pointer at its arena
    offset."""
    return C.param_pointer(paddr, MASTER) + start, code_ptr + aoff


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
