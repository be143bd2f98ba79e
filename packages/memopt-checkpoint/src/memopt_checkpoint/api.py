"""``save`` / ``load``: a model and its optimizer in one checksummed file, keyed by parameter name.

What is stored (one :mod:`memopt_checkpoint.container` file, written atomically and streamed
one tensor at a time):

- ``model/<name>`` for every tensor of ``model.state_dict()`` in its own dtype (a bf16 model
  stays 2 B per weight). Tied weights, which ``state_dict()`` lists under every name, are stored
  once; the other names are recorded as aliases. A module's ``get_extra_state()`` value is stored
  as a tensor when it is one, else in the meta when JSON gives it back equal (other values make
  :func:`save` raise :class:`~memopt_core.errors.ConfigError` naming the key); :func:`load`
  hands it to ``model.load_state_dict``, so to ``set_extra_state``.
- Tensor subclasses (a sharded model's DTensors) are refused with a ``ConfigError``: their
  bytes are not where a plain tensor's are; ``torch.distributed.checkpoint`` saves them.
- ``optim/<parameter name>/<state key>`` for every tensor of ``optimizer.state_dict()["state"]``
  (and ``optim_groups/<group>/<key>`` for tensor hyperparameters, such as a capturable ``lr``,
  which load back as tensors) in its stored format: q8 and fp8 moments stay 1 B per element with their block scales, the
  ECC-24 code stays 1 B per element (FlashOptim writes 2), AdamBridge's host masters their own
  dtype. An ECC-24 FlashAdamW checkpoint (weights and optimizer) is therefore about
  2 + 1 + 2 x (1 + 1/32) = 5.06 B per parameter.
- The index's JSON ``meta``: format versions, the optimizer's class and its state dict's non-tensor
  parts (param groups with parameter *names* instead of positions, the ``memopt`` entry; a
  tensor's place marked ``{"$tensor": key}``, an inf or NaN, which JSON has not, marked
  ``{"$float": "inf"}``, ``"-inf"`` or ``"nan"``), each optimizer parameter's shape, the model's
  keys and aliases, and ``extra`` (values JSON gives back as they are: no tuples, inf or nan;
  tensors at its top level are stored as ``extra/<key>``).

Parameters are matched by name (``model.named_parameters()``), not by position, so a model whose
parameters were reordered or whose optimizer groups list them differently still loads, and a
missing or extra name is reported by name. A tied parameter goes by whichever of its names the
file used. Each optimizer parameter's shape is checked against the saved one, by name or by
position (torch's own ``load_state_dict`` checks none). Training then continues bit for bit only with
``stochastic_rounding=False``: the stochastic-rounding words are keyed by a parameter's position
in the optimizer, so a moved parameter rounds with other (equally distributed) bits.

:func:`load` validates everything first, then reads and checks every tensor it needs
(checksums), and only then changes the model and the optimizer. The optimizer's own
``load_state_dict`` checks formats, shapes and dtypes. So a bad file, a foreign optimizer or a
shape mismatch raises (:class:`~memopt_core.errors.CheckpointError`,
:class:`~memopt_core.errors.StateDictError`) with nothing changed. The model is then loaded with
``model.load_state_dict`` (copying in place), so modules that build their ``state_dict()``
entries (``_save_to_state_dict`` / ``_load_from_state_dict``, state-dict hooks, lazy modules)
and load hooks load as they do in torch, and the optimizer after it. Where a module's own load
code (``set_extra_state``, a load hook) or the optimizer's ``load_state_dict`` still refuses,
the model's tensors are put back from a host copy taken before (host memory for one more copy
of the model while :func:`load` runs), and the optimizer is unchanged: the error propagates
with nothing half loaded. A module's non-tensor extra state is not put back.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy

from memopt_checkpoint.container import CheckpointReader, CheckpointWriter
from memopt_core.errors import CheckpointError, ConfigError, StateDictError
from memopt_core.optimizer import check_bool

__all__ = ["CHECKPOINT_SCHEMA", "load", "save"]

#: Version of the key/meta layout below (the container has its own format version). 2: tensors
#: in the optimizer's state and param groups are marked ``{TENSOR_REF: key}`` (1 marked state
#: tensors with None, so a None state value could not be stored), and ``shapes`` holds each
#: optimizer parameter's shape. 3: an inf or NaN in the optimizer's state dict is marked
#: ``{FLOAT_REF: "inf" | "-inf" | "nan"}`` (schema 2 refused to save it). Files of schemas 1
#: and 2 still load; a reader of schema 2 refuses a file of 3 rather than hand the marker on.
CHECKPOINT_SCHEMA = 3
#: The marker of a value stored as a tensor under the container key it names.
TENSOR_REF = "$tensor"
#: The marker of a float JSON cannot hold, by the name ``float()`` reads back: an
#: AdamBridge's ``last_grad_norm`` after a step whose gradients overflowed is inf or NaN.
FLOAT_REF = "$float"
_NON_FINITE = ("inf", "-inf", "nan")
#: The ``state_dict()`` key suffix of a module's ``get_extra_state()`` (torch's own constant).
_EXTRA_STATE = "_extra_state"


def _param_names(
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    known: set[str] | None = None,
) -> list[str]:
    """The name of each optimizer parameter, in ``state_dict()`` index order: its first name in
    the model, or, for a tied parameter with several names, the first one in ``known`` (the
    names a checkpoint uses), so a model whose tied modules were declared in another order
    still finds its state."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if model is None:
        return [f"#{i}" for i in range(len(params))]
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out = []
    for i, p in enumerate(params):
        if id(p) not in names:
            raise ConfigError(
                f"optimizer parameter #{i} (shape {tuple(p.shape)}) is not a parameter of the "
                "model: pass the model the optimizer trains (or model=None to key by position)"
            )
        mine = names[id(p)]
        out.append(next((n for n in mine if known and n in known), mine[0]))
    return out


