"""Interop: vanilla ``torch.optim`` state dicts <-> memopt optimizers.

- :func:`to_torch_state_dict`: a memopt optimizer's state as the state dict of the matching torch
  optimizer (``adamw`` -> :class:`torch.optim.AdamW`, ``adam`` -> :class:`torch.optim.Adam`,
  ``sgd`` / ``sgdw`` -> :class:`torch.optim.SGD`), loadable with its ``load_state_dict()``.
- :func:`load_torch_state_dict`: the reverse, a torch optimizer's state dict into a memopt one.
- :func:`quantization_bound` / :data:`QUANTIZATION_BOUNDS` / :func:`quantization_error_bound`:
  what loading an fp32 moment into each memopt moment format may change.

Bytes and precision. torch keeps every moment in fp32 (4 B per element per moment: 8 B per
parameter element for Adam/AdamW, 4 for SGD with momentum); memopt keeps them in its format
(``fp32`` 4, ``bf16`` 2, ``fp8`` / ``q8`` 1.03125 B per element per moment).

- memopt -> torch decodes each moment with its codec: exact for ``fp32`` (bit for bit), and for
  ``bf16`` / ``fp8`` / ``q8`` exactly the values memopt itself computes with, so the export adds
  no error of its own. Adam's second moments in ``fp8`` / ``q8`` are stored decay-normalized,
  ``u = v / N`` with ``N = beta2**(step % P)`` (:meth:`MemOptimizer.decay_norm
  <memopt_core.MemOptimizer.decay_norm>`); the export hands out torch's ``v = u * N``, rounded
  once to fp32 (within 2**-24 of ``v`` relative).
- torch -> memopt encodes each fp32 moment into the optimizer's format, rounding to nearest even
  (never stochastically: the result is deterministic): exact for ``fp32``; otherwise within
  :data:`QUANTIZATION_BOUNDS` (an ``fp8`` / ``q8`` second moment is divided by ``N`` of the
  torch dict's beta2 and step first, rounded toward zero, and the bounds hold for that ``u``;
  the optimizer records that beta2 as its state dict's ``decay_norm_beta2``). A value decoded
  from a memopt format encodes back to the same value (a second moment through ``v`` and back
  too), so memopt -> torch -> memopt changes no moment value in any format (fp32: not a bit; a
  blocked format's block may come back with a lower scale and codes scaled to match, decoding
  to the same values). Adam/AdamW training then continues with the same bits. SGD/SGDW too,
  except with stochastic rounding: torch's SGD keeps no step, so a parameter's step becomes
  max(its current step in the memopt optimizer, 1) (1 in a fresh one), and that step is also
  the stochastic-rounding counter, so the continuation rounds with other (equally distributed)
  bits.

Master weights are not optimizer state in torch. fp32 parameters are their own master and travel
with the model; a bf16 parameter with an ECC master (``ecc24`` / ``ecc32``) is only half of its
weight, the other half being the code in ``optimizer.state[p]["master_code"]``: get the fp32
weights with :func:`memopt_core.fp32_state.get_fp32_model_state_dict` (or
:func:`memopt_checkpoint.fp32_model_state_dict`) for the torch model, and put fp32 weights back
into a bf16 ECC model with :func:`memopt_ecc.set_fp32_model_state_dict`.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from memopt_core import conversions, reference
from memopt_core.errors import ConfigError, StateDictError
from memopt_core.formats import (
    DECAY_NORMALIZED_PRESETS,
    MOMENT_FORMATS,
    MOMENT_PRESETS,
    MomentCodec,
    StateSpec,
)
from memopt_core.optimizer import (
    MemOptimizer,
    check_saved_param_lists,
    real_as_float,
    require_memopt_optimizer,
)
from memopt_core.plan import own_storage, padding_unit, round_up, state_key
from memopt_core.sharding import is_dtensor

__all__ = [
    "QUANTIZATION_BOUNDS",
    "load_torch_state_dict",
    "quantization_bound",
    "quantization_error_bound",
    "to_torch_state_dict",
    "torch_optimizer_class",
]

#: memopt rule -> the torch optimizer class whose state dicts it exchanges
_TORCH_CLASS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "sgdw": torch.optim.SGD,
}
#: torch's state keys and the hyperparameters that travel under the same name, per rule kind
_ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
_SGD_STATE = ("momentum_buffer",)
_ADAM_HYPER = ("lr", "betas", "eps", "weight_decay")
_SGD_HYPER = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
#: the ``memopt`` entry's list of each group's normalizing beta2 (memopt-core's state dict v2)
_NORM_KEY = "decay_norm_beta2"

#: Stated error of loading a finite fp32 moment ``x`` into each moment format (round to nearest
#: even, as :func:`load_torch_state_dict` does; see docs/formats.md). ``x'`` is the decoded value,
#: ``bmax`` the largest finite magnitude of x's block of 32 (blocks start at each tensor's first
#: element). :func:`quantization_error_bound` evaluates these per element.
QUANTIZATION_BOUNDS: dict[str, str] = {
    "fp32": "exact: x' == x bit for bit (0)",
    "bf16": "|x' - x| <= 2**-8 * |x| (8 significant bits, round to nearest even); subnormals: "
    "<= 2**-134 absolute",
    "fp8_e4m3": "|x' - x| <= max(2**-4 * |x|, 2**-9 * bmax / 448): 2**-4 relative within 2**8 of "
    "the block's largest magnitude, else absolute relative to it",
    "fp8_e5m2": "|x' - x| <= max(2**-3 * |x|, 2**-15 * bmax / 57344): 2**-3 relative within 2**15 "
    "of the block's largest magnitude, else absolute relative to it (one subnormal spacing: a "
    "finite non-zero x is never stored as 0)",
    "q8_signed": "as fp8_e4m3 (the same codes and scales): |x' - x| <= max(2**-4 * |x|, "
    "2**-9 * bmax / 448)",
    "q8_sqrt": "on s = sqrt(v): |q - s| <= max(2**-5 * s, 2**-17 * sqrt(vmax) / 1.875) (one "
    "subnormal spacing: a positive v is never stored as 0), v' = q*q; "
    "for v within 2**28 of its block's largest v: |v' - v| <= ((1 + 2**-5)**2 * (1 + 2**-24) - 1) "
    "* v ~= 6.35% of v",
}
_BIG = 2.0**127  # beyond this a value may round to inf: no finite bound is stated


def torch_optimizer_class(optimizer: MemOptimizer) -> type[torch.optim.Optimizer]:
    """The torch optimizer class whose state dicts ``optimizer`` exchanges: ``AdamW`` (rule
    ``adamw``), ``Adam`` (``adam``), ``SGD`` (``sgd``, ``sgdw``). Lion: :class:`ConfigError`."""
    require_memopt_optimizer(optimizer)
    if optimizer.rule not in _TORCH_CLASS:
        raise ConfigError(
            f"torch.optim has no {optimizer.rule!r} optimizer (no Lion): there is no torch state "
            "dict to convert to or from; save it with optimizer.state_dict() or memopt_checkpoint.save"
        )
    return _TORCH_CLASS[optimizer.rule]


def _refuse_sharded(optimizer: MemOptimizer, what: str) -> None:
    """ConfigError for an optimizer over FSDP2-sharded (DTensor) parameters: the conversions
    work on whole tensors (they reshaped a local shard to the global shape, or copied a plain
    tensor into a DTensor, deep inside)."""
    for gi, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if is_dtensor(p):
                raise ConfigError(
                    f"{what} converts whole tensors; parameter {i} of param group {gi} is "
                    f"sharded (a DTensor of shape {tuple(p.shape)}): save sharded optimizers "
                    "with optimizer.state_dict() or torch.distributed.checkpoint (dcp.save / "
                    "dcp.load, any sharding on load), or convert an unsharded copy of the model"
                )


# --------------------------------------------------------------------------------------- export
def to_torch_state_dict(optimizer: MemOptimizer) -> dict[str, Any]:
    """``optimizer``'s state as the state dict of the matching torch optimizer.

    Load it with ``load_state_dict()`` of :class:`torch.optim.AdamW` (rule ``adamw``),
    :class:`torch.optim.Adam` (``adam``) or :class:`torch.optim.SGD` (``sgd``; ``sgdw`` only with
    ``weight_decay == 0``, where it equals SGD) built over the same parameters in the same groups
    (:func:`torch_optimizer_class` names the class). Lion raises :class:`ConfigError`: torch has no
    Lion.

    ``state``, keyed by torch's parameter indices (0, 1, ... across the groups in order):

    - Adam/AdamW: ``{"step": float32 scalar tensor, "exp_avg": ..., "exp_avg_sq": ...}`` per
      parameter with state, the moments as new fp32 tensors shaped like the parameter, on its
      device (4 B per element each; torch's ``load_state_dict`` adopts them without a copy).
    - SGD: ``{"momentum_buffer": ...}`` for parameters that took at least one step with momentum;
      a state before the first step (``init_state()``) is left out, as torch has none then (its
      first step sets ``buf = g``, which an explicit zero buffer would change).

    Precision: moments are decoded from memopt's format: ``fp32`` exactly (bit for bit); ``bf16``,
    ``fp8``, ``q8`` to exactly the values memopt computes with (no loss beyond the format's own).
    ``exp_avg_sq`` is torch's ``v``: an ``fp8`` / ``q8`` second moment, stored decay-normalized
    (``u = v / N``), is multiplied by ``optimizer.decay_norm(group, step)``, rounded once.
    torch's ``load_state_dict`` casts them to the parameter dtype: load into an fp32 copy of a
    bf16 model to keep them (the master weights come from
    :func:`memopt_core.fp32_state.get_fp32_model_state_dict` for ECC models; they are not optimizer state).

    ``param_groups``: torch's keys for the class (``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``amsgrad=False``, ``maximize``, ``foreach=None``, ``capturable=False``,
    ``differentiable=False``, ``fused=None``, and ``decoupled_weight_decay`` where torch has it;
    SGD: ``lr``, ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``, ``maximize``, ...)
    plus ``initial_lr`` and ``param_names`` where the group has them. memopt's format keys
    (``master``, ``moments``, ``stochastic_rounding``) and its ``memopt`` entry (which
    ``state_dict()`` puts at the top level and in every group, and torch's ``load_state_dict``
    would copy into the torch optimizer's live groups) are left out. ``decouple_lr=True`` decays by
    ``lr / initial_lr * weight_decay``; torch decays by ``lr * weight_decay``, so the exported
    ``weight_decay`` is ``weight_decay / initial_lr`` (the same factor up to one rounding); a
    group whose ``decouple_lr`` was switched on by hand has no ``initial_lr`` until its next step
    records its ``lr`` as it, so that ``lr`` stands for it (it is not written in the group).
    """
    cls = torch_optimizer_class(optimizer)
    _refuse_sharded(optimizer, "to_torch_state_dict")
    kind = "adam" if cls is not torch.optim.SGD else "sgd"
    defaults = _torch_defaults(cls)
    # hand-edited group values the next step would refuse: torch's load_state_dict checks
    # none, and its step would run them (a negative lr ascends)
    optimizer.check_param_groups()
    # q8/fp8 second moments of an edited step count or a changed beta2 convert first, as the
    # next step would: read against the edited count's N, v would come out rescaled
    optimizer.settle_state()
    state: dict[int, dict[str, Tensor]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for gi, group in enumerate(optimizer.param_groups):
        tgroup = _torch_group(optimizer.rule, kind, group, defaults, gi)
        ids: list[int] = []
        for p in group["params"]:
            ids.append(index)
            entry = optimizer.state.get(p)
            if entry:
                out = _export_entry(optimizer, kind, gi, group, p, entry, index)
                if out:
                    state[index] = out
            index += 1
        tgroup["params"] = ids
        groups.append(tgroup)
    return {"state": state, "param_groups": groups}


@functools.cache
def _torch_defaults_cached(
    cls: Callable[..., torch.optim.Optimizer],
) -> tuple[tuple[str, Any], ...]:
    # the keys (and defaults) of this torch version's param groups, from a throwaway instance
    dummy = torch.zeros(1, requires_grad=True, dtype=torch.float32, device="cpu")
    return tuple(cls([dummy]).defaults.items())


def _torch_defaults(cls: Callable[..., torch.optim.Optimizer]) -> dict[str, Any]:
    return dict(_torch_defaults_cached(cls))


def _plain(value: Any) -> Any:
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item()
    return value


def _torch_group(
    rule: str, kind: str, group: Mapping[str, Any], defaults: dict[str, Any], gi: int
) -> dict[str, Any]:
    out = dict(defaults)
    wd = float(_plain(group["weight_decay"]))
    if rule == "sgdw" and wd != 0.0:
        raise ConfigError(
            f"param group {gi} runs SGDW (decoupled weight decay {wd}); torch.optim.SGD only has "
            "L2 weight decay, which updates differently: export with weight_decay=0 or use rule "
            "'sgd'"
        )
    if rule in ("adamw", "sgdw") and group.get("decouple_lr") and wd != 0.0:
        # decouple_lr switched on in the group by hand has no initial_lr until the next step
        # records the group's lr as it: divide by that lr, as the step will
        initial = float(_plain(group["initial_lr"] if "initial_lr" in group else group["lr"]))
        if initial <= 0:  # the step refuses it too (ConfigError): no torch decay matches
            raise ConfigError(
                f"param group {gi} has decouple_lr=True, which scales weight decay by "
                f"lr / initial_lr, and its initial lr (the lr until a step records it) is "
                f"{initial}: set the group's initial_lr (> 0)"
            )
        wd = wd / initial  # torch: lr * wd' == lr / initial_lr * wd
    if kind == "adam":
        out.update(
            lr=_plain(group["lr"]),
            betas=tuple(float(_plain(b)) for b in group["betas"]),
            eps=_plain(group["eps"]),
            weight_decay=wd,
            amsgrad=False,
            maximize=group["maximize"],
        )
        if "decoupled_weight_decay" in out:
            out["decoupled_weight_decay"] = rule == "adamw"
    else:
        out.update(
            lr=_plain(group["lr"]),
            momentum=_plain(group["momentum"]),
            dampening=_plain(group["dampening"]),
            weight_decay=wd,
            nesterov=group["nesterov"],
            maximize=group["maximize"],
        )
    for key in ("initial_lr", "param_names"):
        if key in group:
            out[key] = _plain(group[key]) if key == "initial_lr" else list(group[key])
    return out


def _spec(group: Mapping[str, Any], p: Tensor) -> StateSpec:
    return StateSpec(
        master="fp32" if p.dtype == torch.float32 else group["master"],
        moments=group["moments"],
        stochastic_rounding=group["stochastic_rounding"],
    )


def _codec(spec: StateSpec, name: str) -> MomentCodec:
    return spec.second if name == "exp_avg_sq" else spec.first


def _decode(entry: Mapping[str, Any], name: str, codec: MomentCodec, p: Tensor) -> Tensor | None:
    keys = {sfx: state_key(name, sfx) for sfx in codec.fields}
    if not all(k in entry for k in keys.values()):
        return None
    x = conversions.decode_moment(codec, {sfx: entry[k] for sfx, k in keys.items()})
    return own_storage(x.reshape(-1)[: p.numel()].reshape(p.shape))


def _export_entry(
    optimizer: MemOptimizer,
    kind: str,
    gi: int,
    group: Mapping[str, Any],
    p: Tensor,
    entry: Mapping[str, Any],
    index: int,
) -> dict[str, Tensor]:
    spec = _spec(group, p)
    step = float(_plain(entry.get("step", 0)))
    if kind == "sgd":
        buf = _decode(entry, "momentum_buffer", spec.first, p)
        if buf is None or step < 1 or float(_plain(group["momentum"])) == 0.0:
            return {}  # torch has no buffer before the first momentum step
        return {"momentum_buffer": buf}
    out: dict[str, Tensor] = {"step": torch.tensor(step, dtype=torch.float32, device="cpu")}
    for name in ("exp_avg", "exp_avg_sq"):
        x = _decode(entry, name, _codec(spec, name), p)
        if x is None:
            raise StateDictError(
                f"the memopt state of parameter index {index} ({tuple(p.shape)}, {p.dtype}) lacks "
                f"{name!r}; it is not the state of an Adam optimizer"
            )
        if name == "exp_avg_sq":  # q8 / fp8 store u = v / N: torch's is v
            # N of the count u is stored for: a state dict entry written into optimizer.state
            # (ZeroRedundancyOptimizer's load), not adopted yet, records it
            count = conversions.saved_step_count(entry.get("decay_norm_step", step))
            if count is None:
                raise StateDictError(
                    f"the memopt state of parameter index {index} holds decay_norm_step "
                    f"{entry['decay_norm_step']!r}, which is no step count"
                )
            x = conversions.denormalize_second_moment(x, optimizer.decay_norm(gi, count))
        out[name] = x
    return out


# ----------------------------------------------------------------------------------------- load
def load_torch_state_dict(optimizer: MemOptimizer, state_dict: Mapping[str, Any]) -> None:
    """Load a torch optimizer's state dict (``torch.optim.AdamW/Adam/SGD.state_dict()``) into
    ``optimizer``, the reverse of :func:`to_torch_state_dict`.

    Validation first (:class:`StateDictError`, naming the group or parameter index; nothing
    changes, neither the optimizer nor ``state_dict``, when it fails): the dict belongs to the
    optimizer's rule (Adam/AdamW groups with ``betas`` and states ``step``, ``exp_avg``,
    ``exp_avg_sq``; AdamW's ``decoupled_weight_decay=True`` needs rule ``adamw``, ``False`` rule
    ``adam``; SGD groups with ``momentum`` and states ``momentum_buffer``); ``amsgrad=True`` or a
    ``max_exp_avg_sq`` state is refused (memopt has no AMSGrad); the same number of groups and of
    parameters per group; every state tensor a real floating tensor of its parameter's shape.
    Rule ``sgdw`` takes only ``weight_decay == 0`` (torch's SGD decay is L2), Lion nothing
    (:class:`ConfigError`: torch has no Lion). Hyperparameter values are then checked as
    ``optimizer.load_state_dict`` checks them. A memopt optimizer's own state dict (a ``memopt``
    entry at the top level or in a param group) is refused: it loads with
    ``optimizer.load_state_dict()``.

    Precision: each moment is converted to fp32 (exact from fp32, bf16 and fp16; float64 rounds to
    nearest) and encoded into the optimizer's moment format with round to nearest even (never
    stochastic rounding, so loading is deterministic): exact for ``fp32``, within
    :data:`QUANTIZATION_BOUNDS` otherwise (``bf16`` 2 B, ``fp8``/``q8`` 1.03125 B per element per
    moment). An ``fp8`` / ``q8`` ``exp_avg_sq`` is stored decay-normalized: torch's ``v`` is
    divided by ``memopt_core.reference.decay_norm(beta2, step)`` of the torch dict's beta2 and the
    entry's step (rounded toward zero) before it is encoded, and the optimizer records that
    beta2 (``optimizer.decay_norm`` then gives the same ``N``).

    Hyperparameters come from the torch dict (``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``maximize``; SGD ``momentum``, ``dampening``, ``nesterov``; ``initial_lr`` where present) with
    torch's weight decay semantics (``decouple_lr`` is set to False); formats (``master``,
    ``moments``, ``stochastic_rounding``), ``param_names`` and the seed stay the optimizer's.

    Steps: Adam's ``step`` is torch's. torch's SGD keeps no step: a parameter with a momentum
    buffer gets the optimizer's current step if it is >= 1, else 1 (past the first step, where
    memopt sets ``buf = g``); memopt also uses the step as the stochastic-rounding counter.

    State torch does not have (a parameter without an entry, an SGD buffer that is None) starts
    fresh: step 0, zero moments. Master weights are not in torch's dict: ECC codes
    (``master_code``) of parameters that have memopt state are kept as they are; parameters
    without state get the codes that encode their current values, as :meth:`init_state` writes
    them. To load fp32 weights into a bf16 ECC model use
    :func:`memopt_ecc.set_fp32_model_state_dict`.
    """
    cls = torch_optimizer_class(optimizer)
    _refuse_sharded(optimizer, "load_torch_state_dict")
    kind = "adam" if cls is not torch.optim.SGD else "sgd"
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"expected a state dict (a mapping), got {type(state_dict).__name__}")
    groups = state_dict.get("param_groups")
    # memopt's state dicts hold their 'memopt' entry at the top level and in every param group
    # (where torch's get_state_dict keeps it)
    if "memopt" in state_dict or (
        isinstance(groups, (list, tuple))
        and any(isinstance(g, Mapping) and "memopt" in g for g in groups)
    ):
        raise StateDictError(
            "this is a memopt optimizer's state dict (it has a 'memopt' entry), not a torch "
            "one: load it with optimizer.load_state_dict()"
        )
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise StateDictError(
                f"the torch state dict lacks {key!r}; pass what torch.optim.{cls.__name__}."
                "state_dict() returns"
            )
    saved_groups = state_dict["param_groups"]
    saved_state = state_dict["state"]
    if not isinstance(saved_groups, (list, tuple)):
        raise StateDictError("the torch state dict's 'param_groups' must be a list")
    if not isinstance(saved_state, Mapping):
        raise StateDictError("the torch state dict's 'state' must be a dict")
    check_saved_param_lists(state_dict)
    if len(saved_groups) != len(optimizer.param_groups):
        raise StateDictError(
            f"the torch state dict has {len(saved_groups)} param group(s), this optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    where: dict[Any, tuple[int, Tensor]] = {}
    new_groups = []
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        new_groups.append(_merged_group(optimizer.rule, kind, cls, gi, group, saved))
        for key, p in zip(saved["params"], group["params"], strict=True):
            where[key] = (gi, p)  # each key once: check_saved_param_lists
    moments: dict[Any, dict[str, Tensor]] = {}
    for key, entry in saved_state.items():
        if key not in where:
            raise StateDictError(
                f"the torch state dict holds state for parameter index {key!r}, which none of its "
                "param groups lists"
            )
        gi, p = where[key]
        moments[key] = _validated_entry(kind, key, gi, p, entry)
    # everything checked: build memopt's state dict (fresh tensors only) and load it. The
    # 8-bit second moments are stored normalized, u = v / N, with N of the loaded beta2 and
    # step; the memopt entry records that beta2 per group, as a memopt state dict does
    norm_beta2 = [
        _normalizing_beta2(kind, group, merged)
        for group, merged in zip(optimizer.param_groups, new_groups, strict=True)
    ]
    new_state: dict[Any, dict[str, Any]] = {}
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        merged = new_groups[gi]
        for key, p in zip(saved["params"], group["params"], strict=True):
            entry = _memopt_entry(
                optimizer, kind, group, merged, p, moments.get(key), norm_beta2[gi]
            )
            if entry is not None:
                new_state[key] = entry
    optimizer.load_state_dict(
        {
            "state": new_state,
            "param_groups": new_groups,
            "memopt": {_NORM_KEY: norm_beta2},
        }
    )


def _normalizing_beta2(
    kind: str, group: Mapping[str, Any], merged: Mapping[str, Any]
) -> float | None:
    """The beta2 a group's second moments are loaded normalized with: the torch dict's, for
    Adam groups of a decay-normalized moment preset (q8, fp8); None for the others, and where
    that beta2 is out of [0, 1) (the optimizer's load_state_dict then refuses the group)."""
    if kind != "adam" or group["moments"] not in DECAY_NORMALIZED_PRESETS:
        return None
    try:
        beta2 = float(_plain(merged["betas"][1]))
    except (TypeError, ValueError, IndexError, RuntimeError):
        return None
    return beta2 if 0.0 <= beta2 < 1.0 else None


def _merged_group(
    rule: str,
    kind: str,
    cls: type[torch.optim.Optimizer],
    gi: int,
    group: Mapping[str, Any],
    saved: Any,
) -> dict[str, Any]:
    what = f"param group {gi} of the torch state dict"
    if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), (list, tuple)):
        raise StateDictError(f"{what} is not a param group dict with a 'params' list")
    if len(saved["params"]) != len(group["params"]):
        raise StateDictError(
            f"{what} has {len(saved['params'])} parameters, this optimizer's has "
            f"{len(group['params'])}"
        )
    needed = _ADAM_HYPER if kind == "adam" else _SGD_HYPER
    missing = [k for k in needed if k not in saved]
    foreign = "momentum" if kind == "adam" else "betas"
    if missing or foreign in saved:
        other = "SGD" if kind == "adam" else "Adam/AdamW"
        raise StateDictError(
            f"{what} lacks {missing} or has {foreign!r}: it is not a torch.optim.{cls.__name__} "
            f"state dict (this optimizer runs rule {rule!r}; is it a torch {other} dict?)"
        )
    if kind == "adam":
        if _saved_flag(saved, "amsgrad", what):
            raise StateDictError(
                f"{what} has amsgrad=True: memopt has no AMSGrad (it keeps no max_exp_avg_sq)"
            )
        dwd = _saved_flag(saved, "decoupled_weight_decay", what)
        if dwd is not None and dwd != (rule == "adamw"):
            raise StateDictError(
                f"{what} has decoupled_weight_decay={dwd} (torch.optim."
                f"{'AdamW' if dwd else 'Adam'}); this optimizer runs rule {rule!r}: use rule "
                f"{'adamw' if dwd else 'adam'!r}"
            )
    elif rule == "sgdw":
        wd = saved["weight_decay"]
        if (
            isinstance(wd, bool)
            or not isinstance(wd, (int, float, Tensor))
            or (isinstance(wd, Tensor) and wd.numel() != 1)
            or float(_plain(wd)) != 0.0
        ):
            raise StateDictError(
                f"{what} has weight_decay={wd!r}: torch.optim.SGD's decay is L2, which rule "
                "'sgdw' (decoupled decay) does not apply; load it into rule 'sgd'"
            )
    merged = {k: v for k, v in group.items() if k != "params"}
    for k in needed:
        merged[k] = _plain(saved[k])
    if kind == "adam" and isinstance(merged["betas"], (list, tuple)):
        merged["betas"] = tuple(_plain(b) for b in merged["betas"])
    merged["maximize"] = bool(_saved_flag(saved, "maximize", what))
    merged["decouple_lr"] = False  # torch decays by lr * weight_decay
    if "initial_lr" in saved:  # an LR scheduler's base: it scales every later lr
        initial = _plain(saved["initial_lr"])
        if (  # a real number as torch's optimizers take them: numpy's too
            isinstance(initial, bool)
            or not isinstance(initial, numbers.Real)
            or not 0.0 <= real_as_float(initial) < math.inf
        ):
            raise StateDictError(f"{what}: initial_lr must be a number >= 0, got {initial!r}")
        merged["initial_lr"] = initial
    merged["params"] = list(saved["params"])
    return merged


