"""The resolved eager step a :class:`~memopt_core.MemOptimizer` replays while nothing it was
resolved for changed: O(state groups) host work per step plus a few C-level passes over the
tensors.

An ordinary step (``MemOptimizer._update``) plans, checks every gradient, groups parameters by
step count, selects backends and builds the :class:`~memopt_core.backends.GroupStep` of each state
group and step count: per-tensor Python work (16 ms over 4096 tensors on the H200's host). A
:class:`CachedStep` keeps those works (one per state group and step count: replays advance each
work's counters together, so the grouping holds), with the backend's prepared launch where the
backend offers ``prepare()`` (Triton, and the C++ cpu backend, whose replays then skip its
per-tensor table-cache key; prepared at the first replay, so a step that never replays
costs no preparation). ``MemOptimizer._replay`` then recomputes only the scalars (schedulers and
edited hyperparameters take effect), launches and advances the counters.

:meth:`CachedStep.current_grads` is the check before every replay: the same param group objects
and lengths, the same parameter objects in them (``group["params"][i] = nn.Parameter(p.data)``
keeps the address, and the new tensor starts from fresh state), the same resolution keys
(backend choice, formats, kernel variants: what
``MemOptimizer._resolution_keys`` returns), every parameter at its address, of its number of
elements (``p.data = p.data[:n]`` keeps the address; a prepared launch would write the old
size) and of its dtype (a new tensor of another dtype can land where the allocator freed the
old one: the kernels would write the old dtype's bytes into it), every gradient of
its dtype (or still None) and number of elements (``p.grad.data = p.grad.data[:n]``: the
``.grad`` setter checks shapes, ``.data`` does not): the ECC family takes float32 gradients of
bfloat16 parameters, and a launch prepared for one gradient dtype must not read the other; and
every parameter and
gradient that was contiguous still contiguous (``p.grad = p.grad.t()`` or ``p.data =
p.data.t()`` on a square parameter keeps the address, dtype and size, and a prepared launch would
read or write the memory in the old order).
Addresses, not tensors, are kept: holding gradients between steps would keep a whole model's
freed gradients alive. Then :meth:`CachedStep.counts_even`: each work's parameters still at
one step count (host counters; an in-place ``state[p]["step"].zero_()`` is seen by no write
counter, and the replay counts a work from its first parameter), one vectorized comparison
per work.

Gradients that moved are checked against the memory the launch writes before a prepared
launch follows them (:meth:`CachedEntry.grads_apart`: ``p1.grad = p0.detach()`` would have the
kernel read a gradient another program writes); where they may share memory the backend's
``prepare`` checks exactly, and refuses, as the ordinary step does. Gradients that moved are
also checked for torch's negative bit (:func:`any_negated`: ``x.conj().imag`` holds the
opposite values in memory), which the ordinary step refuses, and for address 0 (autograd's
zero gradient, which the ordinary step replaces by zeros and never caches, or a freed storage,
which it refuses).

Gradients at new addresses do not end the cached step: ``zero_grad(set_to_none=True)`` (torch's
default) frees them and the next backward allocates them again, often elsewhere (on the H200, the
Qwen2.5-0.5B shape's 290 gradients moved at most steps, and each ordinary step then cost 3-5 ms of
host time against about 1 ms for a replay). :meth:`CachedStep.follow_grads` points the prepared
launches of the groups whose gradients moved at the new ones (the prepared launch's
``with_grads``, or the backend's ``prepare`` again: always the latter for a capturable step,
``follow_by_prepare``, whose tables a CUDA graph capture of the ordinary step must then find
cached); works without a prepared launch read their gradients at every step
anyway. A cached step built with ``fixed_grads=True`` (ApexW's CUDA graph, which captured the
addresses) is still dropped when a gradient moves. What the check cannot see (plans rebuilt, state
loaded, param groups added, ``step_parameters`` advancing some counters) the optimizer handles by
dropping its cached steps; writes to ``optimizer.state`` (a state deleted or replaced, a tensor
put in one: :mod:`memopt_core.tracked_state` counts them) end the replays, and the ordinary step
adopts them. An optimizer that keeps
several cached steps (ApexW, one per mode) drops the others whose works an ordinary step splits
(:meth:`CachedStep.splits`: a parameter without a gradient this step advances its neighbours'
counters and not its own), and those whose replays would split the new one's works. A cached step that is dropped
before it ever replayed makes the optimizer wait before caching again (1, 3, 7, ... up to 31
ordinary steps), so a loop whose gradients move every step pays little for the attempts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, is_, itemgetter
from typing import Any, cast

import torch
from torch import Tensor

from memopt_core import backends
from memopt_core.aliasing import clear_of, sorted_extents

__all__ = [
    "CachedEntry",
    "CachedStep",
    "any_negated",
    "contiguous_positions",
    "grad_addresses",
    "grad_dtypes",
    "grad_sizes",
    "param_addresses",
    "param_dtypes",
    "param_sizes",
    "still_contiguous",
]

_GRAD = attrgetter("grad")
_PARAMS = itemgetter("params")
_DTYPE = attrgetter("dtype")
_DATA_PTR = Tensor.data_ptr
_NUMEL = Tensor.numel
_NBYTES = attrgetter("nbytes")
_CONTIGUOUS = Tensor.is_contiguous
_IS_NEG = Tensor.is_neg


def _all_params(groups: Sequence[dict[str, Any]]) -> list[Tensor]:
    """Every param group's parameters, in order, in one list."""
    return list(chain.from_iterable(map(_PARAMS, groups)))


