"""Which module wrappers per-parameter update hooks cannot work under.

memopt's per-parameter hooks (``memopt_ecc.enable_gradient_release``,
``memopt_offload.AdamBridge.attach_hooks``) act on a parameter's gradient the moment
``register_post_accumulate_grad_hook`` says it is final. Two wrappers make that gradient not the
one to apply: :func:`reject_hook_wrappers` refuses them with a ``TypeError`` that says why.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["reject_hook_wrappers"]


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
