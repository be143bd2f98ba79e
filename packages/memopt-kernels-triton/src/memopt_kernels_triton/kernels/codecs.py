"""Inlined ``@triton.jit`` codecs: memopt-core's formats (``docs/formats.md``) bit for bit.

Every function here mirrors one reference function of ``memopt_core.formats`` on int32 bit
patterns: magnitudes are below ``2**31`` so int32 holds them, signs are handled separately, shift
amounts are clamped below 32 (a shift by 32 or more is undefined on the GPU and differs in numpy),
and the only float operations are exact ones (an int below ``2**23`` read back through an exact
``2**23 + v - 2**23`` addition, products by powers of two) or the single correctly rounded IEEE
operations the formats define (``sqrt_rn``, one multiply). No float ->
narrower float cast is used anywhere: the Triton interpreter truncates those while the GPU rounds
them to nearest even.

Moment formats are picked by a ``tl.constexpr`` format id (:data:`FMT_FP32` ...), master formats
by a master id (:data:`MASTER_FP32` ...). Blocked formats work on 2-D tiles ``[ROWS, 32]``: one
row per quantization block, so a block's scale is a reduction along axis 1.

Stochastic rounding takes ``r24``: the element's 32-bit random word
(:mod:`~memopt_kernels_triton.kernels.rng`) shifted right by 8 (int32 in ``[0, 2**24)``); the
magnitude rounds up iff ``r24 < frac24`` (core's ``sr_round_up``).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# ---------------------------------------------------------------------------------- format ids
FMT_FP32: tl.constexpr = tl.constexpr(0)
FMT_BF16: tl.constexpr = tl.constexpr(1)
FMT_E4M3: tl.constexpr = tl.constexpr(2)  # fp8_e4m3 and q8_signed (identical)
FMT_E5M2: tl.constexpr = tl.constexpr(3)
FMT_Q8SQRT: tl.constexpr = tl.constexpr(4)
FMT_NONE: tl.constexpr = tl.constexpr(5)  # no such state (SGD without momentum)

MASTER_FP32: tl.constexpr = tl.constexpr(0)  # fp32 parameter is the master
MASTER_BF16: tl.constexpr = tl.constexpr(1)  # 'none' with bf16 parameters
MASTER_FP16: tl.constexpr = tl.constexpr(2)  # 'none' with fp16 parameters
MASTER_ECC24: tl.constexpr = tl.constexpr(3)
MASTER_ECC32: tl.constexpr = tl.constexpr(4)

F32_INF: tl.constexpr = tl.constexpr(0x7F800000)
F32_QNAN: tl.constexpr = tl.constexpr(0x7FC00000)
SCALE_BIAS: tl.constexpr = tl.constexpr(127)
# Triton's CPU interpreter (decided at import, as Triton decides it): no inline PTX there
INTERPRETED: tl.constexpr = tl.constexpr(
    os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")
)

# memopt_core.backends.KERNEL_MOMENT_IDS maps core's format names to these ids.


# ---------------------------------------------------------------------------------- bit views
@triton.jit
def f32_bits(x):
    """fp32 -> its int32 bit pattern."""
    return x.to(tl.int32, bitcast=True)


@triton.jit
def bits_f32(u):
    """int32 bit pattern -> fp32."""
    return u.to(tl.float32, bitcast=True)


@triton.jit
def neg(x):
    """IEEE negation (flip the sign bit): Triton's ``-x`` is ``0 - x``, which turns ``+0`` into
    ``+0`` where torch's ``-x`` gives ``-0``."""
    return (x.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)


# ---------------------------------------------------------------------------------- rounding
@triton.jit
def round_drop_bits(mag, DROP: tl.constexpr, r24, SR: tl.constexpr):
    """``mag >> DROP`` rounded to nearest even, or stochastically (core's ``round_drop_bits``),
    as one addition before the shift. SR rounds up iff ``r24 < rem << (24 - DROP)``, that is iff
    ``r24 >> (24 - DROP) < rem``: adding ``2**DROP - 1`` less that carries exactly then. Nearest
    even adds half less one, plus the kept last bit. (NaN magnitudes may wrap; callers replace
    them.)"""
    if SR:  # noqa: SIM108 (constexpr branch)
        up = ((1 << DROP) - 1) - (r24 >> (24 - DROP))
    else:
        up = ((1 << (DROP - 1)) - 1) + ((mag >> DROP) & 1)
    return (mag + up) >> DROP


