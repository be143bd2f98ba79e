"""memopt-apexw: ``ApexW``, AdamW with compact state (bf16 or q8 moments, ECC masters for bf16
parameters) and a step whose host work stays O(1) per group: cached fused launches, optional
CUDA-graph capture with lr and step in device memory, and a measured ``mode="auto"``.
"""

from __future__ import annotations

from memopt_apexw.apexw import MODES, STATES, ApexW, state_bytes_per_param
from memopt_apexw.auto_mode import ModeDecision

__all__ = ["MODES", "STATES", "ApexW", "ModeDecision", "__version__", "state_bytes_per_param"]
__version__ = "0.1.0"
