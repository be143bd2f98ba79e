"""``run_eagerly``: a decorator for steps that ``torch.compile`` must not trace.

A compiled caller (``torch.compile(train_step)``) reaches an optimizer's ``step`` through
dynamo; the decorated function is a graph break and runs eagerly, as written. Steps need it:
inductor compiled the torch backend's rounding words (:mod:`memopt_core.rng`'s wrapping int64
arithmetic) into other values, and AdamBridge's hooks, threads and host buffers are no graph.

``torch.compiler.disable`` is applied at the first call, not at import: it imports
``torch._dynamo``, which imports triton, and importing memopt must do neither (it cost a second
per import, and a triton imported before ``TRITON_INTERPRET=1`` is set ignores it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["run_eagerly"]

F = TypeVar("F", bound=Callable[..., Any])


def run_eagerly(fn: F) -> F:
    """``fn`` wrapped so that ``torch.compile`` runs it eagerly (see the module doc)."""
    disabled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    # what torch.compiler.disable marks its wrappers with (without importing dynamo here): a
    # compiled caller then breaks its graph before the wrapper, not at the disable() call
    # inside it, and a fullgraph=True compile fails with this reason instead of dynamo's
    # "Attempted to call function marked as skipped ... file an issue to PyTorch"
    wrapper._torchdynamo_disable = True  # type: ignore[attr-defined]
    wrapper._torchdynamo_disable_msg = _REASON  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


_REASON = (
    "memopt runs optimizer steps eagerly (a graph break): compile the model or the forward and "
    "backward, and call step() outside the compiled function (or compile without fullgraph=True)"
)
