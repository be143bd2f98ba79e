"""``cast_model``: a model in bf16 (or another dtype) with chosen layers kept in fp32.

Semantics (FlashOptim's, made precise):

- Every floating parameter and buffer is cast to ``dtype`` in place (``p.data = ...``), so each
  ``nn.Parameter`` stays the same object: tied weights stay tied, and an optimizer built later
  sees the cast tensors. Integer buffers are untouched. Gradients already present are cast too.
- ``full_precision_layers``: matching modules keep their parameters and buffers, and those of
  every submodule, in float32 (lower-precision ones are widened, float64 ones narrowed); a
  forward pre-hook widens their bf16/fp16 floating inputs (positional and keyword, inside
  tuples, lists and dicts) to float32; the **output stays float32**. For terminal layers
  (``lm_head``, a classifier) whose output feeds a loss. A matched container without a forward
  of its own (``ModuleList``, ``ModuleDict``) gets no hook, since it never runs: the modules in it
  that run get them.
- ``full_precision_recast_layers``: the same, plus a forward hook that **casts the floating
  outputs back to** ``dtype``. For layers in the middle of a bf16 network.
- ``selective=True`` (default): normalization layers with running statistics (``BatchNorm1d/2d/
  3d``, ``SyncBatchNorm``, ``InstanceNorm1d/2d/3d``, their lazy variants and subclasses:
  :data:`RUNNING_STAT_NORMS`) stay float32; a pre-hook widens their inputs and a hook casts their outputs back
  to the dtype the input had, so they run inside a bf16 network with fp32 statistics.
  LayerNorm/RMSNorm/GroupNorm (no running statistics) are cast like any other layer.
- Matching: a string is an ``fnmatch`` pattern (case-sensitive) tested against each module's
  full dotted name from ``model.named_modules()`` (``"head"`` matches the top-level ``head``, not
  ``decoder.head``: use ``"*.head"``; ``"*"`` matches every module, the root ``""`` included); an
  ``nn.Module`` matches by identity. A pattern or module that matches nothing warns.
- A tensor shared by a float32 module and a cast module (for example an embedding tied to a
  full-precision ``lm_head``) cannot have both dtypes: ``ConfigError`` names both.
- ``dtype=torch.float64``: every module is cast, those the options above name included (float32
  would be the less precise one), and no hook is installed.
- Calling ``cast_model`` again replaces the hooks of the previous call.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from collections.abc import Iterable, Iterator
from fnmatch import fnmatchcase
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from memopt_core.errors import ConfigError
from memopt_core.optimizer import check_bool

__all__ = ["RUNNING_STAT_NORMS", "cast_model"]

#: normalization layers with running statistics (kept fp32 with ``selective=True``)
RUNNING_STAT_NORMS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
)
#: dtypes ``cast_model`` casts to (8-bit floats are no dtype a model trains in)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_HANDLES = "_memopt_cast_hooks"
_IN_DTYPES = "_memopt_cast_input_dtypes"


def _specs(value: Any, what: str) -> list[str | nn.Module]:
    if value is None:
        return []
    if isinstance(value, (str, nn.Module)):
        return [value]
    if not isinstance(value, Iterable):
        raise ConfigError(
            f"{what} takes an fnmatch pattern (str), an nn.Module, or an iterable of them; got "
            f"{type(value).__name__} {value!r}"
        )
    out = list(value)
    for spec in out:
        if not isinstance(spec, (str, nn.Module)):
            raise ConfigError(
                f"{what} takes fnmatch patterns (str) on dotted module names or nn.Module objects; "
                f"got {type(spec).__name__} {spec!r}"
            )
    return out


def _map_floats(obj: Any, fn) -> Any:
    """``obj`` with ``fn`` applied to its floating tensors; containers keep their type, so
    callers still find ``out.logits`` (HF ``ModelOutput``) or ``out.values`` (``torch.max``)."""
    if isinstance(obj, Tensor):
        return fn(obj) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        items = [_map_floats(o, fn) for o in obj]
        if all(new is old for new, old in zip(items, obj, strict=True)):
            return obj  # as it was, whatever its type (torch.Size, which holds no tensor)
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        if hasattr(type(obj), "n_sequence_fields"):  # structseq: torch.return_types
            return type(obj)(items)
        if type(obj) is not tuple:
            try:  # another subclass built from its items, as tuple is
                return type(obj)(items)
            except TypeError:  # its constructor takes other arguments: a plain tuple
                pass
        return tuple(items)
    if isinstance(obj, list):
        items = [_map_floats(o, fn) for o in obj]
        if type(obj) is list:
            return items
        seq = copy.copy(obj)  # a subclass keeps its type and attributes
        seq[:] = items
        return seq
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        inst = copy.copy(obj)
        for f in dataclasses.fields(obj):  # object's setattr: a frozen one's copy is ours
            object.__setattr__(inst, f.name, _map_floats(getattr(obj, f.name), fn))
        return inst
    if type(obj) is dict:
        return {k: _map_floats(v, fn) for k, v in obj.items()}
    if isinstance(obj, dict):
        # a subclass (OrderedDict, ModelOutput) may need more than its items to be rebuilt:
        # a copy keeps its attributes, and assigning keeps the keys' order
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _map_floats(v, fn)
        return out
    return obj


def _widen(t: Tensor) -> Tensor:
    return t.float() if t.dtype.itemsize < 4 else t


def _first_low_dtype(obj: Any) -> torch.dtype | None:
    if isinstance(obj, Tensor):
        return obj.dtype if obj.is_floating_point() and obj.dtype.itemsize < 4 else None
    if isinstance(obj, (tuple, list)):
        items: Iterable[Any] = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return None
    for o in items:
        found = _first_low_dtype(o)
        if found is not None:
            return found
    return None


# Hooks are module-level functions (or partials of them) so hooked models still pickle.
def _upcast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return _map_floats(args, _widen), _map_floats(kwargs, _widen)


def _recast_outputs(module: nn.Module, args: tuple, output: Any, *, dtype: torch.dtype) -> Any:
    return _map_floats(output, lambda t: t.to(dtype))


def _norm_pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    module.__dict__.setdefault(_IN_DTYPES, []).append(_first_low_dtype((args, kwargs)))
    return _upcast_inputs(module, args, kwargs)


def _norm_post(module: nn.Module, args: tuple, output: Any) -> Any:
    stack = module.__dict__.get(_IN_DTYPES)
    dtype = stack.pop() if stack else None
    if dtype is None:
        return output
    return _map_floats(output, lambda t: t.to(dtype))


def _remove_hooks(model: nn.Module) -> None:
    for m in model.modules():
        for handle in m.__dict__.pop(_HANDLES, ()):
            handle.remove()
        m.__dict__.pop(_IN_DTYPES, None)


_M = TypeVar("_M", bound=nn.Module)


def cast_model(
    model: _M,
    dtype: torch.dtype = torch.bfloat16,
    selective: bool = True,
    full_precision_layers: Iterable[str | nn.Module] | str | nn.Module | None = (),
    full_precision_recast_layers: Iterable[str | nn.Module] | str | nn.Module | None = (),
) -> _M:
    """Cast ``model``'s floating parameters and buffers to ``dtype`` in place; returns ``model``.

    See the module doc for the exact semantics of ``selective``, ``full_precision_layers`` (kept
    fp32, output stays fp32) and ``full_precision_recast_layers`` (kept fp32, output cast back to
    ``dtype``). Raises ``ConfigError`` when a tied tensor would need two dtypes. Works on any
    device, where the tensors are; a cast fp32 tensor goes from 4 to 2 bytes per element.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"cast_model expects a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
        raise ConfigError(
            "dtype must be a floating torch dtype of 16 bits or more: torch.bfloat16, "
            f"torch.float16, torch.float32 or torch.float64; got {dtype!r}"
        )
    check_bool("selective", selective)
    keep = _specs(full_precision_layers, "full_precision_layers")
    recast = _specs(full_precision_recast_layers, "full_precision_recast_layers")

    # every (name, module) pair, shared modules under each of their names
    named = list(model.named_modules(remove_duplicate=False))
    modes: dict[int, str] = {}  # id(module) -> "keep" | "recast" | "norm"
    used: set[tuple[str, int]] = set()
    for name, m in named:
        for mode, specs in (("keep", keep), ("recast", recast)):
            for i, spec in enumerate(specs):
                hit = m is spec if isinstance(spec, nn.Module) else fnmatchcase(name, spec)
                if not hit:
                    continue
                used.add((mode, i))
                if modes.get(id(m), mode) != mode:
                    raise ConfigError(
                        f"module {name!r} matches both full_precision_layers and "
                        "full_precision_recast_layers; list it in one of them"
                    )
                modes[id(m)] = mode
        if selective and isinstance(m, RUNNING_STAT_NORMS) and id(m) not in modes:
            modes[id(m)] = "norm"
    if dtype == torch.float64:
        # nothing is less precise than float32 here: float32 layers inside a float64 network
        # would take float64 inputs they cannot mix with (BatchNorm raised deep in torch)
        modes = {}
    for mode, specs in (("keep", keep), ("recast", recast)):
        for i, spec in enumerate(specs):
            if (mode, i) not in used:
                what = "full_precision_layers" if mode == "keep" else "full_precision_recast_layers"
                shown = (
                    f"module {type(spec).__name__}" if isinstance(spec, nn.Module) else repr(spec)
                )
                warnings.warn(
                    f"cast_model: {what} entry {shown} matches no module of the model (patterns "
                    "match full dotted names: use '*.name' for nested modules)",
                    UserWarning,
                    stacklevel=2,
                )

    # which modules lie inside a float32 subtree (a module reached twice must agree per tensor)
    holders: dict[int, list[tuple[str, bool, nn.Module, str, str]]] = {}

    def walk(prefix: str, m: nn.Module, inherited: bool) -> None:
        fp32 = inherited or id(m) in modes
        for kind, table in (("param", m._parameters), ("buffer", m._buffers)):
            for tname, t in table.items():
                if t is not None:
                    full = f"{prefix}.{tname}" if prefix else tname
                    holders.setdefault(id(t), []).append((full, fp32, m, tname, kind))
        for cname, child in m._modules.items():
            if child is not None:
                walk(f"{prefix}.{cname}" if prefix else cname, child, fp32)

    walk("", model, False)
    for entries in holders.values():
        flags = {fp32 for _, fp32, *_ in entries}
        if len(flags) > 1:
            kept = [n for n, fp32, *_ in entries if fp32]
            cast = [n for n, fp32, *_ in entries if not fp32]
            raise ConfigError(
                f"tensor {kept[0]!r} is shared with {cast[0]!r}: the first belongs to a module kept "
                f"in float32, the second to one cast to {dtype}, and one tensor has one dtype. Keep "
                "both modules in full precision, or untie them"
            )

    # cast (each tensor once; Parameters keep their identity, shared buffers stay shared)
    with torch.no_grad():
        done: set[int] = set()
        for tid, entries in holders.items():
            if tid in done:
                continue
            done.add(tid)
            _, fp32, m, tname, kind = entries[0]
            t = m._parameters[tname] if kind == "param" else m._buffers[tname]
            if t is None or not t.is_floating_point():
                continue
            # float64 tensors of a float32 subtree are narrowed too: its pre-hook widens inputs
            # to float32 only (a float64 BatchNorm raised on them)
            target = torch.float32 if fp32 else dtype
            if t.dtype == target:
                continue
            if kind == "param":
                t.data = t.data.to(target)
                if t.grad is not None:
                    t.grad = t.grad.to(target)
            else:
                new = t.to(target)
                for _, _, holder, bname, _ in entries:
                    holder._buffers[bname] = new

    _remove_hooks(model)
    hooked: set[int] = set()
    for _, matched in named:
        matched_mode = modes.get(id(matched))
        if matched_mode is None:
            continue
        for m in _called_modules(matched):
            if id(m) in hooked or (m is not matched and id(m) in modes):
                continue  # hooked once, under its own mode where it has one
            hooked.add(id(m))
            _hook(m, matched_mode, dtype)
    return model


def _called_modules(m: nn.Module) -> Iterator[nn.Module]:
    """``m``, or where ``m`` is a container without a forward of its own (``ModuleList``,
    ``ModuleDict``), the modules in it that run: their callers call them, never ``m``, so a
    hook on ``m`` would not run."""
    if type(m).forward is not nn.Module.forward:
        yield m
        return
    for child in m.children():
        yield from _called_modules(child)


def _hook(m: nn.Module, mode: str, dtype: torch.dtype) -> None:
    """Install ``mode``'s hooks on ``m`` (see the module doc)."""
    if mode == "norm":
        handles = [
            m.register_forward_pre_hook(_norm_pre, with_kwargs=True),
            m.register_forward_hook(_norm_post, always_call=True),
        ]
    else:
        handles = [m.register_forward_pre_hook(_upcast_inputs, with_kwargs=True)]
        if mode == "recast":
            handles.append(m.register_forward_hook(functools.partial(_recast_outputs, dtype=dtype)))
    m.__dict__[_HANDLES] = handles
