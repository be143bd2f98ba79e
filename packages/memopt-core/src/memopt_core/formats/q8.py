"""q8 moments: ``q8_signed`` (first moments) and ``q8_sqrt`` (second moments), 8 bits + a
per-block E8M0 scale each, 2.0625 B/param for both moments together (see docs/formats.md).

``q8_signed`` is block-scaled fp8 e4m3 (exactly ``fp8_e4m3``'s layout and rounding).

``q8_sqrt`` stores ``s = sqrt(v)`` (correctly rounded) in an unsigned minifloat "e4m4": 4 exponent
bits (bias 15), 4 mantissa bits, subnormals at exponent field 0, ``0xFF`` = NaN, largest finite
``0xFE`` = 1.875; per block of 32 an E8M0 scale chosen from the block's largest finite ``s``.
Decoding squares the decoded ``q`` (one correctly rounded multiply). sqrt companding halves the
dynamic range a block must span: a 1000x gradient outlier is 1e6x in ``v`` but only 1000x in
``s``, so its neighbours keep 5 significant bits instead of flushing to zero. Because
``sqrt(RN(q*q)) == q`` in IEEE arithmetic, Adam's ``sqrt(v)`` recovers ``q`` exactly.

Stochastic rounding picks one of the two codes around ``s`` with the probability that keeps
``v`` unbiased (``E[q*q] = s*s``, ``v`` up to the square root's rounding), not ``s``: rounding
``s`` unbiasedly would bias ``v`` upwards by ``Var(q)``, about +1% over a long Adam run
(tests/test_long_run.py).

A positive ``v`` is never stored as code 0 (RNE or SR): below the smallest positive code it gets
that code (``v`` biased upwards there; the step smaller, never larger, than fp32's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from memopt_core.formats.base import FieldSpec
from memopt_core.formats.bits import sr_round_up
from memopt_core.formats.block_fp8 import BlockFp8Codec, BlockMinifloatCodec
from memopt_core.reference import correctly_rounded_sqrt

__all__ = ["Q8SignedCodec", "Q8SqrtCodec"]


class Q8SignedCodec(BlockFp8Codec):
    """First moments: fp8 e4m3 codes with per-block E8M0 scales (identical to ``fp8_e4m3``)."""

    def __init__(self) -> None:
        super().__init__(torch.float8_e4m3fn)
        self.name = "q8_signed"


class Q8SqrtCodec(BlockMinifloatCodec):
    """Second moments: ``sqrt(v)`` as unsigned e4m4 codes (``uint8``) with per-block E8M0 scales."""

    name = "q8_sqrt"
    signed = False
    man_bits, emin = 4, -14  # bias 15: exponent fields 1..15 are 2**-14 .. 2**0
    fmax_bits, max_code, nan_code, inf_code = 0x3FF00000, 0xFE, 0xFF, None  # 1.875
    sign_bit = 0
    code_dtype = torch.uint8
    fields = {"": FieldSpec(torch.uint8), "scale": FieldSpec(torch.uint8, per_block=True)}  # noqa: RUF012

    def encode(self, x: Tensor, *, rand: Tensor | None = None) -> dict[str, Tensor]:
        if x.dtype != torch.float32:
            return self._encode_codes(x, rand)  # raises the FormatError of f32_to_bits
        # sqrt(-0) = -0 is stored as 0; a negative v gives NaN (stored as the NaN code)
        s = correctly_rounded_sqrt(x)
        if rand is None:
            return self._floored(self._encode_codes(s, None), s)  # nearest even on s's grid
        # SR chooses between the neighbouring codes lo <= s <= hi with the probability that keeps
        # the decoded v unbiased, E[q*q] = s*s: with L = lo / (hi - lo) (an integer) and f24 the
        # first 24 bits of s's fraction of the way from lo to hi, the shared rule with
        # frac24 = ceil((2L * f24 + (f24 * f24 >> 24)) / (2L + 1)), exact integer arithmetic
        # (KERNEL_API 7; see docs/formats.md).
        lo_fields = self._encode_codes(
            s, torch.full(s.shape, 0xFFFFFFFF, dtype=torch.int64, device=s.device)
        )
        lo_code = lo_fields[""].to(torch.int64).reshape(-1)
        hi_code = torch.clamp(lo_code + 1, max=self.max_code)
        both = self._decode_codes(
            {  # lo and hi in one pass
                "": torch.cat([lo_code.to(torch.uint8), hi_code.to(torch.uint8)]),
                "scale": lo_fields["scale"].repeat(2),
            }
        ).double()
        lo, hi = both[: x.numel()], both[x.numel() :]
        # exact in fp64: s - lo and the spacing hi - lo (a power of two) of fp32 values
        span = hi - lo
        frac = (s.reshape(-1).double() - lo) / torch.where(span > 0, span, 1.0)
        # the NaN code (span NaN) and the largest (span 0) never round up
        f24 = torch.where(span > 0, torch.floor(frac * 2.0**24), 0.0).to(torch.int64)
        two_l = 2 * torch.where(lo_code >= 16, 16 + (lo_code & 15), lo_code)
        frac24 = (two_l * f24 + ((f24 * f24) >> 24) + two_l) // (two_l + 1)  # the ceiling
        code = lo_code.view(x.shape) + sr_round_up(frac24.view(x.shape), rand).to(torch.int64)
        return self._floored({"": code.to(torch.uint8), "scale": lo_fields["scale"]}, s)

    @staticmethod
    def _floored(fields: dict[str, Tensor], s: Tensor) -> dict[str, Tensor]:
        """A positive ``v`` whose code rounded to 0 gets code 1, the smallest positive one: a
        second moment stored as 0 next to a first moment that is not would make Adam's step
        ``m / (sqrt(v) + eps)`` far too large (in a block whose largest ``s`` is 2**18 times
        larger, see docs/formats.md, "Limits"); stored as the smallest code, the step is
        smaller than fp32's instead."""
        code = fields[""]
        fields[""] = torch.where((code == 0) & (s > 0), torch.ones_like(code), code)
        return fields

    def decode(self, fields: dict[str, Tensor]) -> Tensor:
        self.check_fields(fields)
        q = self._decode_codes(fields)
        # NaN codes keep the decoder's NaN pattern (a NaN product's bits differ between devices)
        return torch.where(torch.isnan(q), q, q * q)
