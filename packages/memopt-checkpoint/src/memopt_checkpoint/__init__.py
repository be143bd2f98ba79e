"""memopt-checkpoint: small, safe, interoperable checkpoints of memopt (and torch) training.

- :func:`save` / :func:`load` (:mod:`memopt_checkpoint.api`): model + optimizer + extra in one
  file, keyed by parameter name, compressed states kept compressed (q8 moments and ECC-24 codes
  1 B per element), per-tensor checksums, atomic streamed writes.
- :func:`export_fp32` / :func:`fp32_model_state_dict` (:mod:`memopt_checkpoint.fp32_export`):
  full-precision weights reconstructed from bf16 + ECC (or AdamBridge's host masters) as a plain
  torch state dict.
- :mod:`memopt_checkpoint.interop`: memopt optimizer state <-> vanilla torch optimizer state.
- :func:`check_dcp_load` (:mod:`memopt_checkpoint.dcp_check`): before
  ``torch.distributed.checkpoint.load``, refuses an optimizer without state or of another format
  than the checkpoint's, which ``dcp.load`` would otherwise fill or overwrite unchecked.
- :mod:`memopt_checkpoint.container`: the file format itself.
"""

from __future__ import annotations

from memopt_checkpoint.api import load, save
from memopt_checkpoint.dcp_check import check_dcp_load
from memopt_checkpoint.fp32_export import export_fp32, fp32_model_state_dict
from memopt_checkpoint.interop import load_torch_state_dict, to_torch_state_dict
from memopt_core.errors import CheckpointError, StateDictError  # what these functions raise

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "StateDictError",
    "__version__",
    "check_dcp_load",
    "export_fp32",
    "fp32_model_state_dict",
    "load",
    "load_torch_state_dict",
    "save",
    "to_torch_state_dict",
]
