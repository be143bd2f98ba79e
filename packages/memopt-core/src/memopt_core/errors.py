"""One exception hierarchy for every memopt package.

Messages say what was wrong, with which parameter (name or shape), and what to do instead.
Each class also derives from the builtin a caller would naturally catch (``ValueError``,
``RuntimeError``, ...), so ``except ValueError`` keeps working for bad hyperparameters.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "FormatError",
    "MemoptError",
    "NumericsError",
    "OffloadError",
    "RoundToNearestWarning",
    "StateDictError",
]


class MemoptError(Exception):
    """Base class of every error memopt raises on purpose."""


class ConfigError(MemoptError, ValueError):
    """A bad hyperparameter, format name or parameter (dtype, device, layout)."""


class FormatError(MemoptError, ValueError):
    """Data that does not fit a state format (wrong dtype, size or block layout)."""


class NumericsError(MemoptError, ArithmeticError, RuntimeError):
    """A non-finite value or an update too small for the format to represent (``check_numerics``).
    Also a ``RuntimeError``, as FlashOptim's ``NumericsError`` is."""


class BackendUnavailableError(MemoptError, RuntimeError):
    """A kernel backend that was asked for cannot run here; the message says why."""


class StateDictError(MemoptError, ValueError):
    """An optimizer state dict that does not match this optimizer (keys, shapes, formats)."""


class OffloadError(MemoptError, RuntimeError):
    """Host offload that cannot proceed: host memory short, pinning refused, or a pipeline used
    out of order (a forward before ``step_sync()``, a gradient arriving twice)."""


class CheckpointError(MemoptError, ValueError):
    """A checkpoint file that cannot be read as written: truncated, corrupted (checksum), of a
    newer format version, or not a memopt checkpoint. Nothing is loaded from such a file."""


class RoundToNearestWarning(UserWarning):
    """``stochastic_rounding=False`` with state that rounding to nearest can stall (bf16, fp8 or
    q8 moments; a bf16/fp16 parameter without a master or with ECC-24): fine for bit-exact
    experiments, not for training (docs/formats.md, "Long runs")."""
