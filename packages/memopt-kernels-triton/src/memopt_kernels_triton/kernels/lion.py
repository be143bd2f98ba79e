"""Fused Lion step over a whole group (core's ``reference.lion``, bit for bit)::

g = -g                              if MAXIMIZE
p = p * decay                       if HAS_DECAY
u = beta1 * m + one_minus_beta1 * g
p = p - lr * sign(u)                (sign(±0) = sign(NaN) = +0, as torch.sign)
m = beta2 * m + one_minus_beta2 * g

Whole tiles first with per-row masks, then the partial last tile; ``AHEAD``: loads run one whole
tile ahead of the math; both as in :mod:`~memopt_kernels_triton.kernels.adam`.

Stochastic rounding draws the words of the rounded streams only (master: stream 0, moment:
stream 1), from keys computed once per chunk, as in :mod:`~memopt_kernels_triton.kernels.adam`.

``HYPER``: the scalars, seed and step are read from ``hyper_ptr`` (int32 words, layout
:data:`memopt_kernels_triton.ops.LION_HYPER_FIELDS`) instead of the arguments, as in
:mod:`~memopt_kernels_triton.kernels.adam` (one row per tensor or a shared one, ``skip`` and ``inv_scale``).
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
def _tile_words(
    t, lofs, limit, pp, cp, gaddr, gkind, start, mp, msp,
    ROWS: tl.constexpr, MASTER: tl.constexpr, FMT1: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    """The undecoded words (master, gradient, moment) of the whole tile at chunk element ``t``
    (nothing at or past ``limit``, the end of the whole tiles)."""
    offs, emask, amask, rmask = row_masks(t, lofs, limit, ROWS)
    soffs = C.scale_offsets(t // 32, ROWS)
    xp, xc = C.load_master_raw(pp, cp, offs, emask, amask, MASTER)
    gw = C.load_grad_raw(gaddr, gkind, start, offs, emask, MASTER, ALIGNED)
    mc, ms = C.load_moment_raw(mp, msp, offs, soffs, rmask, amask, FMT1)
    return xp, xc, gw, mc, ms


@triton.jit
def _update(
    x, g, m, offs, emask, amask, rmask, soffs, pp, cp, mp, msp,
    origin, k0, k1, k3, lr_, b1, omb1, b2, omb2, dec, inv, gkind,
    MASTER: tl.constexpr, FMT1: tl.constexpr, SR: tl.constexpr, NEED_RAND: tl.constexpr,
    MAXIMIZE: tl.constexpr, HAS_DECAY: tl.constexpr, UNSCALE: tl.constexpr,
):  # fmt: skip
    """One tile's update from its decoded states, encoded and stored (the module doc's order)."""
    r0, r1, _r2 = rounding_words(offs, origin, k0, k1, 0, k3, MASTER, FMT1, C.FMT_NONE, NEED_RAND)
    g, x = gradient_and_decay(
        g, x, inv, 0.0, dec, gkind, MASTER, UNSCALE, MAXIMIZE, False, HAS_DECAY
    )
    u = b1 * m + omb1 * g
    sgn = tl.where(u > 0.0, 1.0, tl.where(u < 0.0, -1.0, 0.0))
    x = x - lr_ * sgn
    m = b2 * m + omb2 * g
    C.store_master(x, pp, cp, offs, emask, amask, r0, MASTER, SR)
    C.store_moment(m, mp, msp, offs, soffs, rmask, amask, r1, FMT1, SR, m)


@triton.jit(do_not_specialize=["n_chunks", "seed", "step", "hstride"])
def lion_kernel(
    chunk_ptr,
    n_chunks,
    slot_ptr,
    code_ptr,
    m_ptr,
    ms_ptr,
    lr,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    decay,
    seed,
    step,
    hyper_ptr,
    hstride,
    MASTER: tl.constexpr,
    FMT1: tl.constexpr,
    SR: tl.constexpr,
    NEED_RAND: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
    HYPER: tl.constexpr,
    UNSCALE: tl.constexpr,
    AHEAD: tl.constexpr,
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
            b1 = hyper_f32(hyper_ptr, slot, hstride, 1)
            omb1 = hyper_f32(hyper_ptr, slot, hstride, 2)
            b2 = hyper_f32(hyper_ptr, slot, hstride, 3)
            omb2 = hyper_f32(hyper_ptr, slot, hstride, 4)
            dec = hyper_f32(hyper_ptr, slot, hstride, 5)
            seed_ = hyper_word(hyper_ptr, slot, hstride, 6)
            step_ = hyper_word(hyper_ptr, slot, hstride, 7)
            inv = hyper_f32(hyper_ptr, slot, hstride, 8)
            limit = padded * (hyper_word(hyper_ptr, slot, hstride, 9) == 0).to(tl.int32)
        else:
            lr_ = lr
            b1 = beta1
            omb1 = one_minus_beta1
            b2 = beta2
            omb2 = one_minus_beta2
            dec = decay
            seed_ = seed
            step_ = step
            inv = 1.0
            limit = padded
        if NEED_RAND:  # the chunk's tensor at this step
            k0, k1, _k2, k3 = step_keys(seed_, tid, step_)
            origin = base + start  # index of the chunk's element 0
        else:
            k0, k1, k3 = 0, 0, 0
            origin = 0
        pp, cp = master_ptrs(paddr, code_ptr, start, aoff, MASTER, ALIGNED)
        mp = m_ptr + aoff
        msp = ms_ptr + aoff // 32
        tile = ROWS * 32
        whole = whole_tiles(length, limit, ROWS)
        if AHEAD:
            xp, xc, gw, mc, ms = _tile_words(
                0, lofs, whole, pp, cp, gaddr, gkind, start, mp, msp, ROWS, MASTER, FMT1, ALIGNED
            )
        for t in range(0, whole, tile):
            if AHEAD:
                nxp, nxc, ngw, nmc, nms = _tile_words(
                    t + tile, lofs, whole, pp, cp, gaddr, gkind, start, mp, msp,
                    ROWS, MASTER, FMT1, ALIGNED,
                )  # fmt: skip
            offs, emask, amask, rmask = row_masks(t, lofs, whole, ROWS)
            soffs = C.scale_offsets(t // 32, ROWS)
            if AHEAD:
                x = C.decode_master(xp, xc, MASTER)
                g = C.grad_value(gw, gkind, MASTER)
                m = C.decode_moment(mc, ms, FMT1)
            else:
                x = C.load_master(pp, cp, offs, emask, amask, MASTER)
                g = C.load_grad(gaddr, gkind, start, offs, emask, MASTER, ALIGNED)
                m = C.load_moment(mp, msp, offs, soffs, rmask, amask, FMT1)
            _update(
                x, g, m, offs, emask, amask, rmask, soffs, pp, cp, mp, msp,
                origin, k0, k1, k3, lr_, b1, omb1, b2, omb2, dec, inv, gkind,
                MASTER, FMT1, SR, NEED_RAND, MAXIMIZE, HAS_DECAY, UNSCALE,
            )  # fmt: skip
            if AHEAD:
                xp, xc, gw, mc, ms = nxp, nxc, ngw, nmc, nms
        if whole < limit:  # the partial last tile
            offs, emask, amask, rmask = tail_masks(whole, lofs, length, padded, ROWS, BS)
            soffs = C.scale_offsets(whole // 32, ROWS)
            x = C.load_master(pp, cp, offs, emask, amask, MASTER)
            g = C.load_grad(gaddr, gkind, start, offs, emask, MASTER, ALIGNED)
            m = C.load_moment(mp, msp, offs, soffs, rmask, amask, FMT1)
            _update(
                x, g, m, offs, emask, amask, rmask, soffs, pp, cp, mp, msp,
                origin, k0, k1, k3, lr_, b1, omb1, b2, omb2, dec, inv, gkind,
                MASTER, FMT1, SR, NEED_RAND, MAXIMIZE, HAS_DECAY, UNSCALE,
            )  # fmt: skip
