"""torch's state-dict hooks at the points torch runs them, for optimizers whose state dicts
torch's base methods only begin (memopt adds, decodes or loads the real state around them).

torch runs ``register_state_dict_post_hook`` hooks at the end of ``Optimizer.state_dict()``, and
``register_load_state_dict_pre_hook`` / ``post_hook`` hooks at the start and end of
``load_state_dict()``. An optimizer that calls the base methods for part of the work would run
them too early: a post-hook would see a dict without the memopt entries (or with encoded
moments where decoded ones are returned), and a pre-hook would see an empty ``state`` after
the real state had already been loaded, so a pre-hook that refuses a dict would leave the
optimizer half-loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast, overload

from torch.optim import Optimizer

__all__ = [
    "finished_state_dict",
    "load_hooks_suspended",
    "run_load_post_hooks",
    "run_load_pre_hooks",
]


def finished_state_dict(opt: Optimizer, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``build()``'s state dict with ``opt``'s state-dict post-hooks run on the finished dict
    (a hook's non-None result replaces it), not inside the base ``state_dict()`` it calls."""
    hooks = opt._optimizer_state_dict_post_hooks
    opt._optimizer_state_dict_post_hooks = OrderedDict()  # the base method finds none
    try:
        sd = build()
    finally:
        opt._optimizer_state_dict_post_hooks = hooks  # the same dict: handles still remove
    for hook in hooks.values():
        result = hook(opt, sd)
        if result is not None:
            sd = result
    return sd


@overload
def run_load_pre_hooks(opt: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]: ...


@overload
def run_load_pre_hooks(opt: Optimizer, state_dict: Mapping[str, Any]) -> Mapping[str, Any]: ...


def run_load_pre_hooks(opt: Optimizer, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict`` after ``opt``'s load pre-hooks (each may return a replacement): what
    ``load_state_dict`` must validate and load. Run before anything changes."""
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        # torch types the hooks for the dict its load_state_dict takes; they get the mapping
        # the caller passed, as they would from torch
        result = hook(opt, cast("dict[str, Any]", state_dict))
        if result is not None:
            state_dict = result
    return state_dict


def run_load_post_hooks(opt: Optimizer) -> None:
    """``opt``'s load post-hooks, run once everything is loaded."""
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)


@contextmanager
def load_hooks_suspended(opt: Optimizer) -> Iterator[None]:
    """Inside, the base ``load_state_dict`` runs no load hooks (the caller runs them itself at
    the start and the end, :func:`run_load_pre_hooks` and :func:`run_load_post_hooks`)."""
    pre, post = opt._optimizer_load_state_dict_pre_hooks, opt._optimizer_load_state_dict_post_hooks
    opt._optimizer_load_state_dict_pre_hooks = OrderedDict()
    opt._optimizer_load_state_dict_post_hooks = OrderedDict()
    try:
        yield
    finally:
        opt._optimizer_load_state_dict_pre_hooks = pre
        opt._optimizer_load_state_dict_post_hooks = post
