"""Master-weight formats: ``fp32``, ``none``, ``ecc24`` and ``ecc32`` (see docs/formats.md)."""

from __future__ import annotations

import torch
from torch import Tensor

from memopt_core.formats import bits
from memopt_core.formats.base import MasterCodec

__all__ = ["Ecc24Master", "Ecc32Master", "Fp32Master", "LowPrecisionMaster"]


class Fp32Master(MasterCodec):
    """An fp32 parameter is its own master weight: no code, 0 extra bytes."""

    name = "fp32"
    param_dtype = torch.float32
    code_dtype = None

    def encode(self, x: Tensor, *, rand: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return bits.require_f32(x), None

    def decode(self, param: Tensor, code: Tensor | None) -> Tensor:
        self.check_decode(param, code)
        return param.to(torch.float32)


class LowPrecisionMaster(MasterCodec):
    """Master format ``none``: the bf16/fp16 parameter is the weight; no code, 0 extra bytes.

    ``encode`` rounds fp32 to the parameter dtype by integer arithmetic on the bit pattern: to
    nearest even (equal to torch's cast) or stochastically with ``rand`` (the shared rule).
    Overflow goes to inf as in the cast; NaN stays NaN.
    """

    name = "none"
    code_dtype = None

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            from memopt_core.errors import ConfigError

            raise ConfigError(
                f"master format 'none' is for bfloat16/float16 parameters; got {dtype}"
            )
        self.param_dtype = dtype

    def encode(self, x: Tensor, *, rand: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        u = bits.f32_to_bits(x)
        if self.param_dtype == torch.bfloat16:
            return bits.bits_to_int16(bits.bf16_round(u, rand)).view(torch.bfloat16), None
        return bits.bits_to_int16(_fp16_round(u, rand)).view(torch.float16), None

    def decode(self, param: Tensor, code: Tensor | None) -> Tensor:
        self.check_decode(param, code)
        # exact widening on the pattern (NaN payloads identical on every device)
        p = bits.int16_to_bits(param)
        if self.param_dtype == torch.bfloat16:
            return bits.bits_to_f32(p << 16)
        return bits.bits_to_f32(_fp16_widen(p))


def _fp16_round(u: Tensor, rand: Tensor | None) -> Tensor:
    # IEEE binary16: 10 mantissa bits, emin -14, inf 0x7C00; overflow -> inf, NaN -> quiet NaN.
    sign = u >> 31
    mag = u & 0x7FFFFFFF
    finite = mag < bits.F32_INF
    code = bits.minifloat_encode(torch.where(finite, mag, 0), 0, 10, -14, rand)
    code = torch.clamp(code, max=0x7C00)
    code = torch.where(finite, code, torch.where(mag == bits.F32_INF, 0x7C00, 0x7E00))
    return (sign << 15) | code


def _fp16_widen(p: Tensor) -> Tensor:
    # fp16 pattern -> fp32 pattern: exact values; inf -> inf; NaN -> quiet NaN keeping the payload
    mag = p & 0x7FFF
    out = bits.minifloat_decode(torch.clamp(mag, max=0x7BFF), 0, 10, -14)
    out = torch.where(mag >= 0x7C00, bits.F32_INF | ((mag & 0x3FF) << 13), out)
    out = torch.where(mag > 0x7C00, out | 0x400000, out)
    return out | ((p >> 15) << 31)


class Ecc32Master(MasterCodec):
    """Master format ``ecc32``: bf16 parameter + int16 code, exact for every finite fp32 weight.

    With ``x``'s pattern ``top16 | low16`` (sign-magnitude), ``param = top16 + (low16 >= 0x8000)``
    (round to nearest, ties away from zero: RNE except on exact ties) and ``code = low16``
    (two's-complement int16 view). Decoding undoes the carry: ``top16 = param - (code >= 0x8000)``.
    Exactly 65536 fp32 patterns share each parameter value, so the 16-bit code is a bijection
    (with ties to even, an even bf16 value would be the nearest of 65537 inputs). NaN decodes to
    NaN (payload not kept); ``rand`` is ignored (the split is exact).

    No encode pairs a ``+-0`` parameter with a carrying code (``>= 0x8000``); such a pair, left
    when a weight is set to zero in place after its code was written (``nn.init.zeros_``),
    decodes to that zero (KERNEL_API 6), not to the NaN pattern the borrow would give.
    """

    name = "ecc32"
    param_dtype = torch.bfloat16
    code_dtype = torch.int16

    def encode(self, x: Tensor, *, rand: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        u = bits.f32_to_bits(x)
        top, low = u >> 16, u & 0xFFFF
        param = top + (low >= 0x8000).to(torch.int64)
        param = torch.where(
            (u & 0x7FFFFFFF) > bits.F32_INF, top | 0x40, param
        )  # NaN: quiet, no carry
        return bits.bits_to_int16(param).view(torch.bfloat16), bits.bits_to_int16(low)

    def decode(self, param: Tensor, code: Tensor | None) -> Tensor:
        self.check_decode(param, code)
        assert code is not None  # check_decode refuses None: this format has a code
        # shaped like the parameter: a (n,) code beside a (n, 1) parameter broadcast to (n, n)
        p, c = bits.int16_to_bits(param), bits.int16_to_bits(code.reshape(param.shape))
        c = _without_stale_carry(p, c, 0x8000)
        top = p - (c >= 0x8000).to(torch.int64)
        return bits.bits_to_f32((top << 16) | c)


class Ecc24Master(MasterCodec):
    """Master format ``ecc24``: bf16 parameter + uint8 code holding a 24-bit master pattern.

    ``x``'s pattern is first rounded to its top 24 bits (drop the low 8: nearest-even on the
    pattern, or SR with ``frac24 = low8 << 16``), saturating at the largest finite pattern rather
    than turning a finite ``x`` into inf; then ``top24 = top16 | mid8`` is split like ECC-32:
    ``param = top16 + (mid8 >= 0x80)``, ``code = mid8``. Decoded value: 16 significant bits,
    relative error <= 2**-16 for normal ``x`` (RNE; SR: < 2**-15 and unbiased). A ``+-0``
    parameter with a carrying code (``>= 0x80``) decodes to that zero, as in ECC-32.
    """

    name = "ecc24"
    param_dtype = torch.bfloat16
    code_dtype = torch.uint8

    def encode(self, x: Tensor, *, rand: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        u = bits.f32_to_bits(x)
        sign, mag = u >> 31, u & 0x7FFFFFFF
        top24 = bits.round_drop_bits(mag, 8, rand)
        top24 = torch.where(mag < bits.F32_INF, torch.clamp(top24, max=0x7F7FFF), mag >> 8)
        top24 = torch.where(mag > bits.F32_INF, (mag >> 8) | 0x4000, top24)  # NaN stays NaN
        top24 = (sign << 23) | top24
        top, mid = top24 >> 8, top24 & 0xFF
        param = top + (mid >= 0x80).to(torch.int64)
        param = torch.where(mag > bits.F32_INF, top, param)
        return bits.bits_to_int16(param).view(torch.bfloat16), mid.to(torch.uint8)

    def decode(self, param: Tensor, code: Tensor | None) -> Tensor:
        self.check_decode(param, code)
        assert code is not None  # check_decode refuses None: this format has a code
        p = bits.int16_to_bits(param)
        c = _without_stale_carry(p, code.reshape(param.shape).to(torch.int64), 0x80)
        top = p - (c >= 0x80).to(torch.int64)
        return bits.bits_to_f32((top << 16) | (c << 8))


def _without_stale_carry(p: Tensor, c: Tensor, carry: int) -> Tensor:
    """Code ``c`` (a 16-bit or 8-bit pattern), or 0 where parameter pattern ``p`` is ``+-0`` and
    ``c`` carries: encodes never pair them (a carry rounds the parameter's magnitude up), and
    undoing the carry of a zero would borrow through the sign into a NaN pattern."""
    return torch.where(((p & 0x7FFF) == 0) & (c >= carry), 0, c)
