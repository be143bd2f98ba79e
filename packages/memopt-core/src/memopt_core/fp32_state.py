"""Full-precision weights in and out of a model trained with ECC master weights.

A bf16 parameter with master ``ecc24`` / ``ecc32`` is only half of its weight: the other half is
the code in ``optimizer.state[p]["master_code"]``. :func:`get_fp32_model_state_dict` decodes
both with the master codec of :mod:`memopt_core.formats` into an ordinary fp32 state dict (load it
into an fp32 copy of the model, or save it as a portable checkpoint);
:func:`set_fp32_model_state_dict` encodes fp32 weights back into the parameters and their codes.

Round trips: ECC-32 is exact (``get(set(sd)) == sd`` bit for bit, for every finite fp32 value);
ECC-24 keeps 16 significant bits (``set`` rounds to nearest, so ``get(set(sd))`` is ``sd`` rounded
to the 24-bit master pattern, and ``set(get())`` changes nothing); without a master (``none``) the
weight is the bf16 parameter (``set`` rounds to nearest even); fp32 parameters are copied.

It needs only memopt-core, so memopt-checkpoint's fp32 export works for any memopt optimizer
without memopt-ecc installed; ``memopt_ecc`` re-exports these functions (FlashOptim's names).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from memopt_core import MemOptimizer, conversions
from memopt_core.aliasing import has_memory, same_view, share_memory
from memopt_core.errors import StateDictError
from memopt_core.formats import master_codec
from memopt_core.optimizer import _fits_plan, check_bool, require_memopt_optimizer
from memopt_core.sharding import is_dtensor, local_shard, sharded_like, sharding_mismatch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["fp32_master", "get_fp32_model_state_dict", "set_fp32_model_state_dict"]


def _unwrap(model: nn.Module) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    wrappers: tuple[type, ...] = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    while isinstance(model, wrappers):
        # DistributedDataParallel does not declare .module's type (nn.Module's __getattr__
        # would say Tensor | Module); both wrappers hold the wrapped module there
        model = cast(nn.Module, model.module)
    return model


def _groups(optimizer: MemOptimizer) -> dict[int, Mapping[str, Any]]:
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def _master_name(p: Tensor, group: Mapping[str, Any]) -> str:
    return "fp32" if p.dtype == torch.float32 else group["master"]


def _check_code_fits(optimizer: MemOptimizer, param: Tensor) -> None:
    """StateDictError for ``param`` (holding a master code) cast, moved or reshaped since its
    optimizer state was created: the code belongs to the tensor it was created for, so it
    cannot be decoded with this one (an fp32 parameter has no code at all)."""
    p = local_shard(param)
    loc = optimizer._where.get(id(param))
    plan = optimizer._plans[loc[0]].entries[loc[1]].plan if loc is not None else None
    if plan is not None and loc is not None and not _fits_plan(p, plan, loc[2]):
        was = f"{plan.param_dtype} of shape {tuple(plan.slots[loc[2]].shape)} on {plan.device}"
    elif p.dtype == torch.float32:  # its own master: no plan records what the code was for
        was = "a low-precision parameter"
    else:
        return
    raise StateDictError(
        f"{optimizer._param_label(param)} is {p.dtype} of shape {tuple(p.shape)} on {p.device}, "
        f"but its optimizer state (and ECC master code) was created for {was}: the code "
        "belongs to that tensor, and casting in place (cast_model(model, dtype=torch.float32)) "
        "dropped its low bits. Take get_fp32_model_state_dict(model, optimizer) before "
        "casting the model, and load that dict into the cast one"
    )


def _decode(optimizer: MemOptimizer, param: Tensor, group: Mapping[str, Any] | None) -> Tensor:
    code = optimizer.state.get(param, {}).get("master_code") if group is not None else None
    if code is not None:
        _check_code_fits(optimizer, param)
    p = local_shard(param.detach())  # a sharded parameter: decode its shard, hand out a DTensor
    if code is None or group is None:
        out = p.float().clone() if p.dtype != torch.float32 else p.clone()
    else:
        codec = master_codec(_master_name(param, group), p.dtype)
        out = conversions.decode_master(codec, p, code).reshape(p.shape)
    return sharded_like(param, out)


def fp32_master(optimizer: MemOptimizer, param: Tensor) -> Tensor:
    """The fp32 master weight of ``param`` (a new tensor shaped like it, on its device).

    bf16 parameter + ECC code decoded with the master codec; without a code (master ``none``, a
    parameter without state yet, or one the optimizer does not hold) the parameter widened to
    fp32, which is also what a fresh ECC state decodes to. ``param.detach()`` or ``param.data``
    stands for the parameter; a part of a held parameter (``param[0]``) raises ``ValueError``:
    widened, it would not be that part's master weight.
    """
    require_memopt_optimizer(optimizer)
    held = _groups(optimizer)
    if id(param) not in held and not is_dtensor(param) and has_memory(param):
        param = _held_alias(optimizer, param)
    return _decode(optimizer, param, held.get(id(param)))


def _held_alias(optimizer: MemOptimizer, t: Tensor) -> Tensor:
    """The held parameter ``t`` is a detached alias of (the same view of its memory), else
    ``t`` when it shares no byte with one; ValueError for a part of one."""
    for gi, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if is_dtensor(p) or p.device != t.device or not share_memory(p.detach(), t):
                continue
            if same_view(p, t):
                return p
            raise ValueError(
                f"fp32_master got a tensor that is part of parameter #{i} of param group {gi} "
                f"(shape {tuple(p.shape)}), not the parameter: its ECC code belongs to the "
                "whole parameter. Pass the parameter, and index its fp32 master"
            )
    return t


def get_fp32_model_state_dict(model: nn.Module, optimizer: MemOptimizer) -> dict[str, Any]:
    """``model.state_dict()`` with its floating tensors in (at least) fp32, ECC ones decoded.

    Keys are those of the (unwrapped, for DDP/DataParallel) model's ``state_dict()``, tied
    parameters under each of their names; values are new tensors on the model's devices.
    Parameters with an ECC code hold their full master weight; other bf16/fp16 parameters and
    buffers are widened to fp32, float64 ones stay float64 (fp32 would round them); integer
    tensors (``num_batches_tracked``, an index table) keep their dtype. For an fp32 copy of a
    model cast by ``memopt_ecc.cast_model`` to load it into, use ``cast_model(copy,
    dtype=torch.float32)``: ``.float()`` keeps the cast's hooks (recast layers output bf16).
    """
    require_memopt_optimizer(optimizer)
    model = _unwrap(model)
    held = _groups(optimizer)
    out: dict[str, Any] = {}
    with torch.no_grad():
        for key, value in model.state_dict(keep_vars=True).items():
            if not isinstance(value, Tensor):
                out[key] = value
            elif isinstance(value, nn.Parameter) and id(value) in held:
                out[key] = _decode(optimizer, value, held[id(value)])
            elif value.is_floating_point() and value.dtype.itemsize < 4:
                out[key] = value.detach().float()
            else:
                out[key] = value.detach().clone()
    return out


def _written_bytes(target: Tensor, value: Tensor) -> Tensor:
    """The bytes that loading ``value`` writes into ``target`` (NaNs compare by their bits)."""
    return value.detach().to(device="cpu", dtype=target.dtype).reshape(-1).view(torch.uint8)


def _check_value_dtype(key: str, target: Tensor, value: Tensor) -> None:
    """StateDictError unless ``value``'s dtype loads into ``target`` (see
    :func:`set_fp32_model_state_dict`): a cast that rounds a float into an int, or an ECC
    parameter's fp32 weight through another dtype, would change it silently."""
    if not target.is_floating_point():
        ok, want = value.dtype == target.dtype, f"{target.dtype}, as the model's"
    elif isinstance(target, nn.Parameter):
        ok = value.dtype == torch.float32 or value.dtype == target.dtype == torch.float64
        want = "float32 (the dict get_fp32_model_state_dict returns)"
    else:
        ok, want = value.is_floating_point(), "a floating dtype, as the model's"
    if not ok:
        raise StateDictError(f"entry {key!r} is {value.dtype}; it loads from {want}")


