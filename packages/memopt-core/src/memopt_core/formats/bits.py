"""Shared bit helpers of the reference codecs: one copy of each, used by every format.

Everything here is integer arithmetic on int64 tensors holding unsigned bit patterns (an fp32
pattern is a value in ``[0, 2**32)``), so a C++/Triton kernel working on ``uint32``/``uint64``
reproduces it exactly. The only float operation is the exact int -> fp32 conversion of an integer
below ``2**24`` in :func:`floor_log2` (a kernel may use count-leading-zeros instead).

Conventions: ``mag`` is the sign-magnitude pattern without its sign bit
(``bits & 0x7FFFFFFF``); a finite ``mag`` is below :data:`F32_INF`. Rounding decisions follow the
one stochastic-rounding rule of :mod:`memopt_core.formats.base` (:func:`sr_round_up`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "F32_INF",
    "F32_SIGN",
    "bf16_round",
    "bits_to_f32",
    "bits_to_int16",
    "compose_f32",
    "f32_to_bits",
    "floor_log2",
    "int16_to_bits",
    "minifloat_decode",
    "minifloat_encode",
    "pow2_block_exponent",
    "require_f32",
    "round_drop_bits",
    "split_f32",
    "sr_round_up",
]

F32_SIGN = 0x80000000
F32_INF = 0x7F800000
_MAG = 0x7FFFFFFF
_U32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------- bit views
def require_f32(x: Tensor) -> Tensor:
    """``x``, after a FormatError unless it is a float32 tensor: every encoder takes fp32 values
    (a float64 input would be rounded on the way in, differently by each backend)."""
    if x.dtype != torch.float32:
        from memopt_core.errors import FormatError

        raise FormatError(f"codecs encode float32 tensors, got {x.dtype}: convert with .float()")
    return x


def f32_to_bits(x: Tensor) -> Tensor:
    """The fp32 bit patterns of ``x`` as int64 values in ``[0, 2**32)``."""
    return require_f32(x).contiguous().view(torch.int32).to(torch.int64) & _U32


def bits_to_f32(u: Tensor) -> Tensor:
    """fp32 tensor whose bit patterns are the int64 values ``u`` in ``[0, 2**32)``."""
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


def bits_to_int16(u: Tensor) -> Tensor:
    """int16 tensor holding the 16-bit patterns ``u`` in ``[0, 2**16)`` (two's complement view)."""
    return torch.where(u >= 2**15, u - 2**16, u).to(torch.int16)


def int16_to_bits(t: Tensor) -> Tensor:
    """The 16-bit patterns of an int16 (or bf16/fp16, viewed) tensor as int64 in ``[0, 2**16)``."""
    if t.dtype != torch.int16:
        t = t.contiguous().view(torch.int16)
    return t.to(torch.int64) & 0xFFFF


# ----------------------------------------------------------------------------- rounding rule
def sr_round_up(frac24: Tensor, rand: Tensor) -> Tensor:
    """The stochastic-rounding decision: round the magnitude up iff ``(rand >> 8) < frac24``.

    ``frac24 = floor((|y| - lo) / (hi - lo) * 2**24)`` and ``rand`` holds uniform 32-bit words, so
    the probability of rounding up is ``frac24 / 2**24``; ``frac24 == 0`` (exact values) never moves.
    A word outside ``[0, 2**32)`` is taken modulo ``2**32`` (its low 32 bits), as the kernels take
    it: a negative int32-style word otherwise always rounded up here and never there.
    """
    if not isinstance(rand, Tensor) or rand.dtype != torch.int64 or rand.numel() != frac24.numel():
        from memopt_core.errors import FormatError

        got = (
            f"{rand.dtype}{tuple(rand.shape)}" if isinstance(rand, Tensor) else type(rand).__name__
        )
        raise FormatError(
            f"rand must be an int64 tensor of {frac24.numel()} uniform 32-bit words (one per "
            f"element of the encoded tensor, any shape), got {got}: use "
            "memopt_core.rng.uniform_bits"
        )
    # words of any shape in the encoded tensor's flattened order, as the kernels read them (a
    # blocked codec rounds its input flattened: a rand of a 2-D x's shape was refused there)
    return ((rand.reshape(frac24.shape) & 0xFFFFFFFF) >> 8) < frac24


def round_drop_bits(mag: Tensor, drop: int, rand: Tensor | None) -> Tensor:
    """``mag >> drop`` rounded: to nearest, ties to even (``rand=None``) or stochastically.

    For a bit pattern this rounds the value to the grid of patterns whose low ``drop`` bits are zero
    (value and pattern are linear inside a binade and the carry lands on the next power of two), so
    ``frac24 = rem << (24 - drop)`` (``drop <= 24``).
    """
    kept = mag >> drop
    rem = mag & ((1 << drop) - 1)
    if rand is None:
        half = 1 << (drop - 1)
        up = (rem > half) | ((rem == half) & ((kept & 1) == 1))
    else:
        up = sr_round_up(rem << (24 - drop), rand)
    return kept + up.to(torch.int64)


def bf16_round(bits: Tensor, rand: Tensor | None = None) -> Tensor:
    """The bf16 patterns (int64 in ``[0, 2**16)``) of fp32 patterns ``bits``, RNE or SR.

    RNE is the classic ``(bits + 0x7FFF + lsb) >> 16`` and equals torch's fp32 -> bf16 cast; values
    that round past the largest bf16 become inf (SR: ``hi`` above the largest finite is inf). NaN
    stays NaN: its top half with the quiet bit set (the addition would carry a NaN into the sign).
    """
    sign = bits >> 31
    mag = bits & _MAG
    top = round_drop_bits(mag, 16, rand)
    top = torch.where(mag > F32_INF, (mag >> 16) | 0x40, top)
    return (sign << 15) | top


# ----------------------------------------------------------------------------- float pieces
def floor_log2(v: Tensor) -> Tensor:
    """``floor(log2(v))`` for integers ``1 <= v < 2**24`` (int64; 0 gives a meaningless value).

    Exact: an integer below ``2**24`` converts to fp32 exactly, its exponent field is the answer.
    """
    return ((v.to(torch.float32).view(torch.int32).to(torch.int64) >> 23) & 0xFF) - 127


def split_f32(mag: Tensor) -> tuple[Tensor, Tensor]:
    """``(sig, ea)`` of finite magnitude patterns: value = ``sig * 2**(ea - 23)`` with ``sig``
    normalized to ``[2**23, 2**24)`` (subnormals shifted up), ``ea = floor(log2(value))``. A zero
    magnitude gives ``sig = 0`` and a meaningless ``ea``."""
    ef = mag >> 23
    sig = torch.where(ef > 0, (mag & 0x7FFFFF) | 0x800000, mag & 0x7FFFFF)
    sh = 23 - floor_log2(torch.clamp(sig, min=1))  # 0 for normal numbers
    return sig << sh, torch.clamp(ef, min=1) - 127 - sh


def compose_f32(sig: Tensor, e: Tensor) -> Tensor:
    """fp32 bit patterns of ``sig * 2**e`` (``0 <= sig < 2**24``), exact when representable.

    Results below the normal range become subnormal patterns (exact if ``sig * 2**e`` is a multiple
    of ``2**-149``, which every decoder here guarantees); results of ``2**128`` or more are inf
    (reachable only by a value rounded up to ``2**128``, or by a corrupted scale).
    """
    nz = sig > 0
    s = torch.clamp(sig, min=1)
    msb = floor_log2(s)
    te = e + msb  # true exponent
    normal = ((te + 127) << 23) | ((s << torch.clamp(23 - msb, min=0)) & 0x7FFFFF)
    subnormal = s << torch.clamp(e + 149, 0, 23)
    normal = torch.where(te > 127, F32_INF, normal)
    return torch.where(nz, torch.where(te >= -126, normal, subnormal), torch.zeros_like(sig))


# ----------------------------------------------------------------------------- minifloats
def minifloat_encode(
    mag: Tensor, k: Tensor | int, man_bits: int, emin: int, rand: Tensor | None
) -> Tensor:
    """Magnitude code of ``|y| = value(mag) * 2**-k`` on a minifloat grid, before any saturation.

    The grid has ``man_bits`` mantissa bits, smallest normal exponent ``emin`` and subnormals below
    it (IEEE style); the code is ``exponent_field << man_bits | mantissa`` with the exponent biased
    by ``1 - emin``. The scaling by ``2**-k`` is exact (it only shifts the exponent), so a scaled
    format rounds once. Rounding: nearest-even, or SR with ``frac24`` of the dropped bits. Codes
    may exceed the format's largest finite code: the caller saturates or maps them to inf/NaN.
    ``mag`` must be finite; 0 gives code 0.
    """
    sig, ea = split_f32(mag)  # |y| = sig * 2**(ea - k - 23), sig in [2**23, 2**24)
    ey = ea - k
    qexp = torch.clamp(ey, min=emin) - man_bits  # exponent of the grid's spacing at |y|
    d = torch.clamp(qexp - ey + 23, max=50)  # low bits of sig below the spacing: >= 23 - man_bits
    kept = sig >> d
    if rand is None:  # nearest, ties to even: add half - 1 plus the kept lsb, truncate
        n = (sig + ((1 << (d - 1)) - 1) + (kept & 1)) >> d
    else:
        rem = sig - (kept << d)
        frac24 = torch.where(
            d <= 24, rem << torch.clamp(24 - d, min=0), rem >> torch.clamp(d - 24, min=0)
        )
        n = kept + sr_round_up(frac24, rand).to(torch.int64)
    # n counts spacings; a carry to 2**(man_bits+1) moves into the next exponent by itself
    code = ((qexp - (emin - man_bits)) << man_bits) + n
    return torch.where(sig > 0, code, 0)


def minifloat_decode(code: Tensor, k: Tensor | int, man_bits: int, emin: int) -> Tensor:
    """fp32 patterns of magnitude codes of :func:`minifloat_encode` times ``2**k`` (exact)."""
    ef = code >> man_bits
    mant = code & ((1 << man_bits) - 1)
    sig = torch.where(ef > 0, mant | (1 << man_bits), mant)
    e = torch.clamp(ef, min=1) - 1 + emin - man_bits + k
    return compose_f32(sig, e)


def pow2_block_exponent(mag_max: Tensor, fmax_bits: int, lo: int = -127, hi: int = 127) -> Tensor:
    """Smallest ``k`` in ``[lo, hi]`` with ``value(mag_max) * 2**-k <= fmax`` (``fmax`` an fp32
    pattern); 0 maxima give ``lo``. Pure integer: compare exponents, then normalized mantissas."""
    sig, ea = split_f32(mag_max)
    e_f = (fmax_bits >> 23) - 127
    k = ea - e_f + ((sig & 0x7FFFFF) > (fmax_bits & 0x7FFFFF)).to(torch.int64)
    k = torch.where(sig > 0, k, lo)
    return torch.clamp(k, lo, hi)