@triton.jit
def bf16_round(u, r24, SR: tl.constexpr):
    """16-bit bf16 pattern (int32 in [0, 2**16)) of fp32 pattern ``u`` (core's ``bf16_round``)."""
    sign = (u >> 31) & 1
    mag = u & 0x7FFFFFFF
    top = round_drop_bits(mag, 16, r24, SR)
    top = tl.where(mag > F32_INF, (mag >> 16) | 0x40, top)
    return (sign << 15) | top


@triton.jit
def bf16_widen(p):
    """fp32 value of 16-bit bf16 patterns ``p`` (int32, any upper bits)."""
    return bits_f32((p & 0xFFFF) << 16)


@triton.jit
def mf_round(yb, MAN: tl.constexpr, EMIN: tl.constexpr, r24, MODE: tl.constexpr):
    """Magnitude code of ``y`` on a minifloat grid (``MAN`` mantissa bits, smallest normal exponent
    ``EMIN``, subnormals below it), before any saturation: core's ``minifloat_encode``.

    ``yb`` is the pattern of a finite ``y >= 0`` that is either exact or below ``2**-126`` (every
    grid here rounds those to code 0, stochastically too: their frac24 is 0), so ``y``'s own
    exponent and 24-bit significand stand in for core's normalization. ``MODE``: 0 nearest even,
    1 stochastic (``r24``). The 8-bit grids take :func:`mf8_round`."""
    ey = (yb >> 23) - 127
    sig = (yb & 0x7FFFFF) | 0x800000
    # dropped low bits of sig; at 48 and beyond both n and frac24 are 0
    d = tl.minimum(tl.maximum(EMIN - ey, 0) + (23 - MAN), 48)
    kept = sig >> tl.minimum(d, 31)
    if MODE == 0:
        d2 = tl.minimum(d, 25)  # (sig + 2**(d-1) - 1 + lsb) >> d is 0 for d >= 25 either way
        n = (sig + ((1 << (d2 - 1)) - 1) + (kept & 1)) >> d2
    else:
        rem = sig - (kept << tl.minimum(d, 31))
        frac24 = tl.where(d <= 24, rem << tl.maximum(24 - d, 0), rem >> tl.maximum(d - 24, 0))
        n = kept + (r24 < frac24).to(tl.int32)
    return ((tl.maximum(ey, EMIN) - EMIN) << MAN) + n


@triton.jit
def mf8_round(yb, MAN: tl.constexpr, EMIN: tl.constexpr, r24, MODE: tl.constexpr):
    """:func:`mf_round` for a grid whose codes stay below ``2**8`` (``y`` at most its largest
    value, the blocked formats). Works on ``t = code << 24 | frac24``
    (uint32: the code and the 24 bits below its last place, as core's ``frac24`` truncates them).
    At or above ``2**EMIN`` the pattern minus the grid's exponent bias, shifted left by
    ``MAN + 1``, is ``t`` (the code's exponent and mantissa fields follow fp32's). Below it ``t``
    is ``y`` in units of ``2**(EMIN - MAN - 24)``: an exact product, truncated to an integer
    (under ``2**(MAN + 24)``; lanes above the range take the other branch of the select, and
    their product is capped at ``2**30`` first so that no conversion leaves int32's range: the
    GPU would saturate, numpy warns). Rounding is then one addition: ``2**24 - 1 - r24``
    carries into the code iff ``r24 < frac24``; nearest even adds ``2**23 - 1`` plus the code's
    last bit. ``MODE`` 2 returns ``t`` itself (int32 bits), for ``q8_sqrt``'s rounding."""
    tn = (yb - ((126 + EMIN) << 23)) << (MAN + 1)
    unit = tl.full([], (151 + MAN - EMIN) << 23, tl.int32).to(tl.float32, bitcast=True)
    ts = tl.minimum(bits_f32(yb) * unit, 1073741824.0).to(tl.int32)
    t = tl.where(yb >= ((127 + EMIN) << 23), tn, ts).to(tl.uint32, bitcast=True)
    if MODE == 0:
        t = t + (0x7FFFFF + ((t >> 24) & 1))
    elif MODE == 1:
        t = t + (0xFFFFFF - r24).to(tl.uint32, bitcast=True)
    if MODE == 2:  # noqa: SIM108 (a constexpr branch)
        out = t.to(tl.int32, bitcast=True)
    else:
        out = (t >> 24).to(tl.int32, bitcast=True)
    return out