def _stored(v: Any, key: str, tensors: list[tuple[str, Tensor]], where: str) -> Any:
    """``v`` for the meta: tensors (inside tuples and lists too) go to ``tensors`` under
    ``key`` and are marked ``{TENSOR_REF: key}``; the rest must be JSON."""
    if isinstance(v, Tensor):
        tensors.append((key, v))
        return {TENSOR_REF: key}
    if isinstance(v, (tuple, list)):
        return [_stored(x, f"{key}/{i}", tensors, where) for i, x in enumerate(v)]
    if isinstance(v, Mapping) and TENSOR_REF in v:
        raise ConfigError(
            f"{where} is a dict with the key {TENSOR_REF!r}, which marks tensors here"
        )
    return _json_value(v, where)


def _restored(v: Any, reader: CheckpointReader, schema: int = CHECKPOINT_SCHEMA) -> Any:
    """The inverse of :func:`_stored`: marked tensors read back (lists stay lists), marked
    floats decoded (from schema 3 on; :func:`_checked_meta` has checked the markers)."""
    if isinstance(v, Mapping) and set(v) == {TENSOR_REF}:
        return reader.load(v[TENSOR_REF])
    if isinstance(v, list):
        return [_restored(x, reader, schema) for x in v]
    return _floats_decoded(v) if schema >= 3 else v


def _json_value(v: Any, where: str) -> Any:
    """``v`` for the meta, each inf or NaN in it (at any depth) marked ``{FLOAT_REF: name}``:
    optimizers keep them (AdamBridge's ``last_grad_norm``) and JSON has none. A dict that
    holds ``FLOAT_REF`` itself is refused, as it would load back as a float."""
    if isinstance(v, float) and not math.isfinite(v):
        return {FLOAT_REF: "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if isinstance(v, (list, tuple)):
        v = [_json_value(x, f"{where}[{i}]") for i, x in enumerate(v)]
    elif isinstance(v, Mapping):
        if FLOAT_REF in v:
            raise ConfigError(
                f"{where} is a dict with the key {FLOAT_REF!r}, which marks inf and nan here"
            )
        v = {k: _json_value(x, f"{where}[{k!r}]") for k, x in v.items()}
    try:
        json.dumps(v, allow_nan=False)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} ({type(v).__name__}) is not JSON-serializable") from None
    return v