def param_addresses(params: Sequence[Tensor]) -> tuple[int, ...]:
    """Storage addresses of ``params``."""
    return tuple(map(_DATA_PTR, params))


def param_sizes(params: Sequence[Tensor]) -> tuple[int, ...]:
    """Numbers of elements of ``params``."""
    return tuple(map(_NUMEL, params))


def grad_addresses(grads: Sequence[Tensor | None]) -> tuple[int, ...]:
    """Storage addresses of ``grads``, -1 for None (an empty tensor's address is 0)."""
    try:  # a C-level loop: the common case, no None (which raises TypeError)
        return tuple(map(_DATA_PTR, cast("Sequence[Tensor]", grads)))
    except TypeError:  # some gradient is None
        return tuple(-1 if g is None else g.data_ptr() for g in grads)


def contiguous_positions(tensors: Sequence[Tensor | None]) -> tuple[int, ...] | None:
    """The positions of the contiguous tensors (None counts as one) of ``tensors``, or None
    when that is all of them (the common case)."""
    flags = [t is None or t.is_contiguous() for t in tensors]
    return None if all(flags) else tuple(i for i, f in enumerate(flags) if f)


def still_contiguous(tensors: Sequence[Tensor | None], positions: tuple[int, ...] | None) -> bool:
    """Whether the tensors at ``positions`` (:func:`contiguous_positions`; None: all) still
    are contiguous (or None). A strided tensor that became contiguous needs no check: its work
    has no prepared launch, or one that reads it through a copy."""
    chosen = tensors if positions is None else [tensors[i] for i in positions]
    try:  # a C-level loop: the common case, no None (which raises TypeError)
        return all(map(_CONTIGUOUS, cast("Sequence[Tensor]", chosen)))
    except TypeError:  # some gradient is None
        return all(t is None or t.is_contiguous() for t in chosen)


def any_negated(grads: Sequence[Tensor | None]) -> bool:
    """Whether a gradient is a negated view (torch's negative bit, ``x.conj().imag``), whose
    memory holds the opposite values: kernels read memory. Checked for gradients that moved
    (a flip at the same address takes torch's private ``_neg_view``)."""
    try:  # a C-level loop: the common case, no None (which raises TypeError)
        return any(map(_IS_NEG, cast("Sequence[Tensor]", grads)))
    except TypeError:  # some gradient is None
        return any(g is not None and g.is_neg() for g in grads)


def param_dtypes(params: Sequence[Tensor]) -> tuple[Any, ...]:
    """Dtypes of ``params``."""
    return tuple(map(_DTYPE, params))


def grad_sizes(grads: Sequence[Tensor | None]) -> tuple[int, ...]:
    """Numbers of elements of ``grads`` (-1 for None)."""
    try:  # a C-level loop: the common case, no None (which raises TypeError)
        return tuple(map(_NUMEL, cast("Sequence[Tensor]", grads)))
    except TypeError:  # some gradient is None
        return tuple(-1 if g is None else g.numel() for g in grads)


def grad_dtypes(grads: Sequence[Tensor | None]) -> tuple[Any, ...]:
    """Dtypes of ``grads`` (None for None)."""
    try:
        return tuple(map(_DTYPE, grads))
    except AttributeError:
        return tuple(None if g is None else g.dtype for g in grads)


