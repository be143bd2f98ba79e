"""Correctly rounded division of a tile by one scalar divisor, with the divisor's reciprocal
computed once (Adam's ``sqrt(v) / bc2_sqrt``: ``bc2_sqrt`` is the same for a whole chunk).

``tl.div_rn(a, b)`` compiles to CUDA's IEEE division: a fast path (``MUFU.RCP``, one Newton step
refining the reciprocal, then ``q0 = a * r``, the exact remainder ``a - q0 * b`` by FMA and
``q0 + r * rem``, five FMAs) guarded by ``FCHK``, a range check that sends the rare operands the
fast path cannot take to a slow subroutine. Per element that is about 11 instructions, and
ptxas recomputes the reciprocal for every element even when the divisor is loop-invariant.

Here the reciprocal is refined once per chunk (:func:`divisor_reciprocal`, the same ``MUFU.RCP``
and Newton step, so the same ``r``), and each element runs the fast path's last three operations
(:func:`div_rn_by`): the bits ``div_rn`` gives, wherever the operands are inside the range that
:func:`divisor_in_range` keeps them to. There every operand, the quotient and the remainder are
normal fp32 numbers or zeros, the case the fast path exists for; the GPU tests compare it with
``div_rn`` on every significand of ``a`` for hundreds of divisors. Outside it the caller divides
with ``div_rn``.

Triton's CPU interpreter has no inline PTX (and rounds fused operations its own way), so there
the kernels keep ``div_rn``: :data:`FAST_SCALAR_DIVISION` is False.
"""

from __future__ import annotations

import triton
import triton.language as tl

from memopt_kernels_triton.kernels.codecs import INTERPRETED

#: Whether the kernels divide by a chunk's scalar through its reciprocal (False when interpreted).
FAST_SCALAR_DIVISION: tl.constexpr = tl.constexpr(not INTERPRETED.value)


@triton.jit
def divisor_in_range(b):
    """Whether scalar ``b`` may divide through :func:`div_rn_by`: ``2**-60 <= b <= 16``, which
    holds for every ``bc2_sqrt = sqrt(1 - beta2**step)`` of a ``beta2`` in [0, 1) (computed in
    double, as core does: at least ``sqrt(2**-53)``, at most 1) and for its decay-normalized
    form ``bc2_sqrt / sqrt(N)`` (``memopt_core.reference.adam_scalars(normalized=True)``:
    ``N = beta2**j >= 2**-8``, so at most ``1 / sqrt(2**-8) = 16``).

    The dividends are square roots of fp32 values: +-0 or ``2**-75 <= a < 2**64``. Over that
    range of ``b`` the reciprocal lies in ``[2**-4, 2**60]``, a quotient of a nonzero ``a`` in
    ``[2**-79, 2**124]`` (``a / 16`` at least, ``a / 2**-60`` at most), and the exact
    remainder ``q0 * b - a`` is a multiple of the smaller of ``ulp(a)`` and ``ulp(q0) *
    ulp(b)`` (about ``a * 2**-47``, at least ``2**-122``): zero or normal. So every operand of
    the fast path is normal, as :func:`div_rn_by` needs; the bound on the remainder holds for
    any ``b`` (it follows ``a``), and the upper end 16 only lowers the smallest quotient from
    ``2**-75`` to ``2**-79``."""
    return (b >= 8.673617379884035e-19) & (b <= 16.0)


@triton.jit
def divisor_reciprocal(b):
    """The reciprocal of scalar ``b`` that CUDA's division refines for its fast path:
    ``r0 = rcp.approx(b)`` then ``r0 + r0 * (1 - b * r0)`` (two FMAs)."""
    r0 = tl.inline_asm_elementwise(
        asm="rcp.approx.ftz.f32 $0, $1;",
        constraints="=r,r",
        args=[b],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )
    return tl.fma(r0, tl.fma(r0, -b, 1.0), r0)


@triton.jit
def div_rn_by(a, b, rb):
    """``div_rn(a, b)`` for a tile ``a`` of square roots (+-0, normal, +inf or NaN; at most
    ``2**64``) and a scalar ``b`` that passed :func:`divisor_in_range`, with ``rb`` its
    :func:`divisor_reciprocal`: the fast path's quotient ``q0`` and its one correction from the
    exact remainder, five instructions where ``div_rn`` issues eleven.

    The remainder is taken negated, ``q0 * b - a``, and subtracted: the same bits for every
    non-zero ``a`` (rounding is symmetric), and a zero keeps its sign (``a - q0 * b`` would make
    ``-0 / b`` a ``+0``). An infinite ``a`` makes that remainder NaN; the max with ``q0`` scaled
    down by ``2**-10`` restores it: there the scaled ``q0`` is the infinity, a max ignores a NaN,
    and for finite ``a`` it lies far below the quotient (``q0`` is within two units in the last
    place of it)."""
    q0 = a * rb
    q = tl.fma(-rb, tl.fma(q0, b, -a), q0)
    return tl.maximum(q, q0 * 0.9990234375)