def _saved_flag(saved: Mapping[str, Any], key: str, what: str) -> bool | None:
    """A saved group's torch flag ``key``: True, False or None where it is absent (or None);
    StateDictError for anything else (bool("no") is True: amsgrad="no" was refused as
    amsgrad=True, decoupled_weight_decay="no" taken as true)."""
    value = saved.get(key)
    if value is not None and not isinstance(value, bool):
        raise StateDictError(f"{what}: {key} must be a bool, got {value!r}")
    return value


def _validated_entry(kind: str, key: Any, gi: int, p: Tensor, entry: Any) -> dict[str, Any]:
    label = f"parameter index {key!r} (shape {tuple(p.shape)}, {p.dtype}, param group {gi})"
    if not isinstance(entry, Mapping):
        raise StateDictError(f"the state of {label} must be a dict, got {type(entry).__name__}")
    allowed = _ADAM_STATE if kind == "adam" else _SGD_STATE
    if "max_exp_avg_sq" in entry:
        raise StateDictError(
            f"the state of {label} has 'max_exp_avg_sq' (AMSGrad): memopt has no AMSGrad"
        )
    extra = sorted((k for k in entry if k not in allowed), key=str)
    if extra:
        raise StateDictError(
            f"the state of {label} has unexpected entries {extra}; a torch "
            f"{'Adam/AdamW' if kind == 'adam' else 'SGD'} state holds {list(allowed)}"
        )
    if kind == "adam":
        missing = [k for k in allowed if k not in entry]
        if missing:
            raise StateDictError(
                f"the state of {label} lacks {missing} (Adam stores {list(allowed)})"
            )
    out: dict[str, Any] = {}
    for name in allowed:
        value = entry.get(name)
        if name == "step":
            out[name] = value  # memopt's load_state_dict checks it (whole number >= 0)
            continue
        if value is None:
            if kind == "adam":  # Adam stores both moments from its first step
                raise StateDictError(f"state {name!r} of {label} is None (Adam stores a tensor)")
            continue  # SGD without a buffer (yet)
        if not isinstance(value, Tensor) or not value.is_floating_point():
            got = f"a {value.dtype} tensor" if isinstance(value, Tensor) else type(value).__name__
            raise StateDictError(f"state {name!r} of {label} must be a floating tensor, got {got}")
        if value.is_meta:  # as MemOptimizer.load_state_dict says it
            raise StateDictError(
                f"state {name!r} of {label} is on the meta device and holds no values (a state "
                "dict built under a meta device context?)"
            )
        if tuple(value.shape) != tuple(p.shape):
            raise StateDictError(
                f"state {name!r} of {label} has shape {tuple(value.shape)}; the parameter's is "
                f"{tuple(p.shape)}"
            )
        if name == "exp_avg_sq":  # torch loads a negative one; memopt's formats cannot hold it
            conversions.check_second_moment(value, f"state {name!r} of {label}")
        out[name] = value
    return out


