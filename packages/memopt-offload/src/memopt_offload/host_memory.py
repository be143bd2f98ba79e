"""Host buffers of AdamBridge: exact-size slabs, first-touched by the kernel threads, pinned in place.

PyTorch's pinned caching allocator rounds every block up to a power of two (up to 2x waste) and
touches pages from the allocating thread. AdamBridge instead allocates a few large ordinary
buffers (:class:`HostSlab`), zero-fills them with :func:`memopt_kernels_cpu.ops.first_touch`
(the CPU kernels' own static partition, so on a NUMA host each page lands on the node of the
thread that will update it), then page-locks exactly those bytes with ``cudaHostRegister``.
Views of a slab are 64-byte aligned. :func:`check_host_memory` refuses, before anything is
allocated, a request larger than the host's available memory, saying how much was needed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from memopt_core.errors import OffloadError
from memopt_core.plan import round_up
from memopt_kernels_cpu import ops as cpu_ops

__all__ = ["ALIGN", "HostSlab", "SlabLayout", "available_host_bytes", "check_host_memory"]

#: Byte alignment of every view (a cache line; full AVX-512 vectors).
ALIGN = 64
_GIB = 2**30


def available_host_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where the file does not exist)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(needed: int, pinned: int, what: str, hint: str = "") -> None:
    """OffloadError when ``needed`` bytes (``pinned`` of them page-locked) exceed the host's
    available memory; the message says how much was needed and how much there is, then
    ``hint`` (the caller's own way to need less)."""
    avail = available_host_bytes()
    if avail is not None and needed > avail:
        raise OffloadError(
            f"{what} needs {needed / _GIB:.2f} GiB of host RAM ({pinned / _GIB:.2f} GiB of it "
            f"pinned) but only {avail / _GIB:.2f} GiB is available: free host memory or train "
            f"fewer parameters per process{hint}"
        )


@dataclass(frozen=True)
class _Entry:
    offset: int
    numel: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class SlabLayout:
    """Offsets of tensors packed into one slab, each 64-byte aligned; :attr:`nbytes` in all."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.nbytes = 0

    def add(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Reserve room for a tensor of ``shape`` and ``dtype``; returns its entry index."""
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        if numel == 0:  # no bytes, no padding
            self.entries.append(_Entry(self.nbytes, 0, dtype, shape))
            return len(self.entries) - 1
        offset = round_up(self.nbytes, ALIGN)
        self.entries.append(_Entry(offset, numel, dtype, shape))
        self.nbytes = offset + numel * dtype.itemsize
        return len(self.entries) - 1


class HostSlab:
    """One flat host buffer of exactly ``layout.nbytes`` bytes, zero-filled by the kernel
    threads, page-locked in place when ``pin`` (``cudaHostRegister``; unregistered when the slab
    is freed). :meth:`view` gives the tensors of the layout."""

    def __init__(self, layout: SlabLayout, *, pin: bool, what: str) -> None:
        self.layout = layout
        self.pinned = False
        self.storage = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8, device="cpu")
        cpu_ops.first_touch(self.storage)
        if pin and layout.nbytes:
            _register(self.storage, what)
            self.pinned = True
            weakref.finalize(self, _unregister, self.storage.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def view(self, index: int) -> Tensor:
        """The tensor of entry ``index`` (shaped, typed, a view of the slab)."""
        e = self.layout.entries[index]
        raw = self.storage[e.offset : e.offset + e.numel * e.dtype.itemsize]
        return raw.view(e.dtype).view(e.shape)


def _register(t: Tensor, what: str) -> None:
    nbytes = t.numel()
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    code = int(getattr(rc, "value", rc))
    if code != 0:
        raise OffloadError(
            f"pinning {nbytes / _GIB:.2f} GiB of host memory for {what} failed (CUDA error "
            f"{code}: {rc}): raise the locked-memory limit (ulimit -l), free host memory, or pass "
            "pin_memory=False (transfers then go through a staging copy and overlap less)"
        )


def _unregister(ptr: int) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
        torch.cuda.cudart().cudaHostUnregister(ptr)
