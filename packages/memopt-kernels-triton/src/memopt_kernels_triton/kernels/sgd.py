"""Fused SGD/SGDW step (with or without momentum, Nesterov) over a whole group (core's
``reference.sgd``, bit for bit; no FMA contraction)::

    g = -g                              if MAXIMIZE
    g = g + l2 * p                      if HAS_L2 (2: only where l2 != 0)
    p = p * decay                       if HAS_DECAY
    buf = g                             on the first step (FIRST), with momentum
    buf = momentum * buf + one_minus_dampening * g        afterwards
    d = g + momentum * buf              if NESTEROV, else d = buf (g without momentum)
    p = p - lr * d

``FMT1 == FMT_NONE`` means no momentum buffer (momentum 0).

Stochastic rounding draws the words of the rounded streams only (master: stream 0, momentum
buffer: stream 1), from keys computed once per chunk, as in
:mod:`~memopt_kernels_triton.kernels.adam`.

``HYPER``: the scalars, seed, step and first-step flag are read from ``hyper_ptr`` (int32 words,
layout :data:`memopt_kernels_triton.ops.SGD_HYPER_FIELDS`) instead of the arguments, as in
:mod:`~memopt_kernels_triton.kernels.adam`. The first step is then a runtime choice (the
``first_step`` word, nonzero on the first step; ``FIRST`` is ignored): the buffer is loaded and
updated as on any step and ``tl.where`` keeps ``g`` where the word says first step, so one
captured launch serves step 1 and every later step with the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from memopt_kernels_triton.kernels import codecs as C
from memopt_kernels_triton.kernels.rng import step_keys
from memopt_kernels_triton.kernels.tiles import (
    chunk_info,
    gradient_and_decay,
    hyper_f32,
    hyper_word,
    master_ptrs,
    rounding_words,
    row_masks,
    tail_masks,
    whole_tiles,
)


@triton.jit
def _tile(
    offs, emask, amask, rmask, soffs, pp, cp, bp, bsp, gaddr, gkind, start,
    origin, k0, k1, k3, lr_, mom, omd, dec, l2_, fst, inv,
    MASTER: tl.constexpr, FMT1: tl.constexpr, SR: tl.constexpr, NEED_RAND: tl.constexpr,
    MAXIMIZE: tl.constexpr, HAS_L2: tl.constexpr, HAS_DECAY: tl.constexpr,
    NESTEROV: tl.constexpr, FIRST: tl.constexpr, HYPER: tl.constexpr, UNSCALE: tl.constexpr,
    ALIGNED: tl.constexpr,
):  # fmt: skip
    """One tile: load, update (the module doc's order), encode and store."""
    x = C.load_master(pp, cp, offs, emask, amask, MASTER)
    g = C.load_grad(gaddr, gkind, start, offs, emask, MASTER, ALIGNED)
    r0, r1, _r2 = rounding_words(offs, origin, k0, k1, 0, k3, MASTER, FMT1, C.FMT_NONE, NEED_RAND)
    g, x = gradient_and_decay(
        g, x, inv, l2_, dec, gkind, MASTER, UNSCALE, MAXIMIZE, HAS_L2, HAS_DECAY
    )
    if FMT1 != C.FMT_NONE:
        if HYPER:  # first step from the device: select, bit for bit
            old = C.load_moment(bp, bsp, offs, soffs, rmask, amask, FMT1)
            buf = tl.where(fst, g, mom * old + omd * g)
        elif FIRST:
            buf = g
        else:
            buf = C.load_moment(bp, bsp, offs, soffs, rmask, amask, FMT1)
            buf = mom * buf + omd * g
        if NESTEROV:  # noqa: SIM108 (constexpr branch)
            d = g + mom * buf
        else:
            d = buf
        C.store_moment(buf, bp, bsp, offs, soffs, rmask, amask, r1, FMT1, SR, buf)
    else:
        d = g
    x = x - lr_ * d
    C.store_master(x, pp, cp, offs, emask, amask, r0, MASTER, SR)


@triton.jit(do_not_specialize=["n_chunks", "seed", "step", "hstride"])
def sgd_kernel(
    chunk_ptr,
    n_chunks,
    slot_ptr,
    code_ptr,
    b_ptr,
    bs_ptr,
    lr,
    momentum,
    one_minus_dampening,
    decay,
    l2,
    seed,
    step,
    hyper_ptr,
    hstride,
    MASTER: tl.constexpr,
    FMT1: tl.constexpr,
    SR: tl.constexpr,
    NEED_RAND: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_L2: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    NESTEROV: tl.constexpr,
    FIRST: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
    HYPER: tl.constexpr,
    UNSCALE: tl.constexpr,
    ALIGNED: tl.constexpr,
    ARENA_ALIGNED: tl.constexpr,
):
    r = tl.arange(0, ROWS)
    lofs = r[:, None] * 32 + tl.arange(0, 32)[None, :]
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for c in range(pid, n_chunks, nprog):
        start, length, padded, aoff, paddr, gaddr, gkind, tid, base, slot = chunk_info(
            chunk_ptr, slot_ptr, c, BS, ALIGNED, ARENA_ALIGNED
        )
        if HYPER:
            lr_ = hyper_f32(hyper_ptr, slot, hstride, 0)
            mom = hyper_f32(hyper_ptr, slot, hstride, 1)
            omd = hyper_f32(hyper_ptr, slot, hstride, 2)
            dec = hyper_f32(hyper_ptr, slot, hstride, 3)
            l2_ = hyper_f32(hyper_ptr, slot, hstride, 4)
            seed_ = hyper_word(hyper_ptr, slot, hstride, 5)
            step_ = hyper_word(hyper_ptr, slot, hstride, 6)
            fst = hyper_word(hyper_ptr, slot, hstride, 7) != 0
            inv = hyper_f32(hyper_ptr, slot, hstride, 8)
            limit = padded * (hyper_word(hyper_ptr, slot, hstride, 9) == 0).to(tl.int32)
        else:
            lr_ = lr
            mom = momentum
            omd = one_minus_dampening
            dec = decay
            l2_ = l2
            seed_ = seed
            step_ = step
            fst = FIRST
            inv = 1.0
            limit = padded
        if NEED_RAND:  # the chunk's tensor at this step
            k0, k1, _k2, k3 = step_keys(seed_, tid, step_)
            origin = base + start  # index of the chunk's element 0
        else:
            k0, k1, k3 = 0, 0, 0
            origin = 0
        pp, cp = master_ptrs(paddr, code_ptr, start, aoff, MASTER, ALIGNED)
        bp = b_ptr + aoff
        bsp = bs_ptr + aoff // 32
        whole = whole_tiles(length, limit, ROWS)
        for t in range(0, whole, ROWS * 32):
            offs, emask, amask, rmask = row_masks(t, lofs, whole, ROWS)
            _tile(
                offs, emask, amask, rmask, C.scale_offsets(t // 32, ROWS), pp, cp, bp, bsp,
                gaddr, gkind, start, origin, k0, k1, k3, lr_, mom, omd, dec, l2_, fst, inv,
                MASTER, FMT1, SR, NEED_RAND, MAXIMIZE, HAS_L2, HAS_DECAY, NESTEROV, FIRST, HYPER,
                UNSCALE, ALIGNED,
            )  # fmt: skip
        if whole < limit:  # the partial last tile
            offs, emask, amask, rmask = tail_masks(whole, lofs, length, padded, ROWS, BS)
            _tile(
                offs, emask, amask, rmask, C.scale_offsets(whole // 32, ROWS), pp, cp, bp, bsp,
                gaddr, gkind, start, origin, k0, k1, k3, lr_, mom, omd, dec, l2_, fst, inv,
                MASTER, FMT1, SR, NEED_RAND, MAXIMIZE, HAS_L2, HAS_DECAY, NESTEROV, FIRST, HYPER,
                UNSCALE, ALIGNED,
            )  # fmt: skip
