"""memopt: memory-efficient PyTorch optimizers, the whole stack behind one import.

Names are re-exported lazily from the component packages, so ``import memopt`` stays cheap and a
name whose package is not installed raises an ImportError that says which package to install.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> (module that defines it, distribution that ships the module)
_EXPORTS: dict[str, tuple[str, str]] = {
    "MemOptimizer": ("memopt_core.optimizer", "memopt-core"),
    "StateSpec": ("memopt_core.formats", "memopt-core"),
    "MemoptError": ("memopt_core.errors", "memopt-core"),
    "ConfigError": ("memopt_core.errors", "memopt-core"),
    "FormatError": ("memopt_core.errors", "memopt-core"),
    "NumericsError": ("memopt_core.errors", "memopt-core"),
    "StateDictError": ("memopt_core.errors", "memopt-core"),
    "BackendUnavailableError": ("memopt_core.errors", "memopt-core"),
    "CheckpointError": ("memopt_core.errors", "memopt-core"),
    "FlashSGD": ("memopt_ecc", "memopt-ecc"),
    "FlashSGDW": ("memopt_ecc", "memopt-ecc"),
    "FlashAdam": ("memopt_ecc", "memopt-ecc"),
    "FlashAdamW": ("memopt_ecc", "memopt-ecc"),
    "FlashLion": ("memopt_ecc", "memopt-ecc"),
    "cast_model": ("memopt_ecc", "memopt-ecc"),
    "enable_gradient_release": ("memopt_ecc", "memopt-ecc"),
    "get_fp32_model_state_dict": ("memopt_ecc", "memopt-ecc"),
    "set_fp32_model_state_dict": ("memopt_ecc", "memopt-ecc"),
    "AdamBridge": ("memopt_offload", "memopt-offload"),
    "ApexW": ("memopt_apexw", "memopt-apexw"),
    "OffloadError": ("memopt_core.errors", "memopt-core"),
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name == "checkpoint":  # the submodule, on first use (``memopt.checkpoint.save``)
        try:
            return importlib.import_module("memopt.checkpoint")
        except ImportError as exc:
            raise ImportError(
                "memopt.checkpoint needs the memopt-checkpoint package: pip install memopt-checkpoint"
            ) from exc
    if name not in _EXPORTS:
        raise AttributeError(f"module 'memopt' has no attribute {name!r}")
    module, dist = _EXPORTS[name]
    try:
        value = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ImportError(f"memopt.{name} needs the {dist} package: pip install {dist}") from exc
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
