"""memopt-offload: ``AdamBridge``, AdamW with fp32 master weights and moments in host RAM.

The device keeps only the model's bf16 weights; gradients go to pinned host buffers as backward
produces them, the fused C++ kernels of memopt-kernels-cpu update the host state on their
thread pool while backward continues, and the new bf16 weights go back to the device.
With ``update="device"`` the host keeps only the state (ECC-24 code and bf16 moments, 5 B per
parameter) and the GPU updates it bucket by bucket (:mod:`memopt_offload.device_update`).
See :mod:`memopt_offload.bridge` for the pipeline, the precisions and their bytes per
parameter, and :mod:`memopt_offload.autotune` for the machine measurements.
"""

from __future__ import annotations

from memopt_core.errors import OffloadError, StateDictError  # what AdamBridge raises
from memopt_offload.bridge import PRECISIONS, UPDATES, AdamBridge

__version__ = "0.1.0"

__all__ = ["PRECISIONS", "UPDATES", "AdamBridge", "OffloadError", "StateDictError", "__version__"]
