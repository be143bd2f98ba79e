"""The ``cpu`` backend object core's registry loads (entry point ``memopt.kernels``).

``available()`` is always true once the compiled module imports; its reason names the
instruction set and the thread count. ``supports()`` covers CPU tensors for every rule (sgd,
adam, lion) x master (fp32, none, ecc24, ecc32) x moment preset (fp32, bf16, fp8, q8) for
fp32/bf16/fp16 parameters, with or without stochastic rounding. ``step()`` runs one group in one
call into C++ (:func:`memopt_kernels_cpu.ops.fused_step`), bf16 staging copies included;
``step_all()`` runs a group's parameters at several step counts (one work per count) in one call;
``check()`` validates a group without running it (core checks every group of a step first);
``prepare()`` validates a group once for core's cached step, whose replays then skip the
per-tensor checks of ``step()``. ``codecs()`` hands core's conversions (state dicts, fp32 export)
the standalone codecs of :mod:`memopt_kernels_cpu.ops`.
"""

from __future__ import annotations

import torch

from memopt_core.backends import GroupStep, supports_formats
from memopt_core.formats import StateSpec
from memopt_kernels_cpu import _core

__all__ = ["BACKEND", "CpuBackend"]


class CpuBackend:
    """Fused C++ kernels on a thread pool: one call per group for every rule x format."""

    name = "cpu"
    #: the KERNEL_API level whose stochastic-rounding words (memopt_core.rng) these kernels
    #: compute; a literal rather than core's constant, so a core of another level refuses the
    #: package instead of getting other bits
    KERNEL_API = 8
    #: ``step`` writes ``work.staging`` (the bf16 copies) in the update's own pass
    fused_staging = True
    #: :meth:`step_all` steps the works of one arena (a group's parameters at several step
    #: counts, one work per count) in one call; core builds no family arenas for this backend
    #: (no ``merges_groups``): memopt-offload allocates each arena itself, first-touched
    merges_step_counts = True

    def available(self) -> tuple[bool, str]:
        """See :meth:`memopt_core.backends.Backend.available`."""
        return True, (
            f"C++ kernels, instruction set {_core.get_isa()} (supported here: "
            f"{', '.join(_core.supported_isas())}), {_core.get_num_threads()} threads, chunks "
            f"of {_core.get_chunk_size()} elements"
        )

    def supports(
        self, rule: str, spec: StateSpec, device: torch.device, param_dtype: torch.dtype
    ) -> bool:
        """See :meth:`memopt_core.backends.Backend.supports`."""
        if torch.device(device).type != "cpu":
            return False
        return supports_formats(rule, spec, param_dtype) and spec.block_size in (1, 32)

    def step(self, work: GroupStep) -> None:
        """See :meth:`memopt_core.backends.Backend.step`."""
        from memopt_kernels_cpu import ops

        ops.fused_step(work, staging=work.staging)

    def step_all(self, works, prepared=None, done=None) -> None:
        """Every work of ``works``, one call into C++ per arena
        (:func:`memopt_kernels_cpu.ops.fused_steps`; core's ``merges_step_counts``)."""
        from memopt_kernels_cpu import ops

        ops.fused_steps(works, prepared, done)

    def check(self, work: GroupStep) -> None:
        """Raise what :meth:`step` would raise for ``work``, changing nothing (core checks
        every group of a step before the first one runs); the validated table stays cached."""
        from memopt_kernels_cpu import ops

        ops.check_step(work, staging=work.staging)

    def prepare(self, work: GroupStep):
        """``work`` validated once for the replays of core's cached step
        (:func:`memopt_kernels_cpu.ops.prepare_step`), or None (then :meth:`step` runs)."""
        from memopt_kernels_cpu import ops

        return ops.prepare_step(work)

    def codecs(self, device: torch.device):
        """:mod:`memopt_kernels_cpu.ops` (its standalone codecs) for CPU tensors, else None:
        what :mod:`memopt_core.conversions` runs state-dict and fp32-export conversions on."""
        if torch.device(device).type != "cpu":
            return None
        from memopt_kernels_cpu import ops

        return ops

    def __repr__(self) -> str:
        return "CpuBackend()"


#: What the ``memopt.kernels`` entry point ``cpu`` resolves to.
BACKEND = CpuBackend()
