"""Fused Adam/AdamW step over a whole group (core's ``reference.adam``, bit for bit).

Per element, in core's order with every operation individually rounded (launched with
``enable_fp_fusion=False``: no FMA contraction)::

    g = -g                              if MAXIMIZE
    g = g + l2 * p                      if HAS_L2 (2: only where l2 != 0)
    p = p * decay                       if HAS_DECAY
    m = m + one_minus_beta1 * (g - m)
    v = beta2 * v + one_minus_beta2 * (g * g)
    d = sqrt_rn(v) / bc2_sqrt + eps     (div_rn; on the GPU through bc2_sqrt's reciprocal,
                                        kernels.division, same bits)
    p = p - step_size * (m / d)         (div_rn)

States are decoded and encoded with the inlined codecs (``MASTER``, ``FMT1``, ``FMT2``);
``q8_sqrt`` reuses ``sqrt_rn(v)`` for its encoding.

Stochastic rounding (``SR``; ``NEED_RAND`` when some state is rounded at all): the chunk's step
keys are computed once per chunk (:func:`~memopt_kernels_triton.kernels.rng.step_keys`: the
chunk belongs to one tensor), and each tile computes the folded index of its elements and the
words of the streams its formats round only: the master's (stream 0) for bf16/fp16/ECC-24
masters, a moment's (streams 1, 2) unless it is fp32.

Tiles: the chunk's whole tiles run first with per-row masks (constant along a row), so Triton
gives each thread several contiguous elements of a row and one vector access for them
(``ALIGNED``: the launcher checked the addresses, :func:`~memopt_kernels_triton.kernels.tiles.chunk_info`);
the partial last tile, if any, runs after them with per-element masks.

``AHEAD``: each whole tile's loads are issued one tile ahead, before the previous tile's math,
and its words stay undecoded until their own turn. The kernel otherwise waits on memory latency
(Nsight Compute, docs/benchmarks/2026-11-30-q8-codecs.md). The launcher turns it on where it
measured faster (``ops._loads_ahead``): fp32 and ECC-24 masters with unblocked moments, and
ECC-24 masters with blocked 8-bit ones.

``HYPER``: the scalars, seed and step are read from ``hyper_ptr`` (int32 words, layout
:data:`memopt_kernels_triton.ops.ADAM_HYPER_FIELDS`) instead of the arguments, so a launch
captured in a CUDA graph picks up each step's learning rate and step count from device memory:
row ``slot`` of a ``[slots, hstride]`` table per tensor (a device step,
:mod:`~memopt_kernels_triton.kernels.device_words`), or one shared row when ``hstride`` is 0.
The row's ``skip`` word (a GradScaler's found-inf) turns the tensor's update off; with
``UNSCALE`` the gradient is multiplied by the row's ``inv_scale`` first (``GradScaler.unscale_``'s
product, fused).
"""

from __future__ import annotations

import triton
import triton.language as tl