def _float_refs_ok(v: Any) -> bool:
    """Whether every ``FLOAT_REF`` in the meta value ``v`` is a marker :func:`_json_value`
    writes (an edited one must not reach the optimizer as a dict)."""
    if isinstance(v, list):
        return all(_float_refs_ok(x) for x in v)
    if isinstance(v, dict):
        if FLOAT_REF in v:
            return set(v) == {FLOAT_REF} and v[FLOAT_REF] in _NON_FINITE
        return all(_float_refs_ok(x) for x in v.values())
    return True


def _floats_decoded(v: Any) -> Any:
    """The inverse of :func:`_json_value`'s marking (tuples, which it wrote as lists, stay
    lists)."""
    if isinstance(v, list):
        return [_floats_decoded(x) for x in v]
    if isinstance(v, dict):
        if set(v) == {FLOAT_REF}:
            return float(v[FLOAT_REF])
        return {k: _floats_decoded(x) for k, x in v.items()}
    return v


def _extra_value(v: Any, where: str) -> Any:
    """``v`` when JSON gives it back as it is; else a ``ConfigError`` naming the part of ``v``
    at fault (a tuple would load back as a list, a non-str key as a str)."""
    if isinstance(v, Tensor):
        raise ConfigError(
            f"{where} is a tensor inside a container: only extra's top-level values are stored "
            "as tensors (give it its own key in extra)"
        )
    if isinstance(v, tuple):
        raise ConfigError(
            f"{where} is a tuple, which JSON (the checkpoint meta) would give back as a list: "
            "pass a list and convert it back after load (random.setstate needs tuples)"
        )
    if isinstance(v, list):
        return [_extra_value(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, Mapping):
        for k in v:
            if not isinstance(k, str):
                raise ConfigError(
                    f"{where} has the key {k!r}: JSON (the checkpoint meta) keys are str, so it "
                    "would load back as a str"
                )
        return {k: _extra_value(x, f"{where}[{k!r}]") for k, x in v.items()}
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(
            f"{where} is {v}, which JSON (the checkpoint meta) cannot hold: store a finite value "
            "or a str, or that state with torch.save"
        )
    if v is not None and not isinstance(v, (str, int, float)):  # bool is an int
        raise ConfigError(f"{where} ({type(v).__name__}) is not JSON-serializable")
    return v


def _json_exact(v: Any, where: str) -> Any:
    """``v`` when JSON gives it back equal (so :func:`load` restores it as it was)."""
    try:
        same = bool(json.loads(json.dumps(v, allow_nan=False)) == v)
    except (TypeError, ValueError):
        same = False
    if not same:
        raise ConfigError(
            f"{where} is a {type(v).__name__} that JSON cannot store as it is (only dicts with "
            "str keys, lists, str, finite numbers, bool and None come back equal): make the "
            "module's get_extra_state() return such a value or a tensor"
        )
    return v


def save(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write ``model`` and ``optimizer`` (either may be None) and ``extra`` to ``path``
    atomically: the previous file at ``path`` stays intact until the new one is complete and on
    disk. AdamBridge's pending updates are collected first (its ``state_dict()`` does that).
    Other training state (LR schedulers' ``state_dict()``, RNG states) goes in ``extra``; a value
    JSON would not give back as it is (a tuple, inf) raises ``ConfigError`` naming it."""
    if model is None and optimizer is None:
        raise ConfigError("save needs a model, an optimizer or both")
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError(f"extra must be a mapping of names to values, got {type(extra).__name__}")
    meta: dict[str, Any] = {"schema": CHECKPOINT_SCHEMA}
    tensors: list[tuple[str, Tensor]] = []
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        seen: dict[tuple, str] = {}
        aliases: dict[str, str] = {}
        keys = []
        values: dict[str, Any] = {}
        for name, t in model.state_dict().items():
            if not isinstance(t, Tensor):  # a module's get_extra_state(), for one
                values[name] = _json_exact(t, f"model entry {name!r}")
                continue
            ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if t.numel() and ident in seen:
                aliases[name] = seen[ident]
                continue
            seen[ident] = name
            keys.append(name)
            tensors.append((f"model/{name}", t))
        meta["model"] = {"keys": keys, "aliases": aliases, "values": values}
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        names = _param_names(model, optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        sd = optimizer.state_dict()
        unknown = sorted((k for k in sd if k not in ("state", "param_groups", "memopt")), key=str)
        if unknown:  # never dropped silently: a load hook expecting them would fail later
            raise ConfigError(
                f"optimizer.state_dict() has top-level entries {unknown} besides 'state' and "
                "'param_groups' (added by a state-dict post hook?), which save does not store: "
                "pass their values through extra= and put them back after load"
            )
        groups = []
        # memopt's state dicts repeat their 'memopt' entry in every param group (for torch's
        # get_state_dict, which keeps only the groups): the file keeps the top-level one
        skipped: tuple[str, ...] = ("params", "param_names")
        if sd.get("memopt") is not None:
            skipped += ("memopt",)
        for gi, g in enumerate(sd["param_groups"]):
            out = {
                # a tensor hyperparameter (a capturable lr, tensor betas) stays a tensor
                k: _stored(v, f"optim_groups/{gi}/{k}", tensors, f"param group {gi}'s {k!r}")
                for k, v in g.items()
                if k not in skipped
            }
            out["params"] = [names[i] for i in g["params"]]
            groups.append(out)
        state_meta: dict[str, dict[str, Any]] = {}
        for idx, entry in sd["state"].items():
            name = names[idx]
            state_meta[name] = {
                k: _stored(v, f"optim/{name}/{k}", tensors, f"state {k!r} of {name!r}")
                for k, v in entry.items()
            }
        meta["optimizer"] = {
            "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
            "param_groups": groups,
            "state": state_meta,
            "shapes": {n: list(p.shape) for n, p in zip(names, params, strict=True)},
            "memopt": _json_value(sd.get("memopt"), "the state dict's 'memopt' entry"),
            "keyed_by": "position" if model is None else "name",
        }
    extra_json: dict[str, Any] = {}
    for k, v in (extra or {}).items():
        if not isinstance(k, str):
            raise ConfigError(f"extra's keys must be str, got {k!r}")
        if isinstance(v, Tensor):
            tensors.append((f"extra/{k}", v))
            extra_json[k] = None
        else:
            extra_json[k] = _extra_value(v, f"extra[{k!r}]")
    meta["extra"] = extra_json
    meta["extra_tensors"] = [k for k, v in (extra or {}).items() if isinstance(v, Tensor)]
    with CheckpointWriter(path, meta=meta) as writer:
        for key, t in tensors:
            writer.add(key, t.detach())


def load(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Load what :func:`save` wrote into ``model`` and/or ``optimizer`` (built as when saving)
    and return ``extra``. Validates the whole file and every name and shape before changing
    anything; ``strict=False`` tolerates model entries missing on either side (never a shape or
    dtype mismatch)."""
    # a state dict passed for its module failed deep in the load (AttributeError), and the two
    # swapped were reported as a checkpoint without the optimizer's entries
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    check_bool("strict", strict)
    with CheckpointReader(path) as reader:
        meta = _checked_meta(reader, path)
        model_sd = _plan_model(reader, meta, model, strict) if model is not None else None
        optim_sd = (
            _plan_optimizer(reader, meta, model, optimizer) if optimizer is not None else None
        )
        extra = dict(meta.get("extra", {}))
        for k in meta.get("extra_tensors", []):
            extra[k] = reader.load(f"extra/{k}")
        # every tensor read and checked: now change things. The model first, as torch loads
        # it: copied into the live tensors in place, through the modules' _load_from_state_dict,
        # set_extra_state and load hooks, which may still refuse. Then the optimizer, whose
        # load_state_dict validates everything before it changes anything. If either raises,
        # the model's tensors are put back from a host copy, so nothing is half loaded.
        # a plan is None exactly where its target is: testing both only narrows them for mypy
        backup = _host_copy(model) if model is not None and model_sd is not None else []
        try:
            if model is not None and model_sd is not None:
                model.load_state_dict(model_sd, strict=strict)
            if optimizer is not None and optim_sd is not None:
                optimizer.load_state_dict(optim_sd)
        except BaseException:
            with torch.no_grad():
                for live, saved in backup:
                    live.copy_(saved)
            raise
    return extra


def _host_copy(model: torch.nn.Module) -> list[tuple[Tensor, Tensor]]:
    """Each tensor of ``model.state_dict()`` (tied ones once) with a host copy of its values;
    a lazy module's uninitialized parameters have none (the load materializes them)."""
    seen: set[int] = set()
    pairs = []
    for t in model.state_dict(keep_vars=True).values():
        if isinstance(t, Tensor) and not is_lazy(t) and id(t) not in seen:
            seen.add(id(t))
            pairs.append((t, t.detach().to("cpu", copy=True)))
    return pairs


def _tensor_refs(v: Any) -> list[Any]:
    """The container keys :func:`_restored` reads for ``v``."""
    if isinstance(v, Mapping) and set(v) == {TENSOR_REF}:
        return [v[TENSOR_REF]]
    if isinstance(v, list):
        return [r for x in v for r in _tensor_refs(x)]
    return []


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_shape(v: Any) -> bool:
    return isinstance(v, list) and all(type(d) is int and d >= 0 for d in v)


def _checked_meta(reader: CheckpointReader, path: str | os.PathLike) -> dict[str, Any]:
    """``reader.meta`` once it has the layout :func:`save` writes and every tensor it refers to
    is in the file: a container written by other code raises ``CheckpointError``, not a
    ``KeyError`` or ``TypeError`` halfway through :func:`load`."""
    meta = reader.meta

    def require(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(
                f"{os.fspath(path)} is not a memopt_checkpoint.save file (or its meta was "
                f"edited): {what}"
            )

    # JSON values, of any type until require() has checked them
    schema: Any = meta.get("schema")
    require(
        type(schema) is int and schema >= 1, f"its meta's 'schema' is {schema!r}, not an int >= 1"
    )
    if schema > CHECKPOINT_SCHEMA:
        raise CheckpointError(
            f"{os.fspath(path)} uses checkpoint schema {schema}; this memopt-checkpoint "
            f"reads up to {CHECKPOINT_SCHEMA}: upgrade memopt-checkpoint"
        )
    refs: list[Any] = []
    info = meta.get("model")
    if info is not None:
        aliases: Any = info.get("aliases", {}) if isinstance(info, dict) else None
        values: Any = info.get("values", {}) if isinstance(info, dict) else None
        require(
            isinstance(info, dict)
            and _str_list(info.get("keys"))
            and isinstance(aliases, dict)
            and _str_list(list(aliases.values()))  # (a list there was a bare TypeError)
            and set(aliases.values()) <= set(info["keys"])
            and all(isinstance(k, str) for k in aliases)
            and isinstance(values, dict),
            "its 'model' entry is not {'keys': [str], 'aliases': {str: stored key}, 'values': {}}",
        )
        # a name both stored and an alias (or a value) loaded the alias's tensor in place of
        # its own, silently where the shapes agree
        shadowed = sorted((set(aliases) | set(values)) & set(info["keys"]))
        shadowed += sorted(set(aliases) & set(values))
        require(
            not shadowed,
            f"its model names {shadowed[:8]} both as a stored tensor, an alias or a value",
        )
        refs += [f"model/{k}" for k in info["keys"]]
    info = meta.get("optimizer")
    if info is not None:
        groups: Any = info.get("param_groups") if isinstance(info, dict) else None
        state: Any = info.get("state") if isinstance(info, dict) else None
        shapes: Any = info.get("shapes", {}) if isinstance(info, dict) else None
        require(
            isinstance(info, dict)
            and isinstance(info.get("class"), str)
            and info.get("keyed_by") in ("name", "position")
            and isinstance(groups, list)
            and all(isinstance(g, dict) and _str_list(g.get("params")) for g in groups)
            and isinstance(state, dict)
            and all(isinstance(e, dict) for e in state.values())
            and isinstance(shapes, dict)
            and all(_is_shape(s) for s in shapes.values())
            and isinstance(info.get("memopt"), (dict, type(None))),
            "its 'optimizer' entry lacks the class, keying, param groups, state or shapes "
            "save writes",
        )
        # the checks here, memopt's loaders and their copies recurse per level: a few hundred
        # levels of lists were a bare RecursionError
        require(
            not _nested_deeper([groups, state, info.get("memopt")], _MAX_DEPTH),
            f"its 'optimizer' entry is nested more than {_MAX_DEPTH} levels deep",
        )
        if schema >= 3:
            require(
                _float_refs_ok([groups, state, info.get("memopt")]),
                f"a {{{FLOAT_REF!r}: ...}} in its 'optimizer' entry is not one of {_NON_FINITE}",
            )
        refs += [r for g in groups for v in g.values() for r in _tensor_refs(v)]
        refs += [r for e in state.values() for v in e.values() for r in _tensor_refs(v)]
        if schema < 2:  # None marked a tensor
            refs += [f"optim/{n}/{k}" for n, e in state.items() for k, v in e.items() if v is None]
    extra_tensors = meta.get("extra_tensors", [])
    require(
        isinstance(meta.get("extra", {}), dict) and _str_list(extra_tensors),
        "its 'extra' is not a dict, or 'extra_tensors' not a list of str",
    )
    refs += [f"extra/{k}" for k in extra_tensors]
    missing = [r for r in refs if not isinstance(r, str) or r not in reader]
    require(not missing, f"it refers to tensors it does not hold: {missing[:8]}")
    # save refers to each tensor once; a key named many times was read once per mention (a
    # few bytes of meta each read the whole tensor again: more memory than the file holds)
    seen: set[str] = set()
    repeated = []
    for r in refs:
        if r in seen:
            repeated.append(r)
        seen.add(r)
    require(not repeated, f"it refers to tensors more than once: {repeated[:8]}")
    return meta


#: The deepest nesting of lists and dicts :func:`load` takes in the optimizer's entry (the
#: state dicts of every optimizer here nest 3 levels).
_MAX_DEPTH = 64


def _nested_deeper(v: Any, limit: int) -> bool:
    """Whether the JSON value ``v`` nests lists and dicts more than ``limit`` levels deep
    (without recursion, visiting each value once)."""
    stack = [(v, 0)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (list, dict)):
            if depth >= limit:
                return True
            stack.extend((y, depth + 1) for y in (x.values() if isinstance(x, dict) else x))
    return False


def _extra_state_keys(model: torch.nn.Module) -> set[str]:
    """The ``state_dict()`` keys of the modules' ``get_extra_state()`` values."""
    return {
        f"{prefix}.{_EXTRA_STATE}" if prefix else _EXTRA_STATE
        for prefix, m in model.named_modules()
        if type(m).get_extra_state is not torch.nn.Module.get_extra_state
    }


def _plan_model(reader, meta, model, strict) -> dict[str, Any]:
    """The state dict :func:`load` hands to ``model.load_state_dict``: every entry the file and
    ``model.state_dict()`` both have, each tensor read and checked against that entry's shape and
    dtype (a tied tensor read once, under each of its names). ``get_extra_state()`` values are
    not checked (``set_extra_state`` decides what it takes, as in torch), nor the entries of lazy
    modules that have no shape yet (their load gives them one)."""
    info = meta.get("model")
    if info is None:
        raise StateDictError("the checkpoint holds no model (it was saved with model=None)")
    stored = {name: name for name in info["keys"]}
    stored.update(info.get("aliases", {}))
    saved_values = info.get("values", {})
    stored.update({name: name for name in saved_values})
    current = model.state_dict()
    on_meta = [k for k, t in current.items() if isinstance(t, Tensor) and t.is_meta]
    if on_meta:  # torch's load_state_dict would skip them with a warning; the backup cannot copy
        raise ConfigError(
            f"the model's {on_meta[0]!r} ({len(on_meta)} tensor(s) in all) is on the meta "
            "device, which holds no values to load into: materialize the model first "
            "(model.to_empty(device=...)), then load"
        )
    missing = [k for k in current if k not in stored]
    unexpected = [k for k in stored if k not in current]
    if strict and (missing or unexpected):
        raise StateDictError(
            f"the checkpoint's model does not match: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{'...' if len(unexpected) > 8 else ''} (load(..., strict=False) skips them)"
        )
    sd: dict[str, Any] = {}
    cache: dict[str, Tensor] = {}
    unchecked = _extra_state_keys(model)
    for name, target in current.items():
        if name not in stored:
            continue
        is_value = name in saved_values
        if is_value == isinstance(target, Tensor):
            kinds = ("a tensor", "a non-tensor value")
            raise StateDictError(
                f"model entry {name!r} is {kinds[is_value]} in the checkpoint, "
                f"{kinds[not is_value]} in the model"
            )
        if is_value:
            sd[name] = saved_values[name]
            continue
        key = f"model/{stored[name]}"
        if name not in unchecked and not torch.nn.parameter.is_lazy(target):
            dtype, shape, _ = reader.entry(key)
            if tuple(shape) != tuple(target.shape) or dtype != target.dtype:
                raise StateDictError(
                    f"model entry {name!r} is {dtype} of shape {tuple(shape)} in the checkpoint, "
                    f"{target.dtype} of shape {tuple(target.shape)} in the model"
                )
        if key not in cache:
            cache[key] = reader.load(key)
        sd[name] = cache[key]
    return sd


def _plan_optimizer(reader, meta, model, optimizer) -> dict[str, Any]:
    info = meta.get("optimizer")
    if info is None:
        raise StateDictError("the checkpoint holds no optimizer (it was saved with optimizer=None)")
    cls = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if info["class"] != cls:
        raise StateDictError(
            f"the checkpoint holds the state of a {info['class']}; this optimizer is a {cls}: "
            f"load it into a {info['class'].rsplit('.', 1)[-1]} (memopt_checkpoint.interop "
            "converts between memopt and torch optimizers' state dicts; an ECC master keeps its "
            "low bits through fp32_model_state_dict only)"
        )
    if info["keyed_by"] == "name" and model is None:
        # (a file keyed by position was saved with model=None, so it has no model to load)
        raise ConfigError("this checkpoint keys the optimizer state by parameter name: pass model=")
    saved_names = {n for g in info["param_groups"] for n in g["params"]} | set(info["state"])
    names = _param_names(model, optimizer, known=saved_names)
    index = {name: i for i, name in enumerate(names)}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for name, p in zip(names, params, strict=True):
        shape = info.get("shapes", {}).get(name)  # schema 1 files have none
        if shape is not None and list(p.shape) != shape:
            raise StateDictError(
                f"optimizer parameter {name!r} has shape {tuple(p.shape)}; the checkpoint's state "
                f"under that {'position' if name.startswith('#') else 'name'} was saved for a "
                f"parameter of shape {tuple(shape)}: it belongs to another parameter"
            )
    schema = meta["schema"]
    saved_groups = info["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise StateDictError(
            f"the checkpoint has {len(saved_groups)} param group(s), the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    groups = []
    pos = 0
    for gi, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups, strict=True)):
        mine = names[pos : pos + len(group["params"])]
        pos += len(group["params"])
        if sorted(saved["params"]) != sorted(mine):
            missing = sorted(set(mine) - set(saved["params"]))
            extra = sorted(set(saved["params"]) - set(mine))
            if not missing and not extra:  # the same names, one listed twice
                raise StateDictError(
                    f"param group {gi} of the checkpoint lists a parameter twice: the file is "
                    "corrupt or was edited"
                )
            raise StateDictError(
                f"param group {gi} differs: the checkpoint lacks {missing[:8]} and has "
                f"{extra[:8]} that the optimizer's group does not"
            )
        g = {k: _restored(v, reader, schema) for k, v in saved.items() if k != "params"}
        for k, v in g.items():  # JSON has no tuples: betas, Rprop's etas, Adafactor's eps
            if isinstance(v, list) and (k == "betas" or isinstance(group.get(k), tuple)):
                g[k] = tuple(v)
        g["params"] = [index[n] for n in mine]  # torch maps saved ids to params by position
        groups.append(g)
    state: dict[int, dict[str, Any]] = {}
    for name, values in info["state"].items():
        if name not in index:
            raise StateDictError(f"the checkpoint holds optimizer state for {name!r}, unknown here")
        if schema < 2:  # None marked a tensor
            entry = {
                k: reader.load(f"optim/{name}/{k}") if v is None else v for k, v in values.items()
            }
        else:
            entry = {k: _restored(v, reader, schema) for k, v in values.items()}
        state[index[name]] = entry
    sd: dict[str, Any] = {"state": state, "param_groups": groups}
    if info.get("memopt") is not None:
        memo = dict(info["memopt"])
        sd["memopt"] = _floats_decoded(memo) if schema >= 3 else memo
    return sd
