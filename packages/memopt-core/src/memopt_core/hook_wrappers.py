"""Which module wrappers per-parameter update hooks cannot work under.

memopt's per-parameter hooks (``memopt_ecc.enable_gradient_release``,
``memopt_offload.AdamBridge.attach_hooks``) act on a parameter's gradient the moment
``register_post_accumulate_grad_hook`` says it is final. Two wrappers make that gradient not the
one to apply: :func:`reject_hook_wrappers` refuses them with a ``TypeError`` that says why. A
gradient already in ``.grad`` when the hooks attach would be added to the next backward's (the
ordinary loop's ``zero_grad`` comes before backward, and hooks need none):
:func:`reject_pending_gradients` refuses it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memopt_core.errors import ConfigError

__all__ = [
    "reject_hook_wrappers",
    "reject_pending_gradients",
    "reject_unsynchronized",
    "remove_hooks",
]


def reject_hook_wrappers(model: nn.Module, who: str) -> None:
    """TypeError when ``model`` or a submodule is DistributedDataParallel or FSDP1;
    ``who`` names the caller in the message (e.g. ``"enable_gradient_release()"``)."""
    ddp = nn.parallel.DistributedDataParallel
    fsdp1: type | None = None
    if torch.distributed.is_available():
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel as fsdp1
        except ImportError:  # pragma: no cover - builds without FSDP
            fsdp1 = None
    for name, m in model.named_modules():
        where = f"the model's submodule {name!r}" if name else "the model"
        if isinstance(m, ddp):
            raise TypeError(
                f"{who} cannot work with DistributedDataParallel ({where} is one): DDP "
                "all-reduces gradients in buckets and writes the averaged bucket back into p.grad "
                "after the per-parameter hooks have run, so a hook would use the local, "
                "un-averaged gradient (and free the tensor DDP writes into). Use DDP with the "
                "ordinary loop: backward, then step(); or FSDP2 (fully_shard), whose sharded "
                "parameters every memopt optimizer but AdamBridge takes, gradient release included"
            )
        if fsdp1 is not None and isinstance(m, fsdp1):
            raise TypeError(
                f"{who} cannot work with FSDP1 FullyShardedDataParallel ({where} is one): FSDP1 "
                "flattens parameters into FlatParameters and reduce-scatters their gradients "
                "after backward, so per-parameter hooks never see a final gradient of the "
                "tensors the optimizer holds. Use DDP with the ordinary loop: backward, then "
                "step(); or FSDP2 (fully_shard), whose sharded parameters every memopt optimizer "
                "but AdamBridge takes, gradient release included"
            )


def reject_unsynchronized(model: nn.Module, who: str, escape: str | None = None) -> None:
    """TypeError when several processes run and ``model`` trains parameters that are not
    sharded (not DTensors): their gradients are each process's own when the per-parameter hooks
    see them. :func:`reject_hook_wrappers` catches a DDP wrapper it is given, not one around
    ``ddp.module``, one wrapped after the call, or composable ``replicate()``: there the hooks
    updated each replica with its local gradient, and the replicas drifted apart silently.
    ``escape``: how the caller lets a run whose processes train parameters of their own."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    from memopt_core.sharding import is_dtensor

    plain = [n for n, p in model.named_parameters() if p.requires_grad and not is_dtensor(p)]
    if not plain:
        return
    more = f" (and {len(plain) - 1} more)" if len(plain) > 1 else ""
    raise TypeError(
        f"{who} with {dist.get_world_size()} processes: parameter {plain[0]!r}{more} is not "
        "sharded (not a DTensor), so the hooks would see this process's own gradient. Data "
        "parallel training averages gradients after the hooks ran (DDP, also around the model's "
        ".module or wrapped later, and replicate()), so each replica would be updated with its "
        "local gradient. Use FSDP2 (fully_shard), or DDP with the ordinary loop: backward, then "
        "step()" + (f"; if each process trains parameters of its own, {escape}" if escape else "")
    )


def reject_pending_gradients(model: nn.Module, held: set[int], who: str) -> None:
    """ConfigError naming the first parameter of ``model`` whose id is in ``held`` (those the
    hooks will update) and that still holds a gradient."""
    for name, p in model.named_parameters():
        if id(p) in held and p.grad is not None:
            raise ConfigError(
                f"{who}: parameter {name!r} (shape {tuple(p.shape)}) still holds a gradient "
                "from an earlier backward, which the next backward would add to its own before "
                "the hook updates it (zeros too: zero_grad(set_to_none=False) keeps the "
                "tensor): call zero_grad() (set_to_none=True, the default) first"
            )


def remove_hooks(handles: list[Any]) -> None:
    """Remove every hook of ``handles`` (``RemovableHandle``s) and empty the list."""
    for h in handles:
        h.remove()
    handles.clear()