@triton.jit
def mf_value(mag, MAN: tl.constexpr, EMIN: tl.constexpr):
    """fp32 value of magnitude codes ``mag`` (no specials): exact. A code shifted to fp32's
    mantissa position is an fp32 pattern worth ``value * 2**-(126 + EMIN)`` (the grid's exponent
    field, bias ``1 - EMIN``, sits where fp32's does; its subnormals land on fp32 subnormals), so
    one exact multiply by a power of two rescales it."""
    rescale = tl.full([], (253 + EMIN) << 23, tl.int32).to(tl.float32, bitcast=True)
    return bits_f32(mag << (23 - MAN)) * rescale


@triton.jit
def block_scale(mmax, FMAX_BITS: tl.constexpr):
    """E8M0 scale byte ``k + 127`` of the smallest ``k >= -127`` with ``value(mmax) * 2**-k <=
    fmax`` (``mmax`` the largest finite magnitude pattern of a block; 0 gives byte 0): core's
    ``pow2_block_exponent``, for the maxima the blocked formats meet (see
    :func:`block_mf_encode`: ``k`` stays below 128 by itself).

    On normal patterns ``k = ceil((mmax - fmax) / 2**23)`` (exponent difference, plus one when
    the mantissa is larger). The same pattern arithmetic on a subnormal (or 0) ``mmax`` is not a
    logarithm, but with ``fmax >= 2`` such a maximum needs ``k <= -127`` and the formula
    (monotone in ``mmax``) gives at most -134, so the clamp settles it; ``q8_sqrt``'s square
    roots (``fmax`` 1.875) are never subnormal."""
    return tl.maximum((mmax - (FMAX_BITS - 0x7FFFFF - (SCALE_BIAS << 23))) >> 23, 0)


# ---------------------------------------------------------------------------------- fp16
@triton.jit
def fp16_round(u, r24, SR: tl.constexpr):
    """16-bit fp16 pattern of fp32 pattern ``u``: nearest even or SR, overflow -> inf."""
    sign = (u >> 31) & 1
    mag = u & 0x7FFFFFFF
    finite = mag < F32_INF
    code = mf_round(tl.where(finite, mag, 0), 10, -14, r24, 1 if SR else 0)
    code = tl.minimum(code, 0x7C00)
    code = tl.where(finite, code, tl.where(mag == F32_INF, 0x7C00, 0x7E00))
    return (sign << 15) | code


@triton.jit
def fp16_widen(p):
    """fp32 value of 16-bit fp16 patterns ``p`` (exact; NaN quiet with its payload)."""
    p = p & 0xFFFF
    mag = p & 0x7FFF
    out = f32_bits(mf_value(tl.minimum(mag, 0x7BFF), 10, -14))
    out = tl.where(mag >= 0x7C00, F32_INF | ((mag & 0x3FF) << 13), out)
    out = tl.where(mag > 0x7C00, out | 0x400000, out)
    return bits_f32(out | ((p >> 15) << 31))


