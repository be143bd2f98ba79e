"""memopt: memory-efficient PyTorch optimizers, the whole stack behind one import.

Names are re-exported lazily from the component packages, so ``import memopt`` stays cheap and a
name whose package is not installed raises an ImportError that says which package to install
(``hasattr`` too: it only catches AttributeError; test for a component with
``importlib.util.find_spec("memopt_offload")``). ``__all__`` lists the installed components'
names, so ``from memopt import *`` takes what is there. An installed package that fails to
import raises its own error.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers and IDEs see: each name with its component's types
    from memopt import checkpoint as checkpoint  # the submodule (memopt.checkpoint.save)
    from memopt_apexw import ApexW
    from memopt_core.errors import (
        BackendUnavailableError,
        CheckpointError,
        ConfigError,
        FormatError,
        MemoptError,
        NumericsError,
        OffloadError,
        RoundToNearestWarning,
        StateDictError,
    )
    from memopt_core.formats import StateSpec
    from memopt_core.fp32_state import get_fp32_model_state_dict, set_fp32_model_state_dict
    from memopt_core.optimizer import MemOptimizer
    from memopt_ecc import (
        FlashAdam,
        FlashAdamW,
        FlashLion,
        FlashSGD,
        FlashSGDW,
        cast_model,
        enable_gradient_release,
    )
    from memopt_offload import AdamBridge

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
    "get_fp32_model_state_dict": ("memopt_core.fp32_state", "memopt-core"),
    "set_fp32_model_state_dict": ("memopt_core.fp32_state", "memopt-core"),
    "AdamBridge": ("memopt_offload", "memopt-offload"),
    "ApexW": ("memopt_apexw", "memopt-apexw"),
    "OffloadError": ("memopt_core.errors", "memopt-core"),
    "RoundToNearestWarning": ("memopt_core.errors", "memopt-core"),
}


def _installed(module: str) -> bool:
    """Whether ``module``'s top-level package is installed (found, not imported)."""
    return importlib.util.find_spec(module.partition(".")[0]) is not None


#: the names of the installed components only, so ``from memopt import *`` and ``dir()`` work
#: whatever is installed; a missing component's name still explains itself when asked for.
#: Type checkers read the literal (every name; a test keeps it equal to ``_EXPORTS``).
if TYPE_CHECKING:
    __all__ = [
        "AdamBridge",
        "ApexW",
        "BackendUnavailableError",
        "CheckpointError",
        "ConfigError",
        "FlashAdam",
        "FlashAdamW",
        "FlashLion",
        "FlashSGD",
        "FlashSGDW",
        "FormatError",
        "MemOptimizer",
        "MemoptError",
        "NumericsError",
        "OffloadError",
        "RoundToNearestWarning",
        "StateDictError",
        "StateSpec",
        "__version__",
        "cast_model",
        "enable_gradient_release",
        "get_fp32_model_state_dict",
        "set_fp32_model_state_dict",
    ]
else:
    __all__ = [
        "__version__",
        *(name for name, (module, _) in _EXPORTS.items() if _installed(module)),
    ]


#: distributions that the meta-package's own extras install (``pip install "memopt[offload]"``)
_EXTRAS = {"memopt-offload": "offload"}


def _import(module: str, what: str, dist: str) -> Any:
    """``module`` imported; ImportError naming ``dist`` when its package is not installed. Any
    other failure (an installed package that fails to import: a stale build) propagates as it
    is, so its own message is the first one the user reads."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.partition(".")[0]
        if exc.name not in (top, module):
            raise
        extra = f", or the extra memopt[{_EXTRAS[dist]}]" if dist in _EXTRAS else ""
        raise ImportError(
            f"{what} needs the {dist} package (from a checkout: pip install packages/{dist}{extra})"
        ) from exc


# Outside type checking only: a module-level __getattr__ would make every misspelled
# ``memopt.<name>`` an Any to a type checker, which reads the imports above instead.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        if name == "checkpoint":  # the submodule, on first use (``memopt.checkpoint.save``)
            return importlib.import_module("memopt.checkpoint")  # which says what is missing
        if name not in _EXPORTS:
            raise AttributeError(f"module 'memopt' has no attribute {name!r}")
        module, dist = _EXPORTS[name]
        value = getattr(_import(module, f"memopt.{name}", dist), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted([*__all__, *(["checkpoint"] if _installed("memopt_checkpoint") else [])])
