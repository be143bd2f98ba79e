"""Memory shared between the tensors of one kernel call: what a backend must refuse before a
kernel writes in place.

A fused step reads gradients and writes parameters, state and staging copies; when a written
tensor shares a byte with any other tensor of the call, the result depends on which program or
thread gets there first. One case is well defined and allowed: a gradient that *is* its own
parameter's memory (the same address, dtype, shape and strides), as after ``p.grad =
p.detach()``: every backend reads each element's gradient before it writes that element, so
the step computes with ``g = p`` as the reference does. Used by the cpu and Triton backends'
validation (the uncached path), not at every replay.

A tensor with torch's negative bit is refused too (:func:`refuse_negated`): its memory holds
the opposite of its values, and the kernels read memory.
"""

from __future__ import annotations

import operator
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from itertools import compress, repeat
from operator import attrgetter, itemgetter
from typing import Any

import torch
from torch import Tensor

from memopt_core.errors import ConfigError
from memopt_core.plan import element_offsets, overlaps_itself
from memopt_core.sharding import is_dtensor

__all__ = [
    "Label",
    "addressable",
    "any_extents_overlap",
    "check_aliasing",
    "check_parameters_apart",
    "clear_of",
    "has_memory",
    "labelled_parameters",
    "ranges_overlap",
    "refuse_negated",
    "same_view",
    "share_memory",
    "sorted_extents",
]

#: An error message's name for a tensor, or a callable that makes it (only an error needs it).
Label = str | Callable[[], str]

#: Elements; beyond that an overlap of two strided extents counts as sharing memory.
_EXACT_OVERLAP_LIMIT = 1 << 22


def _extent(t: Tensor) -> tuple[int, int] | None:
    """The byte range ``[start, end)`` ``t``'s elements lie in (None when empty)."""
    n = t.numel()
    if n == 0:
        return None
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + n * t.element_size()
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return start, start + span * t.element_size()


def _byte_set(t: Tensor) -> Tensor:
    """Addresses of every byte of ``t``'s elements (int64)."""
    starts = t.data_ptr() + element_offsets(t) * t.element_size()
    return (starts.unsqueeze(-1) + torch.arange(t.element_size(), device="cpu")).reshape(-1)