# ---------------------------------------------------------------------------------- blocked
@triton.jit
def block_mf_encode(
    x,
    r24,
    MAN: tl.constexpr,
    EMIN: tl.constexpr,
    FMAX: tl.constexpr,
    NANC: tl.constexpr,
    INFC: tl.constexpr,
    SIGNED: tl.constexpr,
    MODE: tl.constexpr,
):
    """Codes (int32 ``[R, 32]``; ``MODE`` 2: ``t = code << 24 | frac24``, :func:`mf8_round`)
    and scale bytes ``k + 127`` (int32 ``[R]``) of fp32 tile ``x`` (core's
    ``BlockMinifloatCodec._encode_codes``). ``|x| * 2**-k`` is one exact multiply
    (or lands below ``2**-126``, which rounds to code 0 on every grid).

    The inputs keep ``k`` where core never clamps it at 127: e4m3 and e5m2 need at most 120 and
    113 for the largest fp32, and ``q8_sqrt`` encodes square roots of fp32 values (0, or in
    ``[2**-75, 2**64]``: ``k`` is -127 or in [-75, 64]). So ``2**-k`` is a normal number, every
    scaled block maximum is at most ``fmax`` and no code passes the largest finite one (core's
    saturation never acts)."""
    u = f32_bits(x)
    mag = u & 0x7FFFFFFF
    finite = mag < F32_INF
    magf = tl.where(finite, mag, 0)
    s = block_scale(tl.max(magf, axis=1), FMAX)
    y = magf.to(tl.float32, bitcast=True) * bits_f32((254 - s[:, None]) << 23)  # 2**-k
    code = mf8_round(f32_bits(y), MAN, EMIN, r24, MODE)
    if MODE == 2:  # t = code << 24 | frac24 (int32 bits); NaN: the NaN code, frac24 0
        special = tl.full(mag.shape, (NANC << 24) - (1 << 32), tl.int32)
    elif INFC >= 0:
        special = tl.where(mag == F32_INF, INFC, NANC)
    else:
        special = tl.full(mag.shape, NANC, tl.int32)
    code = tl.where(finite, code, special)
    if SIGNED:
        code = code | (((u >> 31) & 1) << 7)
    return code, s


@triton.jit
def block_mf_decode(
    c,
    sf,
    MAN: tl.constexpr,
    EMIN: tl.constexpr,
    MAXC: tl.constexpr,
    INFC: tl.constexpr,
):
    """fp32 values of signed codes ``c`` (int32 in [0, 256)) with block scale factors
    ``sf = 2**k`` (fp32): one exact multiply (a product past the largest fp32 is inf, as in
    core)."""
    mag = c & 0x7F
    out = f32_bits(mf_value(mag, MAN, EMIN) * sf)
    if INFC >= 0:
        out = tl.where(mag == INFC, F32_INF, out)
        out = tl.where(mag > INFC, F32_QNAN, out)
    else:
        out = tl.where(mag > MAXC, F32_QNAN, out)
    return bits_f32(out | ((c >> 7) << 31))


