"""State formats: bit layouts and pure-torch reference codecs (see ``docs/formats.md``).

Moment formats (``moment_codec(name)``): ``fp32``, ``bf16``, ``fp8_e4m3``, ``fp8_e5m2``,
``q8_signed`` (first moments) and ``q8_sqrt`` (second moments). Master formats
(``master_codec(name, param_dtype)``): ``fp32`` (the fp32 parameter is the master), ``none`` (a
bf16/fp16 parameter updated directly), ``ecc24`` and ``ecc32`` (bf16 parameter + 8/16-bit code).

A :class:`StateSpec` names one master format and one moment preset (``fp32``, ``bf16``, ``fp8``,
``q8``) and says whether rounding is stochastic.
"""

from __future__ import annotations

from memopt_core.formats.base import FieldSpec, MasterCodec, MomentCodec
from memopt_core.formats.registry import (
    DECAY_NORMALIZED_PRESETS,
    MASTER_FORMATS,
    MOMENT_FORMATS,
    MOMENT_PRESETS,
    StateSpec,
    master_codec,
    moment_codec,
)

__all__ = [
    "DECAY_NORMALIZED_PRESETS",
    "MASTER_FORMATS",
    "MOMENT_FORMATS",
    "MOMENT_PRESETS",
    "FieldSpec",
    "MasterCodec",
    "MomentCodec",
    "StateSpec",
    "master_codec",
    "moment_codec",
]
