"""The ``memopt`` entry of memopt's optimizer state dicts, kept where torch's helpers keep it.

memopt's optimizers record what their states mean beside ``state`` and ``param_groups``: the
rule, the stochastic-rounding seed, the state-dict version (and, per family, FlashOptim's
``compressed``, AdamBridge's precision and clipping state), under a top-level ``"memopt"`` key.
torch's ``torch.distributed.checkpoint.state_dict`` helpers (``get_state_dict``,
``get_optimizer_state_dict`` and their ``set_*``) keep only ``state`` and ``param_groups``, but
every key of each param group dict, so :func:`add_group_meta` puts a copy of the entry into every
saved group as well, and :func:`saved_meta` reads it back from the top level or, where that is
missing, from the groups (which must all hold the same one). The live ``param_groups`` never hold
it: :func:`without_meta` takes it out of a saved group before its keys are merged into a live one
(torch's ``Optimizer.load_state_dict`` would copy it there).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor, equal

from memopt_core.errors import StateDictError

__all__ = ["META_KEY", "add_group_meta", "saved_meta", "without_meta"]

#: the key of memopt's entry, at the top level of a state dict and in each of its param groups
META_KEY = "memopt"


def add_group_meta(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (changed in place and returned) with a copy of its top-level ``memopt``
    entry in each of its ``param_groups`` (the saved groups: new dicts, never the live ones)."""
    meta = state_dict[META_KEY]
    for group in state_dict["param_groups"]:
        group[META_KEY] = dict(meta)
    return state_dict


def without_meta(group: Mapping[str, Any]) -> dict[str, Any]:
    """A saved param group without its ``memopt`` entry (a new dict)."""
    return {k: v for k, v in group.items() if k != META_KEY}


def _same(a: Any, b: Any) -> bool:
    """Equal values of a ``memopt`` entry (NaN equals NaN: AdamBridge's ``last_grad_norm``)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def saved_meta(state_dict: Mapping[str, Any], what: str = "the state dict") -> Any:
    """The ``memopt`` entry of ``state_dict``: the top-level one where it has one (not None),
    else the one each of its param groups holds (a dict that went through torch's
    ``get_state_dict`` / ``set_state_dict``), else None (a dict of a memopt that saved it at the
    top level only, through those helpers). The value is returned unchecked (the caller checks
    its contents); :class:`StateDictError` when only some of the groups hold one, or when they
    differ (``what`` names the dict in the message)."""
    top = state_dict.get(META_KEY)
    if top is not None:
        return top
    groups = state_dict.get("param_groups")
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
        return None  # the caller explains what is wrong
    held = [gi for gi, g in enumerate(groups) if META_KEY in g]
    if not held:
        return None
    if len(held) != len(groups):
        lacking = [gi for gi in range(len(groups)) if gi not in held]
        raise StateDictError(
            f"param group(s) {held} of {what} hold a {META_KEY!r} entry (rule, seed, version), "
            f"group(s) {lacking} none: a memopt optimizer saves it in every group. Were param "
            "groups of different state dicts mixed? (torch's set_state_dict hands a param group "
            "without parameters, other than the last, another group's saved entries)"
        )
    first = groups[held[0]][META_KEY]
    for gi in held[1:]:
        other = groups[gi][META_KEY]
        if not _same(first, other):
            raise StateDictError(
                f"param groups {held[0]} and {gi} of {what} hold different {META_KEY!r} entries "
                f"({first!r} and {other!r}); one optimizer saves the same one in every group. "
                "Were param groups of different optimizers' state dicts mixed? (torch's "
                "get_state_dict of several optimizers at once saves all their groups in one "
                "list: load it with set_state_dict, which splits them again)"
            )
    return first