# Grid parameters (man_bits, emin, fmax pattern, max code, NaN code, inf code or -1, signed):
#   e4m3fn  3, -6,  0x43E00000 (448),   0x7E, 0x7F, -1,   signed
#   e5m2    2, -14, 0x47600000 (57344), 0x7B, 0x7E, 0x7C, signed
#   e4m4    4, -14, 0x3FF00000 (1.875), 0xFE, 0xFF, -1,   unsigned (q8_sqrt's sqrt(v))
@triton.jit
def encode_blocked(x, r24, FMT: tl.constexpr, SR: tl.constexpr, sqrt_x):
    """``(codes [R, 32], scale bytes [R])`` of tile ``x`` in blocked format ``FMT`` (RNE, or
    SR with ``r24``). For ``q8_sqrt`` ``sqrt_x`` must be ``sqrt_rn(x)`` (Adam computes it anyway);
    the other formats ignore it."""
    MODE: tl.constexpr = 1 if SR else 0
    if FMT == FMT_E4M3:
        code, s = block_mf_encode(x, r24, 3, -6, 0x43E00000, 0x7F, -1, True, MODE)
    elif FMT == FMT_E5M2:
        code, s = block_mf_encode(x, r24, 2, -14, 0x47600000, 0x7E, 0x7C, True, MODE)
        # a finite non-zero x is never magnitude code 0 (core's BlockFp8Codec.keeps_nonzero);
        # non-finite x have their special codes
        nonzero = (f32_bits(x) & 0x7FFFFFFF) != 0
        code = code | (((code & 0x7F) == 0) & nonzero).to(tl.int32)
    elif not SR:
        code, s = block_mf_encode(sqrt_x, r24, 4, -14, 0x3FF00000, 0xFF, -1, False, 0)
    else:
        # SR keeping v unbiased (core's Q8SqrtCodec.encode): t holds the code lo below s and f24,
        # the first 24 bits of s's fraction of the way to the next code. With L = lo / spacing
        # (16 + mantissa, or a subnormal code's mantissa), E[q*q] = s*s takes P(up) =
        # f (2L + f) / (2L + 1): round up iff r24 (2L + 1) < 2L f24 + (f24 * f24 >> 24), both
        # sides below 2**30. The NaN code and the largest one (s is at most its value) have
        # f24 = 0 and never round up.
        t, s = block_mf_encode(sqrt_x, r24, 4, -14, 0x3FF00000, 0xFF, -1, False, 2)
        lo_code = (t >> 24) & 0xFF
        f24 = t & 0xFFFFFF
        two_l = ((lo_code & 15) | (tl.minimum(lo_code, 16) & 16)) << 1
        f28 = (f24 << 4).to(tl.uint32, bitcast=True)
        rhs = two_l * f24 + tl.umulhi(f28, f28).to(tl.int32, bitcast=True)
        up = r24 * two_l + r24 < rhs
        code = lo_code + up.to(tl.int32)
    if FMT == FMT_Q8SQRT:  # a positive v is never code 0 (core's Q8SqrtCodec._floored)
        code = code | ((code == 0) & (sqrt_x > 0)).to(tl.int32)
    return code, s


