"""ApexW's CUDA-graph step: the fused launches of every group captured once, replayed each step
with the learning rate, bias corrections and step count read from device memory.

Per step the host computes each group's scalars (core's ``adam_scalars``, in double, so the bits
equal an eager step), writes them into one slot of a two-slot pinned ring, copies it to the
device tensor the kernels read (``non_blocking``; an event per slot keeps the host from
overwriting a slot the GPU has not read yet) and replays the graph: O(groups) host work.

Rules a capture needs, enforced by ApexW with a clear error: CUDA tensors on one device, the
Triton backend, contiguous parameters and gradients, and gradients that stay in their buffers
(``zero_grad(set_to_none=False)``, ApexW's default with ``capturable=True``); when a gradient
buffer moves anyway, the step is resolved and captured again (correct, but slow: ApexW warns).
"""

from __future__ import annotations

import torch

from memopt_core import backends
from memopt_core.cached_step import CachedStep

__all__ = ["GraphStep"]


class GraphStep:
    """The captured step of one :class:`~memopt_core.cached_step.CachedStep` (CUDA only)."""

    def __init__(self, cached: CachedStep, device: torch.device) -> None:
        from memopt_kernels_triton import ops

        self._ops = ops
        self.cached = cached
        self.device = device
        words = len(ops.ADAM_HYPER_FIELDS)
        n = len(cached.entries)
        self.hyper = torch.zeros((n, words), dtype=torch.int32, device=device)
        self._ring = [
            torch.zeros((n, words), dtype=torch.int32, device="cpu").pin_memory() for _ in range(2)
        ]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._slot = 0
        self._flags = [self._variant(e) for e in cached.entries]
        self.graph: torch.cuda.CUDAGraph | None = None
        self._warm = False

    @staticmethod
    def _variant(entry) -> dict[str, bool]:
        s = entry.work.scalars
        # decay/L2 on whenever the group has weight decay: an exact factor of 1 is harmless, and
        # the capture then stays valid when a scheduler moves lr (and with it the decay factor)
        return {"maximize": bool(s.maximize), "has_l2": s.l2 != 0.0, "has_decay": s.decay != 1.0}

    def variant_matches(self, scalars_per_entry: list) -> bool:
        """Whether the captured kernel variants still fit these scalars."""
        for flags, s in zip(self._flags, scalars_per_entry, strict=True):
            if bool(s.maximize) != flags["maximize"]:
                return False
            if (s.l2 != 0.0) and not flags["has_l2"]:
                return False
            if (s.decay != 1.0) and not flags["has_decay"]:
                return False
        return True

    def _write(self, scalars_per_entry: list, seed: int, steps: list[int]) -> None:
        slot = self._slot
        ev = self._events[slot]
        if ev is not None:
            ev.synchronize()  # the GPU has read this slot's previous contents
        host = self._ring[slot]
        rows = [
            self._ops.adam_hyper_words(s, seed, step)
            for s, step in zip(scalars_per_entry, steps, strict=True)
        ]
        host.copy_(torch.tensor(rows, dtype=torch.int32, device="cpu"))
        self.hyper.copy_(host, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))  # the copy's stream: the device's
        self._events[slot] = ev
        self._slot ^= 1

    def _launch_all(self) -> None:
        for i, (entry, flags) in enumerate(zip(self.cached.entries, self._flags, strict=True)):
            entry.prepared.launch_hyper(self.hyper[i], **flags)

    def run(self, scalars_per_entry: list, seed: int, steps: list[int]) -> None:
        """One step (``steps``: each entry's 1-based step): write the scalars, then replay
        (capturing first if not done yet).

        The first call runs the launches eagerly (compiling the device-scalar kernel variant, so
        the capture records no compilation); the second captures and replays. Everything runs
        on the parameters' GPU, whichever device is current (a graph replays on the current
        stream of the current device)."""
        with torch.cuda.device(self.device):
            self._run(scalars_per_entry, seed, steps)

    def _run(self, scalars_per_entry: list, seed: int, steps: list[int]) -> None:
        self._write(scalars_per_entry, seed, steps)
        if self.graph is None:
            if not self._warm:
                self._launch_all()
                self._warm = True
                return
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            # thread_local: another thread (a DataLoader's pin-memory thread) may allocate
            # during the capture; in the default "global" mode that invalidated the capture and
            # failed the allocation. The capture records only these launches on this stream and
            # allocates nothing, so other threads cannot affect it.
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                self._launch_all()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.graph = graph
        self.graph.replay()
        for entry in self.cached.entries:  # the replay wrote them where autograd cannot see
            backends.mark_written(entry.work.param_owners)
