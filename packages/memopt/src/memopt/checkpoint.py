"""``memopt.checkpoint``: memopt-checkpoint's API under the meta-package
(``from memopt.checkpoint import save, load``); see :mod:`memopt_checkpoint`."""

from __future__ import annotations

from memopt_checkpoint import (
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
