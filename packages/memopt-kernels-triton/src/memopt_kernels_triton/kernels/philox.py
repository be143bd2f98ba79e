"""Philox4x32-10 in Triton: core's ``memopt_core.rng`` stream layout, bit for bit.

``key = (seed, tensor_id)``, ``counter = (index lo, index hi, step, 0)``, stream ``k`` = output
word ``k`` (0 master, 1 first moment, 2 second moment). The round is Random123's (and Triton's
own ``tl.philox``): 32x32 -> 64-bit products split with ``umulhi`` and a wrapping multiply.
"""

from __future__ import annotations

import triton
import triton.language as tl

PHILOX_M0: tl.constexpr = tl.constexpr(0xD2511F53)
PHILOX_M1: tl.constexpr = tl.constexpr(0xCD9E8D57)
PHILOX_W0: tl.constexpr = tl.constexpr(0x9E3779B9)
PHILOX_W1: tl.constexpr = tl.constexpr(0xBB67AE85)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of counter ``(c0, c1, c2, c3)`` and key ``(k0, k1)`` (all uint32)."""
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.umulhi(PHILOX_M1, a2) ^ c1 ^ k0
        c2 = tl.umulhi(PHILOX_M0, a0) ^ c3 ^ k1
        c1 = PHILOX_M1 * a2
        c3 = PHILOX_M0 * a0
        k0 = k0 + PHILOX_W0
        k1 = k1 + PHILOX_W1
    return c0, c1, c2, c3


@triton.jit
def stream_words(seed, tensor_id, index, step):
    """The four stream words (uint32) of int64 element ``index`` of tensor ``tensor_id`` at
    ``step``: ``seed``/``step`` are int32 holding 32-bit values (bit-cast), ``tensor_id`` int64."""
    c0 = (index & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((index >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c2 = step.to(tl.uint32, bitcast=True)
    c3 = tl.zeros_like(c2)
    k0 = seed.to(tl.uint32, bitcast=True)
    k1 = (tensor_id & 0xFFFFFFFF).to(tl.uint32)
    return philox4x32_10(c0, c1, c2, c3, k0, k1)


@triton.jit
def r24_of(word):
    """The top 24 bits of a uint32 word as int32: stochastic rounding compares them with frac24."""
    return (word >> 8).to(tl.int32)