@triton.jit
def scale_factor(s):
    """``2**(s - 127)`` as fp32 for E8M0 scale bytes ``s`` in [0, 254] (int32): the exponent
    field is ``s`` except at 0, where a max puts the subnormal ``2**-127``."""
    return tl.maximum(s << 23, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def decode_blocked(c, s, FMT: tl.constexpr):
    """fp32 tile held by codes ``c`` and scale bytes ``s`` (int32, broadcastable) of ``FMT``."""
    sf = scale_factor(s)
    if FMT == FMT_E4M3:
        q = block_mf_decode(c, sf, 3, -6, 0x7E, -1)
    elif FMT == FMT_E5M2:
        q = block_mf_decode(c, sf, 2, -14, 0x7B, 0x7C)
    else:
        # the NaN code keeps the decoder's NaN pattern; other codes square to a number or inf
        q = mf_value(c, 4, -14) * sf
        q = bits_f32(tl.where(c == 0xFF, F32_QNAN, f32_bits(q * q)))
    return q


# ---------------------------------------------------------------------------------- moments I/O
@triton.jit
def scale_offsets(b0, ROWS: tl.constexpr):
    """Scale-byte offsets ``[ROWS]`` of a tile whose first block is ``b0`` (row ``r`` of the tile
    is block ``b0 + r``). A row's scale byte is loaded and stored once, as a 1-D tensor in the
    layout of the tile's rows (a row reduction's), and broadcast along the row: the codes keep a
    layout with several contiguous elements per thread, so their accesses stay vectorized."""
    return b0 + tl.arange(0, ROWS)


@triton.jit
def load_moment_raw(ptr, sptr, offs, soffs, rmask, amask, FMT: tl.constexpr):
    """The moment tile's stored words at element offsets ``offs`` ``[R, 32]`` (scale offsets
    ``soffs`` from :func:`scale_offsets`, row mask ``rmask`` ``[R]``), undecoded: ``(values or
    codes, scale bytes [R])`` for :func:`decode_moment`. A kernel that issues the next tile's
    loads before this tile's math decodes them only when it needs them, so nothing waits on the
    loads.

    ``ptr`` points at the field ``""`` (fp32, int16 for bf16, uint8 for the 8-bit codes) and
    ``sptr`` at the per-block ``uint8`` scales, both already offset to the chunk."""
    if FMT == FMT_FP32:
        c = tl.load(ptr + offs, mask=amask, other=0.0)
        s = 0
    elif FMT == FMT_BF16:
        c = tl.load(ptr + offs, mask=amask, other=0).to(tl.int32)
        s = 0
    else:
        c = tl.load(ptr + offs, mask=amask, other=0).to(tl.int32) & 0xFF
        s = tl.load(sptr + soffs, mask=rmask, other=0).to(tl.int32) & 0xFF
    return c, s


@triton.jit
def decode_moment(c, s, FMT: tl.constexpr):
    """fp32 moment tile from :func:`load_moment_raw`'s words; each row's scale byte is
    broadcast along the row."""
    if FMT == FMT_FP32:
        m = c
    elif FMT == FMT_BF16:
        m = bf16_widen(c)
    else:
        m = decode_blocked(c, s[:, None], FMT)
    return m


@triton.jit
def load_moment(ptr, sptr, offs, soffs, rmask, amask, FMT: tl.constexpr):
    """The decoded moment tile (:func:`load_moment_raw`, then :func:`decode_moment`)."""
    c, s = load_moment_raw(ptr, sptr, offs, soffs, rmask, amask, FMT)
    return decode_moment(c, s, FMT)


@triton.jit
def store_moment(
    m, ptr, sptr, offs, soffs, rmask, amask, r24, FMT: tl.constexpr, SR: tl.constexpr, sqrt_m
):
    """Encode tile ``m`` in format ``FMT`` and store it (see :func:`load_moment`), each block's
    scale byte once."""
    if FMT == FMT_FP32:
        tl.store(ptr + offs, m, mask=amask)
    elif FMT == FMT_BF16:
        tl.store(ptr + offs, bf16_round(f32_bits(m), r24, SR).to(tl.int16), mask=amask)
    else:
        code, s = encode_blocked(m, r24, FMT, SR, sqrt_m)
        tl.store(ptr + offs, code.to(tl.uint8), mask=amask)
        store_row_bytes(sptr + soffs, s, rmask, offs)


@triton.jit
def store_row_bytes(ptrs, vals, rmask, offs):
    """Store byte ``vals[r]`` (int32 ``[R]``) at ``ptrs[r]`` where ``rmask[r]``: a tile's scale
    bytes. On the GPU the thread holding a row's first element stores it, with inline PTX on the
    tile's own layout: ``tl.store`` of a 1-D tensor gets a layout of its own, and converting the
    bytes to it costs two barriers per store. ``offs`` only gives the tile's shape."""
    if INTERPRETED:
        tl.store(ptrs, vals.to(tl.uint8), mask=rmask)
    else:
        first = ((tl.arange(0, 32) == 0)[None, :] & rmask[:, None]).to(tl.int32)
        zero = tl.zeros_like(offs)
        tl.inline_asm_elementwise(
            asm="{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.global.u8 [$1], $2; mov.b32 $0, 0; }",
            constraints="=r,l,r,r",
            args=[ptrs.to(tl.int64, bitcast=True)[:, None] + zero, vals[:, None] + zero, first],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


# ---------------------------------------------------------------------------------- masters
@triton.jit
def decode_master(p, c, MASTER: tl.constexpr):
    """fp32 master from parameter bits ``p`` (fp32 values for MASTER_FP32, else int32 holding
    16-bit patterns) and code ``c`` (int32 holding the uint8 / int16 code; unused without one)."""
    if MASTER == MASTER_FP32:
        x = p
    elif MASTER == MASTER_BF16:
        x = bf16_widen(p)
    elif MASTER == MASTER_FP16:
        x = fp16_widen(p)
    else:
        # top16 - carry then the code below it: adding the code read as a signed byte (ECC-24)
        # or 16-bit value (ECC-32). The sum keeps top16's sign except where a +-0 parameter
        # meets a carrying code (no encode makes one): that decodes to the zero (KERNEL_API 6)
        top = p << 16
        if MASTER == MASTER_ECC24:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
            x = top + ((c << 24) >> 16)
        else:
            x = top + ((c << 16) >> 16)
        x = bits_f32(tl.where((x ^ top) < 0, top, x))
    return x


@triton.jit
def encode_master(x, r24, MASTER: tl.constexpr, SR: tl.constexpr):
    """``(param, code)`` of fp32 master ``x``: param as fp32 (MASTER_FP32) or an int32 16-bit
    pattern, code an int32 (uint8 / int16 range; 0 without a code)."""
    if MASTER == MASTER_FP32:
        p = x
        code = 0
    elif MASTER == MASTER_BF16:
        p = bf16_round(f32_bits(x), r24, SR)
        code = 0
    elif MASTER == MASTER_FP16:
        p = fp16_round(f32_bits(x), r24, SR)
        code = 0
    elif MASTER == MASTER_ECC24:
        u = f32_bits(x)
        sign = (u >> 31) & 1
        mag = u & 0x7FFFFFFF
        top24 = round_drop_bits(mag, 8, r24, SR)
        top24 = tl.where(mag < F32_INF, tl.minimum(top24, 0x7F7FFF), mag >> 8)
        top24 = tl.where(mag > F32_INF, (mag >> 8) | 0x4000, top24)  # NaN stays NaN
        top24 = (sign << 23) | top24
        # top16 + (mid8 >= 0x80) is one rounding addition; NaN keeps its top16
        p = tl.where(mag > F32_INF, top24 >> 8, (top24 + 0x80) >> 8)
        code = top24 & 0xFF
    else:
        u = f32_bits(x)
        top = (u >> 16) & 0xFFFF
        low = u & 0xFFFF
        p = top + (low >= 0x8000).to(tl.int32)
        p = tl.where((u & 0x7FFFFFFF) > F32_INF, top | 0x40, p)
        code = low
    return p, code


@triton.jit
def load_master_raw(pptr, cptr, offs, emask, amask, MASTER: tl.constexpr):
    """The master tile's stored words, undecoded (``(param, code)`` for :func:`decode_master`):
    parameters at ``pptr + offs`` (real elements; padding reads 0, as the torch backend's zero
    padding), codes at ``cptr + offs`` (whole blocks)."""
    if MASTER == MASTER_FP32:
        p = tl.load(pptr + offs, mask=emask, other=0.0)
        c = 0
    else:
        p = tl.load(pptr + offs, mask=emask, other=0).to(tl.int32)
        if MASTER == MASTER_ECC24 or MASTER == MASTER_ECC32:  # noqa: SIM109 (constexprs)
            c = tl.load(cptr + offs, mask=amask, other=0).to(tl.int32)
        else:
            c = 0
    return p, c


@triton.jit
def load_master(pptr, cptr, offs, emask, amask, MASTER: tl.constexpr):
    """The decoded master tile (:func:`load_master_raw`, then :func:`decode_master`)."""
    p, c = load_master_raw(pptr, cptr, offs, emask, amask, MASTER)
    return decode_master(p, c, MASTER)


@triton.jit
def store_master(x, pptr, cptr, offs, emask, amask, r24, MASTER: tl.constexpr, SR: tl.constexpr):
    """Encode tile ``x`` and store the parameters (real elements) and codes (whole blocks)."""
    p, code = encode_master(x, r24, MASTER, SR)
    if MASTER == MASTER_FP32:
        tl.store(pptr + offs, p, mask=emask)
    else:
        tl.store(pptr + offs, p.to(tl.int16), mask=emask)
        if MASTER == MASTER_ECC24:
            tl.store(cptr + offs, code.to(tl.uint8), mask=amask)
        elif MASTER == MASTER_ECC32:
            tl.store(cptr + offs, code.to(tl.int16), mask=amask)


@triton.jit
def load_grad_raw(gptr, gkind, start, offs, emask, MASTER: tl.constexpr, ALIGNED: tl.constexpr):
    """The gradient tile's stored words from int64 address ``gptr`` (elements ``start + offs``),
    undecoded (for :func:`grad_value`): fp32 values with an fp32 master (a 16-bit gradient
    widened here), else int32 holding the fp32 bits (``gkind`` 1, a float32 gradient) or the
    16-bit pattern (``gkind`` 0, the parameter's dtype). Padding reads 0. ``ALIGNED``: ``gptr``
    is a multiple of 16 bytes."""
    if MASTER == MASTER_FP32:
        g = load_grad_of_f32(gptr, gkind, start, offs, emask, ALIGNED)
    else:
        if gkind != 0:
            g = tl.load(typed_pointer(gptr, tl.int32, ALIGNED) + start + offs, mask=emask, other=0)
        else:
            g16 = tl.load(
                typed_pointer(gptr, tl.int16, ALIGNED) + start + offs, mask=emask, other=0
            )
            g = g16.to(tl.int32)
    return g


@triton.jit
def grad_value(g, gkind, MASTER: tl.constexpr):
    """fp32 gradient tile from :func:`load_grad_raw`'s words (16-bit patterns widened exactly)."""
    if MASTER == MASTER_FP32:
        out = g
    else:
        if gkind != 0:
            out = g.to(tl.float32, bitcast=True)
        else:
            out = fp16_widen(g) if MASTER == MASTER_FP16 else bf16_widen(g)
    return out


@triton.jit
def load_grad_of_f32(gptr, gkind, start, offs, emask, ALIGNED: tl.constexpr):
    """Gradient tile of a float32 parameter as fp32: ``gkind`` 1 = float32, 0 = bfloat16,
    2 = float16 (16-bit gradients widened exactly on the pattern, as core's backends take them).
    Padding reads 0."""
    if gkind == 1:
        g = tl.load(typed_pointer(gptr, tl.float32, ALIGNED) + start + offs, mask=emask, other=0.0)
    else:
        g16 = tl.load(typed_pointer(gptr, tl.int16, ALIGNED) + start + offs, mask=emask, other=0)
        if gkind == 2:  # noqa: SIM108 - one widening per branch, not both computed
            g = fp16_widen(g16.to(tl.int32))
        else:
            g = bf16_widen(g16.to(tl.int32))
    return g


@triton.jit
def load_grad(gptr, gkind, start, offs, emask, MASTER: tl.constexpr, ALIGNED: tl.constexpr):
    """Gradient tile as fp32 from int64 address ``gptr`` (elements ``start + offs``): ``gkind`` 1 =
    float32 gradient, 0 = the parameter's 16-bit dtype (widened exactly on the pattern; beside a
    float32 parameter: :func:`load_grad_of_f32`). Padding reads 0. Not :func:`load_grad_raw`
    then :func:`grad_value`: one branch on ``gkind`` instead of two, which the blocked formats'
    kernels (loading in place) feel."""
    if MASTER == MASTER_FP32:
        g = load_grad_of_f32(gptr, gkind, start, offs, emask, ALIGNED)
    else:
        if gkind != 0:
            g = tl.load(
                typed_pointer(gptr, tl.float32, ALIGNED) + start + offs, mask=emask, other=0.0
            )
        else:
            g16 = tl.load(
                typed_pointer(gptr, tl.int16, ALIGNED) + start + offs, mask=emask, other=0
            )
            if MASTER == MASTER_FP16:
                g = fp16_widen(g16.to(tl.int32))
            else:
                g = bf16_widen(g16.to(tl.int32))
    return g


@triton.jit
def typed_pointer(addr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The int64 address ``addr`` as a pointer to ``DTYPE``; with ``ALIGNED`` (the launcher checked
    that it is a multiple of 16 bytes) marked so, which lets Triton vectorize accesses through it
    (the mark has to be on the pointer: Triton drops it across the integer-to-pointer cast)."""
    p = addr.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def param_pointer(pptr, MASTER: tl.constexpr, ALIGNED: tl.constexpr):
    """The int64 parameter address as a typed pointer (fp32, else 16-bit patterns)."""
    if MASTER == MASTER_FP32:
        return typed_pointer(pptr, tl.float32, ALIGNED)
    else:
        return typed_pointer(pptr, tl.int16, ALIGNED)
