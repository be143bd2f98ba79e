"""Block-scaled 8-bit float moments: ``fp8_e4m3`` and ``fp8_e5m2`` (see docs/formats.md).

Layout (like OCP microscaling, MX): blocks of 32 elements; field ``""`` holds one 8-bit float code
per element (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``), field ``"scale"`` one ``uint8`` per
block, an E8M0 exponent ``s`` meaning ``2**(s - 127)``. Stored value = code value * 2**(s - 127).
1 + 1/32 = 1.03125 B/element.

Scale: the smallest ``k`` in [-127, 127] with ``max finite |x| * 2**-k <= fmax`` (448 or 57344); an
all-zero block gets ``k = -127``. Elements are ``x * 2**-k`` (an exponent shift: exact) rounded once
to the 8-bit grid, to nearest even or stochastically. Non-finite elements do not take part in the
block maximum and are stored on their own: NaN as NaN, inf as inf where the format has inf (e5m2),
else as NaN (e4m3fn); the rest of the block is encoded exactly as if they were zero.

``fp8_e5m2``, the second-moment format of the ``fp8`` preset, never stores a finite non-zero
element as zero: where it rounds to code 0 (more than 2**16 below the block's largest element,
2**-16 of the grid's top), it gets the smallest code of its sign instead (KERNEL_API 5). A second
moment flushed to 0 beside a first moment that is not made Adam's step for that element about
8x fp32's (docs/formats.md, "Limits"); stored as the smallest code, it is smaller than fp32's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from memopt_core.formats import bits
from memopt_core.formats.base import FieldSpec, MomentCodec

__all__ = ["BLOCK_SIZE", "BlockFp8Codec", "BlockMinifloatCodec"]

BLOCK_SIZE = 32
SCALE_BIAS = 127


class BlockMinifloatCodec(MomentCodec):
    """An 8-bit minifloat with a per-block E8M0 scale: the machinery shared by fp8 and q8.

    Subclasses set the grid (``man_bits``, ``emin``: smallest normal exponent, subnormals below),
    ``fmax_bits`` (fp32 pattern of the largest finite value), the codes ``max_code``, ``nan_code``,
    ``inf_code`` (None: inf is stored as NaN), ``sign_bit`` (0 for an unsigned code) and the
    storage dtype of field ``""``.
    """

    block_size = BLOCK_SIZE
    man_bits: int
    emin: int
    fmax_bits: int
    max_code: int
    nan_code: int
    inf_code: int | None
    sign_bit: int
    code_dtype: torch.dtype
    #: a finite non-zero element that rounds to code 0 gets magnitude code 1 (fp8_e5m2)
    keeps_nonzero: bool = False

    def _encode_codes(self, x: Tensor, rand: Tensor | None) -> dict[str, Tensor]:
        self.check_length(x.numel())
        u = bits.f32_to_bits(x.reshape(-1))
        mag = u & 0x7FFFFFFF
        finite = mag < bits.F32_INF
        magf = torch.where(finite, mag, 0)
        k = bits.pow2_block_exponent(magf.view(-1, BLOCK_SIZE).amax(1), self.fmax_bits)
        kk = k.repeat_interleave(BLOCK_SIZE)
        code = bits.minifloat_encode(magf, kk, self.man_bits, self.emin, rand)
        code = torch.clamp(code, max=self.max_code)  # only reachable when k is clamped at 127
        if self.keeps_nonzero:
            code = torch.where((code == 0) & (magf > 0), 1, code)
        special = (
            self.nan_code
            if self.inf_code is None
            else torch.where(mag == bits.F32_INF, self.inf_code, self.nan_code)
        )
        code = torch.where(finite, code, special)
        if self.sign_bit:
            code = code | ((u >> 31) * self.sign_bit)
        stored = code.to(torch.uint8)
        if self.code_dtype != torch.uint8:
            stored = stored.view(self.code_dtype)
        return {"": stored.view(x.shape), "scale": (k + SCALE_BIAS).to(torch.uint8)}

    def _decode_codes(self, fields: dict[str, Tensor]) -> Tensor:
        codes = fields[""]
        c = codes.reshape(-1).view(torch.uint8).to(torch.int64)
        self.check_length(c.numel())
        k = (fields["scale"].to(torch.int64) - SCALE_BIAS).repeat_interleave(BLOCK_SIZE)
        mag = c & (self.sign_bit - 1) if self.sign_bit else c
        out = bits.minifloat_decode(
            torch.clamp(mag, max=self.max_code), k, self.man_bits, self.emin
        )
        if self.inf_code is not None:
            out = torch.where(mag == self.inf_code, bits.F32_INF, out)
            out = torch.where(mag > self.inf_code, 0x7FC00000, out)
        else:
            out = torch.where(mag > self.max_code, 0x7FC00000, out)
        # the scale byte 255, which no encoder writes, decodes as the kernels decode it: their
        # fp32 factor 2**(255 - 127) is inf, so code 0 gives NaN and every other finite code inf
        special = torch.where(mag == 0, 0x7FC00000, bits.F32_INF)
        out = torch.where((k == 255 - SCALE_BIAS) & (mag <= self.max_code), special, out)
        if self.sign_bit:
            out = out | ((c >> 7) << 31)
        return bits.bits_to_f32(out).view(codes.shape)

    def encode(self, x: Tensor, *, rand: Tensor | None = None) -> dict[str, Tensor]:
        return self._encode_codes(x, rand)

    def decode(self, fields: dict[str, Tensor]) -> Tensor:
        self.check_fields(fields)
        return self._decode_codes(fields)


class BlockFp8Codec(BlockMinifloatCodec):
    """fp8 moments with per-block E8M0 scales: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``."""

    sign_bit = 0x80

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype == torch.float8_e4m3fn:
            # e4m3fn: bias 7, no inf, 0x7F = NaN, largest 0x7E = 448
            self.name, self.man_bits, self.emin = "fp8_e4m3", 3, -6
            self.fmax_bits, self.max_code, self.nan_code, self.inf_code = (
                0x43E00000,
                0x7E,
                0x7F,
                None,
            )
        elif dtype == torch.float8_e5m2:
            # e5m2: IEEE-like, bias 15, 0x7C = inf, 0x7D..0x7F = NaN, largest 0x7B = 57344
            self.name, self.man_bits, self.emin = "fp8_e5m2", 2, -14
            self.keeps_nonzero = True  # second moments: see the module docstring
            self.fmax_bits, self.max_code, self.nan_code, self.inf_code = (
                0x47600000,
                0x7B,
                0x7E,
                0x7C,
            )
        else:
            from memopt_core.errors import ConfigError

            raise ConfigError(f"block fp8 moments are float8_e4m3fn or float8_e5m2, got {dtype}")
        self.code_dtype = dtype
        self.fields = {"": FieldSpec(dtype), "scale": FieldSpec(torch.uint8, per_block=True)}