@dataclass
class CachedEntry:
    """One work of a cached step: a state group's participating parameters."""

    group_index: int
    backend: Any
    work: backends.GroupStep
    counters: Any  # the optimizer's plan entry: its ``steps`` hold the work's step counters
    positions: tuple[int, ...] | None  # where work.params sit in their group (None: all, in order)
    prepared: Any = None  # the backend's prepared launch, or None (then backend.step(work))

    #: the byte ranges the work's launch writes (parameters, state) and its gradients' sizes
    #: in bytes (fixed: the cached step checks them), for :meth:`grads_apart`
    _written: tuple[tuple[list[int], list[int]] | None, tuple[int, ...]] | None = field(
        default=None, init=False, repr=False
    )
    #: (counters tensor, two views of it offset by one) for :meth:`counts_even`
    _shifted: tuple[Tensor, Tensor, Tensor] | None = field(default=None, init=False, repr=False)

    def grads_apart(self, addresses: Sequence[int] | None = None) -> bool:
        """Whether the work's gradients (moved since the launch was prepared) share no memory
        with what it writes: ``p1.grad = p0.detach()`` would have the kernel read a gradient
        that another program is writing. False also when unsure (the backend's ``prepare``
        then checks exactly, as the ordinary step does, and refuses a race). The written
        ranges are fixed while the cached step lives (its check holds the parameters at their
        addresses; the state arenas do not move)."""
        grads = self.work.grads
        if self._written is None:
            self._written = (
                sorted_extents([*self.work.params, *self.work.arena.tensors()]),
                tuple(map(_NBYTES, grads)),
            )
        # a strided gradient is refused by with_grads itself (prepared again)
        if addresses is None:
            addresses = tuple(map(_DATA_PTR, grads))
        return clear_of(self._written[0], addresses, self._written[1])

    def counts_even(self) -> bool:
        """Whether the work's parameters still hold one step count (host counters). No write
        counter sees an in-place edit of one ``state[p]["step"]`` (``zero_()`` to restart a
        parameter), and a replay counts the work as one from its first parameter's count."""
        slots = self.work.slots
        if len(slots) < 2:
            return True
        steps = self.counters.steps
        if not self.work.full:  # a subset: gathered (rare: parameters without gradients)
            picked = steps[torch.tensor(slots, device="cpu")]
            return torch.equal(picked[1:], picked[:-1])
        if self._shifted is None or self._shifted[0] is not steps:
            self._shifted = (steps, steps[1:], steps[:-1])  # views: they see later edits
        return torch.equal(self._shifted[1], self._shifted[2])

    @property
    def last_step(self) -> int:
        """The step count the work's parameters have reached (read from their counters, which
        another cached step of the same optimizer may also have advanced)."""
        # the slot's own view: indexing the counters tensor costs a torch call per group
        return int(self.counters.step_views[self.work.slots[0]].item())


