"""``memopt.checkpoint``: memopt-checkpoint's API under the meta-package
(``from memopt.checkpoint import save, load``); see :mod:`memopt_checkpoint`."""

from __future__ import annotations

from memopt import _import

# both import forms (``memopt.checkpoint`` and ``from memopt.checkpoint import save``) come
# here: a missing memopt-checkpoint is an ImportError saying what to install
_import("memopt_checkpoint", "memopt.checkpoint", "memopt-checkpoint")

from memopt_checkpoint import (  # noqa: E402
    CheckpointError,
    StateDictError,
    check_dcp_load,
    export_fp32,
    fp32_model_state_dict,
    load,
    load_torch_state_dict,
    save,
    to_torch_state_dict,
)

__all__ = [
    "CheckpointError",
    "StateDictError",
    "check_dcp_load",
    "export_fp32",
    "fp32_model_state_dict",
    "load",
    "load_torch_state_dict",
    "save",
    "to_torch_state_dict",
]
