"""fp32 export: the full-precision weights as an ordinary torch state dict (no memopt to load it).

``fp32_model_state_dict(model, optimizer)`` is ``model.state_dict()`` with every floating entry
in (at least) fp32 and the true master weight where the optimizer keeps one beyond the parameter:

- memopt optimizers (``MemOptimizer`` and its subclasses: the ``memopt_ecc`` Flash* family,
  ApexW): an ECC master's bf16 parameter + code decoded (exactly fp32 for ECC-32), through
  :func:`memopt_core.fp32_state.get_fp32_model_state_dict` (memopt-core only);
- ``memopt_offload.AdamBridge``: its host fp32 masters (:meth:`AdamBridge.master_weight`);
- anything else (or no optimizer): the parameters widened to fp32.

Floating entries narrower than fp32 (bf16, fp16, fp8) are widened; float64 ones stay float64,
which fp32 would round, whatever the optimizer (as memopt-core's export does).

Non-tensor entries (a module's ``get_extra_state()``) pass through as they are. A model wrapped
in ``DistributedDataParallel`` / ``DataParallel`` is unwrapped, whatever the optimizer, as
:func:`memopt_core.fp32_state.get_fp32_model_state_dict` does: the keys are the wrapped model's, without the
``module.`` prefix, so the export loads into the bare model.

:func:`export_fp32` writes that dict with ``torch.save`` atomically (temporary file, fsync,
rename), so a crash never leaves a half-written export. To go back, load the file with
``torch.load`` and use ``memopt_ecc.set_fp32_model_state_dict`` (ECC models) or
``model.load_state_dict`` (others).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from memopt_core.atomic_write import atomic_file
from memopt_core.errors import ConfigError
from memopt_core.fp32_state import get_fp32_model_state_dict
from memopt_core.optimizer import MemOptimizer

__all__ = ["export_fp32", "fp32_model_state_dict"]

_WRAPPERS = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)


def fp32_model_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """``model.state_dict()`` (of the model inside a DDP/DataParallel wrapper) in (at least)
    fp32 with master weights where ``optimizer`` keeps them (see the module doc); new CPU
    tensors."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    while isinstance(model, _WRAPPERS):  # keys without "module.", as memopt_ecc's
        model = model.module
    if optimizer is not None:
        _check_optimizer_of(model, optimizer)
    if isinstance(optimizer, MemOptimizer):
        sd = get_fp32_model_state_dict(model, optimizer)
        return {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in sd.items()}
    masters: dict[int, torch.Tensor] = {}
    master_weight = getattr(optimizer, "master_weight", None)
    # (None's master_weight is None: the test of optimizer only narrows it for mypy)
    if optimizer is not None and callable(master_weight):  # memopt_offload.AdamBridge
        for g in optimizer.param_groups:
            for p in g["params"]:
                # every parameter it holds a master of: one frozen after training has its
                # trained master there, which the (bf16) parameter only rounds
                try:
                    masters[id(p)] = master_weight(p)
                except ConfigError:  # one it does not train
                    continue
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            p = params.get(name)
            if not torch.is_tensor(t):  # a module's get_extra_state(), for one
                out[name] = t
            elif p is not None and id(p) in masters:
                out[name] = masters[id(p)].detach().cpu().reshape(t.shape).clone()
            elif t.is_floating_point() and t.dtype.itemsize < 4:
                out[name] = t.detach().to("cpu", torch.float32).clone()
            else:
                out[name] = t.detach().cpu().clone()
    return out


def _check_optimizer_of(model: torch.nn.Module, optimizer: Any) -> None:
    """TypeError/ConfigError for an ``optimizer`` that is no optimizer (``opt.state_dict()``
    passed for ``opt``) or holds none of ``model``'s parameters (another model's): either way
    the export widened the bf16 weights and left out the masters it exists to keep."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be the optimizer itself (a torch.optim.Optimizer) or None, got "
            f"{type(optimizer).__name__}"
        )
    params = {id(p) for p in model.parameters()}
    if params and not any(id(p) in params for g in optimizer.param_groups for p in g["params"]):
        raise ConfigError(
            f"the {type(optimizer).__name__} holds none of the model's parameters (another "
            "model's optimizer?): its master weights would be left out"
        )


def export_fp32(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Write :func:`fp32_model_state_dict` to ``path`` with ``torch.save``, atomically."""
    sd = fp32_model_state_dict(model, optimizer)
    with atomic_file(path) as f:
        torch.save(sd, f)
