"""Stochastic-rounding words in Triton: core's ``memopt_core.rng``, bit for bit.

One Philox4x32-10 block per (seed, tensor, step) gives the step's four keys, then each element
takes, for each stream it rounds, a 32-bit hash of its index mixed with that stream's key::

    K0, K1, K2, K3 = philox4x32_10(counter=(step, 0, 0, 0), key=(seed, tensor_id))   # step_keys
    y              = (index & 0xFFFFFFFF) * 0x9E3779B9 + (index >> 32) * K3   # mod 2**32, fold_index
    word[stream]   = lowbias32(y ^ K[stream])                                  # stream_word
    lowbias32(x)   : x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16

Streams: 0 master, 1 first moment, 2 second moment. The keys are scalars, computed once per
chunk (a chunk belongs to one tensor); a tile computes ``y`` once (two 32-bit multiplies, and
``lowbias32``'s first xorshift, which every stream shares: :func:`fold_index`) and the words of
the streams its formats round only (two 32-bit multiplies each). Every value is uint32, whose
arithmetic wraps modulo ``2**32`` and whose right shifts are logical, on the GPU and in Triton's
interpreter (numpy uint32) alike. The Philox round is Random123's (and Triton's own ``tl.philox``): 32x32 ->
64-bit products split with ``umulhi`` and a wrapping multiply.
"""

from __future__ import annotations

import triton
import triton.language as tl

PHILOX_M0: tl.constexpr = tl.constexpr(0xD2511F53)
PHILOX_M1: tl.constexpr = tl.constexpr(0xCD9E8D57)
PHILOX_W0: tl.constexpr = tl.constexpr(0x9E3779B9)
PHILOX_W1: tl.constexpr = tl.constexpr(0xBB67AE85)
INDEX_M: tl.constexpr = tl.constexpr(0x9E3779B9)
MIX_M0: tl.constexpr = tl.constexpr(0x7FEB352D)
MIX_M1: tl.constexpr = tl.constexpr(0x846CA68B)


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
def step_keys(seed, tensor_id, step):
    """``(K0, K1, K2, K3)`` (uint32 scalars) of tensor ``tensor_id`` at optimizer ``step``:
    Philox4x32-10 of counter ``(step, 0, 0, 0)`` and key ``(seed, tensor_id)``. ``seed`` and
    ``step`` are int32 holding 32-bit values (bit-cast); ``tensor_id`` is an int64 or int32
    whose low 32 bits are taken."""
    c0 = step.to(tl.uint32, bitcast=True)
    zero = tl.zeros_like(c0)
    k0 = seed.to(tl.uint32, bitcast=True)
    k1 = (tensor_id.to(tl.int64) & 0xFFFFFFFF).to(tl.uint32)
    return philox4x32_10(c0, zero, zero, zero, k0, k1)


@triton.jit
def fold_index(index, k3):
    """``h = y ^ (y >> 16)`` (uint32) of int64 element indices ``index`` with the step's key
    ``k3``, where ``y`` is the index's low word times :data:`INDEX_M` plus its high word times
    ``k3``, modulo ``2**32``: the folded index with ``lowbias32``'s first xorshift applied. That
    xorshift commutes with the stream key's xor (``(y ^ K) >> 16 == (y >> 16) ^ (K >> 16)``), so
    one ``h`` serves every stream, each xoring its :func:`stream_key` instead of ``K``."""
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    y = lo * INDEX_M + hi * k3
    return y ^ (y >> 16)


@triton.jit
def stream_key(key):
    """The step key ``K`` (uint32 scalar) of a stream as :func:`stream_word` takes it:
    ``K ^ (K >> 16)``, a scalar (loop-invariant in a chunk's tile loop, so not per element)."""
    return key ^ (key >> 16)


@triton.jit
def stream_word(h, skey):
    """The word (uint32) ``lowbias32(y ^ K)`` of folded indices ``h`` (:func:`fold_index`) in the
    stream whose :func:`stream_key` is ``skey``: ``lowbias32`` after its first xorshift."""
    x = (h ^ skey) * MIX_M0
    x = x ^ (x >> 15)
    x = x * MIX_M1
    return x ^ (x >> 16)


@triton.jit
def r24_of(word):
    """The top 24 bits of a uint32 word as int32: stochastic rounding compares them with frac24."""
    return (word >> 8).to(tl.int32)
