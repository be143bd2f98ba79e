"""memopt-core: the interface every memopt package shares.

- :mod:`memopt_core.reference`: the update rules (SGD, SGDW, Adam, AdamW, Lion) as plain functions.
- :mod:`memopt_core.formats`: the bit-level state formats and their reference codecs.
- :mod:`memopt_core.rng`: the counter-based generator behind stochastic rounding.
- :mod:`memopt_core.plan`: multi-tensor planning (groups, state arenas, chunk tables).
- :mod:`memopt_core.backends`: the kernel-backend registry and the pure-torch backend.
- :mod:`memopt_core.optimizer`: :class:`MemOptimizer`, the base of every memopt optimizer.
- :mod:`memopt_core.cached_step`: the resolved eager step it replays while addresses hold.
- :mod:`memopt_core.errors`: the exception hierarchy.
"""

from __future__ import annotations

from memopt_core.backends import (
    KERNEL_API,
    Backend,
    BackendStatus,
    GroupStep,
    available_backends,
    backend_capabilities,
    select_backend,
)
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
from memopt_core.optimizer import MemOptimizer
from memopt_core.plan import GroupPlan, Slot, StateArena, make_plans
from memopt_core.torch_backend import TorchBackend

__version__ = "0.1.0"

__all__ = [
    "KERNEL_API",
    "Backend",
    "BackendStatus",
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "FormatError",
    "GroupPlan",
    "GroupStep",
    "MemOptimizer",
    "MemoptError",
    "NumericsError",
    "OffloadError",
    "RoundToNearestWarning",
    "Slot",
    "StateArena",
    "StateDictError",
    "StateSpec",
    "TorchBackend",
    "__version__",
    "available_backends",
    "backend_capabilities",
    "make_plans",
    "select_backend",
]