def _encode(
    x: Tensor | None, codec: MomentCodec, p: Tensor, padded: int, name: str, norm: float = 1.0
) -> dict[str, Tensor]:
    """Fields of ``x`` (``p``'s shape; None: zeros) under memopt's state keys, rounded to
    nearest even; a second moment divided by ``norm`` first (``N``: stored ``u = v / N``)."""
    flat = torch.zeros(padded, dtype=torch.float32, device=p.device)
    if x is not None:
        flat[: p.numel()] = x.detach().reshape(-1).to(device=p.device, dtype=torch.float32)
        flat = conversions.normalize_second_moment(flat, norm)
    out = {}
    for sfx, value in conversions.encode_moment(codec, flat).items():
        if codec.block_size == 1:
            value = value[: p.numel()].reshape(p.shape)
        out[state_key(name, sfx)] = own_storage(value)
    return out


def _memopt_entry(
    optimizer: MemOptimizer,
    kind: str,
    group: Mapping[str, Any],
    merged: Mapping[str, Any],
    p: Tensor,
    loaded: dict[str, Any] | None,
    norm_beta2: float | None = None,
) -> dict[str, Any] | None:
    spec = _spec(group, p)
    master = spec.master_for(p.dtype)
    current = optimizer.state.get(p) or {}
    code = current.get("master_code") if master.code_dtype is not None else None
    if kind == "adam":
        names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    else:
        has_buffer = loaded is not None and "momentum_buffer" in loaded
        names = ("momentum_buffer",) if has_buffer or float(merged["momentum"]) != 0.0 else ()
        if not has_buffer:
            loaded = None
    if loaded is None and code is None:
        return None  # fresh state, created from the parameter as a first step would
    if loaded is None:  # fresh state, but keep the weight's ECC code
        entry: dict[str, Any] = {"step": 0}
    elif kind == "adam":
        entry = {"step": loaded["step"]}
    else:
        step = current.get("step")
        entry = {"step": max(int(float(_plain(step))) if step is not None else 0, 1)}
    padded = round_up(p.numel(), padding_unit(spec))
    count = conversions.saved_step_count(entry["step"])
    for name in names:
        x = None if loaded is None else loaded[name]
        norm = 1.0
        if name == "exp_avg_sq" and norm_beta2 is not None and count is not None:
            norm = reference.decay_norm(norm_beta2, count)
        entry.update(_encode(x, _codec(spec, name), p, padded, name, norm))
    if master.code_dtype is not None:
        if code is None:  # what init_state() writes: the code of the current value
            _, code = conversions.encode_master(master, p.detach().float().reshape(-1))
            assert code is not None  # a master format with a code dtype encodes one
        entry["master_code"] = code.detach().reshape(p.shape).clone()
    return entry