_HOW_TO_RESHARD = (
    "load it into the model sharded as it was saved (the same processes), or load the "
    "checkpoint through torch.distributed.checkpoint (dcp.save of the dict "
    "get_fp32_model_state_dict returns; dcp.load into this model's, which reshards it)"
)


def _local_value(key: str, target: Tensor, value: Tensor) -> Tensor:
    """The part of ``value`` that ``target``'s local shard holds (``value`` itself unsharded),
    once its sharding is checked (StateDictError): the copies would fail inside torch, after
    the entries before it were written."""
    if not is_dtensor(target):
        if is_dtensor(value):
            raise StateDictError(
                f"entry {key!r} is a DTensor (a sharded model's, as get_fp32_model_state_dict "
                "returns it under FSDP2); this model's parameter is not sharded: pass the whole "
                "tensor (value.full_tensor(), called on every process of the saving mesh), or "
                + _HOW_TO_RESHARD
            )
        return value
    want = tuple(cast("DTensor", target).placements)
    if not is_dtensor(value):
        raise StateDictError(
            f"entry {key!r} is a plain tensor; its parameter is sharded ({want}): pass "
            "the DTensors get_fp32_model_state_dict returns for the sharded model"
        )
    why = sharding_mismatch(target, value)
    if why is not None:
        raise StateDictError(f"entry {key!r} {why}: {_HOW_TO_RESHARD}")
    local = cast("DTensor", value).to_local()
    own = local_shard(target)
    if local.shape != own.shape:
        raise StateDictError(
            f"entry {key!r} holds a local shard of shape {tuple(local.shape)}; this process's "
            f"shard of the parameter has shape {tuple(own.shape)} (a file of another rank?): "
            + _HOW_TO_RESHARD
        )
    return local