class CachedStep:
    """Every state group's resolved step, valid while :meth:`current_grads` says so."""

    def __init__(
        self, entries: list[CachedEntry], groups: list[dict[str, Any]], keys: tuple
    ) -> None:
        self.entries = entries
        self.prepared = False
        self.replays = 0
        #: True: a gradient at a new address invalidates the step (a captured graph holds them)
        self.fixed_grads = False
        #: True: gradients that moved are followed by the backend's ``prepare`` (which caches
        #: their tables where a later ordinary step, e.g. one captured in a CUDA graph, finds
        #: them), not by the prepared launch's ``with_grads``
        self.follow_by_prepare = False
        self._moved: set[int] = set()  # groups whose gradients moved (new addresses: _new_gptrs)
        self._new_gptrs: tuple[int, ...] = ()
        self._groups = list(groups)
        self._keys = keys
        # the checks run over every group's tensors at once (one C-level pass each): per-group
        # passes cost several microseconds per group (per-layer param groups: dozens)
        self._counts = [len(g["params"]) for g in groups]
        self._spans = [
            (sum(self._counts[:gi]), sum(self._counts[: gi + 1])) for gi in range(len(groups))
        ]
        params = _all_params(groups)
        self._params = params  # the optimizer holds them anyway
        self._pptrs = param_addresses(params)
        self._psizes = param_sizes(params)
        self._pdtypes = param_dtypes(params)
        self._pcontig = contiguous_positions(params)
        grads = list(map(_GRAD, params))
        self._gptrs = grad_addresses(grads)
        self._gsizes = grad_sizes(grads)
        self._dtypes = grad_dtypes(grads)
        self._gcontig = contiguous_positions(grads)
        #: the parameters the works update: a replay advances all of their step counters
        self.participants = frozenset(id(p) for e in entries for p in e.work.param_owners)

    def counts_even(self) -> bool:
        """Whether every work's parameters still hold one step count
        (:meth:`CachedEntry.counts_even`), as the ordinary step that built it grouped them."""
        return all(e.counts_even() for e in self.entries)

    def splits(self, ids: frozenset[int] | set[int]) -> bool:
        """Whether advancing the step counters of the parameters ``ids`` (and no others) would
        leave one of this step's works with parameters at different step counts (a work reads
        its step count from its first parameter)."""
        for e in self.entries:
            inside = sum(id(p) in ids for p in e.work.param_owners)
            if 0 < inside < len(e.work.param_owners):
                return True
        return False

    def current_grads(
        self, groups: list[dict[str, Any]], keys: tuple
    ) -> list[list[Tensor | None]] | None:
        """Each param group's gradients when replaying is valid for ``groups`` (the optimizer's
        ``param_groups``) with resolution ``keys`` now, else None. Gradients at new addresses
        are noted for :meth:`follow_grads` (None with ``fixed_grads``)."""
        self._moved = set()
        if keys != self._keys or len(groups) != len(self._groups):
            return None
        if not all(map(is_, groups, self._groups)):
            return None
        if list(map(len, map(_PARAMS, groups))) != self._counts:
            return None
        params = _all_params(groups)
        if not all(map(is_, params, self._params)):
            return None  # another tensor in a group's list, possibly over the same memory
            # (``group["params"][i] = nn.Parameter(p.data)``): it starts from fresh state
        try:
            if param_addresses(params) != self._pptrs:
                return None
            if param_sizes(params) != self._psizes:
                return None  # resized at its address (``p.data = p.data[:n]``): a prepared
                # launch would still write the old size
            if param_dtypes(params) != self._pdtypes:
                return None  # another dtype at the same address (``p.data = new`` where the
                # allocator reused the old memory): the kernels would write the old one
            if not still_contiguous(params, self._pcontig):
                return None  # another layout at the same address (``p.data = p.data.t()``): a
                # prepared launch would write its memory in the old order
            grads = list(map(_GRAD, params))
            if grad_dtypes(grads) != self._dtypes:  # None where None, as before
                return None
            if grad_sizes(grads) != self._gsizes:
                return None  # ``p.grad.data = smaller`` (the .grad setter checks shapes, .data
                # does not): a prepared launch would read the old size
            if not still_contiguous(grads, self._gcontig):
                return None  # likewise ``p.grad = p.grad.t()``, read in the old order
            gptrs = grad_addresses(grads)
        except RuntimeError:  # a tensor without storage (a sparse gradient): the ordinary step
            return None  # explains what is wrong
        if gptrs != self._gptrs:
            if self.fixed_grads:
                return None
            if any_negated(grads) or (
                0 in gptrs  # a C-level scan; empty tensors are at 0 too
                and any(a == 0 and n > 0 for a, n in zip(gptrs, self._gsizes, strict=True))
            ):
                return None  # the ordinary step refuses a negated gradient, and hands the
                # kernels zeros for autograd's zero gradient (no memory: address 0)
            old = self._gptrs
            self._moved = {gi for gi, (a, b) in enumerate(self._spans) if gptrs[a:b] != old[a:b]}
            self._new_gptrs = gptrs
        return [grads[a:b] for a, b in self._spans]

    def follow_grads(self) -> None:
        """Point the prepared launches of the groups whose gradients moved (found by the last
        :meth:`current_grads`) at the gradients the works now hold (:meth:`hand_grads`)."""
        if not self._moved:
            return
        for e in self.entries:
            if e.prepared is None or e.group_index not in self._moved:
                continue
            with_grads = None if self.follow_by_prepare else getattr(e.prepared, "with_grads", None)
            if with_grads is not None and not e.grads_apart(self._work_addresses(e)):
                with_grads = None  # prepared again: its validation refuses shared memory
            prepared = with_grads(e.work.grads) if with_grads is not None else None
            if prepared is None:  # no shortcut (or a strided gradient): resolve the work again
                prepared = e.backend.prepare(e.work)
            e.prepared = prepared if prepared is not None and prepared.reusable else None
        self._settle_moved()

    def _work_addresses(self, e: CachedEntry) -> tuple[int, ...] | None:
        """The addresses of ``e``'s gradients where the last check read them (a work over its
        whole group, in order), else None."""
        if e.positions is not None:
            return None
        a, b = self._spans[e.group_index]
        return self._new_gptrs[a:b]

    def _settle_moved(self) -> None:
        """The prepared launches read the moved gradients: compare with those from now on."""
        if self._moved:
            self._gptrs = self._new_gptrs
        self._moved = set()

    def hand_grads(self, grads: list[list[Tensor | None]]) -> None:
        """Give each work the current gradients of its parameters."""
        for e in self.entries:
            # a work holds parameters that had gradients, and current_grads found None where
            # None was (a work with positions None holds its whole group)
            g = cast("list[Tensor]", grads[e.group_index])
            e.work.grads = g if e.positions is None else list(map(g.__getitem__, e.positions))

    def drop_grads(self) -> None:
        """Let go of the gradients (a queued kernel's stream keeps their memory valid)."""
        for e in self.entries:
            e.work.grads = []

    def prepare(self) -> None:
        """Resolve the prepared launches of backends that offer ``prepare()`` (the works hold
        their current gradients)."""
        for e in self.entries:
            prepare = getattr(e.backend, "prepare", None)
            prepared = prepare(e.work) if prepare is not None else None
            e.prepared = prepared if prepared is not None and prepared.reusable else None
        self.prepared = True
        self._settle_moved()
