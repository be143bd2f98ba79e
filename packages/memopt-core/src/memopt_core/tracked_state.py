"""The optimizer's ``state`` mapping and its per-parameter dicts, counting every write to them.

A :class:`~memopt_core.MemOptimizer` keeps each parameter's state in arenas and hands out
views of them; its cached step replays without reading ``self.state``. torch's optimizers read
the state afresh at every step, so a user may delete one (``del opt.state[p]``,
``opt.state.clear()``), replace one (``opt.state[p] = {...}``) or replace a tensor in one
(``opt.state[p]["exp_avg"] = t``) and expect the next step to use what is there now. These
dicts count such writes in one shared :class:`WriteCounter`, so the optimizer notices any of them
in O(1) per step and then rebuilds the affected groups from the state as it is (a missing state
starts fresh, a replaced tensor is copied into the arena). In-place edits of the tensors
(``opt.state[p]["exp_avg"].zero_()``) need nothing: they are views of the arenas.

Both pickle, copy and deep-copy as the plain ``defaultdict(dict)`` / ``dict`` torch uses, so
nothing outside memopt ever needs these classes (``torch.load(weights_only=True)`` included).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["ParamState", "TrackedState", "WriteCounter"]


class WriteCounter:
    """The number of writes to a :class:`TrackedState` and its :class:`ParamState` dicts."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


def _counting(base: type, name: str):
    """``base``'s method ``name``, counting a write first."""
    real = getattr(base, name)

    def method(self, *args, **kwargs):
        self._counter.n += 1
        return real(self, *args, **kwargs)

    method.__name__ = name
    return method


_WRITES = (
    "__setitem__",
    "__delitem__",
    "__ior__",
    "clear",
    "pop",
    "popitem",
    "setdefault",
    "update",
)


class ParamState(dict):
    """One parameter's state (a ``dict``) whose writes are counted."""

    def __init__(self, counter: WriteCounter, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._counter = counter

    def __reduce__(self):
        return (dict, (), None, None, iter(self.items()))  # a plain dict's


class TrackedState(defaultdict):
    """``parameter -> state`` (a ``defaultdict`` of dicts, as torch's ``Optimizer.state``) whose
    writes, and those of the states it creates for missing keys, are counted."""

    def __init__(self, counter: WriteCounter, *args: Any) -> None:
        super().__init__(None, *args)
        self._counter = counter
        self.default_factory = self._new_state

    def _new_state(self) -> ParamState:
        return ParamState(self._counter)

    def __reduce__(self):
        return (defaultdict, (dict,), None, None, iter(self.items()))  # a plain defaultdict's

    def __copy__(self):
        out: defaultdict = defaultdict(dict)
        dict.update(out, self)
        return out


for _name in _WRITES:
    setattr(ParamState, _name, _counting(dict, _name))
    setattr(TrackedState, _name, _counting(defaultdict, _name))
