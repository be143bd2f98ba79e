"""The ``triton`` backend object core's registry loads (entry point ``memopt.kernels``).

``available()`` needs triton importable and a CUDA device, or ``TRITON_INTERPRET=1`` (Triton's
CPU interpreter; then CPU tensors are accepted too, which is how CPU CI tests the kernels).
``supports()`` covers every rule (sgd, adam, lion) x master (fp32, none, ecc24, ecc32) x moment
preset (fp32, bf16, fp8, q8) for fp32/bf16/fp16 parameters, with or without stochastic rounding.
``step()`` runs one group in one kernel launch (:func:`memopt_kernels_triton.ops.fused_step`;
a capturable step, ``GroupStep.device_step``, adds one small launch that computes the per-tensor
scalars from step counts on the device); ``step_all()`` runs the groups of one family arena
(param groups with the same device, dtype and formats) in one launch, and a group whose
parameters reached different step counts (some skipped steps) in one launch too;
``check()`` validates a group without launching (core runs it on every group of a step before
the first launch); ``prepare()`` resolves a group once for repeated launches, with scalars from the host or from a
device tensor (CUDA-graph capture); ``codecs()`` hands core's conversions (state dicts, fp32
export) the standalone codecs of :mod:`memopt_kernels_triton.ops` for CUDA tensors.
Nothing here imports triton before it is needed.
"""

from __future__ import annotations

import os

import torch

from memopt_core.backends import GroupStep, supports_formats
from memopt_core.formats import StateSpec

__all__ = ["BACKEND", "TritonBackend"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")


class TritonBackend:
    """Fused Triton kernels: one launch per group for every rule x format."""

    name = "triton"
    #: The interface level these kernels implement, a literal (not core's value): 7 is the level
    #: whose bits they compute (``memopt_core.rng``'s stochastic-rounding words, the ``q8_sqrt``
    #: and ``fp8_e5m2`` floors, the ECC zero decode, ``q8_sqrt``'s integer rounding rule), so a
    #: core at another level refuses a stale package.
    KERNEL_API = 8
    #: runs ``GroupStep.device_step`` work (capturable steps: :func:`ops.device_step`)
    device_steps = True
    #: steps the param groups of one family arena in one launch (:meth:`step_all`)
    merges_groups = True
    #: and a group's works at several step counts (parameters that skipped steps) as one
    merges_step_counts = True

    def available(self) -> tuple[bool, str]:
        """See :meth:`memopt_core.backends.Backend.available`."""
        try:
            import triton
        except ImportError as e:
            if getattr(e, "name", None) == "triton":
                return False, "triton is not installed (pip install triton, on a CUDA machine)"
            return False, f"triton failed to import: {type(e).__name__}: {e}"
        except Exception as e:  # a broken triton install must not break the registry
            return False, f"triton failed to import: {type(e).__name__}: {e}"
        if _interpreting():
            return True, "Triton interpreter (TRITON_INTERPRET=1): CPU tensors, slow, for tests"
        if not torch.cuda.is_available():
            return False, "no CUDA device (torch.cuda.is_available() is False)"
        return True, f"CUDA device {torch.cuda.get_device_name()} with triton {triton.__version__}"

    def supports(
        self, rule: str, spec: StateSpec, device: torch.device, param_dtype: torch.dtype
    ) -> bool:
        """See :meth:`memopt_core.backends.Backend.supports`."""
        device = torch.device(device)
        if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
            return False
        return supports_formats(rule, spec, param_dtype) and spec.block_size in (1, 32)

    def step(self, work: GroupStep) -> None:
        """See :meth:`memopt_core.backends.Backend.step`."""
        from memopt_kernels_triton import ops

        ops.fused_step(work)

    def step_all(self, works, prepared=None, done=None) -> None:
        """Every host work of ``works``, one launch per family arena and kernel variant
        (:func:`memopt_kernels_triton.ops.fused_steps`; core's ``merges_groups``)."""
        from memopt_kernels_triton import ops

        ops.fused_steps(works, prepared, done)

    def check(self, work: GroupStep) -> None:
        """Raise what :meth:`step` would raise for ``work``'s tensors, launching nothing (core
        checks every group of a step before the first one runs: a refused gradient in the
        second group left the first one updated): :func:`memopt_kernels_triton.ops.check_step`."""
        from memopt_kernels_triton import ops

        ops.check_step(work)

    def prepare(self, work: GroupStep):
        """``work`` resolved for repeated launches (:func:`memopt_kernels_triton.ops.prepare_step`);
        memopt_core's cached step (every MemOptimizer's eager step) uses it. It holds no
        references to the tensors (``hold=False``): the cached step checks every address
        before each launch, and keeps the step between iterations, where held gradients would
        stay alive after ``zero_grad(set_to_none=True)``."""
        from memopt_kernels_triton import ops

        return ops.prepare_step(work, hold=False)

    def codecs(self, device: torch.device):
        """:mod:`memopt_kernels_triton.ops` (its standalone codecs) for CUDA tensors, else None
        (the interpreter's CPU tensors are left to the CPU backend or the reference: it would be
        slow): what :mod:`memopt_core.conversions` runs state-dict and fp32-export conversions
        on."""
        if torch.device(device).type != "cuda":
            return None
        from memopt_kernels_triton import ops

        return ops

    def __repr__(self) -> str:
        return "TritonBackend()"


#: What the ``memopt.kernels`` entry point ``triton`` resolves to.
BACKEND = TritonBackend()
