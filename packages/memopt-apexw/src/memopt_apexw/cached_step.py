"""The resolved step that ApexW replays while nothing changed: O(1) work per group per step
plus one check over the tensors' addresses.

A :class:`CachedStep` is built from the :class:`~memopt_core.backends.GroupStep` list of an
ordinary ``MemOptimizer`` step when every tensor of each state group took part at one common step
count. It keeps each group's ``GroupStep`` (and the backend's prepared launch where the backend
offers ``prepare()``, i.e. Triton), the per-parameter ``step`` counters as views of one tensor
per group (one ``add_`` per step; shared by the cached steps of every mode), and the addresses it
was resolved for.

:meth:`CachedStep.current_grads` is the validity check before every replay: every parameter of
every param group still has the address it had, and every gradient has the address it had (or is
still None). Addresses, not tensors, are what a prepared launch holds, so a gradient that was
freed (``zero_grad(set_to_none=True)``) and allocated again at the same address is still valid:
torch gives a parameter's gradient the parameter's dtype, shape and layout. The cached step holds
no gradient between steps (it would keep freed gradients' memory alive); each replay hands the
current ones to the backend. Cost: two C-level passes over the tensors (about 0.3 us per tensor
on the H200's host, docs/apexw.md); everything else is per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch
from torch import Tensor

from memopt_core import backends

__all__ = ["CachedEntry", "CachedStep", "addresses", "grad_addresses", "param_addresses"]

_GRAD = attrgetter("grad")
_DATA_PTR = Tensor.data_ptr


def param_addresses(params: Sequence[Tensor]) -> tuple[int, ...]:
    """Storage addresses of ``params``."""
    return tuple(map(_DATA_PTR, params))


def addresses(tensors: Sequence[Tensor | None]) -> tuple[int, ...]:
    """Storage addresses of ``tensors`` (0 for None)."""
    try:
        return tuple(map(_DATA_PTR, tensors))  # C-level loop: the common case
    except TypeError:  # some entry is None
        return tuple(0 if t is None else t.data_ptr() for t in tensors)


def grad_addresses(params: Sequence[Tensor]) -> tuple[int, ...]:
    """Addresses of the gradients of ``params`` (0 where a gradient is None)."""
    return addresses(list(map(_GRAD, params)))


@dataclass
class CachedEntry:
    """One state group (param group x device x dtype) of a cached step."""

    group_index: int
    backend: Any
    work: backends.GroupStep
    prepared: Any  # a backend's prepared launch, or None (then backend.step(work))
    steps: Tensor  # the participating parameters' ``step`` counters (their state views)
    positions: tuple[int, ...]  # where ``work.params`` sit in their param group's list

    @property
    def last_step(self) -> int:
        """The step count every participating parameter has reached (read from the state, which
        another mode's cached step or an ordinary step may also have advanced)."""
        return int(self.steps[0].item())


class CachedStep:
    """Every group's resolved step, valid while :meth:`current_grads` says so (module doc)."""

    def __init__(
        self,
        entries: list[CachedEntry],
        groups: list[dict[str, Any]],
        formats: list[tuple],
    ) -> None:
        self.entries = entries
        self._groups = groups
        self._counts = [len(g["params"]) for g in groups]
        self._pptrs = [param_addresses(g["params"]) for g in groups]
        self._gptrs = [grad_addresses(g["params"]) for g in groups]
        self._formats = formats
        for e in entries:
            e.work.grads = []  # hold no gradient between steps

    @staticmethod
    def group_formats(group: dict[str, Any]) -> tuple:
        """What a group's cached launch was compiled for besides the scalars."""
        return (group["master"], group["moments"], group["stochastic_rounding"], group["maximize"])

    def current_grads(self, groups: list[dict[str, Any]]) -> list[list[Tensor | None]] | None:
        """Each param group's current gradients when replaying is valid for ``groups`` (the
        optimizer's ``param_groups``) now, else None."""
        if len(groups) != len(self._groups):
            return None
        out = []
        for gi, group in enumerate(groups):
            params = group["params"]
            if group is not self._groups[gi] or len(params) != self._counts[gi]:
                return None
            if self.group_formats(group) != self._formats[gi]:
                return None
            if param_addresses(params) != self._pptrs[gi]:
                return None
            grads = list(map(_GRAD, params))
            if addresses(grads) != self._gptrs[gi]:
                return None
            out.append(grads)
        return out

    def matches(self, groups: list[dict[str, Any]]) -> bool:
        """Whether replaying is valid for ``groups`` now."""
        return self.current_grads(groups) is not None

    def hand_grads(self, grads: list[list[Tensor | None]]) -> None:
        """Give each entry's work the current gradients of its parameters."""
        for e in self.entries:
            g = grads[e.group_index]
            e.work.grads = [g[i] for i in e.positions]

    def drop_grads(self) -> None:
        """Let go of the gradients after the launches (the stream keeps their memory valid
        for the queued kernels; only Python's references go)."""
        for e in self.entries:
            e.work.grads = []

    def advance(self) -> None:
        """Count one step in every participating parameter's ``step`` state."""
        with torch.no_grad():
            for e in self.entries:
                e.steps.add_(1)
