"""Name -> codec lookup and :class:`StateSpec`, the format choice of one optimizer group."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from memopt_core.errors import ConfigError
from memopt_core.formats.base import MasterCodec, MomentCodec

__all__ = [
    "MASTER_FORMATS",
    "MOMENT_FORMATS",
    "MOMENT_PRESETS",
    "StateSpec",
    "master_codec",
    "moment_codec",
]

MOMENT_FORMATS = ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "q8_signed", "q8_sqrt")
MASTER_FORMATS = ("fp32", "none", "ecc24", "ecc32")
#: preset -> (first-moment format, second-moment format)
MOMENT_PRESETS: dict[str, tuple[str, str]] = {
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "bf16"),
    "fp8": ("fp8_e4m3", "fp8_e5m2"),
    "q8": ("q8_signed", "q8_sqrt"),
}


def moment_codec(name: str) -> MomentCodec:
    """The moment codec called ``name`` (one of :data:`MOMENT_FORMATS`)."""
    if not isinstance(name, str):  # the cache below would raise "unhashable type: 'list'"
        raise ConfigError(f"a moment format is one of {MOMENT_FORMATS}, got {name!r}")
    return _moment_codec(name)


@cache
def _moment_codec(name: str) -> MomentCodec:
    if name not in MOMENT_FORMATS:
        raise ConfigError(f"unknown moment format {name!r}; choose one of {MOMENT_FORMATS}")
    if name in ("fp32", "bf16"):
        from memopt_core.formats import float_moments

        return float_moments.Fp32Codec() if name == "fp32" else float_moments.Bf16Codec()
    if name.startswith("fp8_"):
        from memopt_core.formats import block_fp8

        dtype = torch.float8_e4m3fn if name == "fp8_e4m3" else torch.float8_e5m2
        return block_fp8.BlockFp8Codec(dtype)
    from memopt_core.formats import q8

    return q8.Q8SignedCodec() if name == "q8_signed" else q8.Q8SqrtCodec()


def master_codec(name: str, param_dtype: torch.dtype) -> MasterCodec:
    """The master codec ``name`` (one of :data:`MASTER_FORMATS`) for parameters of ``param_dtype``."""
    if not isinstance(name, str):
        raise ConfigError(f"a master format is one of {MASTER_FORMATS}, got {name!r}")
    if not isinstance(param_dtype, torch.dtype):  # 'bfloat16' read "got bfloat16: cast to bfloat16"
        raise ConfigError(
            f"param_dtype must be a torch.dtype (torch.bfloat16, not 'bfloat16'), got {param_dtype!r}"
        )
    return _master_codec(name, param_dtype)


@cache
def _master_codec(name: str, param_dtype: torch.dtype) -> MasterCodec:
    from memopt_core.formats import ecc

    if name not in MASTER_FORMATS:
        raise ConfigError(f"unknown master format {name!r}; choose one of {MASTER_FORMATS}")
    if name == "fp32":
        if param_dtype != torch.float32:
            raise ConfigError(
                f"master format 'fp32' updates float32 parameters in place; got {param_dtype}: "
                "use 'ecc24', 'ecc32' or 'none' for bfloat16 parameters"
            )
        return ecc.Fp32Master()
    if name == "none":
        if param_dtype not in (torch.bfloat16, torch.float16):
            raise ConfigError(
                f"master format 'none' is for bfloat16/float16 parameters; got {param_dtype}"
            )
        return ecc.LowPrecisionMaster(param_dtype)
    if param_dtype != torch.bfloat16:
        raise ConfigError(
            f"master format {name!r} splits fp32 into a bfloat16 parameter plus a code; got "
            f"{param_dtype} parameters: cast them to bfloat16 (memopt_ecc.cast_model), or keep "
            "them without a split master: float32 parameters, or no master (MemOptimizer: "
            "master='none'; memopt_ecc: master_weight_bits=None; ApexW has none)"
        )
    return ecc.Ecc24Master() if name == "ecc24" else ecc.Ecc32Master()


#: moment presets whose second moments are stored divided by their decay (StateSpec.decay_normalized)
DECAY_NORMALIZED_PRESETS = frozenset({"fp8", "q8"})


@dataclass(frozen=True)
class StateSpec:
    """The formats of one optimizer group: a master format, a moment preset, the rounding mode."""

    master: str = "fp32"
    moments: str = "fp32"
    stochastic_rounding: bool = True

    def __post_init__(self) -> None:
        if self.master not in MASTER_FORMATS:
            raise ConfigError(
                f"unknown master format {self.master!r}; choose one of {MASTER_FORMATS}"
            )
        if self.moments not in MOMENT_PRESETS:
            raise ConfigError(
                f"unknown moment format {self.moments!r}; choose one of {tuple(MOMENT_PRESETS)}"
            )

    @property
    def first(self) -> MomentCodec:
        """Codec of first moments (Adam's exp_avg, Lion's exp_avg, SGD's momentum_buffer)."""
        return moment_codec(MOMENT_PRESETS[self.moments][0])

    @property
    def second(self) -> MomentCodec:
        """Codec of second moments (Adam's exp_avg_sq)."""
        return moment_codec(MOMENT_PRESETS[self.moments][1])

    @property
    def decay_normalized(self) -> bool:
        """Whether Adam's second moments are stored divided by their decay, ``u = v / N``
        (``memopt_core.reference.decay_norm``): the 8-bit presets ``fp8`` and ``q8``, whose
        re-rounding of a decaying ``v`` at every step would random-walk (docs/formats.md)."""
        return self.moments in DECAY_NORMALIZED_PRESETS

    @property
    def block_size(self) -> int:
        """Padding unit of this spec's state arena (the largest block of its moment codecs)."""
        return max(self.first.block_size, self.second.block_size)

    def master_for(self, param_dtype: torch.dtype) -> MasterCodec:
        """The codec of this spec's master format for ``param_dtype`` parameters
        (:func:`master_codec`: ``ConfigError`` where the format does not fit the dtype)."""
        return master_codec(self.master, param_dtype)
