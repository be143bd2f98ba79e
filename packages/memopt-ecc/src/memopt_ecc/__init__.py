"""memopt-ecc: FlashOptim-compatible optimizers with ECC master weights and 8-bit states.

- :class:`FlashSGD`, :class:`FlashSGDW`, :class:`FlashAdam`, :class:`FlashAdamW`,
  :class:`FlashLion`: :class:`memopt_core.MemOptimizer` subclasses with FlashOptim's constructor
  (``quantize``, ``master_weight_bits``, ``compress_state_dict``, ``check_numerics``, ``fused``,
  ``decouple_lr``) plus the keyword-only ``stochastic_rounding`` (default True), ``seed`` and
  ``capturable`` (device-resident step counts for CUDA-graph capture).
- :func:`cast_model`: bf16 models with chosen layers (and BatchNorm statistics) kept in fp32.
- :func:`enable_gradient_release`: update parameters during ``backward`` (GradScaler supported).
- :func:`get_fp32_model_state_dict` / :func:`set_fp32_model_state_dict`: fp32 weights out of
  (into) bf16 parameters plus ECC codes; also methods of every Flash* optimizer.
"""

from __future__ import annotations

from memopt_core.errors import NumericsError
from memopt_core.fp32_state import (
    fp32_master,
    get_fp32_model_state_dict,
    set_fp32_model_state_dict,
)
from memopt_ecc.cast import cast_model
from memopt_ecc.gradient_release import GradientReleaseHandle, enable_gradient_release
from memopt_ecc.optimizers import (
    MASTER_WEIGHT_BITS,
    FlashAdam,
    FlashAdamW,
    FlashLion,
    FlashOptimizer,
    FlashSGD,
    FlashSGDW,
    master_resolution,
    significant_bits,
)

__version__ = "0.1.0"

__all__ = [
    "MASTER_WEIGHT_BITS",
    "FlashAdam",
    "FlashAdamW",
    "FlashLion",
    "FlashOptimizer",
    "FlashSGD",
    "FlashSGDW",
    "GradientReleaseHandle",
    "NumericsError",
    "__version__",
    "cast_model",
    "enable_gradient_release",
    "fp32_master",
    "get_fp32_model_state_dict",
    "master_resolution",
    "set_fp32_model_state_dict",
    "significant_bits",
]