# --------------------------------------------------------------------------------------- bounds
def quantization_bound(fmt: str) -> str:
    """The stated error of loading a finite fp32 moment into ``fmt`` (round to nearest even).

    ``fmt``: a moment format (``fp32``, ``bf16``, ``fp8_e4m3``, ``fp8_e5m2``, ``q8_signed``,
    ``q8_sqrt``) or a preset (``fp8``, ``q8``: first and second moment). Values from
    docs/formats.md, restated in :data:`QUANTIZATION_BOUNDS`; ``bf16`` is 2**-8 relative (its 8
    significant bits). Magnitudes >= 2**127 may round
    to inf (no bound); NaN stays NaN (fp8/q8: inf is stored as NaN in e4m3, kept in e5m2).
    """
    if fmt in QUANTIZATION_BOUNDS:
        return QUANTIZATION_BOUNDS[fmt]
    if fmt in MOMENT_PRESETS:
        first, second = MOMENT_PRESETS[fmt]
        return (
            f"first moment ({first}): {QUANTIZATION_BOUNDS[first]}; second moment ({second}): "
            f"{QUANTIZATION_BOUNDS[second]}"
        )
    raise ConfigError(
        f"unknown moment format {fmt!r}; choose one of {MOMENT_FORMATS} or a preset "
        f"{tuple(MOMENT_PRESETS)}"
    )


