"""Unblocked float moment formats: ``fp32`` (4 B/element) and ``bf16`` (2 B/element)."""

from __future__ import annotations

import torch
from torch import Tensor

from memopt_core.formats.base import FieldSpec, MomentCodec
from memopt_core.formats.bits import (
    bf16_round,
    bits_to_f32,
    bits_to_int16,
    f32_to_bits,
    int16_to_bits,
    require_f32,
)

__all__ = ["Bf16Codec", "Fp32Codec"]


class Fp32Codec(MomentCodec):
    """fp32 moments, stored as they are (4 B/element, exact)."""

    name = "fp32"
    fields = {"": FieldSpec(torch.float32)}  # noqa: RUF012

    def encode(self, x: Tensor, *, rand: Tensor | None = None) -> dict[str, Tensor]:
        return {"": require_f32(x)}

    def decode(self, fields: dict[str, Tensor]) -> Tensor:
        self.check_fields(fields)
        return fields[""]


class Bf16Codec(MomentCodec):
    """bf16 moments (2 B/element): round to nearest even, or stochastically with ``rand``."""

    name = "bf16"
    fields = {"": FieldSpec(torch.bfloat16)}  # noqa: RUF012

    def encode(self, x: Tensor, *, rand: Tensor | None = None) -> dict[str, Tensor]:
        # Integer rounding of the fp32 pattern (bits.bf16_round): RNE equals torch's cast on every
        # device, SR follows the shared rule with frac24 = (low 16 bits) << 8.
        return {"": bits_to_int16(bf16_round(f32_to_bits(x), rand)).view(torch.bfloat16)}

    def decode(self, fields: dict[str, Tensor]) -> Tensor:
        self.check_fields(fields)
        return bits_to_f32(int16_to_bits(fields[""]) << 16)  # exact widening, on the pattern