from memopt_kernels_triton.kernels import codecs as C
from memopt_kernels_triton.kernels.division import (
    FAST_SCALAR_DIVISION,
    div_rn_by,
    divisor_in_range,
    divisor_reciprocal,
)
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
    t, lofs, limit, pp, cp, gaddr, gkind, start, mp, msp, vp, vsp,
    ROWS: tl.constexpr, MASTER: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr,
    ALIGNED: tl.constexpr,
):  # fmt: skip
    """The undecoded words (master, gradient, both moments) of the whole tile at chunk element
    ``t``; rows at or past ``limit`` (the end of the whole tiles) are not read, so the load after
    the last whole tile touches no memory."""
    offs, emask, amask, rmask = row_masks(t, lofs, limit, ROWS)
    soffs = C.scale_offsets(t // 32, ROWS)
    xp, xc = C.load_master_raw(pp, cp, offs, emask, amask, MASTER)
    gw = C.load_grad_raw(gaddr, gkind, start, offs, emask, MASTER, ALIGNED)
    mc, ms = C.load_moment_raw(mp, msp, offs, soffs, rmask, amask, FMT1)
    vc, vs = C.load_moment_raw(vp, vsp, offs, soffs, rmask, amask, FMT2)
    return xp, xc, gw, mc, ms, vc, vs


@triton.jit
def _update(
    x, g, m, v, offs, emask, amask, rmask, soffs, pp, cp, mp, msp, vp, vsp,
    origin, k0, k1, k2, k3, omb1, b2, omb2, eps_, lr_t, bc2, rbc2, bc2_fast, dec, l2_, inv,
    gkind, MASTER: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr, SR: tl.constexpr,
    NEED_RAND: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_L2: tl.constexpr,
    HAS_DECAY: tl.constexpr, UNSCALE: tl.constexpr,
):  # fmt: skip
    """One tile's update from its decoded states, encoded and stored (the module doc's order)."""
    r0, r1, r2 = rounding_words(offs, origin, k0, k1, k2, k3, MASTER, FMT1, FMT2, NEED_RAND)
    g, x = gradient_and_decay(
        g, x, inv, l2_, dec, gkind, MASTER, UNSCALE, MAXIMIZE, HAS_L2, HAS_DECAY
    )
    m = m + omb1 * (g - m)
    v = b2 * v + omb2 * (g * g)
    s = tl.sqrt_rn(v)
    if bc2_fast:  # noqa: SIM108 (a uniform runtime branch on the chunk's divisor)
        q = div_rn_by(s, bc2, rbc2)
    else:
        q = tl.div_rn(s, bc2)
    d = q + eps_
    x = x - lr_t * tl.div_rn(m, d)
    C.store_master(x, pp, cp, offs, emask, amask, r0, MASTER, SR)
    C.store_moment(m, mp, msp, offs, soffs, rmask, amask, r1, FMT1, SR, m)
    C.store_moment(v, vp, vsp, offs, soffs, rmask, amask, r2, FMT2, SR, s)


@triton.jit(do_not_specialize=["n_chunks", "seed", "step", "hstride"])
def adam_kernel(
    chunk_ptr,
    n_chunks,
    slot_ptr,
    code_ptr,
    m_ptr,
    ms_ptr,
    v_ptr,
    vs_ptr,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    step_size,
    bc2_sqrt,
    decay,
    l2,
    seed,
    step,
    hyper_ptr,
    hstride,
    MASTER: tl.constexpr,
    FMT1: tl.constexpr,
    FMT2: tl.constexpr,
    SR: tl.constexpr,
    NEED_RAND: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_L2: tl.constexpr,
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
            omb1 = hyper_f32(hyper_ptr, slot, hstride, 0)
            b2 = hyper_f32(hyper_ptr, slot, hstride, 1)
            omb2 = hyper_f32(hyper_ptr, slot, hstride, 2)
            eps_ = hyper_f32(hyper_ptr, slot, hstride, 3)
            lr_t = hyper_f32(hyper_ptr, slot, hstride, 4)
            bc2 = hyper_f32(hyper_ptr, slot, hstride, 5)
            dec = hyper_f32(hyper_ptr, slot, hstride, 6)
            l2_ = hyper_f32(hyper_ptr, slot, hstride, 7)
            seed_ = hyper_word(hyper_ptr, slot, hstride, 8)
            step_ = hyper_word(hyper_ptr, slot, hstride, 9)
            inv = hyper_f32(hyper_ptr, slot, hstride, 10)
            # a skipped step (found-inf) runs no tile of the chunk
            limit = padded * (hyper_word(hyper_ptr, slot, hstride, 11) == 0).to(tl.int32)
        else:
            omb1 = one_minus_beta1
            b2 = beta2
            omb2 = one_minus_beta2
            eps_ = eps
            lr_t = step_size
            bc2 = bc2_sqrt
            dec = decay
            l2_ = l2
            seed_ = seed
            step_ = step
            inv = 1.0
            limit = padded
        if FAST_SCALAR_DIVISION:
            bc2_fast = divisor_in_range(bc2)
            rbc2 = divisor_reciprocal(bc2)
        else:  # the interpreter: div_rn (no inline PTX there)
            bc2_fast = False
            rbc2 = 0.0
        if NEED_RAND:  # the chunk's tensor at this step
            k0, k1, k2, k3 = step_keys(seed_, tid, step_)
            origin = base + start  # index of the chunk's element 0
        else:
            k0, k1, k2, k3 = 0, 0, 0, 0
            origin = 0
        pp, cp = master_ptrs(paddr, code_ptr, start, aoff, MASTER, ALIGNED)
        mp = m_ptr + aoff
        vp = v_ptr + aoff
        msp = ms_ptr + aoff // 32
        vsp = vs_ptr + aoff // 32
        tile = ROWS * 32
        whole = whole_tiles(length, limit, ROWS)
        if AHEAD:
            xp, xc, gw, mc, ms, vc, vs = _tile_words(
                0, lofs, whole, pp, cp, gaddr, gkind, start, mp, msp, vp, vsp,
                ROWS, MASTER, FMT1, FMT2, ALIGNED,
            )  # fmt: skip
        for t in range(0, whole, tile):
            if AHEAD:
                nxp, nxc, ngw, nmc, nms, nvc, nvs = _tile_words(
                    t + tile, lofs, whole, pp, cp, gaddr, gkind, start, mp, msp, vp, vsp,
                    ROWS, MASTER, FMT1, FMT2, ALIGNED,
                )  # fmt: skip
            offs, emask, amask, rmask = row_masks(t, lofs, whole, ROWS)
            soffs = C.scale_offsets(t // 32, ROWS)
            if AHEAD:
                x = C.decode_master(xp, xc, MASTER)
                g = C.grad_value(gw, gkind, MASTER)
                m = C.decode_moment(mc, ms, FMT1)
                v = C.decode_moment(vc, vs, FMT2)
            else:
                x = C.load_master(pp, cp, offs, emask, amask, MASTER)
                g = C.load_grad(gaddr, gkind, start, offs, emask, MASTER, ALIGNED)
                m = C.load_moment(mp, msp, offs, soffs, rmask, amask, FMT1)
                v = C.load_moment(vp, vsp, offs, soffs, rmask, amask, FMT2)
            _update(
                x, g, m, v, offs, emask, amask, rmask, soffs, pp, cp, mp, msp, vp, vsp,
                origin, k0, k1, k2, k3, omb1, b2, omb2, eps_, lr_t, bc2, rbc2, bc2_fast, dec,
                l2_, inv, gkind,
                MASTER, FMT1, FMT2, SR, NEED_RAND, MAXIMIZE, HAS_L2, HAS_DECAY, UNSCALE,
            )  # fmt: skip
            if AHEAD:
                xp, xc, gw, mc, ms, vc, vs = nxp, nxc, ngw, nmc, nms, nvc, nvs
        if whole < limit:  # the partial last tile
            offs, emask, amask, rmask = tail_masks(whole, lofs, length, padded, ROWS, BS)
            soffs = C.scale_offsets(whole // 32, ROWS)
            x = C.load_master(pp, cp, offs, emask, amask, MASTER)
            g = C.load_grad(gaddr, gkind, start, offs, emask, MASTER, ALIGNED)
            m = C.load_moment(mp, msp, offs, soffs, rmask, amask, FMT1)
            v = C.load_moment(vp, vsp, offs, soffs, rmask, amask, FMT2)
            _update(
                x, g, m, v, offs, emask, amask, rmask, soffs, pp, cp, mp, msp, vp, vsp,
                origin, k0, k1, k2, k3, omb1, b2, omb2, eps_, lr_t, bc2, rbc2, bc2_fast, dec,
                l2_, inv, gkind,
                MASTER, FMT1, FMT2, SR, NEED_RAND, MAXIMIZE, HAS_L2, HAS_DECAY, UNSCALE,
            )  # fmt: skip