def _share_bytes(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` share a byte, given that their extents overlap."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    if max(a.numel(), b.numel()) > _EXACT_OVERLAP_LIMIT:
        return True
    return bool(torch.isin(_byte_set(a), _byte_set(b)).any())


def same_view(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (``p.detach()``,
    ``p.data`` and ``p``)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def share_memory(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` (on one device, with memory: :func:`has_memory`) share a byte."""
    ea, eb = _extent(a), _extent(b)
    if ea is None or eb is None or ea[1] <= eb[0] or eb[1] <= ea[0]:
        return False
    return _share_bytes(a, b)


_NBYTES = attrgetter("nbytes")


def _sorted_ranges(tensors: Sequence[Tensor]) -> list[tuple[int, int]] | None:
    """The byte ranges ``(start, stop)`` of contiguous ``tensors``, sorted by start, in
    C-level passes; None when one is strided (its range is no exact extent)."""
    if not all(map(Tensor.is_contiguous, tensors)):
        return None
    starts = list(map(Tensor.data_ptr, tensors))
    return sorted(zip(starts, map(operator.add, starts, map(_NBYTES, tensors)), strict=True))


def ranges_overlap(starts: Sequence[int], stops: Sequence[int]) -> bool:
    """Whether any two of the byte ranges ``[starts[i], stops[i])`` overlap (an empty range
    shares nothing). A sort and C-level passes, no per-range Python call: a backend that read
    its tensors' addresses and sizes for other checks passes them here."""
    keep = list(compress(range(len(starts)), map(operator.lt, starts, stops)))
    if len(keep) < 2:
        return False
    get = itemgetter(*sorted(keep, key=starts.__getitem__))
    begins, ends = get(starts), get(stops)
    # sorted by start, non-empty: a range that overlaps an earlier one overlaps the one just
    # before it too (that one starts between them, before the earlier one's end)
    return any(map(operator.lt, begins[1:], ends[:-1]))


def any_extents_overlap(tensors: Sequence[Tensor]) -> bool:
    """Whether any two of ``tensors``' byte ranges overlap (a strided tensor counts as
    overlapping: the exact check decides): :func:`check_aliasing`'s common case, which a
    backend can test before it labels every tensor for that function's messages."""
    if not all(map(Tensor.is_contiguous, tensors)):
        return True
    starts = list(map(Tensor.data_ptr, tensors))
    return ranges_overlap(starts, list(map(operator.add, starts, map(_NBYTES, tensors))))


def _name(label: Label) -> str:
    return label if isinstance(label, str) else label()


def check_aliasing(
    written: Sequence[tuple[Tensor, Label]],
    read: Sequence[tuple[Tensor, Label]],
    pairs: Sequence[tuple[Tensor, Tensor]] = (),
) -> None:
    """ConfigError naming both tensors when a ``written`` tensor shares memory with any other
    tensor of the call (``read`` ones included). ``pairs``: (parameter, its gradient) pairs
    that may be the same view (the module doc's one allowed case). O(n log n) over the
    tensors' byte ranges; element by element only for strided tensors whose ranges overlap."""
    if not any_extents_overlap([t for t, _ in written] + [t for t, _ in read]):
        return  # the common case, in C-level passes and one scan
    allowed = {(id(p), id(g)) for p, g in pairs}
    items = []
    for kind, group in ((True, written), (False, read)):
        for t, what in group:
            ext = _extent(t)
            if ext is not None:
                items.append((ext[0], ext[1], kind, t, what))
    items.sort(key=lambda e: e[0])
    active: list[tuple[int, int, bool, Tensor, Label]] = []
    for item in items:
        active = [a for a in active if a[1] > item[0]]
        for other in active:
            if not (item[2] or other[2]):
                continue  # two tensors that are only read may share memory
            a, b = other[3], item[3]
            if ((id(a), id(b)) in allowed or (id(b), id(a)) in allowed) and same_view(a, b):
                continue
            if _share_bytes(a, b):
                na, nb = _name(other[4]), _name(item[4])
                raise ConfigError(
                    f"{na} and {nb} share memory; the kernel writes {na if other[2] else nb} in "
                    "place, so they must not overlap (clone one of them)"
                )
        active.append(item)


def addressable(t: Tensor) -> bool:
    """Whether ``t``'s memory can be compared: not sharded, not on meta, not a tensor subclass
    without storage (those are left to the step's own checks)."""
    if is_dtensor(t) or t.is_meta:
        return False
    try:
        return t.data_ptr() != 0
    except RuntimeError:  # a subclass that refuses data_ptr()
        return False


def has_memory(t: Tensor) -> bool:
    """Whether ``t``'s elements lie at a real address, which kernels can read and write: a
    wrapper tensor subclass, a storage resized to 0 bytes and autograd's zero tensor have data
    pointer 0 (empty tensors too, and have no elements), and some subclasses refuse
    ``data_ptr()``."""
    try:
        return t.data_ptr() != 0 or t.numel() == 0
    except RuntimeError:
        return False


def refuse_negated(name: Label, t: Tensor) -> None:
    """ConfigError naming ``name`` when ``t`` has torch's negative bit (``t.is_neg()``: a lazily
    negated view such as ``x.conj().imag`` of a complex ``x``, or ``torch._neg_view(x)``). Such
    a view shares ``x``'s memory, which holds the opposite of its values, and the kernels read
    and write raw memory: they would step with ``-g`` or update ``-p``. One message for every
    check that refuses one."""
    if t.is_neg():
        raise ConfigError(
            f"{_name(name)} is a negated view (torch's negative bit, as from x.conj().imag: its "
            "memory holds the opposite values, which the kernels would read or update as they "
            "are); pass its .resolve_neg() instead"
        )


def labelled_parameters(param_groups: Sequence[Mapping[str, Any]]) -> list[tuple[Tensor, Label]]:
    """Every parameter of ``param_groups`` with its error-message label ("parameter #i of param
    group g", made only when an error needs it), for :func:`check_parameters_apart`."""
    return [
        (p, _param_label(gi, i))
        for gi, g in enumerate(param_groups)
        for i, p in enumerate(g["params"])
    ]


def _param_label(gi: int, i: int) -> Label:
    """The label of parameter ``i`` of param group ``gi``, made when called."""
    return lambda: f"parameter #{i} of param group {gi}"


def check_parameters_apart(
    new: Sequence[tuple[Tensor, Label]], held: Sequence[tuple[Tensor, Label]]
) -> None:
    """ConfigError when a parameter of ``new`` overlaps itself (an expanded tensor) or shares
    memory with another parameter of ``new`` or ``held``: an optimizer updates each parameter
    from its own old value, so in the overlap one update would overwrite the other (the torch
    backend kept one of two silently). Used when a param group is added (core's optimizers and
    AdamBridge); sharded, meta and storage-less parameters are skipped."""
    new = [(t, what) for t, what in new if addressable(t)]
    for t, what in new:
        if not t.is_contiguous() and overlaps_itself(t):
            raise ConfigError(
                f"{_name(what)} (shape {tuple(t.shape)}) has elements that share memory (an "
                "expanded tensor?): it cannot be updated in place; give it its own memory "
                "(p.data = p.data.clone())"
            )
    check_aliasing(new + [(t, what) for t, what in held if addressable(t)], [])


def sorted_extents(tensors: Sequence[Tensor]) -> tuple[list[int], list[int]] | None:
    """The byte ranges of ``tensors`` (which :func:`check_aliasing` found apart) as starts and
    ends sorted by start, after a sentinel range below every address, for :func:`clear_of`;
    empty tensors left out. None when one is strided (its range is no exact extent)."""
    ranges = _sorted_ranges([t for t in tensors if t.numel()])
    if ranges is None:
        return None
    # ends one place further than their starts: ends[bisect_left(starts, b)] is the end of the
    # last range starting before b, without a subtraction pass
    return [-1, *(a for a, _ in ranges)], [-1, -1, *(b for _, b in ranges)]


def clear_of(
    extents: tuple[list[int], list[int]] | None, addresses: Sequence[int], nbytes: Sequence[int]
) -> bool:
    """Whether the byte ranges ``[addresses[i], addresses[i] + nbytes[i])`` (of contiguous
    tensors) miss every range of :func:`sorted_extents` (False when ``extents`` is None: the
    caller checks with :func:`check_aliasing` then; an empty range inside one counts as a
    hit). A cached step's check of gradients that moved against what its launch writes: C-level
    passes (a binary search each), no per-tensor Python call and no sort of the gradients.

    The ranges do not overlap one another, so sorted by start their ends are sorted too, and
    the only one that can overlap ``[a, b)`` among those starting before ``b`` is the last (the
    sentinel when none does)."""
    if extents is None:
        return False
    starts, ends = extents
    before = map(bisect_left, repeat(starts), map(operator.add, addresses, nbytes))
    return not any(map(operator.gt, map(operator.getitem, repeat(ends), before), addresses))