def quantization_error_bound(fmt: str, x: Tensor) -> Tensor:
    """Per element of ``x``, the bound on ``|x' - x|`` stated in :data:`QUANTIZATION_BOUNDS`.

    ``x``: the fp32 values of one tensor as loaded (its blocks of 32 start at its first element,
    as in memopt's state); ``fmt``: a moment format name. Returns float64 bounds shaped like
    ``x`` (on the CPU): 0 for ``fp32``; ``inf`` where no bound is stated (non-finite ``x``,
    ``|x| >= 2**127``, a negative second moment for ``q8_sqrt``).
    """
    if fmt not in MOMENT_FORMATS:
        raise ConfigError(f"unknown moment format {fmt!r}; choose one of {MOMENT_FORMATS}")
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ConfigError(f"x must be a floating tensor, got {type(x).__name__}")
    v = x.detach().to("cpu", torch.float64).reshape(-1)
    n = v.numel()
    a = v.abs()
    finite = torch.isfinite(v)
    if fmt == "fp32":
        bound = torch.zeros_like(a)
    elif fmt == "bf16":
        bound = torch.maximum(a * 2.0**-8, torch.full_like(a, 2.0**-134))
    else:
        padded = round_up(max(n, 1), 32)
        mag = torch.zeros(padded, dtype=torch.float64, device="cpu")
        if fmt == "q8_sqrt":
            ok = finite & ~(v < 0)
            mag[:n] = torch.where(ok, a, 0.0).sqrt()  # s = sqrt(v); -0 -> 0
        else:
            ok = finite
            mag[:n] = torch.where(ok, a, 0.0)
        bmax = mag.view(-1, 32).amax(1).repeat_interleave(32)[:n]
        s = mag[:n]
        if fmt == "q8_sqrt":
            delta = torch.maximum(s * 2.0**-5, bmax * (2.0**-17 / 1.875))
            delta = torch.clamp(delta, min=2.0**-146)
            # |q^2 - s^2| plus the two fp32 roundings (sqrt(v) and q*q), generously
            bound = delta * (2 * s + delta) * (1 + 2.0**-22) + 2.0**-22 * (s + delta) ** 2
        else:
            rel, sub, fmax, tiny = {
                "fp8_e4m3": (2.0**-4, 2.0**-9, 448.0, 2.0**-137),
                "q8_signed": (2.0**-4, 2.0**-9, 448.0, 2.0**-137),
                "fp8_e5m2": (2.0**-3, 2.0**-15, 57344.0, 2.0**-144),
            }[fmt]
            bound = torch.maximum(s * rel, bmax * (sub / fmax))
            bound = torch.clamp(bound, min=tiny)
        finite = ok
    bound = torch.where(finite & (a < _BIG), bound, math.inf)
    return bound.reshape(x.shape)