def set_fp32_model_state_dict(
    model: nn.Module,
    optimizer: MemOptimizer,
    state_dict: Mapping[str, Any],
    strict: bool = True,
) -> None:
    """Load fp32 weights into a (bf16) model and its optimizer's ECC codes.

    Each parameter the optimizer holds is encoded with its master codec (round to nearest): the
    parameter gets the bf16 half, ``optimizer.state[p]["master_code"]`` the code, so the next step
    starts from exactly these weights (ECC-32: bit for bit). Other parameters and buffers are
    copied with a cast. Moments and step counters are untouched. Optimizer state is created for
    trainable parameters that have none yet (``init_state()``: also for those that have had no
    gradient, so that their codes keep the loaded weights); a frozen parameter without state
    only gets the rounded bf16 value.

    ``strict`` (default): the keys must equal ``model.state_dict()``'s. Values must be dense
    tensors with data (not meta, not sparse) of the model's shapes; floating parameters load
    from float32 values (a float64 parameter also from float64), tensors of other dtypes from
    their own dtype, floating buffers from floating values; tied parameters must get equal
    values. A sharded (FSDP2) parameter loads from a DTensor on its device mesh with its
    placements and local shard shape (another number of processes reshards through
    ``torch.distributed.checkpoint``), a plain parameter from a plain tensor. Everything is
    checked before anything changes (:class:`memopt_core.StateDictError`).
    """
    require_memopt_optimizer(optimizer)
    check_bool("strict", strict)
    model = _unwrap(model)
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"expected a state dict (a mapping), got {type(state_dict).__name__}")
    targets = model.state_dict(keep_vars=True)
    if strict:
        missing = [k for k in targets if k not in state_dict]
        unexpected = [k for k in state_dict if k not in targets]
        if missing or unexpected:
            raise StateDictError(
                f"the fp32 state dict does not match the model: missing keys {missing[:8]}, "
                f"unexpected keys {unexpected[:8]} (pass strict=False to load the common keys)"
            )
    held = _groups(optimizer)
    chosen: dict[int, tuple[str, Tensor, Tensor]] = {}
    buffers: dict[int, tuple[str, Tensor, Tensor]] = {}
    for key, target in targets.items():
        if key not in state_dict or not isinstance(target, Tensor):
            continue
        value = state_dict[key]
        if not isinstance(value, Tensor):
            raise StateDictError(f"entry {key!r} must be a tensor, got {type(value).__name__}")
        if tuple(value.shape) != tuple(target.shape):
            raise StateDictError(
                f"entry {key!r} has shape {tuple(value.shape)}; the model's is {tuple(target.shape)}"
            )
        if value.layout != torch.strided or value.is_meta:
            # found only by the copies, after earlier entries were written
            raise StateDictError(
                f"entry {key!r} is a {value.layout} tensor on {value.device}; values must be "
                "dense tensors that hold data"
            )
        _check_value_dtype(key, target, value)
        if isinstance(target, nn.Parameter) and target.is_floating_point():
            value = _local_value(key, target, value)
            prev = chosen.get(id(target))
            if prev is not None:
                a, b = (t.detach().cpu().contiguous().view(torch.int32) for t in (prev[2], value))
                if not torch.equal(a, b):
                    raise StateDictError(
                        f"entries {prev[0]!r} and {key!r} name one tied parameter but differ"
                    )
                continue
            chosen[id(target)] = (key, target, value)
        else:
            prev = buffers.get(id(target))
            if prev is not None:  # one tensor under two names (a shared buffer): one value
                a, b = (_written_bytes(target, t) for t in (prev[2], value))
                if not torch.equal(a, b):
                    raise StateDictError(
                        f"entries {prev[0]!r} and {key!r} name one tensor but differ"
                    )
                continue
            buffers[id(target)] = (key, target, value)
    if any(id(t) in held for _, t, _ in chosen.values()):
        # the codes live in the optimizer's state: create it for every trainable parameter
        optimizer.init_state()
    with torch.no_grad():
        for _, param, value in chosen.values():
            p = local_shard(param)
            if p.dtype.itemsize >= 4:  # float32 (its own master) or float64: copied
                p.detach().copy_(value.detach())
                continue
            x = value.detach().to(device=p.device, dtype=torch.float32)
            group = held.get(id(param))
            if group is None:
                p.detach().copy_(x)  # not optimized here: a plain (nearest) cast
                continue
            codec = master_codec(_master_name(p, group), p.dtype)
            slot = optimizer.state.get(param, {}).get("master_code")
            if p.is_contiguous():  # in slices: no whole-tensor temporaries
                conversions.encode_master_into(codec, x, p.detach(), slot)
            else:
                low, code = conversions.encode_master(codec, x.reshape(-1))
                p.detach().copy_(low.view(p.shape))
                if slot is not None and code is not None:
                    slot.copy_(code.view(slot.shape))
        for _, b, value in buffers.values():
            b.detach().copy_(value.detach())
