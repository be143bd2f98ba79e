"""``MemOptimizer``: the base of every memopt optimizer, also usable directly.

Rules: ``sgd`` / ``adam`` (L2 weight decay added to the gradient), ``sgdw`` / ``adamw`` / ``lion``
(decoupled weight decay), with the semantics of :mod:`memopt_core.reference`.

Parameters: float32 on any device torch runs on (CPU, CUDA), updated in place (their own master);
bfloat16 / float16 with ``master="none"`` (updated directly, rounded to nearest or stochastically)
and bfloat16 with ``master="ecc24"`` / ``"ecc32"`` (an 8 / 16-bit code per element next to the
parameter keeps a 24-bit / exact fp32 master). Other dtypes are refused.

State bytes per parameter element (moments for Adam; Lion and SGD with momentum keep only the
first; SGD without momentum keeps none), plus the master code:

=========== ====================== ======================
moments     first + second moment  master code
=========== ====================== ======================
``fp32``    4 + 4                  ``fp32``/``none``: 0
``bf16``    2 + 2                  ``ecc24``: 1
``fp8``     ~1 + ~1 (+ scales)     ``ecc32``: 2
``q8``      ~1 + ~1 (+ scales)
=========== ====================== ======================

Exact numbers for a configuration: :meth:`MemOptimizer.state_bytes` (arena bytes).

Beyond torch's optimizer interface (advanced; see each method): :meth:`MemOptimizer.init_state`
creates the state before the first step, :meth:`MemOptimizer.step_parameters` updates chosen
parameters only, and :meth:`MemOptimizer.begin_gradient_release` /
:meth:`MemOptimizer.end_gradient_release` / :attr:`MemOptimizer.gradient_release_active` are the
switch that per-parameter update hooks (``memopt_ecc.enable_gradient_release``) set while they own
the updates. ``step()`` fires torch's step pre/post hooks (``register_step_pre_hook``,
``register_step_post_hook``, the global ones) and the profiler range exactly once per call, also
in subclasses whose ``step`` calls ``super().step()``.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import reprlib
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, MutableMapping
from copy import deepcopy
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, NoReturn, TypeGuard, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from memopt_core import backends, conversions, reference, rng
from memopt_core.aliasing import (
    addressable,
    check_aliasing,
    check_parameters_apart,
    clear_of,
    has_memory,
    labelled_parameters,
    refuse_negated,
    sorted_extents,
)
from memopt_core.backends import grad_dtype_ok
from memopt_core.cached_step import CachedEntry, CachedStep
from memopt_core.eager import run_eagerly
from memopt_core.errors import (
    BackendUnavailableError,
    ConfigError,
    NumericsError,
    RoundToNearestWarning,
    StateDictError,
)
from memopt_core.formats import (
    DECAY_NORMALIZED_PRESETS,
    MASTER_FORMATS,
    MOMENT_FORMATS,
    MOMENT_PRESETS,
    MomentCodec,
    StateSpec,
    moment_codec,
)
from memopt_core.plan import (
    GroupPlan,
    StateArena,
    expected_layout,
    family_arenas,
    make_plans,
    overlaps_itself,
    padding_unit,
    round_up,
    state_key,
)
from memopt_core.sharding import (
    check_sharded,
    global_state,
    index_base,
    is_dtensor,
    local_shard,
    local_state,
    max_over_shards,
)
from memopt_core.state_dict_hooks import (
    finished_state_dict,
    run_load_post_hooks,
    run_load_pre_hooks,
)
from memopt_core.state_dict_meta import META_KEY, add_group_meta, saved_meta, without_meta
from memopt_core.tracked_state import ParamState, TrackedState, WriteCounter

if TYPE_CHECKING:
    from types import FrameType

    from torch.distributed.tensor import DTensor

__all__ = [
    "RULES",
    "MemOptimizer",
    "adam_hyperparameters",
    "check_bool",
    "forgets_scaler_flags_on_error",
    "grad_dtype_ok",
    "real_as_float",
    "require_memopt_optimizer",
]

#: rule -> (backend rule, decoupled weight decay)
RULES: dict[str, tuple[str, bool]] = {
    "sgd": ("sgd", False),
    "sgdw": ("sgd", True),
    "adam": ("adam", False),
    "adamw": ("adam", True),
    "lion": ("lion", True),
}
_HYPER = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "momentum",
    "dampening",
    "nesterov",
    "maximize",
    "decouple_lr",
    "master",
    "moments",
    "stochastic_rounding",
)
_BOOLS = ("nesterov", "maximize", "decouple_lr", "stochastic_rounding")
#: the keys of a param group that the step reads (torch's ``__setstate__`` adds defaults such as
#: ``differentiable`` that older groups lack: those are read with ``get``)
_GROUP_KEYS = frozenset(
    ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "master", "moments", *_BOOLS)
)
#: 2: Adam's 8-bit second moments are stored decay-normalized (``decay_norm_beta2`` in the
#: ``memopt`` entry); a version-1 dict's hold ``v`` itself and are normalized at the next step
_STATE_DICT_VERSION = 2
#: the ``memopt`` entry's key of each group's normalizing beta2 (None: not normalized)
_NORM_KEY = "decay_norm_beta2"
#: the first step count a float32 counter cannot advance past (see _check_step_limit)
_STEP_LIMIT = 2**24
_CPU = torch.device("cpu")
#: the state dict entry key recording the parameter's shape (the global shape of a sharded one)
_PARAM_SHAPE = "param_shape"
#: the state dict entry key recording the count a q8/fp8 second moment is stored for
#: (``u = v / N(count)``): a live view of the counters' second row, so that a count edited in
#: the dict before ``load_state_dict`` is seen and its moments converted, as in the optimizer
_NORM_STEP_KEY = "decay_norm_step"
#: rule kind -> the states it may keep
_STATE_NAMES: dict[str, tuple[str, ...]] = {
    "adam": ("exp_avg", "exp_avg_sq"),
    "lion": ("exp_avg",),
    "sgd": ("momentum_buffer",),
}
#: the state key of a parameter's ECC code (an ECC master's low bits)
_CODE_KEY = "master_code"
#: every per-parameter state key a memopt format or rule can store; any other key of
#: ``state[p]`` is the caller's (timm's Lookahead keeps ``lookahead_slow_buff`` there) and is
#: kept through rebuilds and state dicts as torch keeps it
_MEMOPT_KEYS = frozenset(
    {"step", _CODE_KEY, _PARAM_SHAPE, _NORM_STEP_KEY}
    | {
        state_key(name, sfx)
        for names in _STATE_NAMES.values()
        for name in names
        for fmt in MOMENT_FORMATS
        for sfx in moment_codec(fmt).fields
    }
)


@dataclass
class _Entry:
    """One plan group: ``plan.params`` are the tensors stepped (a sharded parameter's local
    shard), ``owners`` the optimizer's parameters (the DTensor), aligned with them."""

    plan: GroupPlan
    arena: StateArena
    tensor_ids: list[int]
    owners: list[Tensor]
    index_bases: list[int] | None  # None: every base is 0 (no sharded parameter)
    # the step counters as one tensor (on the device with capturable=True), and the views of it
    # that self.state[p]["step"] held when it was built (rebuilt when a state no longer holds them)
    steps: Tensor | None = None
    step_views: list[Tensor] | None = None
    sharded: bool = False  # some owner is a DTensor (its plan holds the local shard)
    # each owner's state dict as the optimizer made it, and the tensors it held (the arena's
    # views): a state the user deleted, replaced or put other tensors in is seen by comparing
    states: list[ParamState] = field(default_factory=list)
    held: list[dict[str, Tensor]] = field(default_factory=list)
    # Adam's decay-normalized second moments (q8/fp8: u = v / N, N read from each count): the
    # counts the stored u were normalized with, row 1 of ``counts`` (row 0 is ``steps``, so a
    # host step advances both in one operation; a device step's kernels advance both:
    # ``DeviceStep.norm_steps``). ``counts_version``: the version of ``steps`` when the
    # optimizer last wrote or checked them (every format). An in-place edit of a count
    # (``state[p]["step"].zero_()``, torch users' restart of the bias corrections) changes the
    # version, and :meth:`MemOptimizer._sync_step_edits` then checks the counts and converts u
    # to the new count before the next step reads it (``norm_steps`` None: other formats,
    # which store v and take any count)
    counts: Tensor | None = None
    norm_steps: Tensor | None = None
    counts_version: int = -1
    normalized: bool = False

    def released(self, state: Mapping[Tensor, Any]) -> bool:
        """Whether no owner's state in ``state`` holds a tensor this entry's states held (its
        arena's views, its counters): all of them were replaced, and the entry alone keeps its
        arena alive."""
        held = {id(t) for h in self.held for t in h.values()}
        return not any(id(t) in held for p in self.owners for t in (state.get(p) or {}).values())

    def holds_its_state(self, state: Mapping[Tensor, Any]) -> bool:
        """Whether every owner's state in ``state`` is still the dict and tensors it was."""
        for p, mine, held in zip(self.owners, self.states, self.held, strict=True):
            current = state.get(p)
            if current is not mine or any(current.get(k) is not v for k, v in held.items()):
                return False
        return True


@dataclass
class _GroupPlans:
    signature: tuple | None  # None: rebuild (its states were written from outside)
    formats: tuple[str, str]
    names: tuple[str, ...]
    entries: list[_Entry]
    #: the group dict, its params list and the list's length when the plan was last checked:
    #: step_parameters' fast check sees a group reordered, removed or edited by identity
    source: tuple[dict[str, Any], list[Any], int] | None = None

    def describes(self, group: Mapping[str, Any]) -> bool:
        src = self.source
        return (
            src is not None
            and src[0] is group
            and src[1] is group["params"]
            and src[2] == len(group["params"])
        )


def _locals(entry: _Entry, tensors: list[Tensor]) -> list[Tensor]:
    """``tensors`` as the kernels step them: a sharded parameter's (or gradient's) local shard."""
    return [local_shard(t) for t in tensors] if entry.sharded else tensors


def _initial_lr(lr: Any) -> Any:
    """The ``initial_lr`` to record for ``lr``: a copy of a tensor lr, as torch's LR schedulers
    make, because they set a tensor lr in place (``fill_``): the same tensor would follow it, and
    ``lr / initial_lr`` (decoupled decay) would stay 1."""
    return lr.detach().clone() if isinstance(lr, Tensor) else lr


#: The key of the cached device step in ``_cached_steps`` (:meth:`_device_counted_step`)
_DEVICE_KEY = ("device",)
#: The group values a capturable step reads on the device when they are tensors there
_DEVICE_KEYS = ("lr", "initial_lr", "weight_decay")


def _group_beta2(groups: Any, gi: int) -> float:
    """The beta2 of param group ``gi`` of ``groups`` (live or saved; 0.0 where it has none that
    is a number in [0, 1): a group whose second moments are not normalized, or a malformed
    one, which the group checks refuse)."""
    try:
        beta2 = float(groups[gi]["betas"][1])
    except (TypeError, KeyError, IndexError, ValueError, RuntimeError):
        return 0.0
    return beta2 if 0.0 <= beta2 < 1.0 else 0.0


def _on_a_gpu(value: Any) -> TypeGuard[Tensor]:
    """Whether ``value`` is a tensor outside host memory (reading it synchronises)."""
    return isinstance(value, Tensor) and value.device.type != "cpu"


def real_as_float(value: float | numbers.Real) -> float:
    """``float(value)``, but +-inf for an int beyond float's range (where ``float`` and
    ``math.isfinite`` raise ``OverflowError``), so that a range check refuses it with its own
    message."""
    try:
        return float(value)
    except OverflowError:
        return -math.inf if value < 0 else math.inf  # numbers.Real types <, not >


def _as_float(value: Any, what: str, where: str) -> float:
    """``value`` as a finite float: a real number (numpy's included, as torch's optimizers take
    them; not a bool) or a one-element real tensor; ConfigError otherwise."""
    if type(value) is float and math.isfinite(value):  # the common case, checked every step
        return value
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{what} {where} must be a real number, got {value!r}")
    value = real_as_float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{what} {where} must be finite, got {value}")
    return value


def check_bool(name: str, value: Any) -> None:
    """``ConfigError`` naming ``name`` unless ``value`` is True or False (1, "yes" and None are
    refused: a flag that is not a bool is a mistake more often than a shorthand)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


def _refuse_missing_key(key: str, where: str) -> NoReturn:
    """ConfigError for a param group (``where``: "(param group 0)") that lacks ``key``: torch
    fills every default in, so it was deleted by hand (a bare KeyError in the step before)."""
    raise ConfigError(f"{where.strip('()')} has no {key!r}: give it a value (del removed it?)")


def adam_hyperparameters(g: Mapping[str, Any], betas: Any, where: str) -> dict[str, Any]:
    """``g``'s ``lr``, ``eps`` and ``weight_decay`` (finite, >= 0) and ``betas`` (a pair in
    [0, 1)) as floats: real numbers or one-element tensors, else a ConfigError naming the value
    and ``where``. MemOptimizer's group check and memopt-offload's AdamBridge share it."""
    out: dict[str, Any] = {}
    for key, name in (("lr", "learning rate"), ("eps", "eps"), ("weight_decay", "weight_decay")):
        if key not in g:  # AdamBridge's groups come without MemOptimizer's check of them
            _refuse_missing_key(key, where)
        out[key] = _as_float(g[key], "learning rate (lr)" if key == "lr" else name, where)
        if out[key] < 0:
            raise ConfigError(f"invalid {name} {out[key]} {where}: it must be >= 0")
    if isinstance(betas, Tensor) or not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ConfigError(f"betas {where} must be a pair (beta1, beta2), got {betas!r}")
    out["betas"] = tuple(_as_float(x, f"beta{i + 1}", where) for i, x in enumerate(betas))
    for i, x in enumerate(out["betas"]):
        if not 0.0 <= x < 1.0:
            raise ConfigError(f"invalid beta{i + 1} {x} {where}: betas must lie in [0, 1)")
    return out


def _run_works(
    works: list[tuple[Any, backends.GroupStep]],
    prepared: list[Any] | None,
    launch: Callable[[int], None],
    ran: Callable[[int], None],
) -> None:
    """Run ``works`` (``(backend, work)`` pairs) in order, ``ran(i)`` after work ``i``: each
    run of consecutive works of one backend that merges param groups or step counts
    (:func:`memopt_core.backends.merges_groups`, :func:`~memopt_core.backends.merges_step_counts`),
    all host steps or all capturable ones and none with staging, through its ``step_all`` (one
    launch per family of arenas, or per arena), every other work alone through ``launch(i)``.
    ``prepared``: None, or the works' prepared launches (a cached step's)."""
    i, n = 0, len(works)
    while i < n:
        backend = works[i][0]
        j = _run_end(works, i)
        if j - i > 1:
            part = [w for _, w in works[i:j]]
            backend.step_all(
                part, None if prepared is None else prepared[i:j], lambda k, i=i: ran(i + k)
            )
            i = j
        else:
            backends.launch_then_done(functools.partial(launch, i), (i,), ran)
            i += 1


def _run_end(works: list[tuple[Any, backends.GroupStep]], i: int) -> int:
    """The end of the run of works that :func:`_run_works` hands one ``step_all`` call from
    work ``i`` on (``i + 1``: work ``i`` runs alone)."""
    backend, n = works[i][0], len(works)
    if not (backends.merges_groups(backend) or backends.merges_step_counts(backend)):
        return i + 1
    on_device = works[i][1].device_step is not None
    j = i
    while (
        j < n
        and works[j][0] is backend
        and (works[j][1].device_step is not None) == on_device
        and works[j][1].staging is None
    ):
        j += 1
    return max(j, i + 1)


def _found_inf_on_host(amp: tuple[Tensor | None, Tensor | None]) -> bool:
    """Whether a GradScaler's found-inf flag is set, read on the host (one synchronisation, as
    in the scaler's own loop), for a step where a work cannot take its flags on the device."""
    found_inf = amp[1]
    return found_inf is not None and bool(found_inf.item())


def _unscale_on_host(amp: tuple[Tensor | None, Tensor | None], grads: list[Tensor]) -> None:
    """A GradScaler's step where a work cannot take its flags on the device, its found-inf flag
    read clear (by :meth:`MemOptimizer._resolve`, once: each read is a device synchronisation):
    unscale ``grads`` in place by the factor and kernel ``GradScaler.unscale_`` uses (the same
    bits as that loop). Called once every check of the step passed: a refused step must leave
    the gradients scaled, for the scaler's retry to unscale them once."""
    grad_scale = amp[0]
    if grad_scale is not None:
        inv = grad_scale.double().reciprocal().float()
        by_place: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for g in grads:
            by_place.setdefault((g.device, g.dtype), []).append(g)
        for (dev, _), same in by_place.items():
            seen = torch.zeros(1, dtype=torch.float32, device=dev)  # checked by the scaler
            torch._amp_foreach_non_finite_check_and_unscale_(same, seen, inv.to(dev))


def forgets_scaler_flags_on_error(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` wrapped to drop a GradScaler's ``grad_scale`` and ``found_inf`` attributes when it
    raises. ``GradScaler.step`` sets them on the optimizer and deletes them only after a step
    that returns: after a refused step (memopt refuses some before any change, for the caller
    to fix and go on) the next ``scaler.step`` unscaled by the square of the scale, and a plain
    ``step()`` read a stale scale or inf flag."""

    @functools.wraps(step)
    def wrapper(self: Optimizer, *args: Any, **kwargs: Any) -> Any:
        try:
            return step(self, *args, **kwargs)
        except BaseException:
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise

    return wrapper


def _describe_tensor(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, {t.dtype}, on {t.device}"


def _check_param_dtype(p: Tensor, desc: str, since: str, fix: str) -> None:
    """ConfigError unless ``p`` has a dtype memopt optimizes (``desc`` names it)."""
    if p.dtype not in backends.PARAM_DTYPES:
        raise ConfigError(
            f"{desc} has dtype {p.dtype}{since}; memopt optimizes float32, bfloat16 and float16 "
            f"parameters: {fix}"
        )


def _not_freed(t: Tensor) -> bool:
    """False for a plain tensor with elements at address 0 (its storage freed or resized to 0
    bytes). A wrapper subclass (torchao-style, address 0 too) is left to the backend: the
    torch backend steps it through its own ops, the kernel backends refuse it by name."""
    return type(t).__torch_dispatch__ is not _PLAIN_DISPATCH or has_memory(t)


_PLAIN_DISPATCH = Tensor.__torch_dispatch__


def _is_zero_grad(p: Tensor) -> bool:
    """Whether ``p.grad`` is autograd's efficient zero tensor (no memory of its own)."""
    g = p.grad
    return g is not None and g._is_zerotensor()


def _fits_plan(t: Tensor, plan: GroupPlan, si: int) -> bool:
    """``t`` (a parameter, or its local shard) still has the device, dtype and shape of slot
    ``si`` of the plan built for it."""
    return (
        t.device == plan.device and t.dtype == plan.param_dtype and t.shape == plan.slots[si].shape
    )


def _changed_error(label: str, plan: GroupPlan, si: int) -> ConfigError:
    return ConfigError(
        f"{label} changed since its state was created (it was {plan.param_dtype} of shape "
        f"{tuple(plan.slots[si].shape)} on {plan.device}); move or cast models before their "
        "first optimizer step, or before enable_gradient_release, which creates the state (no "
        "parameter or state was modified)"
    )


#: frames of these packages are not the user's line (see _caller_stacklevel)
_OWN_TOP_MODULES = frozenset(
    ("torch", "memopt", "memopt_core", "memopt_ecc", "memopt_apexw", "memopt_offload")
)


def _caller_stacklevel() -> int:
    """``stacklevel`` for a warning raised in this module that names the first frame outside
    torch and memopt's optimizer packages (step() runs under torch's hook wrapper,
    ``GradScaler.step``, LR schedulers' wrappers, :func:`memopt_core.eager.run_eagerly`'s, and
    subclasses' methods), i.e. the user's line."""
    frame: FrameType | None = sys._getframe(1)  # the function calling warnings.warn
    level = 1
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.partition(".")[0] not in _OWN_TOP_MODULES:
            break
        frame = frame.f_back
        level += 1
    return level


#: gradients below this many elements are checked for finiteness together (one copy)
_FINITE_CAT_LIMIT = 1 << 16


class MemOptimizer(Optimizer):
    """A memory-lean SGD/SGDW/Adam/AdamW/Lion with compact states, the base of memopt's families.

    State bytes per parameter (beside the parameter itself): the master code (ECC-24 1, ECC-32
    2, none or float32 parameters 0) plus 4 / 2 / 1.03 / 1.03 per moment for fp32 / bf16 / fp8 /
    q8 moments (fp8 and q8 keep one scale per 32-element block); Adam keeps two moments, SGD
    with momentum and Lion one. Parameters float32, bfloat16 or float16; on CUDA the Triton
    backend, on the CPU the C++ one (else core's pure-torch backend, same bits): the whole
    update (decode, step, encode of master and moments) is one fused pass, one launch per
    (dtype, format) group.

    Args:
        params: tensors, ``(name, tensor)`` pairs, or param-group dicts (torch semantics).
        rule: ``"sgd"``, ``"sgdw"``, ``"adam"``, ``"adamw"`` or ``"lion"``.
        lr, betas, eps, weight_decay, momentum, dampening, nesterov, maximize: as in torch.optim
            (``betas=None``: (0.9, 0.999), Lion (0.9, 0.99)), except that ``weight_decay``
            defaults to 0 for every rule (torch's AdamW: 0.01; the Flash* classes and ApexW
            keep their own defaults) and tensor ``betas`` are read into floats when their group
            is added (edit ``param_groups[i]["betas"]`` to change them, not the tensors);
            ``momentum``/``dampening``/``nesterov`` apply to SGD, ``betas`` to Adam and Lion,
            ``eps`` to Adam. SGD's momentum buffer starts as the gradient at a parameter's first
            step, as torch's does; a momentum switched on later (from 0) starts from a zero
            buffer, so its first buffer is ``(1 - dampening) * g`` where torch's is ``g`` (the
            same with dampening 0).
        decouple_lr: decoupled weight decay multiplies by ``lr / initial_lr * weight_decay``
            (``initial_lr`` recorded per group when it is added, as LR schedulers do; they then
            take it as their base lr, and OneCycleLR rewrites it: docs/ecc.md) instead of
            ``lr * weight_decay``.
        master: master format of bfloat16 parameters: ``"none"``, ``"ecc24"``, ``"ecc32"``;
            float16 parameters take ``"none"`` only (float32 parameters are their own master).
        moments: moment format preset: ``"fp32"``, ``"bf16"``, ``"fp8"``, ``"q8"``.
        stochastic_rounding: round master and moments stochastically (counter-based, so every
            backend gives the same bits) where the format offers it.
        seed: key of the stochastic-rounding generator; its low 32 bits key it (docs/formats.md),
            so seeds equal modulo 2**32 round alike.
        check_numerics: refuse non-finite gradients with :class:`NumericsError`, before any state
            or parameter changes.
        capturable: keep step counts on the parameters' device (``state["step"]`` float32 device
            tensors, as torch's ``capturable=True``) and compute the step-dependent scalars
            there, so :meth:`step` never synchronises with the host and can be captured in a
            CUDA graph (after one eager step with the same tensors, which builds the tables).
            Needs a backend with device steps (Triton: CUDA tensors). ``lr`` (with
            ``initial_lr``) and ``weight_decay`` may be one-element tensors on the parameters'
            device: the kernel reads them at every launch (a graph at every replay), so a
            scheduler that sets them in place works with a captured step. Not with
            ``check_numerics`` (which reads the device). With or without it, a
            ``torch.amp.GradScaler`` hands the optimizer its scale and found-inf flag
            (``_step_supports_amp_scaling``, unless ``check_numerics``): the Triton kernel
            unscales and skips on the device (no ``.item()``; without ``capturable`` the step
            counts move to the device for such a step), other backends do what the scaler's
            own loop does.
        backend: force a backend by name (``"torch"``, ``"cpu"``, ``"triton"``); None defers to
            ``MEMOPT_BACKEND`` and then to the automatic choice.

    Every hyperparameter except ``rule``, ``seed``, ``check_numerics`` and ``backend`` may differ
    per param group. State lives in one arena per (param group, device, dtype); where the backend
    steps several param groups in one launch (Triton), the arenas of groups that share a device,
    a dtype and formats are views of one family arena (``memopt_core.plan.family_arenas``).
    ``self.state[p]`` holds views of it under named keys (``step``, ``exp_avg``, ``exp_avg_sq``,
    ``momentum_buffer``, codec fields like ``exp_avg_scale``, ``master_code``). The first
    :meth:`step` creates it, or :meth:`init_state` earlier.

    While gradient release is active (:meth:`begin_gradient_release`, which
    ``memopt_ecc.enable_gradient_release`` calls), :meth:`step` and :meth:`zero_grad` do nothing
    and warn once per activation, :meth:`add_param_group` raises :class:`ConfigError`, and
    :meth:`step_parameters` works as always.

    Subclasses may override ``step`` and call ``super().step()``: torch's step hooks and profiler
    range still run once per call of the outermost ``step`` (see :meth:`profile_hook_step`).
    """

    #: default betas per rule when the caller passes None
    DEFAULT_BETAS: dict[str, tuple[float, float]] = {"lion": (0.9, 0.99)}  # noqa: RUF012
    FALLBACK_BETAS: tuple[float, float] = (0.9, 0.999)

    def __init__(
        self,
        params: Iterable[Any],
        rule: str = "adamw",
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] | None = None,
        eps: float = 1e-8,
        weight_decay: float | Tensor = 0.0,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        decouple_lr: bool = False,
        master: str = "none",
        moments: str = "fp32",
        stochastic_rounding: bool = True,
        seed: int = 0,
        check_numerics: bool = False,
        backend: str | None = None,
        capturable: bool = False,
    ) -> None:
        if rule not in RULES:
            raise ConfigError(f"unknown rule {rule!r}; choose one of {tuple(RULES)}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ConfigError(f"seed must be an int in [0, 2**64), got {seed!r}")
        check_bool("check_numerics", check_numerics)
        check_bool("capturable", capturable)
        if capturable and check_numerics:
            raise ConfigError(
                "capturable=True and check_numerics=True exclude each other: check_numerics reads "
                "every gradient's finiteness on the host, which a capturable step must not do "
                "(with a GradScaler, its found-inf flag skips non-finite steps on the device)"
            )
        if backend is not None and not isinstance(backend, str):
            raise ConfigError(
                f"backend must be None or a backend name like 'torch', 'cpu', 'triton'; got {backend!r}"
            )
        self.rule = rule
        self.seed = seed
        self.check_numerics = check_numerics
        self.backend = backend
        self._capturable = capturable
        self._captured = False  # a step was captured: a later load_state_dict warns
        #: group index -> the beta2 its stored second moments are normalized with (absent:
        #: the group's current one; 0.0: not normalized, as a version-1 state dict's)
        self._norm_beta2: dict[int, float] = {}
        self._norm_writes_seen: int | None = None  # the write count _adopt_state_writes saw
        self._reset_plans()
        self._reset_release()
        forced = backends.forced_backend(backend)
        if forced is not None:
            backends.get_backend(forced)  # fail fast with the reason
        defaults = {
            "lr": lr,
            "betas": self._default_betas() if betas is None else betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "dampening": dampening,
            "nesterov": nesterov,
            "maximize": maximize,
            "decouple_lr": decouple_lr,
            "master": master,
            "moments": moments,
            "stochastic_rounding": stochastic_rounding,
        }
        defaults["betas"] = self._check_group(defaults, "(optimizer defaults)")
        if self._kind == "sgd":
            # torch's cycling schedulers (OneCycleLR, CyclicLR) cycle betas[0] when the defaults
            # hold betas, else momentum: SGD reads momentum (its groups still get betas, unused)
            del defaults["betas"]
        if isinstance(params, Tensor):
            raise ConfigError(
                "params must be an iterable of tensors or param-group dicts, got a single tensor "
                f"({_describe_tensor(params)}): wrap it in a list"
            )
        params = list(params)
        if not params:
            raise ConfigError("optimizer got an empty parameter list")
        self._writes = WriteCounter()
        self._writes_seen = 0
        self._norm_writes_seen = None
        self._warned_step_limit = False
        self._warned_rne = False
        # While the constructor adds its groups, the checks against the groups already held
        # wait for the last one: run per group, they made construction quadratic (33 s for
        # 2000 one-parameter groups, where torch.optim takes 0.8 s)
        self._initial_ids: set[int] | None = set()
        #: id(group) -> (the group, its (master, moments) as added or loaded): a format edit
        #: that comes with states written from outside is refused (_check_outside_formats)
        self._group_formats: dict[int, tuple[dict[str, Any], tuple[str, str]]] = {}
        super().__init__(params, defaults)
        self._initial_ids = None
        check_parameters_apart(labelled_parameters(self.param_groups), [])
        self.state = TrackedState(self._writes, self.state)

    # ------------------------------------------------------------------------- configuration
    def _group_betas(self, group: Mapping[str, Any]) -> Any:
        """The group's betas; an SGD group's may be None (unused: see :meth:`_check_group`)."""
        betas = group["betas"]
        return self._default_betas() if betas is None else betas

    @staticmethod
    def _refuse_inference_mode(what: str) -> None:
        """ConfigError for a step inside torch.inference_mode(): the state it creates would be
        inference tensors, which no later step outside it may update (torch raised half-way
        through the next one, after writing part of the step)."""
        if torch.is_inference_mode_enabled():
            raise ConfigError(
                f"{what}() inside torch.inference_mode(): the optimizer state it creates or "
                "updates could not be updated outside it; step outside inference mode"
            )

    def _default_betas(self) -> tuple[float, float]:
        return self.DEFAULT_BETAS.get(self.rule, self.FALLBACK_BETAS)

    def _reset_plans(self) -> None:
        self._plans: dict[int, _GroupPlans] = {}
        self._where: dict[int, tuple[int, int, int]] = {}
        self._index: dict[int, int] | None = None
        #: (the param lists' ids and lengths, the held parameters' sorted_extents) for
        #: _check_staging_apart
        self._held_extents: tuple[tuple[tuple[int, int], ...], Any] | None = None
        #: while a step checks its input (:meth:`_atomically`): how to take back what it changed
        #: so far (plans and states built, an initial_lr recorded), newest last; None otherwise
        self._undo: list[Callable[[], None]] | None = None
        self._drop_cached_steps()

    def _drop_cached_steps(self) -> None:
        """Forget every cached step (:mod:`memopt_core.cached_step`): plans, state or step
        counters changed in a way its address check cannot see. Subclasses also drop what they
        derived from them."""
        self._cached_steps: dict[Any, CachedStep] = {}
        self._cache_futile = 0  # cached steps in a row dropped before they ever replayed
        self._cache_wait = 0  # ordinary steps to run before caching again

    def _reset_release(self) -> None:
        self._release_owner: object | None = None
        self._release_warned: set[str] = set()

    @property
    def _kind(self) -> str:
        return RULES[self.rule][0]

    def _check_group(self, g: Mapping[str, Any], where: str) -> tuple[float, float]:
        """Validate a group's hyperparameters (ConfigError); returns the betas as floats."""
        # torch fills every default into a group: one deleted by hand was a bare KeyError
        if not g.keys() >= _GROUP_KEYS:
            _refuse_missing_key(next(k for k in sorted(_GROUP_KEYS) if k not in g), where)
        if g["betas"] is None and self._kind != "sgd":  # SGD's groups carry betas unused
            raise ConfigError(
                f"betas {where} is None: give the pair of floats (the default is "
                f"{self._default_betas()})"
            )
        if self._capturable and any(map(_on_a_gpu, map(g.get, _DEVICE_KEYS))):
            # read on the device by the step (DeviceStep.lr, weight_decay): reading it here
            # would synchronise (and fail under a CUDA graph capture). Its shape and dtype are
            # checked; its value is the caller's, as for torch's capturable optimizers
            for key in _DEVICE_KEYS:
                v = g.get(key)
                if _on_a_gpu(v) and (v.numel() != 1 or not v.is_floating_point()):
                    raise ConfigError(
                        f"{key} {where} must be a float or a one-element floating-point "
                        f"tensor, got {v.dtype}{tuple(v.shape)}"
                    )
            g = {k: (1.0 if _on_a_gpu(v) else v) for k, v in g.items()}
        b = adam_hyperparameters(g, self._group_betas(g), where)["betas"]
        # torch.optim's keys that change the rule: in a group (a torch-style config, a hand
        # edit) they would be ignored silently
        for flag in ("amsgrad", "differentiable"):  # torch's flags: "no" read as true
            if g.get(flag) is not None:
                check_bool(f"{flag} {where}", g[flag])
        if self._kind == "adam" and g.get("amsgrad"):
            raise ConfigError(
                f"{where} sets amsgrad=True: memopt has no AMSGrad (it would need a compact "
                "running maximum of the second moments); use torch.optim's with amsgrad=True"
            )
        decoupled = RULES[self.rule][1]
        dwd = g.get("decoupled_weight_decay")
        if dwd is not None:
            check_bool(f"decoupled_weight_decay {where}", dwd)
        if self._kind == "adam" and dwd is not None and dwd != decoupled:
            raise ConfigError(
                f"{where} sets decoupled_weight_decay={dwd!r}, but rule {self.rule!r} "
                f"{'decouples' if decoupled else 'does not decouple'} weight decay: use the "
                f"{'AdamW' if dwd else 'Adam'} variant instead"
            )
        if g.get("differentiable"):
            raise ConfigError(
                f"{where} sets differentiable=True: memopt's steps are not differentiable"
            )
        momentum = _as_float(g["momentum"], "momentum", where)
        if momentum < 0:
            raise ConfigError(f"invalid momentum {momentum} {where}: it must be >= 0")
        dampening = _as_float(g["dampening"], "dampening", where)
        for name in _BOOLS:
            check_bool(f"{name} {where}", g[name])
        if g["nesterov"] and (momentum <= 0 or dampening != 0):
            raise ConfigError(
                f"nesterov=True {where} needs momentum > 0 and dampening == 0, got momentum="
                f"{momentum}, dampening={dampening}"
            )
        if g["master"] not in MASTER_FORMATS:
            raise ConfigError(
                f"unknown master format {g['master']!r} {where}; choose 'none', 'ecc24' or "
                "'ecc32' (bfloat16/float16 parameters; float32 ones always use 'fp32')"
            )
        if g["moments"] not in MOMENT_PRESETS:
            raise ConfigError(
                f"unknown moment format {g['moments']!r} {where}; choose one of {tuple(MOMENT_PRESETS)}"
            )
        if g["decouple_lr"] and "initial_lr" in g:
            initial = _as_float(g["initial_lr"], "initial_lr", where)
            if initial <= 0:
                raise ConfigError(
                    f"decouple_lr=True {where} divides by the initial lr, which is {initial}: "
                    "it must be > 0"
                )
        return b

    def _spec(self, group: Mapping[str, Any], dtype: torch.dtype) -> StateSpec:
        return StateSpec(
            master="fp32" if dtype == torch.float32 else group["master"],
            moments=group["moments"],
            stochastic_rounding=group["stochastic_rounding"],
        )

    def _needed_names(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        if self._kind == "sgd" and _as_float(group["momentum"], "momentum", "") == 0:
            return ()
        return _STATE_NAMES[self._kind]

    def _allowed_names(self) -> tuple[str, ...]:
        return _STATE_NAMES[self._kind]

    @staticmethod
    def _codec_of(name: str, spec: StateSpec) -> MomentCodec:
        return spec.second if name == "exp_avg_sq" else spec.first

    def _param_label(self, p: Tensor) -> str:
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    label = f"{names[i]!r}" if names else f"#{i} of param group {gi}"
                    return f"parameter {label} ({_describe_tensor(p)})"
        return f"a tensor ({_describe_tensor(p)}) that this optimizer does not hold"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (torch semantics), validating its parameters and hyperparameters."""
        if not isinstance(param_group, dict):
            raise ConfigError(f"a param group must be a dict, got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ConfigError("a param group needs a 'params' entry")
        if self._release_owner is not None:
            # the release hooks were registered for the parameters held then: these would never
            # be updated (step() does nothing while release is active)
            raise ConfigError(
                "add_param_group while gradient release is active: call handle.remove() first "
                "and enable gradient release again after adding the group"
            )
        gi = len(self.param_groups)
        where = f"(param group {gi})"
        raw = param_group["params"]
        if isinstance(raw, Tensor):
            raw = [raw]
        elif isinstance(raw, (set, frozenset)):
            raise ConfigError(
                f"params {where} is a set, whose order changes between runs: pass a list"
            )
        elif not isinstance(raw, Iterable) or isinstance(raw, (str, bytes, Mapping)):
            raise ConfigError(
                f"params {where} must be a list of parameters (or (name, parameter) pairs), "
                f"got {type(raw).__name__}"
            )
        # a generator is used up by the checks below: torch must get the same items
        raw = param_group["params"] = list(raw)
        tensors, names = [], []
        for i, item in enumerate(raw):
            if isinstance(item, tuple) and len(item) == 2:
                if not isinstance(item[0], str):  # (a, b) of two tensors dropped a silently
                    raise ConfigError(
                        f"parameter #{i} {where} is a pair, read as (name, parameter), whose name "
                        f"is a {type(item[0]).__name__}: give tensors, or (str, tensor) pairs as "
                        "named_parameters() does"
                    )
                names.append(item[0])
                item = item[1]
            tensors.append(item)
        existing = (
            self._initial_ids
            if self._initial_ids is not None
            else {id(q) for g in self.param_groups for q in g["params"]}
        )
        seen: set[int] = set()
        for i, p in enumerate(tensors):
            label = f"{names[i]!r}" if len(names) == len(tensors) else f"#{i}"
            if not isinstance(p, Tensor):
                raise ConfigError(
                    f"parameter {label} {where} is a {type(p).__name__}, not a tensor"
                )
            if torch.nn.parameter.is_lazy(p):
                raise ConfigError(
                    f"parameter {label} {where} is not initialized yet (a lazy module's): run "
                    "one forward pass before creating the optimizer"
                )
            desc = f"parameter {label} {where} ({_describe_tensor(p)})"
            if p.is_inference():
                raise ConfigError(
                    f"{desc} was created under torch.inference_mode(): it cannot be updated in "
                    "place outside it (clone it outside inference mode)"
                )
            refuse_negated(desc, p)
            if not p.is_leaf:
                raise ConfigError(
                    f"{desc} is not a leaf tensor (it was computed from other tensors); optimize "
                    "the leaf it comes from, or pass t.detach().requires_grad_()"
                )
            if is_dtensor(p):
                check_sharded(p, desc)
            _check_param_dtype(p, desc, "", "cast it (e.g. to float32) or leave it out")
            if id(p) in seen:
                raise ConfigError(f"{desc} appears twice in the group; list each parameter once")
            if id(p) in existing:
                raise ConfigError(
                    f"{desc} is already in another param group; each parameter belongs to one group"
                )
            seen.add(id(p))
        if self._initial_ids is None:
            self._check_no_shared_memory(tensors, names, where)
        merged = dict(self.defaults)
        merged.update({k: v for k, v in param_group.items() if k != "params"})
        if merged.get("betas") is None:
            merged["betas"] = self._default_betas()
        betas = self._check_group(merged, where)
        for i, p in enumerate(tensors):
            try:
                self._spec(merged, p.dtype).master_for(p.dtype)
            except ConfigError as e:
                label = f"{names[i]!r}" if len(names) == len(tensors) else f"#{i}"
                raise ConfigError(
                    f"parameter {label} {where} ({_describe_tensor(p)}): {e}"
                ) from None
        param_group["betas"] = betas
        if not merged["stochastic_rounding"]:
            self._warn_round_to_nearest(merged, {p.dtype for p in tensors}, where)
        if merged["decouple_lr"] and "initial_lr" not in param_group:
            lr = _as_float(merged["lr"], "lr", where)
            if lr <= 0:
                raise ConfigError(
                    f"decouple_lr=True {where} scales weight decay by lr / initial_lr and needs "
                    f"a positive initial lr, got {lr}"
                )
            param_group["initial_lr"] = _initial_lr(merged["lr"])
        super().add_param_group(param_group)
        self._record_formats(param_group)
        if self._initial_ids is not None:
            self._initial_ids.update(map(id, tensors))
        self._index = None
        self._drop_cached_steps()

    def _warn_round_to_nearest(
        self, group: Mapping[str, Any], dtypes: set[torch.dtype], where: str
    ) -> None:
        """RoundToNearestWarning (once per optimizer) when ``group`` rounds state to nearest
        that can stall that way: a compact moment, or a bf16/fp16 weight kept without a master
        or with ECC-24. bf16 second moments can then never decay, q8/fp8 ones drift (1.7-2.3x
        fp32's step in an audit's 2000-step run), small updates of such weights are lost."""
        if self._warned_rne:
            return
        stalls = []
        for dtype in dtypes:
            spec = self._spec(group, dtype)
            for name in self._needed_names(group):
                fmt = self._codec_of(name, spec).name
                if fmt != "fp32":
                    stalls.append(f"{fmt} {name}")
            master = spec.master_for(dtype).name
            if master in ("none", "ecc24") and dtype != torch.float32:
                stalls.append(f"{dtype} weights with master {master!r}")
        if stalls:
            self._warned_rne = True
            warnings.warn(
                f"stochastic_rounding=False {where} rounds {', '.join(sorted(set(stalls)))} to "
                "nearest, which stalls (a second moment that can no longer decay, updates "
                "smaller than half a step of the format lost): use it for bit-exact "
                "experiments, not for training (docs/formats.md, 'Long runs')",
                RoundToNearestWarning,
                stacklevel=_caller_stacklevel(),
            )

    def _check_no_shared_memory(self, tensors: list[Tensor], names: list[str], where: str) -> None:
        """:func:`~memopt_core.aliasing.check_parameters_apart` for a group being added."""
        check_parameters_apart(
            [
                (
                    p,
                    f"parameter {names[i]!r} {where}"
                    if len(names) == len(tensors)
                    else f"parameter #{i} {where}",
                )
                for i, p in enumerate(tensors)
            ],
            labelled_parameters(self.param_groups),
        )

    # ------------------------------------------------------------------------- plans, arenas
    def _tensor_index(self) -> dict[int, int]:
        if self._index is None:
            self._index = {
                id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])
            }
        return self._index

    def _members(self, group: Mapping[str, Any], trainable: bool) -> list[Tensor]:
        """The parameters of ``group`` that get arena space: those with state or a gradient, as
        torch's optimizers create state only for a parameter that got a gradient (an unused
        head, an expert no token reached cost nothing until they train). ``trainable``: every
        parameter that requires one too, for :meth:`init_state` (state to write into before
        training) and :meth:`step_parameters`, whose callers step parameters one bucket at a
        time (each bucket's first call would add entries and a launch of its own to the group:
        :meth:`_extend_group`)."""
        return [
            p
            for p in group["params"]
            if (trainable and p.requires_grad) or p.grad is not None or p in self.state
        ]

    def _group_names(self, gi: int, group: Mapping[str, Any], members: list[Tensor]) -> tuple:
        names = set(self._needed_names(group))
        cur = self._plans.get(gi)
        if cur is not None:  # names only grow; the state holds no others
            names.update(cur.names)
            return tuple(n for n in self._allowed_names() if n in names)
        spec_any = self._spec(group, torch.float32)
        for name in self._allowed_names():
            suffix = next(iter(self._codec_of(name, spec_any).fields))
            key = name if suffix == "" else f"{name}_{suffix}"
            if any(key in self.state.get(p, ()) for p in members):
                names.add(name)
        return tuple(n for n in self._allowed_names() if n in names)

    def _plans_current_for(self, only: list[Tensor]) -> bool:
        """Fast check for :meth:`step_parameters`: O(len(only)), not O(all parameters)."""
        groups = set()
        for p in only:
            loc = self._where.get(id(p))
            if loc is None:
                return False
            gi, ei, si = loc
            if not _fits_plan(local_shard(p), self._plans[gi].entries[ei].plan, si):
                return False
            groups.add(gi)
        for gi in groups:
            if gi >= len(self.param_groups):
                return False
            group, cur = self.param_groups[gi], self._plans[gi]
            if not cur.describes(group):
                return False
            if cur.signature is None or cur.signature[:2] != (
                (group["master"], group["moments"]),
                group["stochastic_rounding"],
            ):
                return False
            if not set(self._needed_names(group)) <= set(cur.names):
                return False
        return True

    def _state_written(self) -> bool:
        """Whether ``self.state`` was written since the optimizer last looked (O(1): the writes
        are counted, :mod:`memopt_core.tracked_state`); wraps a mapping assigned to
        ``self.state`` by hand, which counts as a write."""
        state = self.state
        if not (isinstance(state, TrackedState) and state._counter is self._writes):
            self.state = TrackedState(self._writes, state)
            self._writes.n += 1
        return self._writes.n != self._writes_seen

    def _adopt_state_writes(self) -> None:
        """Mark for a rebuild every group whose states were deleted, replaced or given other
        tensors (by the user, as torch's optimizers allow): the rebuild takes the states as
        they are now (a missing one starts fresh, a replaced tensor is copied in)."""
        if not self._state_written():
            return
        self._check_outside_formats()
        # states written from outside (ZeroRedundancyOptimizer's load writes them) hold this
        # version's format, normalized with their group's beta2 now, as a dict without the
        # record does (_checked_norm_meta), not with the one recorded for the states they
        # replace; decided once per batch of writes (state_dict() adopts them too, and a beta2
        # changed after it must still convert them at the next step)
        adopt_norms = self._writes.n != self._norm_writes_seen
        self._norm_writes_seen = self._writes.n
        for gi, gp in self._plans.items():
            if not all(e.holds_its_state(self.state) for e in gp.entries):
                if gi < len(self.param_groups):  # the rebuild copies the moments as they are
                    for e in gp.entries:
                        self._sync_step_edits(gi, e, adopting=True)
                gp.signature = None  # rebuilt by _ensure_all_plans
                if adopt_norms:
                    self._norm_beta2[gi] = _group_beta2(self.param_groups, gi)
        self._drop_cached_steps()

    def _record_formats(self, group: dict[str, Any]) -> None:
        """Remember ``group``'s formats as the optimizer took them (added, or loaded with
        their states by :meth:`load_state_dict`)."""
        self._group_formats[id(group)] = (group, (group["master"], group["moments"]))

    def _check_outside_formats(self) -> None:
        """StateDictError when states were written from outside while a group's ``master`` or
        ``moments`` changed from the format it was built with (its plan's, else the one
        recorded when it was added or loaded). ZeroRedundancyOptimizer's load does both: it
        copies every key of the saved groups into the live ones and writes their states, so a
        checkpoint of another format switched the optimizer to it silently. A format edit alone,
        before the first step, is taken: the first step builds the states in it."""
        for gi, group in enumerate(self.param_groups):
            rec = self._group_formats.get(id(group))
            if rec is None or rec[0] is not group:
                continue  # a group dict put into param_groups by hand: nothing to compare
            cur = self._plans.get(gi)
            built = cur.formats if cur is not None else rec[1]
            now = (group["master"], group["moments"])
            # float32 parameters keep an fp32 master whatever the group says (load_state_dict)
            master_unused = all(local_shard(p).dtype == torch.float32 for p in group["params"])
            if now[1] != built[1] or (now[0] != built[0] and not master_unused):
                raise StateDictError(
                    f"param group {gi} holds states written from outside the optimizer and "
                    f"now says master={now[0]!r}, moments={now[1]!r}, but it was built with "
                    f"master={built[0]!r}, moments={built[1]!r} (torch's "
                    "ZeroRedundancyOptimizer.load_state_dict copies the saved groups' keys into "
                    "the live ones and writes optimizer.state: the checkpoint holds another "
                    "format). Build the optimizer with the checkpoint's format (master/moments; "
                    "memopt_ecc: master_weight_bits/quantize) and load it again"
                )

    def _atomically(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` (a step's checks, which may build plans and states first), whose
        changes to the plans, the states and the param groups are taken back when it raises: a
        refused step leaves no trace (a parameter refused at its first step keeps no state,
        visible in ``state``, ``state_dict()`` and :meth:`state_bytes`). What it records:
        :meth:`_build_group`, :meth:`_extend_group` and :meth:`_scalars` (an ``initial_lr``).
        Not taken back: the conversions that adopt states written from outside
        (:meth:`_adopt_state_writes`), which the next step makes alike, and dropped cached steps
        (the ordinary step gives their bits). A count edited in place is converted after the
        checks (:meth:`_sync_decay_norm`), or in a rebuild's copies (:meth:`_build_groups`)."""
        pending = self._state_written()  # writes from outside, adopted by fn (or the next step)
        seen = self._writes_seen
        self._undo = []
        try:
            return fn(*args)
        except BaseException:
            undo, self._undo = self._undo, None
            for action in reversed(undo):
                action()
            # the states put back are no writes from outside (those still pending are adopted
            # again by the next step: adopting is idempotent)
            self._writes_seen = seen if pending else self._writes.n
            raise
        finally:
            self._undo = None

    def _restorer(self, gi: int, params: list[Tensor], rebuilt: bool) -> Callable[[], None]:
        """What puts group ``gi``'s plan back as it is now, with the states of ``params`` (those
        it is about to be built or extended with) and where they are placed, for
        :meth:`_atomically`. ``rebuilt``: the group's ``_GroupPlans`` is about to be replaced
        (which unplaces its owners too), else extended in place.

        A rebuild from states written from outside (``signature`` None:
        :meth:`_adopt_state_writes`; ZeroRedundancyOptimizer's load) copies those states, not
        the old arenas, and an old arena that none of them holds a tensor of is kept alive by
        its entry alone. Kept until the step's checks pass, each was one more copy of its
        group's state at the peak of a rebuild of several groups (88 MiB against 56 in a
        4-group repro); it is freed with the old plan instead, and a refused step gives its
        entry a new zeroed arena (:meth:`_reopener`): what :meth:`state_bytes` counted, and
        nothing reads it before the next step rebuilds the group from its states again. A
        family arena (:func:`~memopt_core.plan.family_arenas`) is kept: its storage lives
        until every member is dropped, which the new family's allocation precedes anyway."""
        old = self._plans.get(gi)
        # the old plan without its entries: a rebuild drops them (and what they hold)
        shell = None if old is None else replace(old, entries=[])
        kept: list[_Entry | Callable[[], _Entry]] = []
        if old is not None:
            kept = [
                self._reopener(e)
                if rebuilt
                and old.signature is None
                and e.arena.family is None
                and e.released(self.state)
                else e
                for e in old.entries
            ]
        states = [(p, self.state.get(p)) for p in params]
        if rebuilt and old is not None:
            params = params + [p for e in old.entries for p in e.owners]
        where = [(id(p), self._where.get(id(p))) for p in params]

        def restore() -> None:
            # the states first: the new ones hold the new arenas, freed before any reopens
            for p, st in states:
                if st is None:
                    self.state.pop(p, None)
                else:
                    self.state[p] = st
            self._plans.pop(gi, None)
            if shell is not None:
                shell.entries[:] = [e if isinstance(e, _Entry) else e() for e in kept]
                self._plans[gi] = shell
            for pid, loc in where:
                if loc is None:
                    self._where.pop(pid, None)
                else:
                    self._where[pid] = loc
            self._index = None

        return restore

    def _reopener(self, entry: _Entry) -> Callable[[], _Entry]:
        """What gives back ``entry`` (:meth:`_Entry.released`, of a group to rebuild from its
        states) with a new zeroed arena of its plan (:meth:`_new_arena`), holding neither its
        arena nor its states' tensors meanwhile (:meth:`_restorer`). The states it records are
        new empty dicts, as no state in ``self.state`` holds any of its tensors."""
        arena = entry.arena
        plan, codecs, master = entry.plan, arena.codecs, arena.master
        rest = {
            f.name: getattr(entry, f.name)
            for f in fields(entry)
            if f.name not in ("arena", "states", "held")
        }
        n = len(entry.owners)

        def reopen() -> _Entry:
            return _Entry(
                arena=self._new_arena(plan, codecs, master),
                states=[ParamState(self._writes) for _ in range(n)],
                held=[{} for _ in range(n)],
                **rest,
            )

        return reopen

    def _ensure_plans(self, only: list[Tensor] | None = None, trainable: bool = False) -> None:
        """(Re)build the plans and arenas of every group whose parameters or formats changed,
        or whose states were written from outside. ``only`` (:meth:`step_parameters`'s
        parameters) or ``trainable``: every parameter that requires a gradient is a member
        (:meth:`_members`)."""
        self._adopt_state_writes()
        if only is not None and self._plans_current_for(only):
            self._writes_seen = self._writes.n
            return
        self._ensure_all_plans(trainable or only is not None)
        self._writes_seen = self._writes.n

    def _sync_all_step_edits(self) -> None:
        """:meth:`_sync_step_edits` of every entry of every group still in ``param_groups``."""
        for gi, gp in self._plans.items():
            if gi < len(self.param_groups):
                for e in gp.entries:
                    self._sync_step_edits(gi, e)

    def _ensure_all_plans(self, trainable: bool) -> None:
        reindexed = False
        # a rebuilt group leaves its family arena (memopt_core.plan.family_arenas): the family's
        # other groups are rebuilt with it, so that no dead region of the old storage stays
        # held by their views and the groups share one arena again
        left: set[int] = set()
        for gi in [gi for gi in self._plans if gi >= len(self.param_groups)]:
            # a group removed from param_groups by hand (torch's optimizers allow it): the
            # parameters it held are either gone or in a group rebuilt below
            left |= self._families_of(gi)
            self._drop_plan(gi)
            self._index = None
            reindexed = True
        builds: dict[int, tuple] = {}
        current: dict[int, tuple] = {}
        extends: dict[int, tuple[tuple, list[Tensor]]] = {}  # (build args, gained members)
        for gi, group in enumerate(self.param_groups):
            try:
                members = self._members(group, trainable)
                names = self._group_names(gi, group, members)
                formats = (group["master"], group["moments"])
                signature = (
                    formats,
                    group["stochastic_rounding"],
                    names,
                    tuple(map(id, members)),
                    tuple((p.device, p.dtype, p.shape) for p in members),
                )
            except KeyError as e:  # a key deleted from the group by hand (no cost otherwise)
                if not e.args or e.args[0] not in _GROUP_KEYS or e.args[0] in group:
                    raise
                _refuse_missing_key(e.args[0], f"(param group {gi})")
            cur = self._plans.get(gi)
            if cur is not None and cur.signature == signature:
                cur.source = (group, group["params"], len(group["params"]))
                current[gi] = (gi, group, members, names, formats, signature)
                continue
            self._check_dtypes(gi, group, members)
            gained = (
                self._gained_stateless(cur, signature, members)
                if cur is not None and cur.describes(group)
                else None
            )
            if gained:
                # first gradients, in the same params list: no rebuild (a list edited by hand,
                # in place too, is rebuilt, checked and merged into its family, below)
                extends[gi] = ((gi, group, members, names, formats, signature), gained)
                continue
            if cur is not None:
                self._check_unchanged(members)
            if cur is not None and cur.formats != formats:
                raise ConfigError(
                    f"param group {gi} changed its state format from master={cur.formats[0]!r}, "
                    f"moments={cur.formats[1]!r} to master={formats[0]!r}, moments="
                    f"{formats[1]!r} after its state was created; formats cannot change in place: "
                    "restore the old values, or build a new optimizer (memopt_checkpoint converts "
                    "saved states between formats)"
                )
            if not reindexed and (
                cur is None or cur.signature is None or cur.signature[3] != signature[3]
            ):
                # members changed (a group's params list edited in place): the index is rebuilt
                # from every group, so once per pass (per group, a first step of G groups was
                # quadratic)
                self._index = None
                reindexed = True
                # add_param_group's check, for a tensor appended by hand, or a group appended
                # to param_groups by hand (the same dict twice, a copy sharing its params list:
                # its plan is new): one already held by another group would be updated by both
                # groups' launches and counted once (one step counter per parameter)
                check_parameters_apart(labelled_parameters(self.param_groups), [])
            builds[gi] = (gi, group, members, names, formats, signature)
        for gi in builds:
            left |= self._families_of(gi)
        for gi, (args, gained) in extends.items():
            if self._families_of(gi) & left:
                builds[gi] = args  # its family is rebuilt: rebuilt with it, whole
            else:
                self._extend_group(gi, args[1], gained, args[5])
        kept: set[int] = set()
        for gi, args in current.items():
            if self._families_of(gi) & left:
                builds[gi] = args
                kept.add(gi)
        if builds:
            # the last group's old plan: held here, it kept its arenas alive through the whole
            # rebuild (each group's is freed as it is rebuilt: _restorer)
            del cur
            self._build_groups([builds[gi] for gi in sorted(builds)], kept)

    def _gained_stateless(
        self, cur: _GroupPlans, signature: tuple, members: list[Tensor]
    ) -> list[Tensor] | None:
        """The members a group planned as ``cur`` gained, when that is all that changed: none
        has state (parameters with their first gradient), and every old member is still one,
        of its device, dtype and shape (:meth:`_extend_group` then adds them without a
        rebuild). None otherwise."""
        old = cur.signature
        if old is None or old[:3] != signature[:3] or len(signature[3]) <= len(old[3]):
            return None
        index = self._tensor_index()
        if any(id(p) not in index for p in members):
            return None  # a tensor put into the list in place (it has no position yet)
        was = dict(zip(old[3], old[4], strict=True))
        gained = []
        for pid, meta, p in zip(signature[3], signature[4], members, strict=True):
            if pid not in was:
                if p in self.state:
                    return None
                gained.append(p)
            elif was[pid] != meta:
                return None
        return gained if len(members) - len(gained) == len(was) else None

    @staticmethod
    def _check_dtypes(gi: int, group: Mapping[str, Any], members: list[Tensor]) -> None:
        """add_param_group's dtype check at the step, for a parameter cast after it was added
        (``model.double()`` before the first step; one with state is refused by
        :meth:`_check_unchanged`): the format's own error would name no parameter."""
        for p in members:
            if p.dtype not in backends.PARAM_DTYPES:  # the label only when it is needed
                i = next(i for i, q in enumerate(group["params"]) if q is p)
                _check_param_dtype(
                    p,
                    f"parameter #{i} of param group {gi} ({_describe_tensor(p)})",
                    " since it was added to the optimizer (was the model cast?)",
                    "cast it back, or build the optimizer after casting",
                )

    def _families_of(self, gi: int) -> set[int]:
        """The ids of the family arenas group ``gi``'s arenas are views of (none: empty)."""
        cur = self._plans.get(gi)
        if cur is None:
            return set()
        return {id(e.arena.family) for e in cur.entries if e.arena.family is not None}

    def _build_groups(self, builds: list[tuple], kept: set[int]) -> None:
        """Build the plans and arenas of the groups ``builds`` lists (``(gi, group, members,
        names, formats, signature)`` each). Plans of several groups that share a device, a
        parameter dtype, a spec and state names get one family arena where their backend steps
        several groups in one launch (``merges_groups``); the others get their own. The groups
        in ``kept`` did not change (they move to a new family with a changed one): their
        parameters keep their tensor ids (the stochastic-rounding words), so that the move
        changes no bit."""
        plans: dict[int, list[GroupPlan]] = {}
        for gi, group, members, *_ in builds:
            # plans hold what the kernels update: a sharded parameter's local shard
            plans[gi] = make_plans(
                [local_shard(p) for p in members],
                functools.partial(self._spec, group),
                group_index=gi,
            )
        # a state with a count edited in place (its moments not converted yet: that waits for
        # the step's checks, :meth:`_sync_decay_norm`) is copied with the count its moments are
        # stored for, and the copies are converted: the old moments stay as they were for a
        # refused step to put back (converted there, they were converted again at the retry
        # with the count edited back)
        records = self._norm_step_records(edited=True)
        kin: dict[tuple, list[GroupPlan]] = defaultdict(list)
        for gi, _, _, names, *_ in builds:
            for plan in plans[gi]:
                kin[(plan.device, plan.param_dtype, plan.spec, names)].append(plan)
        arenas: dict[int, StateArena] = {}
        for (_, dtype, spec, names), members in kin.items():
            if len(members) > 1 and self._merges_groups(members[0]):
                codecs = {n: self._codec_of(n, spec) for n in names}
                family = family_arenas(members, codecs, spec.master_for(dtype))
                arenas.update(zip(map(id, members), family, strict=True))
        for gi, group, members, names, formats, signature in builds:
            ids = None
            if gi in kept:
                ids = {id(p): e.tensor_ids[si] for e in self._plans[gi].entries
                       for si, p in enumerate(e.owners)}  # fmt: skip
            self._build_group(
                gi, group, members, names, formats, signature, plans[gi], arenas, ids, records
            )

    def _merges_groups(self, plan: GroupPlan) -> bool:
        """Whether the backend that will step ``plan`` runs several param groups in one launch
        (and so their arenas should share a family)."""
        try:
            backend = backends.select_backend(
                self._kind, plan.spec, plan.device, plan.param_dtype, self.backend
            )
        except (ConfigError, BackendUnavailableError):  # the step says why
            return False
        return backends.merges_groups(backend)

    def _check_unchanged(self, members: list[Tensor]) -> None:
        """Raise ConfigError when a parameter with state was cast, moved or reshaped since its
        plan was built: a rebuild would keep only the states that still fit (an ECC code would
        be dropped) and go on from the rounded weight."""
        for p in members:
            loc = self._where.get(id(p))
            if loc is None or p not in self.state:
                continue
            gi, ei, si = loc
            plan = self._plans[gi].entries[ei].plan
            if not _fits_plan(local_shard(p), plan, si):
                raise _changed_error(self._param_label(p), plan, si)

    def _build_group(
        self, gi, group, members, names, formats, signature, plans, arenas, ids, records
    ) -> None:
        index = self._tensor_index() if ids is None else ids
        if self._undo is not None:
            self._undo.append(self._restorer(gi, members, rebuilt=True))
        self._drop_plan(gi)
        entries = self._make_entries(plans, members, names, arenas, index, records)
        self._plans[gi] = _GroupPlans(
            signature, formats, names, entries, (group, group["params"], len(group["params"]))
        )
        self._place(gi, entries, 0)

    def _extend_group(self, gi, group, gained, signature) -> None:
        """Give the members that group ``gi`` gained without state (parameters with their first
        gradient) entries and arenas of their own, after the group's. A rebuild would copy the
        group's whole state into new arenas, holding it twice (a spike a model that fits can
        run out of memory at, whenever a parameter first gets a gradient), and replace every
        state tensor that code may hold (``state_dict()``'s live views, a moment being
        monitored). Here no state moves; each gain adds its own launch to the group's step
        until a rebuild plans them all together. Same bits."""
        cur = self._plans[gi]
        if self._undo is not None:
            self._undo.append(self._restorer(gi, gained, rebuilt=False))
        self._drop_cached_steps()  # they hold the old entries
        plans = make_plans(
            [local_shard(p) for p in gained],
            functools.partial(self._spec, group),
            group_index=gi,
        )
        entries = self._make_entries(plans, gained, cur.names, {}, self._tensor_index(), {})
        cur.entries.extend(entries)
        cur.signature = signature
        self._place(gi, entries, len(cur.entries) - len(entries))

    def _place(self, gi: int, entries: list[_Entry], first: int) -> None:
        """Record where ``entries`` (group ``gi``'s, from entry index ``first`` on) put each
        parameter."""
        for ei, entry in enumerate(entries, start=first):
            for si, p in enumerate(entry.owners):
                self._where[id(p)] = (gi, ei, si)

    def _make_entries(self, plans, members, names, arenas, index, records) -> list[_Entry]:
        """The entries of ``plans`` (of ``members``), with their arenas (from ``arenas``, by the
        plan's id, else new) and each member's new state in ``self.state``: the values of its
        previous state copied in, a new master code encoding its current weight. ``records``:
        :meth:`_norm_step_records` of the states whose count was edited in place (their
        second moments are converted to it in the copies)."""
        entries: list[_Entry] = []
        new_states: dict[Tensor, ParamState] = {}
        owner_of = {id(local_shard(p)): p for p in members}
        for plan in plans:
            master = plan.spec.master_for(plan.param_dtype)
            arena = arenas.get(id(plan)) or self._new_arena(
                plan, {n: self._codec_of(n, plan.spec) for n in names}, master
            )
            owners = [owner_of[id(t)] for t in plan.params]
            for slot, p, t in zip(plan.slots, owners, plan.params, strict=True):
                prev = self.state.get(p) or {}
                views = arena.views(slot)
                for key, view in views.items():
                    src = prev.get(key)
                    if src is not None:
                        if (
                            not isinstance(src, Tensor)
                            or src.shape != view.shape
                            or src.dtype != view.dtype
                        ):
                            got = (
                                f"{src.dtype} of shape {tuple(src.shape)}"
                                if isinstance(src, Tensor)
                                else type(src).__name__
                            )
                            raise ConfigError(
                                f"state {key!r} of {self._param_label(p)} is {got}, but "
                                f"{plan.spec} stores {view.dtype} of shape {tuple(view.shape)}"
                            )
                        view.copy_(src)
                    elif key == "master_code":
                        conversions.encode_master_into(master, t.detach(), None, view)
                step = prev.get("step")
                state = ParamState(
                    self._writes, {"step": _step_tensor(step if step is not None else 0)}
                )
                dict.update(state, views)
                # the caller's own entries stay, as in torch (they were dropped at a rebuild)
                dict.update(state, {k: v for k, v in prev.items() if k not in _MEMOPT_KEYS})
                record = prev.get(_NORM_STEP_KEY)
                if record is None and id(p) in records:
                    record = records[id(p)][0]
                if record is not None:
                    self._convert_written_count(p, plan, record, prev, state)
                new_states[p] = state
            bases = [index_base(p) for p in owners]
            entries.append(
                _Entry(
                    plan,
                    arena,
                    [index[id(p)] for p in owners],
                    owners,
                    bases if any(bases) else None,
                    sharded=any(map(is_dtensor, owners)),
                    normalized=self._kind == "adam" and plan.spec.decay_normalized,
                )
            )
        for p, state in new_states.items():
            self.state[p] = state
        for entry in entries:
            entry.states = [new_states[p] for p in entry.owners]
            entry.held = [dict(s) for s in entry.states]
            if entry.normalized:
                # the counters now, not at the first step: a count edited before it (after
                # load_state_dict or init_state) must differ from the one the moments were
                # normalized with, which the counters' second row records from here on
                self._entry_steps(entry)
        return entries

    def _drop_plan(self, gi: int) -> None:
        """Forget group ``gi``'s plan and where its parameters were in it (not where a rebuild
        of another group, after param_groups were reordered, has put them since)."""
        self._drop_cached_steps()  # they hold the old plans and arenas
        old = self._plans.pop(gi, None)
        if old is not None:
            for entry in old.entries:
                for p in entry.owners:
                    if self._where.get(id(p), (gi,))[0] == gi:
                        self._where.pop(id(p), None)

    def _new_arena(
        self, plan: GroupPlan, codecs: dict[str, MomentCodec], master: Any
    ) -> StateArena:
        """The zeroed state arena of ``plan`` (extension point: a subclass may allocate it
        elsewhere, e.g. memopt-offload first-touches host pages from its update threads). Not
        called for the arenas of a family (:meth:`_build_groups`)."""
        return StateArena(plan, codecs, master)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held now (arenas: moments, scales, master codes; not the
        parameters, not the per-tensor step counters). A parameter's state is created by its
        first step with a gradient (as torch's optimizers create it), or by :meth:`init_state`
        (for every trainable parameter) or :meth:`step_parameters` (every trainable parameter of
        the optimizer at its first call)."""
        return sum(e.arena.nbytes() for gp in self._plans.values() for e in gp.entries)

    def init_state(self) -> None:
        """Create the optimizer state now instead of at the first :meth:`step` (advanced).

        Allocates every param group's plans and arenas and fills ``self.state[p]`` of each
        trainable parameter (``requires_grad``, holding a gradient, or already with state):
        ``step`` 0, zero moments, master codes that encode the current weights, as the first
        step does for the parameters it updates (a step creates state only for parameters with
        a gradient, as torch's optimizers do; this call also for those without one). Frozen
        parameters without state get none. Parameters and gradients are not touched, and a
        following :meth:`step` gives exactly the bits it gives without this call. Idempotent:
        existing state is kept (states of parameters added or unfrozen since are created).
        Returns None.

        Uses: write master codes before training (``memopt_ecc.set_fp32_model_state_dict``),
        measure :meth:`state_bytes` up front, or hand state views to other code. Cast and move the
        model first: a parameter's dtype, device and shape are fixed once its state exists.
        """
        self._refuse_inference_mode("init_state")
        with torch.no_grad():
            self._atomically(self._ensure_plans, None, True)

    # ------------------------------------------------------------------------------- stepping
    def _scalars(
        self,
        group: MutableMapping[str, Any],
        step: int,
        device_lr: bool = False,
        device_wd: bool = False,
    ):
        """The host scalars of ``group`` at ``step``. ``device_lr``: the step reads lr on the
        device (:meth:`_device_work`), so neither lr nor initial_lr is read here (1.0 stands for
        both); ``device_wd``: likewise weight_decay (1.0 stands for it, so the decay and L2
        terms stay in the launch). Only the words that do not depend on them count."""
        kind, decoupled = RULES[self.rule]
        lr = 1.0 if device_lr else float(group["lr"])
        # a pair: _check_group checked every group's betas
        betas = cast("tuple[float, float]", tuple(float(b) for b in self._group_betas(group)))
        wd = 1.0 if device_wd else float(group["weight_decay"])
        initial_lr = None
        if group["decouple_lr"] and decoupled and not device_lr:
            if "initial_lr" not in group:  # decouple_lr switched on in the group by hand
                if lr <= 0:
                    raise ConfigError(
                        f"decouple_lr=True scales weight decay by lr / initial_lr, and the initial "
                        f"lr it would record now is {lr}: set the group's initial_lr (> 0) too"
                    )
                group["initial_lr"] = _initial_lr(group["lr"])
                if self._undo is not None:  # taken back when the step is refused
                    self._undo.append(functools.partial(group.pop, "initial_lr", None))
            initial_lr = float(group["initial_lr"])
        if kind == "adam":
            return reference.adam_scalars(
                lr=lr,
                betas=betas,
                eps=float(group["eps"]),
                weight_decay=wd,
                step=step,
                decoupled=decoupled,
                maximize=group["maximize"],
                initial_lr=initial_lr,
                normalized=self._decay_normalized(group),
            )
        if kind == "lion":
            return reference.lion_scalars(
                lr=lr,
                betas=betas,
                weight_decay=wd,
                maximize=group["maximize"],
                initial_lr=initial_lr,
            )
        return reference.sgd_scalars(
            lr=lr,
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            nesterov=group["nesterov"],
            weight_decay=wd,
            decoupled=decoupled,
            maximize=group["maximize"],
            initial_lr=initial_lr,
        )

    # ------------------------------------------------------ decay-normalized second moments
    @staticmethod
    def _decay_normalized(group: Mapping[str, Any]) -> bool:
        """Whether ``group``'s Adam second moments are stored divided by their decay
        (``StateSpec.decay_normalized``: the 8-bit moment presets)."""
        moments = group.get("moments")
        # a saved group edited to a list or dict (unhashable) is named by the loader's checks
        return isinstance(moments, str) and moments in DECAY_NORMALIZED_PRESETS

    def _normalizing_beta2(self, gi: int) -> float | None:
        """The beta2 that group ``gi``'s stored second moments are normalized with (None: they
        are not normalized): the group's current one unless it changed since they were
        written (:meth:`_sync_decay_norm` then converts them at the next step)."""
        group = self.param_groups[gi]
        if self._kind != "adam" or not self._decay_normalized(group):
            return None
        return self._norm_beta2.get(gi, float(self._group_betas(group)[1]))

    def decay_norm(self, group_index: int, step: int) -> float:
        """``N``: the stored second moment of a parameter of param group ``group_index`` after
        ``step`` steps is ``v / N`` (Adam's 8-bit second moments, ``reference.decay_norm`` of
        the beta2 they were written with; 1.0 for every other state). Code that reads or writes
        decoded second moments outside a step (state dict conversions) multiplies or divides
        by it: ``memopt_core.conversions.denormalize_second_moment`` /
        ``normalize_second_moment``."""
        beta2 = self._normalizing_beta2(group_index)
        return 1.0 if beta2 is None else reference.decay_norm(beta2, int(step))

    def _check_sync(self, gi: int) -> int:
        """The refusals of :meth:`_sync_decay_norm` of group ``gi``, writing nothing: a step
        checks everything before it converts any moments (a refused step converted some).
        Returns what that sync has to do: 0 nothing (the step skips it), 1 bookkeeping (record
        the group's beta2, or the version of counts checked here), 2 maybe convert moments (a
        count edited in place, a changed beta2). Per group and step, in place of the sync's own
        cost while nothing changed."""
        todo = 0
        gp = self._plans.get(gi)
        if gp is not None:
            for entry in gp.entries:
                steps = entry.steps
                if steps is not None and steps._version != entry.counts_version:
                    self._check_counts(entry, steps)
                    todo = 2 if entry.norm_steps is not None else max(todo, 1)
        if self._kind == "adam":  # what _normalizing_beta2 reads
            group = self.param_groups[gi]
            if self._decay_normalized(group):
                new = float(self._group_betas(group)[1])
                old = self._norm_beta2.get(gi)
                if old is None:
                    todo = max(todo, 1)  # the sync records it
                elif old != new:
                    self._refuse_beta2_conversion_in_capture(gi, old, new)
                    todo = 2
        return todo

    def _refuse_beta2_conversion_in_capture(self, gi: int, old: float, new: float) -> None:
        self._refuse_conversion_in_capture(
            f"param group {gi}'s beta2 changed to {new} since its second moments were "
            f"last written (with {old})",
            "take one eager step with the new beta2",
        )

    def _sync_decay_norm(self, gi: int) -> None:
        """Before group ``gi`` steps: where a step count was edited (:meth:`_sync_step_edits`)
        or its beta2 changed since its normalized second moments were written (a scheduler, a
        loaded version-1 state dict), re-encode them with the normalization of the current
        count and beta2 (``v = u * N_old`` rounded to fp32, ``v / N_new`` rounded toward zero,
        then the format's encode: to nearest for an edited count, as a decoded state dict's
        load does, stochastically for a beta2 change)."""
        gp = self._plans.get(gi)
        if gp is not None:
            for entry in gp.entries:
                steps = entry.steps  # the version check inline: it runs per group and step
                if steps is not None and steps._version != entry.counts_version:
                    self._sync_step_edits(gi, entry)
        old = self._normalizing_beta2(gi)
        if old is None:
            return
        group = self.param_groups[gi]
        new = float(self._group_betas(group)[1])
        if old != new:
            self._refuse_beta2_conversion_in_capture(gi, old, new)
            sr = bool(group["stochastic_rounding"])
            tensor_ids = self._tensor_index()
            for p in group["params"]:
                st = self.state.get(p)
                if st is None or "step" not in st:
                    continue  # no state yet: the first step builds it
                k = int(float(st["step"]))
                rand = (
                    functools.partial(self._conversion_words, p, tensor_ids[id(p)], step=k)
                    if sr
                    else None
                )
                self._renormalize(group, st, (old, k), (new, k), rand)
        self._norm_beta2[gi] = new

    @staticmethod
    def _refuse_conversion_in_capture(what: str, fix: str) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # captured, the one-time conversion would run again at every replay
            raise ConfigError(
                f"{what}, and a CUDA graph capture cannot hold the one-time conversion of "
                f"the second moments: {fix} before capturing"
            )

    def _renormalize(
        self,
        group: Mapping[str, Any],
        st: Mapping[str, Any],
        old: tuple[float, int],
        new: tuple[float, int],
        rand: Callable[[Tensor], Tensor] | None,
    ) -> None:
        """Re-encode the second moments in ``st`` (a parameter's state in ``group``) stored as
        ``u = v / N(beta2, count)`` for ``old`` as those for ``new`` (``rand``: the words of a
        stochastic encode, from the decoded ``u``; None: to nearest). A state without them
        (written from outside: :meth:`_ensure_plans` adopts it) is left as it is."""
        codec = moment_codec(MOMENT_PRESETS[group["moments"]][1])
        keys = {sfx: state_key("exp_avg_sq", sfx) for sfx in codec.fields}
        if not all(k in st for k in keys.values()):
            return
        fields = {sfx: st[key] for sfx, key in keys.items()}
        with torch.no_grad():
            u = conversions.decode_moment(codec, {s: f.reshape(-1) for s, f in fields.items()})
            v = conversions.denormalize_second_moment(u, reference.decay_norm(*old))
            u = conversions.normalize_second_moment(v, reference.decay_norm(*new))
            codes = conversions.encode_moment(codec, u, rand=None if rand is None else rand(u))
            for sfx, x in codes.items():
                fields[sfx].copy_(x.reshape(fields[sfx].shape))

    def _sync_step_edits(self, gi: int, entry: _Entry, adopting: bool = False) -> None:
        """Convert the second moments of ``entry`` (param group ``gi``) whose step count was
        edited since they were normalized with it: ``state[p]["step"].zero_()`` in place, or
        (``adopting``: :meth:`_adopt_state_writes`, before the rebuild that takes the states
        as they are) a new count put in the state. Without this, the stored ``u`` would be read
        against the new count's ``N``: ``v`` rescaled silently, up to 256-fold. A state whose
        second moments were replaced too is the writer's, normalized with its count. O(1)
        while no count was edited: the counters' version is unchanged."""
        norm, steps = entry.norm_steps, entry.steps
        if steps is None or (norm is None and adopting):
            return
        if not adopting:
            if steps._version == entry.counts_version:
                return
            self._check_counts(entry, steps)  # edited in place: still counts? (every format)
        if norm is None:  # moments that take any count: nothing to convert
            entry.counts_version = steps._version
            return
        # (a GPU's counters: one synchronisation, after an edit or a move only)
        was = norm.tolist()
        now = steps.tolist()
        edits = []
        for si, (p, mine, held) in enumerate(
            zip(entry.owners, entry.states, entry.held, strict=True)
        ):
            if adopting:
                if self.state.get(p) is not mine:
                    continue  # a new state: the writer's
                if any(mine.get(k) is not t for k, t in held.items() if k.startswith("exp_avg_sq")):
                    continue  # its second moments replaced: normalized with its own count
                count = conversions.saved_step_count(mine.get("step"))
                if count is None:
                    continue  # no count, or not one: the rebuild refuses it
                now[si] = count
            if now[si] != was[si]:
                edits.append((si, mine))
        if edits:
            self._refuse_conversion_in_capture(
                f"a step count of param group {gi} was edited since its second moments were "
                "last written",
                "take one eager step",
            )
            beta2 = self._normalizing_beta2(gi)
            if beta2 is not None:  # None: the group's moments are another format now (rebuilt)
                group = self.param_groups[gi]
                for si, st in edits:
                    self._renormalize(group, st, (beta2, int(was[si])), (beta2, int(now[si])), None)
        if not adopting:
            norm.copy_(steps)
        else:
            # the adopted count replaced its view of row 0 until the rebuild: both rows now
            # hold it, so that a second adoption (state_dict() twice, a pickle, an export, then
            # the step) or the rebuild's own check converts nothing again
            assert entry.counts is not None  # norm_steps is its row 1
            for si, _ in edits:
                entry.counts[:, si] = now[si]
        entry.counts_version = steps._version

    def _conversion_words(self, p: Tensor, tensor_id: int, u: Tensor, step: int) -> Tensor:
        """Stochastic-rounding words of a re-encoding of ``p``'s second moments ``u`` at step
        count ``step``. A beta2 schedule changes beta2 a little at every step, which rescales
        ``u`` by well under a code step: rounded to nearest, the change was lost every time,
        and over a ramp from 0.95 to 0.999 ``v`` grew 2e10-fold; rounded stochastically it is
        kept in expectation. The words are those of ``p``'s tensor id and elements (global
        ones for a shard: any sharding gives the same bits), at a step with the top bit set,
        which no step of a kernel draws (counts stop at 2**24 + 1)."""
        index = index_base(p) + torch.arange(u.numel(), device=u.device)
        return rng.uniform_bits(self.seed, tensor_id, index, step | 1 << 31, rng.STREAM_SECOND)

    def _check_grad(self, p: Tensor, g: Tensor, plan: GroupPlan, si: int) -> None:
        if is_dtensor(p) or is_dtensor(g):
            # each one's placements, None for a plain tensor
            p_pl = tuple(cast("DTensor", p).placements) if is_dtensor(p) else None
            g_pl = tuple(cast("DTensor", g).placements) if is_dtensor(g) else None
            if p_pl is None or g_pl != p_pl:
                got = "a plain tensor" if g_pl is None else f"placements {g_pl}"
                want = "a plain tensor" if p_pl is None else f"placements {p_pl}"
                raise ConfigError(
                    f"{self._param_label(p)} has a gradient with {got}; it must be sharded like "
                    f"the parameter ({want})"
                )
            if g.shape != p.shape:
                raise ConfigError(
                    f"{self._param_label(p)} has a gradient of shape {tuple(g.shape)}; it must "
                    "match the parameter"
                )
            label = self._param_label(p)
            p, g = cast("DTensor", p)._local_tensor, cast("DTensor", g)._local_tensor
        else:
            label = None
        self._check_local_grad(label, p, g, plan, si)

    def _check_local_grad(
        self, label: str | None, p: Tensor, g: Tensor, plan: GroupPlan, si: int
    ) -> None:
        """:meth:`_check_grad` of a plain tensor or of a sharded parameter's local shard
        (``label`` names the sharded parameter). Cheap when nothing is wrong: the label, a
        search over the param groups, is only built for an error message."""
        if (
            g.layout == torch.strided
            and not g.is_complex()
            and not g.is_neg()
            and _not_freed(g)
            and _not_freed(p)
            and g.shape == p.shape
            and g.device == p.device
            and grad_dtype_ok(p.dtype, g.dtype)
            and _fits_plan(p, plan, si)
        ):
            return
        label = label or self._param_label(p)
        if g.layout != torch.strided:
            raise ConfigError(
                f"{label} has a {g.layout} gradient; memopt optimizers need dense "
                "gradients (torch.nn.Embedding(sparse=False), or g.to_dense())"
            )
        if g.is_complex():
            raise ConfigError(f"{label} has a complex gradient ({g.dtype})")
        refuse_negated(f"the gradient of {label}", g)
        for t, what in ((p, "it"), (g, "its gradient")):
            if not _not_freed(t):
                if t.device.type == "meta":  # address 0 too; checked only here, off the hot path
                    raise ConfigError(
                        f"{label}: {what} is on the meta device, which holds shapes and no "
                        "values: materialize the model first (module.to_empty(device=...) and "
                        "initialize it)"
                    )
                raise ConfigError(
                    f"{label}: {what} has no memory (its storage was freed or resized to 0 "
                    "bytes), so there is nothing to read or update"
                )
        if g.shape != p.shape or g.device != p.device:
            raise ConfigError(
                f"{label} has a gradient of shape {tuple(g.shape)} on {g.device}; "
                "it must match the parameter"
            )
        if not grad_dtype_ok(p.dtype, g.dtype):
            raise ConfigError(
                f"{label} has a {g.dtype} gradient; memopt takes gradients in the "
                "parameter's dtype or float32 (float32 parameters also bfloat16 or float16)"
            )
        if not _fits_plan(p, plan, si):
            raise _changed_error(label, plan, si)

    def _collect(
        self, only: list[Tensor] | None, grads: Mapping[Tensor, Tensor] | None = None
    ) -> list[tuple[int, int, list[tuple[int, Tensor, Tensor]]]]:
        tasks: dict[tuple[int, int], list[tuple[int, Tensor, Tensor]]] = {}
        if only is None:
            for gi, gp in self._plans.items():
                for ei, entry in enumerate(gp.entries):
                    part = [
                        (si, p, p.grad) for si, p in enumerate(entry.owners) if p.grad is not None
                    ]
                    if part:
                        tasks[(gi, ei)] = part
        else:
            seen: set[int] = set()
            for p in only:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                loc = self._where.get(id(p))
                if loc is None:
                    if isinstance(p, Tensor) and id(p) in self._tensor_index():
                        continue  # frozen parameter without state: nothing to do
                    what = _describe_tensor(p) if isinstance(p, Tensor) else type(p).__name__
                    raise ConfigError(
                        f"step_parameters got a tensor ({what}) that this optimizer does not hold"
                    )
                g = grads.get(p) if grads is not None else None
                if g is None:
                    g = p.grad
                if g is None:
                    continue
                gi, ei, si = loc
                tasks.setdefault((gi, ei), []).append((si, p, g))
            for part in tasks.values():
                part.sort(key=lambda t: t[0])
        return [(gi, ei, part) for (gi, ei), part in sorted(tasks.items())]

    def _update(
        self,
        only: list[Tensor] | None,
        staging: Mapping[Tensor, Tensor] | None = None,
        grads: Mapping[Tensor, Tensor] | None = None,
        amp: tuple[Tensor | None, Tensor | None] | None = None,
    ) -> list[tuple[Any, backends.GroupStep]]:
        """One update of ``only`` (None: every parameter with a gradient); returns the
        (backend, work) pairs it ran, in order (:meth:`_update_and_cache` caches them). ``amp``:
        a GradScaler's (scale, found_inf) (:attr:`_step_supports_amp_scaling`); without
        ``capturable`` they run on the device where every work can (its counters move there),
        else on the host (one synchronisation; nothing runs when an inf was found).

        A refused update leaves no trace: :meth:`_resolve` runs every check (the groups', the
        gradients', the backends') before anything is written, and what it built (the plans
        and states of parameters at their first step) is taken back when one fails
        (:meth:`_atomically`); the writes that cannot be taken back (moments converted to a new
        beta2 or step count, gradients unscaled for a GradScaler) come after it."""
        self._check_before_update(only, grads)
        works, counters, synced, on_host = self._atomically(
            self._resolve, only, staging, grads, amp
        )
        for gi in synced:
            self._sync_decay_norm(gi)
        if on_host is not None:  # a GradScaler's flags, read on the host: no inf found
            assert amp is not None
            _unscale_on_host(amp, on_host)

        def ran(i: int) -> None:
            backend, work = works[i]
            backends.mark_written(work.param_owners)
            if work.staging is not None and not backends.writes_staging(backend):
                for p, st in zip(work.params, work.staging, strict=True):
                    if st is not None:
                        st.copy_(p.reshape(st.shape))
            if work.device_step is None:  # a device step advanced its counters itself
                counted = counters[i]
                assert counted is not None  # None only for a device step's work
                self._count_step(counted, work)

        _run_works(works, None, lambda i: works[i][0].step(works[i][1]), ran)
        self._check_step_limit(w for _, w in works if w.device_step is None)
        return works

    def _resolve(
        self,
        only: list[Tensor] | None,
        staging: Mapping[Tensor, Tensor] | None,
        grads: Mapping[Tensor, Tensor] | None,
        amp: tuple[Tensor | None, Tensor | None] | None,
    ) -> tuple[list[tuple[Any, backends.GroupStep]], list[_Entry | None], list[int], Any]:
        """The checks and the works of :meth:`_update`, writing nothing it cannot take back
        (run through :meth:`_atomically`): ``(works, counters, synced, on_host)``: each work's
        entry whose host counters advance after it ran (None for a device step, which advances
        its own), the param groups whose :meth:`_sync_decay_norm` runs once every check passed,
        and, where ``amp``'s flags are read on the host and no inf was found, the gradients for
        :func:`_unscale_on_host` (else None; no works when an inf was found)."""
        self._ensure_plans(only)
        tasks = self._collect(only, grads)
        resolved = []
        synced: dict[int, int] = {}  # group index -> what its sync does (_check_sync)
        for gi, ei, part in tasks:
            group = self.param_groups[gi]
            self._check_group(group, f"(param group {gi})")
            if gi not in synced:
                synced[gi] = self._check_sync(gi)
            entry = self._plans[gi].entries[ei]
            plan = entry.plan
            if entry.sharded:
                for si, p, g in part:
                    self._check_grad(p, g, plan, si)
            else:  # the common case, without a DTensor check per tensor
                for k, (si, p, g) in enumerate(part):
                    if is_dtensor(g):
                        self._check_grad(p, g, plan, si)  # refuses it with its message
                    if g._is_zerotensor():
                        # autograd's zero gradient (of a parameter used only through torch.sgn)
                        # has no memory to read: the kernels get real zeros (no cached step
                        # holds them: _build_cached)
                        g = torch.zeros_like(g)
                        part[k] = (si, p, g)
                    self._check_local_grad(None, p, g, plan, si)
                    if not p.is_contiguous() and overlaps_itself(p):
                        raise ConfigError(
                            f"{self._param_label(p)} has elements that share memory (an "
                            "expanded tensor?): it cannot be updated in place; give it its own "
                            "memory (p.data = p.data.clone())"
                        )
            spec = self._spec(group, plan.param_dtype)
            backend = backends.select_backend(
                self._kind, spec, plan.device, plan.param_dtype, self.backend
            )
            resolved.append((gi, entry, spec, backend, part))
        on_device = self._capturable
        on_host: list[Tensor] | None = None
        unscales = False  # the gradients are unscaled on the host before the works run
        if amp is not None and not on_device:
            # a GradScaler's step without capturable: on the device where every work can run
            # there (its counts move there), else as GradScaler's own loop does it (after
            # every check: the unscaling writes the gradients)
            on_device = all(backends.runs_device_steps(r[3]) for r in resolved)
            if not on_device:
                if _found_inf_on_host(amp):  # skipped before the works, as by the scaler
                    return [], [], [gi for gi, todo in synced.items() if todo], None
                on_host = [g for r in resolved for _, _, g in r[4]]
                unscales = amp[0] is not None
                amp = None
        works: list[tuple[Any, backends.GroupStep]] = []
        counters: list[_Entry | None] = []  # each work's entry (a host work's counters advance
        # after it ran; None for a device step, which advances its own)
        for gi, entry, spec, backend, part in resolved:
            group = self.param_groups[gi]
            if on_device:
                works.append(
                    (backend, self._device_work(gi, entry, spec, backend, part, staging, amp))
                )
                counters.append(None)
                continue
            steps = self._entry_steps(entry, [si for si, _, _ in part])
            counts = steps.tolist()  # one read for the whole entry
            by_step: dict[int, list[tuple[int, Tensor, Tensor]]] = {}
            for item in part:
                by_step.setdefault(int(counts[item[0]]), []).append(item)
            for done in sorted(by_step):
                items = by_step[done]
                step = done + 1
                work = self._group_step(entry, spec, items, staging, self._scalars(group, step))
                work.step, work.first_step = step, step == 1
                works.append((backend, work))
                counters.append(entry)
        if self.check_numerics:
            self._check_finite(works)
        # the first run validates its own works before writing anything (one backend.step, or
        # a step_all that validates all of its run): the others are checked before it runs.
        # Where something is written before it (the conversions, the unscaling) or was built
        # for this step (taken back on a refusal), the first run is checked here too
        if works:
            whole = self._undo or unscales or 2 in synced.values()
            backends.check_works(works if whole else works[_run_end(works, 0) :])
        return works, counters, [gi for gi, todo in synced.items() if todo], on_host

    def _check_step_limit(self, works: Iterable[backends.GroupStep]) -> None:
        """Warn once when a step count reaches 2**24, where float32 counters stop (torch's too).
        Stochastic rounding draws its words from the count, so from there on every step would
        round each element with the same word: state rounded with it could stall; and the
        decay normalization's phase ``step % P`` stops, so q8/fp8 second moments stop decaying."""
        if self._warned_step_limit:
            return
        if any(w.step >= _STEP_LIMIT and w.spec.stochastic_rounding for w in works):
            self._warned_step_limit = True
            warnings.warn(
                "step counts reached 2**24 (16,777,216): memopt keeps them in float32 tensors, "
                "as torch does, and they stop advancing there. Bias corrections are 1 long "
                "before, but stochastic rounding draws its words from the count: from now on "
                "each element rounds with the same word at every step, and state rounded with "
                "it (bf16/fp8/q8 moments, ECC-24 codes) can stall, and q8/fp8 second moments, "
                "stored as v / beta2**(step % P), stop decaying. To go on, lower every "
                "state['step'] in the state dict keeping its remainder modulo its group's "
                "P = memopt_core.reference.decay_norm_period(beta2) (another remainder rescales "
                "those moments), e.g. to step - P * ((step - 2**23) // P), and load it",
                RuntimeWarning,
                stacklevel=_caller_stacklevel(),
            )

    @staticmethod
    def _count_step(entry: _Entry, work: backends.GroupStep) -> None:
        """Advance the host step counters of ``work``'s parameters (views of ``entry.steps``)."""
        steps, views, counts = entry.steps, entry.step_views, entry.counts
        # the work's counts were read through _entry_steps, which holds both
        assert steps is not None
        assert views is not None
        if counts is not None:  # the counts of the stored second moments advance with them
            if work.full:
                counts.add_(1)
            elif len(work.slots) <= 8:
                for si in work.slots:
                    counts[:, si].add_(1)
            else:
                counts[:, torch.tensor(work.slots, device="cpu")] += 1
            entry.counts_version = steps._version
        else:
            if work.full:
                steps.add_(1)
            elif len(work.slots) <= 8:  # e.g. gradient release: cheaper than an index
                for si in work.slots:
                    views[si].add_(1)
            else:
                steps[torch.tensor(work.slots, device="cpu")] += 1
            entry.counts_version = steps._version

    def _check_before_update(
        self, only: list[Tensor] | None, grads: Mapping[Tensor, Tensor] | None = None
    ) -> None:
        """Extension point: checks that must pass before an update of ``only`` (None: every
        parameter with a gradient) changes anything; a replayed cached step runs them too
        (memopt-ecc's resolution check with ``check_numerics``). ``grads``: the gradients
        :meth:`step_parameters` was given, used instead of ``p.grad`` where present (gradient
        release hooks have already freed ``p.grad``)."""

    def _device_work(self, gi, entry, spec, backend, part, staging, amp) -> backends.GroupStep:
        """The capturable step of ``part`` (one entry's participating parameters) in param
        group ``gi``."""
        plan = entry.plan
        if not backends.runs_device_steps(backend):
            raise ConfigError(
                f"capturable=True needs a backend that keeps step counts on the device (the "
                f"triton backend, for CUDA tensors); the {plan.param_dtype} parameters on "
                f"{plan.device} run on the {backend.name!r} backend"
            )
        scalars, device_step = self._device_step(gi, entry, [si for si, _, _ in part], amp)
        # the host scalars give the step-independent words; the device computes the rest
        work = self._group_step(entry, spec, part, staging, scalars)
        work.first_step = False  # a placeholder, as step: the device decides per tensor
        work.device_step = device_step
        return work

    def _device_step(self, gi, entry, slots, amp) -> tuple[Any, backends.DeviceStep]:
        """The host scalars and the :class:`~memopt_core.backends.DeviceStep` of a device step
        of ``entry``'s ``slots`` in param group ``gi`` (its counters moved to the device).
        ``slots`` None: the entry's counters are on the device and held (a cached step's)."""
        group = self.param_groups[gi]
        # a pair: _check_group checked every group's betas
        betas = cast("tuple[float, float]", tuple(float(b) for b in self._group_betas(group)))
        if self._kind == "adam":
            try:  # before any group steps: the table is cached, this costs once per betas
                reference.adam_bias_table(*betas)
            except ValueError as e:
                raise ConfigError(f"param group {gi}: {e}") from None
        grad_scale, found_inf = amp if amp is not None else (None, None)
        dev = entry.plan.device
        lr = group["lr"]
        # a tensor lr or weight decay on the group's device is read there at every launch (and,
        # in a CUDA graph, at every replay); one elsewhere is read now
        device_lr = isinstance(lr, Tensor) and lr.device == dev
        wd = group["weight_decay"]
        device_wd = isinstance(wd, Tensor) and wd.device == dev
        decoupled = RULES[self.rule][1]
        initial_lr = group.get("initial_lr") if group["decouple_lr"] and decoupled else None
        if isinstance(initial_lr, Tensor) and not (device_lr and initial_lr.device == dev):
            initial_lr = float(initial_lr)
        scalars = self._scalars(group, 1, device_lr, device_wd)
        steps = entry.steps if slots is None else self._entry_steps(entry, slots, on_device=True)
        return scalars, backends.DeviceStep(
            steps=steps,
            lr=lr if device_lr else float(lr),
            betas=betas,
            grad_scale=None if grad_scale is None else grad_scale.to(dev).reshape(1),
            found_inf=None if found_inf is None else found_inf.to(dev).reshape(1),
            weight_decay=wd if device_wd else float(wd),
            decoupled=decoupled,
            initial_lr=initial_lr,
            normalized=self._kind == "adam" and self._decay_normalized(group),
            # the backend advances the record of the counts the moments are stored for with
            # the counters (no copy follows the step; an edit is seen against it)
            norm_steps=entry.norm_steps,
        )

    def _group_step(self, entry, spec, items, staging, scalars) -> backends.GroupStep:
        """The backend's work for ``items`` (``(slot, parameter, gradient)`` of one entry, by
        slot) at step 1; the caller sets the step (or a device step)."""
        return backends.GroupStep(
            rule=self._kind,
            spec=spec,
            plan=entry.plan,
            slots=[si for si, _, _ in items],
            params=_locals(entry, [p for _, p, _ in items]),
            grads=_locals(entry, [g for _, _, g in items]),
            arena=entry.arena,
            scalars=scalars,
            step=1,
            seed=self.seed,
            tensor_ids=[entry.tensor_ids[si] for si, _, _ in items],
            first_step=True,
            staging=None if staging is None else [staging.get(p) for _, p, _ in items],
            index_bases=(
                None if entry.index_bases is None else [entry.index_bases[si] for si, _, _ in items]
            ),
            owners=[p for _, p, _ in items],
            grads_checked=True,  # _check_before_update / the cached step's checks
        )

    def _entry_steps(
        self, entry: _Entry, slots: list[int] | None = None, on_device: bool = False
    ) -> Tensor:
        """``entry``'s step counters as one float32 tensor, indexed by plan slot: on the CPU, or
        on the entry's device with ``capturable=True`` or ``on_device`` (a GradScaler's step,
        :meth:`_update`). Each ``self.state[p]["step"]`` is a view of it, so a step reads every
        count at once and advances them in one operation.

        Only the states of ``slots`` (None: all) are checked to still hold their views: a state
        replaced elsewhere (e.g. by hand) is picked up when its parameter next steps, since the
        rebuild (eager: it copies) reads every state's current count. A step over one tensor
        (gradient release) thus costs O(1) here. Counters held on the other device move in one
        copy (one synchronisation from a GPU), once per change of place."""
        dev = entry.plan.device if self._capturable or on_device else _CPU
        views, steps = entry.step_views, entry.steps
        if views is not None:
            assert steps is not None  # _hold_steps sets both
            state = self.state
            owners = entry.owners
            if steps.device == dev:
                if slots is None:
                    ok = all(state[p]["step"] is v for p, v in zip(owners, views, strict=True))
                else:
                    ok = all(state[owners[si]]["step"] is views[si] for si in slots)
                if ok:
                    return steps
            elif all(state[p]["step"] is v for p, v in zip(owners, views, strict=True)):
                return self._hold_steps(entry, steps.to(dev))
        steps = torch.stack(
            [self.state[p]["step"].to(dev, torch.float32).reshape(()) for p in entry.owners]
        )
        # counts read from the states (new ones, or written from outside) are checked once here,
        # not at every step: NaN failed deep in the step, a fraction or a negative passed
        self._check_counts(entry, steps)
        return self._hold_steps(entry, steps)

    def _check_counts(self, entry: _Entry, steps: Tensor) -> None:
        """ConfigError naming the first parameter of ``entry`` whose count in ``steps`` is no
        count (NaN, inf, negative, a fraction); one vectorized check."""
        whole = torch.isfinite(steps) & (steps >= 0) & (steps == steps.floor())
        if not bool(whole.all()):
            si = int((~whole).nonzero()[0])
            raise ConfigError(
                f"state['step'] of {self._param_label(entry.owners[si])} is {float(steps[si])}: "
                "a step count is a whole number >= 0"
            )

    def _hold_steps(self, entry: _Entry, steps: Tensor) -> Tensor:
        """Make ``steps`` ``entry``'s counters: each state's ``step`` becomes a view of it."""
        if entry.normalized:
            # row 1: the counts the second moments were normalized with. They moved to the
            # other device (the same counts), or are read from the states for the first time
            # (a new plan's: its moments were normalized with them); a count edited since is
            # converted at the next sync, which compares the rows
            norm = entry.norm_steps
            counts = torch.empty((2, steps.numel()), dtype=steps.dtype, device=steps.device)
            counts[0].copy_(steps)
            counts[1].copy_(steps if norm is None else norm)
            entry.counts, steps, entry.norm_steps = counts, counts[0], counts[1]
            entry.counts_version = -1 if norm is not None else steps._version
        else:
            entry.counts_version = steps._version
        entry.steps = steps
        entry.step_views = [steps[i] for i in range(len(entry.owners))]
        for p, v, held in zip(entry.owners, entry.step_views, entry.held, strict=True):
            self.state[p]["step"] = v
            held["step"] = v
        self._writes_seen = self._writes.n  # its own writes
        return steps

    def _check_finite(self, works: list[tuple[Any, backends.GroupStep]]) -> None:
        by_device: dict[torch.device, list[tuple[Tensor, Tensor]]] = {}
        sharded: dict[torch.device, list[tuple[Tensor, Tensor]]] = {}
        for _, work in works:
            for p, g in zip(work.param_owners, work.grads, strict=True):
                if is_dtensor(p):  # an empty shard too: every rank decides alike
                    sharded.setdefault(g.device, []).append((p, g))
                elif g.numel():
                    by_device.setdefault(g.device, []).append((p, g))
        bad: list[Tensor] = []
        for dev, pairs in sharded.items():
            # a NaN in one rank's shard is the whole tensor's: each shard's flag, maximized
            # over the ranks, so every rank refuses the step (or none does)
            flags = torch.stack(
                [
                    (~torch.isfinite(torch.stack(torch.aminmax(g)))).any().float()
                    if g.numel()
                    else torch.zeros((), dtype=torch.float32, device=dev)
                    for _, g in pairs
                ]
            ).reshape(-1, 1)
            maxed = max_over_shards([p for p, _ in pairs], flags).flatten().tolist()
            bad.extend(p for (p, _), f in zip(pairs, maxed, strict=True) if f)
        for pairs in by_device.values():
            # a min-max reduction keeps NaN and inf (isfinite().all() took 20-50x as long on
            # the CPU); the small gradients of a dtype go through one: per-tensor calls cost
            # more than the elements (a bad one is found by the per-tensor pass below)
            by_dtype: dict[torch.dtype, list[Tensor]] = {}
            ends: list[Tensor] = []
            for _, g in pairs:
                if g.numel() < _FINITE_CAT_LIMIT:
                    by_dtype.setdefault(g.dtype, []).append(g.reshape(-1))
                else:
                    ends.append(torch.stack(torch.aminmax(g)).float())
            ends.extend(
                torch.stack(torch.aminmax(torch.cat(gs))).float() for gs in by_dtype.values()
            )
            if bool(torch.isfinite(torch.cat(ends)).all()):
                continue
            oks = [bool(torch.isfinite(torch.stack(torch.aminmax(g))).all()) for _, g in pairs]
            bad.extend(p for (p, _), ok in zip(pairs, oks, strict=True) if not ok)
        if bad:
            listed = "; ".join(self._param_label(p) for p in bad[:8])
            more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
            raise NumericsError(
                f"non-finite gradient (NaN or Inf) in {len(bad)} parameter(s): {listed}{more}. "
                "No parameter or state was modified; lower the learning rate or loss scale, or "
                "skip this step"
            )

    # ----------------------------------------------------------------------- step hooks
    @staticmethod
    def profile_hook_step(func: Callable[..., Any]) -> Callable[..., Any]:
        """torch's ``step`` wrapper (profiler range, step pre/post hooks), made re-entrant.

        ``torch.optim.Optimizer`` wraps ``step`` of every class it is instantiated as. A subclass
        whose ``step`` calls ``super().step()`` then holds two wrapped layers, and torch alone
        fires every hook twice per call once the parent class was also instantiated (and once
        otherwise: it depends on which class was built first). Here only the outermost ``step``
        of a call fires the hooks; nested ``step`` calls on the same optimizer run unwrapped.
        """
        hooked = Optimizer.profile_hook_step(func)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self = args[0]
            if self.__dict__.get("_in_step", False):
                return func(*args, **kwargs)
            self._in_step = True
            try:
                return hooked(*args, **kwargs)
            finally:
                self._in_step = False

        # eager under torch.compile as the step it wraps: torch 2.11's dynamo, tracing a
        # compiled training step into it, failed an internal assertion at the _in_step setattr
        return run_eagerly(wrapper)

    # --------------------------------------------------------------------- gradient release
    @property
    def gradient_release_active(self) -> bool:
        """True between :meth:`begin_gradient_release` and :meth:`end_gradient_release`."""
        return self._release_owner is not None

    def begin_gradient_release(self, owner: object) -> None:
        """Advanced: mark that per-parameter hooks (``owner``) now update this optimizer's
        parameters during backward, through :meth:`step_parameters`.

        ``memopt_ecc.enable_gradient_release`` calls it with its activation's state; call it
        yourself only when you write such hooks. Until :meth:`end_gradient_release` with the
        same ``owner``, :meth:`step` and :meth:`zero_grad` do nothing and warn (a
        ``UserWarning``, once each per activation): an update in ``step()`` would apply gradients twice, a ``zero_grad()`` would
        free gradients the hooks still need. Raises :class:`ConfigError` while already active.
        A copy (``copy.deepcopy``, pickle) of the optimizer starts inactive.
        """
        if owner is None:
            raise ConfigError("begin_gradient_release needs an owner object, got None")
        if self._release_owner is not None:
            raise ConfigError(
                "gradient release is already active on this optimizer: call handle.remove() first"
            )
        self._release_owner = owner
        self._release_warned = set()  # warn once per activation

    def end_gradient_release(self, owner: object) -> None:
        """Advanced: end the activation :meth:`begin_gradient_release` started with ``owner``;
        :meth:`step` and :meth:`zero_grad` work again. Does nothing when ``owner`` is not the
        active one (idempotent)."""
        if owner is not None and self._release_owner is owner:
            self._release_owner = None

    def _warn_released(self, what: str) -> None:
        if what in self._release_warned:
            return
        self._release_warned.add(what)
        warnings.warn(
            f"{type(self).__name__}.{what}() does nothing while enable_gradient_release() is "
            "active: its hooks update each parameter during backward, as soon as its gradient is "
            "final, and then free that gradient. So every backward is a whole update: gradient "
            "accumulation (a framework's gradient_accumulation_steps) updates once per "
            "micro-batch, and clip_grad_norm_ finds no gradient to clip. Drop the "
            f"{what}() call from the training loop (in a framework: no accumulation, no "
            "clipping), or call handle.remove() to go back to the ordinary "
            "zero_grad()/backward()/step() loop (this warning is shown once per activation)",
            UserWarning,
            stacklevel=_caller_stacklevel(),
        )

    # ------------------------------------------------------------------------ stepping (API)
    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch semantics; a no-op (warning once) while gradient release is active."""
        if self._release_owner is not None:
            self._warn_released("zero_grad")
            return
        super().zero_grad(set_to_none=set_to_none)

    @run_eagerly  # under torch.compile too (memopt_core.eager says why)
    @forgets_scaler_flags_on_error
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every parameter with a gradient; returns the closure's loss.

        Outside a CUDA graph capture, the works of an earlier step are replayed while every
        parameter and gradient keeps its address (:mod:`memopt_core.cached_step`): the same bits
        without the per-tensor host work.

        A step refused for bad input (``ConfigError``, ``NumericsError``: a group value, a
        gradient, a backend's check) changes nothing: no parameter, state or step count, no
        state built for parameters at their first step, no ``initial_lr`` recorded, no gradient
        unscaled for a GradScaler; fixed and stepped again, it gives the bits of a step never
        refused. The same holds for :meth:`step_parameters` and :meth:`init_state`.

        While gradient release is active: does nothing (the closure is not called), warns once
        per activation and returns None; torch's step hooks still run once. Inside a CUDA graph
        capture it needs ``capturable=True`` (``ConfigError`` otherwise, before any change).
        """
        self._refuse_inference_mode("step")
        if self._release_owner is not None:
            self._warn_released("step")
            return None
        capturing = self._refuse_invalid_capture("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            # GradScaler.step sets these (see _step_supports_amp_scaling)
            amp = (getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
            if capturing:  # what the graph records: the ordinary step, which copies nothing
                self._update(None, amp=amp)  # once an eager step cached its tables
            elif self._capturable or amp[0] is not None or amp[1] is not None:
                self._device_counted_step(amp)
            elif not self._replay(None):
                self._update_and_cache(None)
        return loss

    def _refuse_invalid_capture(
        self,
        what: str,
        params: list[Tensor] | None = None,
        grads: Mapping[Tensor, Tensor] | None = None,
    ) -> bool:
        """Whether ``what`` (``step`` or ``step_parameters``) is being captured in a CUDA graph;
        ConfigError, before any change, where that capture could not replay correctly
        (``params``, ``grads``: those of ``step_parameters``; None: every parameter)."""
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if capturing and not self._capturable:
            raise ConfigError(
                f"{type(self).__name__}.{what}() is being captured in a CUDA graph, but the "
                "optimizer has capturable=False: its step counts, bias corrections and stochastic"
                "-rounding step live on the host and would be frozen into the graph (every "
                "replay would repeat the captured step and no count would advance). Construct "
                "it with capturable=True to capture its step"
            )
        if capturing:
            stepped = (
                None
                if params is None
                else [p for p in params if p.grad is not None or (grads and p in grads)]
            )
            self._refuse_unready_capture(stepped)
            self._captured = True
        return capturing

    def _refuse_unready_capture(self, stepped: list[Tensor] | None = None) -> None:
        """ConfigError, before any change, for a captured step that would have to read a device
        value on the host or copy from the host: a parameter's first step allocates its state
        and uploads its tables (torch refused the pageable copy with a RuntimeError that did
        not say why), and a GPU tensor lr (or initial_lr, or weight_decay) on another device than
        its group's parameters is read with a synchronising ``.item()`` (the capture failed with
        ``cudaErrorStreamCaptureInvalidated``). One on their device is read by the kernel.
        ``stepped``: the parameters with a gradient that the step takes (None: every parameter
        whose ``.grad`` is set)."""
        first = (
            [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            if stepped is None
            else stepped
        )
        for p in first:
            if p not in self.state:
                raise ConfigError(
                    f"{self._param_label(p)} takes its first step inside a CUDA graph "
                    "capture: a first step allocates the state and copies tables from the "
                    "host, which a capture cannot hold. Take one eager step (with the "
                    "gradient buffers the graph will use) before capturing"
                )
        for gi, group in enumerate(self.param_groups):
            devices = {p.device for p in group["params"]}
            lr, initial = group["lr"], group.get("initial_lr")
            read = (
                ("lr", lr),
                ("initial_lr", initial if group["decouple_lr"] else None),
                ("weight_decay", group["weight_decay"]),
            )
            if _on_a_gpu(initial) and group["decouple_lr"] and not _on_a_gpu(lr):
                raise ConfigError(
                    f"param group {gi}: initial_lr is a tensor on {initial.device} but lr is "
                    "not: the kernel reads initial_lr on the device only beside a tensor lr "
                    "there, and a captured step cannot read it on the host; give both as "
                    "tensors on the parameters' device, or initial_lr as a float"
                )
            for key, v in read:
                if _on_a_gpu(v) and devices - {v.device}:
                    raise ConfigError(
                        f"param group {gi}: {key} is a tensor on {v.device} and parameters are "
                        f"on {sorted(map(str, devices - {v.device}))}: a captured step would "
                        "read it on the host (a synchronisation a CUDA graph capture cannot "
                        "hold); keep it on the parameters' device (the kernel reads it there "
                        "at every replay), or give a float or a CPU tensor (its value at "
                        "capture is the one the graph replays)"
                    )

    # ---------------------------------------------------------------------- the cached step
    def _resolved_for(self, group: Mapping[str, Any]) -> tuple:
        """What a cached step's resolved works depend on in ``group`` besides the per-step
        scalars: the state formats and the kernel variants a prepared launch fixed (Triton's
        SGD keeps a momentum buffer or not)."""
        return (
            group["master"],
            group["moments"],
            group["stochastic_rounding"],
            group["maximize"],
            group["momentum"] != 0,
        )

    def _resolution_keys(self) -> tuple:
        """Everything a cached step was resolved for besides addresses (the backend choice,
        each group's :meth:`_resolved_for`)."""
        return (backends.forced_backend(self.backend), *map(self._resolved_for, self.param_groups))

    def _update_and_cache(self, key: Any) -> None:
        """An ordinary update of every parameter with a gradient, its works then cached under
        ``key`` when they can be replayed (memopt_apexw keeps one per mode)."""
        works = self._update(None)
        stepped = {id(p) for _, work in works for p in work.param_owners}
        for k, other in list(self._cached_steps.items()):
            # another mode's cached step whose works this step split (a parameter without a
            # gradient now kept its count while its work's others advanced) would replay them
            # at the first one's step count
            if k != key and other.splits(stepped):
                del self._cached_steps[k]
        if self._cache_wait:  # gradients kept moving: caching would only cost
            self._cache_wait -= 1
            return
        cached = self._build_cached(works)
        if cached is not None:
            cached.drop_grads()
            for k, other in list(self._cached_steps.items()):
                if k != key and cached.splits(other.participants):  # its replays would split ours
                    del self._cached_steps[k]
            self._cached_steps[key] = cached

    def _build_cached(self, works: list[tuple[Any, backends.GroupStep]]) -> CachedStep | None:
        """The cached step of ``works`` (their gradients still attached), or None for sharded
        (FSDP2) parameters, whose gradients arrive in new buffers every step. A state group whose
        parameters are at several step counts has one work per count; replays advance each
        work's counters together, so the grouping holds while the gradients' addresses do."""
        entries: list[CachedEntry] = []
        by_plan = {id(e.plan): e for gp in self._plans.values() for e in gp.entries}
        for backend, work in works:
            entry = by_plan[id(work.plan)]
            if entry.sharded:
                return None
            if any(_is_zero_grad(p) for p in work.param_owners):
                return None  # the ordinary step handed zeros in its place (_update); a replay
                # would hand the kernels the gradient itself, which has no memory
            gi = work.plan.group_index
            params, owners = self.param_groups[gi]["params"], work.param_owners
            positions = None
            if len(owners) != len(params) or not all(map(operator.is_, owners, params)):
                where = {id(p): i for i, p in enumerate(params)}
                positions = tuple(where[id(p)] for p in owners)
            entries.append(CachedEntry(gi, backend, work, entry, positions))
        return CachedStep(entries, self.param_groups, self._resolution_keys())

    def _device_counted_step(self, amp: tuple[Tensor | None, Tensor | None]) -> None:
        """An eager step whose counters live on the device: ``capturable=True`` outside a CUDA
        graph capture, or a GradScaler's step (``amp``: its scale and found-inf flag, or
        Nones) without it. Where every work ran on the device, the works are cached and
        replayed at the next such step while the tensors and the counters (on the device) stay
        where they are, as :meth:`_replay` does for host steps. Without ``capturable`` the other
        backends read the scaler's flag on the host, uncached.

        A capturable cached step follows gradients that moved by preparing its launches again
        (:attr:`CachedStep.follow_by_prepare`), which caches their tables as an ordinary step
        does: a capture after one eager step with the graph's buffers then copies nothing."""
        if self._replay(_DEVICE_KEY, amp):
            return
        # the step counts move to the device: a cached host step would read them there
        self._drop_cached_steps()
        works = self._update(None, amp=amp)
        if not works or any(w.device_step is None for _, w in works):
            return  # unscaled on the host, or skipped there
        cached = self._build_cached(works)
        if cached is not None:
            cached.follow_by_prepare = self._capturable
            cached.drop_grads()
            self._cached_steps[_DEVICE_KEY] = cached

    def _replay(self, key: Any, amp: tuple[Tensor | None, Tensor | None] | None = None) -> bool:
        """Replay the step cached under ``key`` if it is still valid (True); else drop it.
        ``amp``: for the device step :meth:`_device_counted_step` cached, a GradScaler's
        (scale, found_inf) or Nones (a capturable step without a scaler), valid while its
        counters are still on the device (a host step in between moves them back); its
        DeviceSteps are built again from the groups' current lr, weight decay and betas, and
        each work keeps its prepared launch."""
        cached = self._cached_steps.get(key)
        if cached is None:
            return False
        if self._state_written():  # the ordinary step adopts what was written (and drops these)
            return False
        # a device step is cached only where every work has a DeviceStep (_device_counted_step)
        if amp is not None and any(
            e.counters.steps is not cast(backends.DeviceStep, e.work.device_step).steps
            for e in cached.entries
        ):
            del self._cached_steps[key]
            return False
        grads = cached.current_grads(self.param_groups, self._resolution_keys())
        if grads is not None and amp is None and not cached.counts_even():
            grads = None  # a count edited in place: the ordinary step splits the works by count
        if grads is None:
            del self._cached_steps[key]
            if cached.replays == 0 and amp is None:  # back off exponentially, up to 31 steps
                self._cache_futile = min(self._cache_futile + 1, 5)
                self._cache_wait = 2**self._cache_futile - 1
            return False
        self._check_before_update(None)
        cached.hand_grads(grads)
        try:
            # every check first (a refused replay changes nothing, as a refused ordinary step;
            # an initial_lr recorded by _scalars is taken back), then the conversions
            checked = self._atomically(self._check_replay, key, cached, amp)
            for gi, todo in checked.items():
                if todo:
                    self._sync_decay_norm(gi)
            try:
                self._launch_cached(cached)
            except BaseException:
                self._cached_steps.pop(key, None)  # as for a failed preparation (below)
                raise
            cached.replays += 1
            if amp is None:
                self._cache_futile = 0
        finally:
            cached.drop_grads()
        return True

    def _check_replay(
        self,
        key: Any,
        cached: CachedStep,
        amp: tuple[Tensor | None, Tensor | None] | None,
    ) -> dict[int, int]:
        """:meth:`_replay`'s checks, with each work's scalars (or device step) set and its
        launch prepared for the gradients it holds; returns the param groups stepped, with what
        their :meth:`_sync_decay_norm` has to do (:meth:`_check_sync`)."""
        checked: dict[int, int] = {}
        for e in cached.entries:
            group = self.param_groups[e.group_index]
            if e.group_index not in checked:
                self._check_group(group, f"(param group {e.group_index})")
                checked[e.group_index] = self._check_sync(e.group_index)
            work = e.work
            if amp is None:
                work.step = e.last_step + 1
                work.first_step = work.step == 1
                work.scalars = self._scalars(group, work.step)
            else:  # counters unchanged (checked above, no state written): no view check
                work.scalars, work.device_step = self._device_step(
                    e.group_index, e.counters, None, amp
                )
            work.seed = self.seed
        if self.check_numerics:
            self._check_finite([(e.backend, e.work) for e in cached.entries])
        try:
            if not cached.prepared:
                cached.prepare()
            else:
                cached.follow_grads()
            if self._undo or 2 in checked.values():
                # the works without a prepared launch are validated as they launch, after what
                # is written before (moments converted, an initial_lr recorded): checked here
                backends.check_works(
                    [(e.backend, e.work) for e in cached.entries if e.prepared is None]
                )
        except BaseException:
            # a launch prepared again for these gradients may be what failed: replaying it
            # would fail the same way until the gradients move, so the next step starts over
            self._cached_steps.pop(key, None)  # the failed launch may have dropped it
            raise
        return checked

    def _launch_cached(self, cached: CachedStep) -> None:
        """Run every work of ``cached`` (scalars, step and gradients set) and count the step
        (a device step counts itself)."""
        # a prepared launch was validated when it was prepared; the others validate in step()
        backends.check_works(
            [(e.backend, e.work) for e in cached.entries[1:] if e.prepared is None]
        )
        entries = cached.entries

        def launch(i: int) -> None:
            e = entries[i]
            work = e.work
            if e.prepared is None:
                e.backend.step(work)
            elif work.device_step is not None:
                e.prepared.launch_device(work)
            else:
                e.prepared.launch(work.scalars, work.step, work.seed, work.first_step)

        def ran(i: int) -> None:
            e = entries[i]
            backends.mark_written(e.work.param_owners)
            if e.work.device_step is None:
                self._count_step(e.counters, e.work)

        works = [(e.backend, e.work) for e in entries]
        _run_works(works, [e.prepared for e in entries], launch, ran)
        self._check_step_limit(e.work for e in entries if e.work.device_step is None)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # torch.amp.GradScaler.step asks this: when True it does not unscale or skip the step
        # itself (so it does not synchronise), but sets self.grad_scale / self.found_inf
        # (device tensors) for step() to use, as for torch's fused AdamW. Not with
        # check_numerics, which would refuse the infinite gradients of a step the scaler skips.
        return self._capturable or not self.check_numerics

    @run_eagerly
    def step_parameters(
        self,
        params: Iterable[Tensor],
        *,
        grads: Mapping[Tensor, Tensor] | None = None,
        staging: Mapping[Tensor, Tensor] | None = None,
        found_inf: Tensor | None = None,
    ) -> None:
        """Update only ``params`` (those with a gradient), e.g. from a gradient-release hook.

        ``grads``: ``{parameter: gradient}`` used instead of ``parameter.grad`` where given
        (torch cannot store a bfloat16 gradient as the ``.grad`` of a float32 tensor;
        memopt-offload passes its host gradient buffers this way).
        ``staging``: ``{parameter: tensor}`` for float32/bfloat16 parameters: a contiguous
        bfloat16 tensor of the parameter's size and device that receives the updated weights
        rounded to nearest-even bf16 (fused into the update by the cpu backend; a copy after the
        update elsewhere). memopt-offload uses it for the copy it sends back to the GPU.
        ``found_inf``: a one-element float32 tensor; nonzero skips the update (parameters,
        state and step counts unchanged), as a GradScaler's flag skips :meth:`step` (gradient
        release with a GradScaler uses it). Read on the device, without a host
        synchronisation, where every parameter's backend runs device steps (Triton: CUDA
        tensors; their step counts then live on the device); else read on the host."""
        self._refuse_inference_mode("step_parameters")
        if isinstance(params, Tensor):
            params = [params]
        params = list(params)
        if grads is not None and not isinstance(grads, Mapping):
            raise ConfigError(
                f"grads must be a {{parameter: gradient}} mapping, got {type(grads).__name__}"
            )
        stepped = {id(p) for p in params} if grads or staging is not None else set()
        if grads:
            for p, g in grads.items():
                if not isinstance(p, Tensor):
                    raise ConfigError(
                        f"grads is keyed by the parameters being stepped, got a key {p!r}"
                    )
                if not isinstance(g, Tensor):  # it failed deep in the step (no _is_zerotensor)
                    raise ConfigError(
                        f"grads[{self._param_label(p)}] must be a tensor (the gradient), got "
                        f"{type(g).__name__}"
                    )
                if id(p) not in stepped:  # its gradient would be dropped without a word
                    raise ConfigError(
                        f"grads names {self._param_label(p)}, which is not among the parameters "
                        "being stepped: pass it in params too, or leave its gradient out"
                    )
        if staging is not None:  # once the gradients are known to be tensors
            self._check_staging(stepped, staging)
            self._check_staging_apart(params, staging, grads)
        if found_inf is not None and (
            not isinstance(found_inf, Tensor)
            or found_inf.numel() != 1
            or found_inf.dtype != torch.float32
        ):
            got = (
                f"{found_inf.dtype}{tuple(found_inf.shape)}"
                if isinstance(found_inf, Tensor)
                else type(found_inf).__name__
            )
            raise ConfigError(f"found_inf must be a one-element float32 tensor, got {got}")
        self._refuse_invalid_capture("step_parameters", params, grads)
        amp = None if found_inf is None else (None, found_inf)
        self._drop_cached_steps()  # some counters advance: the cached step counts would differ
        with torch.no_grad():
            self._update(params, staging, grads, amp=amp)
        # torch's LR schedulers warn at their first step() unless the optimizer's step() ran
        # (they wrap it to set this flag): this is a step too, gradient release's instead of it
        self._opt_called = True

    def _check_staging(self, stepped: set[int], staging: Mapping[Tensor, Tensor]) -> None:
        """Each entry of ``staging`` (keyed by parameters whose ids are in ``stepped``)."""
        if not isinstance(staging, Mapping):
            raise ConfigError(
                f"staging must be a {{parameter: bf16 tensor}} mapping, got {type(staging).__name__}"
            )
        for p, st in staging.items():
            if not isinstance(p, Tensor):  # its label failed deep in the check
                raise ConfigError(
                    f"staging is keyed by the parameters being stepped, got a key {p!r}"
                )
            if id(p) not in stepped:
                raise ConfigError(
                    f"staging names {self._param_label(p)}, which is not among the parameters "
                    "being stepped"
                )
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise ConfigError(
                    f"staging of {self._param_label(p)}: bf16 copies are for float32 and bfloat16 "
                    "parameters"
                )
            if (
                not isinstance(st, Tensor)
                or st.dtype != torch.bfloat16
                or st.numel() != p.numel()
                or st.device != p.device
                or not st.is_contiguous()
            ):
                got = (
                    f"{st.dtype}, {st.numel()} elements on {st.device}"
                    + ("" if st.is_contiguous() else ", not contiguous")
                    if isinstance(st, Tensor)
                    else type(st).__name__
                )
                raise ConfigError(
                    f"staging of {self._param_label(p)} must be a contiguous bfloat16 tensor of "
                    f"{p.numel()} elements on {p.device}, got {got}"
                )

    def _check_staging_apart(
        self, params: list[Tensor], staging: Mapping[Tensor, Tensor], grads: Any
    ) -> None:
        """ConfigError when a staging buffer shares memory with another, with a gradient of the
        call or with a parameter this optimizer holds: its copy overwrote them (the torch and
        Triton backends copy after the update; the cpu backend refused only its call's
        tensors). The held parameters' byte ranges are cached per param lists, so a call costs
        binary searches over them (memopt-offload's per-bucket path); a cached range says no
        more than "maybe" (a parameter moved by ``p.data = ...``): the exact check then decides,
        on the current addresses. A parameter moved onto a staging buffer's memory (made a view
        of it) after the ranges were cached is not seen until the param lists change."""
        named = [
            (st, functools.partial(self._staging_label, p))
            for p, st in staging.items()
            if st.numel()
        ]
        if not named:
            return
        given = grads if isinstance(grads, Mapping) else {}
        read = [(p, g) for p, g in given.items()]
        read += [(p, p.grad) for p in params if p not in given and isinstance(p.grad, Tensor)]
        check_aliasing(
            named,
            [(g, functools.partial(self._grad_label, p)) for p, g in read if addressable(g)],
        )
        # per group, not per parameter: the check runs once per offload bucket, and a key of
        # every parameter cost O(parameters) each time (a list edited in place to the same
        # length is seen at the next rebuild of the cache, as a moved parameter is)
        key = tuple((id(g["params"]), len(g["params"])) for g in self.param_groups)
        if self._held_extents is None or self._held_extents[0] != key:
            held = [p for group in self.param_groups for p in group["params"]]
            self._held_extents = (key, sorted_extents([p for p in held if addressable(p)]))
        sts = [st for st, _ in named]
        if clear_of(
            self._held_extents[1], [st.data_ptr() for st in sts], [st.nbytes for st in sts]
        ):
            return
        self._held_extents = None  # maybe stale: rebuilt at the next call
        check_aliasing(
            named,
            [(p, what) for p, what in labelled_parameters(self.param_groups) if addressable(p)],
        )

    def _staging_label(self, p: Tensor) -> str:
        return f"staging of {self._param_label(p)}"

    def _grad_label(self, p: Tensor) -> str:
        return f"the gradient of {self._param_label(p)}"

    # ---------------------------------------------------------------------------- state dicts
    def state_dict(self) -> dict[str, Any]:
        """torch's format (``state`` by parameter index, ``param_groups``) with memopt's named
        state keys, plus ``memopt``: rule, seed, version, at the top level and a copy of it in
        every saved param group (torch's ``get_state_dict`` / ``set_state_dict`` keep only
        ``state`` and ``param_groups``; :mod:`memopt_core.state_dict_meta`; the live
        ``param_groups`` do not hold it). State tensors are views of the arenas
        (live references, as in torch; ``torch.save`` stores each arena once; take a
        ``copy.deepcopy`` for a snapshot in memory).

        The states of a sharded (FSDP2) parameter are DTensors sharded like it, in the layout
        :mod:`memopt_core.sharding` describes, so ``torch.distributed.checkpoint`` can load them
        into another sharding; per-element states and the blocked fields of parameters whose rows
        hold whole blocks alias the arenas, live like a plain parameter's views (each over a
        storage of its own bytes, which ``torch.save`` stores and ``copy.deepcopy`` copies).

        Each entry also holds ``"param_shape"``: its parameter's shape (a sharded parameter's
        global shape) as a new int64 CPU tensor, which :meth:`load_state_dict` checks (flat
        blocked moments and an fp32 master's missing code do not show which parameter they
        belong to). A tensor, not a tuple, because ``dcp.load`` fills tensors in place but puts
        the non-tensor values of ``state``'s int-keyed entries under new string keys."""
        return finished_state_dict(self, self._full_state_dict)

    def _full_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` before its post-hooks (they run on this finished dict)."""
        sd = self._sharded_state_dict(self._local_state_dict())
        state = sd["state"]
        records = self._norm_step_records()
        for group, saved in zip(self.param_groups, sd["param_groups"], strict=True):
            for p, key in zip(group["params"], saved["params"], strict=True):
                if key in state:
                    # a new entry: torch's state_dict() hands out the live self.state[p] dicts
                    shape = torch.tensor(tuple(p.shape), dtype=torch.int64, device="cpu")
                    state[key] = {**state[key], _PARAM_SHAPE: shape}
                    record = records.get(id(p))
                    # encoded second moments only (memopt-ecc's decoded ones are v, any count's)
                    if record is not None and record[1] <= state[key].keys():
                        state[key][_NORM_STEP_KEY] = record[0]
        return add_group_meta(sd)  # last: with what subclasses add (memopt-ecc's compressed)

    def _norm_step_records(self, edited: bool = False) -> dict[int, tuple[Tensor, set[str]]]:
        """``{id(parameter): (its count record, its second moment's field keys)}`` for
        :meth:`state_dict`'s ``decay_norm_step`` entries: the parameters whose q8/fp8 second
        moments are held by a plan (the record is a view of its counters' second row, which
        the steps advance with the counts, so a dict held across steps stays consistent).
        ``edited``: only those of plan entries whose counts changed since the optimizer last
        wrote or checked them (edited in place: :meth:`_sync_step_edits`)."""
        out: dict[int, tuple[Tensor, set[str]]] = {}
        for gp in self._plans.values():
            for entry in gp.entries:
                norm, steps = entry.norm_steps, entry.steps
                if norm is None or (
                    edited and steps is not None and steps._version == entry.counts_version
                ):
                    continue
                for si, (p, mine, held) in enumerate(
                    zip(entry.owners, entry.states, entry.held, strict=True)
                ):
                    keys = {k for k in held if k.startswith("exp_avg_sq")}
                    if self.state.get(p) is mine and all(mine.get(k) is held[k] for k in keys):
                        out[id(p)] = (norm[si], keys)
        return out

    def check_param_groups(self) -> None:
        """:class:`ConfigError` naming the first param group whose hyperparameters the next step
        would refuse (a hand edit of ``param_groups``: ``lr=-1``, ``betas=(0.9, 1.0)``, an
        unknown format). For code that hands the groups on without stepping
        (``memopt_checkpoint.to_torch_state_dict``). Returns None."""
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, f"(param group {gi})")

    def settle_state(self) -> None:
        """Convert now what the next step would before reading ``self.state``: the q8/fp8
        second moments of a group whose beta2 changed, or of a step count edited by hand, as
        :meth:`state_dict` does. States written from outside are adopted (normalized with their
        group's beta2) and copied into arenas at the next rebuild (the next step,
        :meth:`init_state`), which converts a written entry's moments from its
        ``decay_norm_step`` record. For code that reads ``self.state`` directly
        (``memopt_checkpoint.to_torch_state_dict``); a group whose hyperparameters the next
        step would refuse is left as it is. Returns None."""
        # a beta2 changed since a group's last step: its second moments convert now, as the
        # next step would, so that a state dict's follow its param groups' beta2 even where its
        # record is lost (torch's flatten_optimizer_state_dict, ZeroRedundancyOptimizer). States
        # written from outside are adopted first (_adopt_state_writes: their group's beta2)
        self._adopt_state_writes()
        for gi, group in enumerate(self.param_groups):
            try:
                self._check_group(group, f"(param group {gi})")
            except ConfigError:
                continue  # the next step refuses the group; its record says what it holds
            self._sync_decay_norm(gi)

    def _local_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` with every state in the arena's local layout and no
        ``param_shape`` yet (extension point: memopt-ecc decodes moments here)."""
        self.settle_state()
        sd = super().state_dict()
        sd[META_KEY] = {
            "rule": self.rule,
            "seed": self.seed,
            "version": _STATE_DICT_VERSION,
            _NORM_KEY: [self._normalizing_beta2(gi) for gi in range(len(self.param_groups))],
        }
        return sd

    def _blocked_keys(self, group: Mapping[str, Any], p: Tensor) -> dict[str, tuple]:
        """``{state key: (codec, field suffix)}`` of the blocked moment fields ``p`` may hold."""
        spec = self._spec(group, p.dtype)
        out: dict[str, tuple] = {}
        for name in self._allowed_names():
            codec = self._codec_of(name, spec)
            if codec.block_size > 1:
                for suffix in codec.fields:
                    out[state_key(name, suffix)] = (codec, suffix)
        return out

    def _sharded_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        state = sd["state"]
        for group, saved in zip(self.param_groups, sd["param_groups"], strict=True):
            for p, key in zip(group["params"], saved["params"], strict=True):
                if is_dtensor(p) and key in state:
                    state[key] = global_state(p, state[key], self._blocked_keys(group, p))
        return sd

    def _localized(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with the DTensor states of sharded parameters in local layout (the
        inverse of :meth:`_sharded_state_dict`; malformed dicts pass through for the checks).
        StateDictError for a DTensor state of a plain parameter."""
        saved_groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if (
            not isinstance(saved_groups, (list, tuple))
            or not isinstance(state, Mapping)
            or len(saved_groups) != len(self.param_groups)
        ):
            return state_dict
        state = dict(state)
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            keys = saved.get("params", ()) if isinstance(saved, Mapping) else ()
            if len(keys) != len(group["params"]):
                continue
            spec = self._spec(group, torch.float32)
            codecs = {n: self._codec_of(n, spec) for n in self._allowed_names()}
            for p, key in zip(group["params"], keys, strict=True):
                entry = state.get(key)
                if not isinstance(entry, Mapping):
                    continue
                label = f"parameter index {key!r} (param group {gi})"
                if is_dtensor(p):
                    state[key] = local_state(p, entry, codecs, label)
                    continue
                sharded = next((k for k, v in entry.items() if is_dtensor(v)), None)
                if sharded is not None:
                    # its global shape may fit the plain parameter: the copies would then fail
                    # inside torch, after the states before it were written
                    raise StateDictError(
                        f"state {sharded!r} of {label} is a DTensor: the dict was saved by a "
                        "sharded optimizer (FSDP2), and this parameter is not sharded. Load the "
                        "checkpoint through torch.distributed.checkpoint (dcp.load into this "
                        "optimizer's own state_dict(), then load_state_dict), which gathers the "
                        "shards, or into the sharding it was saved from"
                    )
        return dict(state_dict, state=state)

    def _prepare_loaded(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Extension point of :meth:`load_state_dict`, called on the localized dict before the
        checks (memopt-ecc encodes decoded moments here). Here: a decoded dict of a
        memopt-ecc optimizer (``compressed`` False in its ``memopt`` entry) is refused, naming
        what reads it (its missing code fields were named one by one)."""
        meta = saved_meta(state_dict)
        if isinstance(meta, Mapping) and meta.get("compressed") is False:
            raise StateDictError(
                "this state dict holds decoded moments (a memopt_ecc optimizer's, saved with "
                f"compress_state_dict=False); {type(self).__name__} reads only encoded ones: "
                "load it into that memopt_ecc class (FlashAdamW, ...), which encodes them, or "
                "save it with compress_state_dict=True"
            )
        return state_dict

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`, validating everything before changing anything.

        States keep their formats and dtypes (never cast to the parameter dtype); saved param
        groups' hyperparameters replace the current ones, but their formats (``master``,
        ``moments``) must match. Mismatches raise :class:`StateDictError` naming the parameter.

        Blocked moments (q8, fp8) are flat and padded to whole blocks and an fp32 master keeps
        no code, so their tensors alone fit any parameter with the same padded number of
        elements (a (60,) and a (64,), an MLP's (4096, 1024) and (1024, 4096)). Each entry's
        ``"param_shape"`` (written by :meth:`state_dict`: a 1-D integer tensor, a sharded
        parameter's global shape; a tuple or list of ints is taken too) must therefore equal
        the shape of the parameter it is loaded into, else :class:`StateDictError` names the
        parameter index and both shapes: the state belongs to another parameter (parameters
        reordered, a model changed). Entries without it (state dicts of older versions) load
        as before, unchecked. The key is not kept in the optimizer's state.

        The ``memopt`` entry (rule, seed, version) is read from the top level, else from the
        param groups (where torch's ``set_state_dict`` hands it over; every group must hold the
        same one), and never enters the live ``param_groups``. A dict with neither (one of an
        older memopt through torch's helpers) loads with this optimizer's seed, its rule
        unchecked.
        """
        if not isinstance(state_dict, Mapping):
            raise StateDictError(
                f"expected a state dict (a mapping), got {type(state_dict).__name__}"
            )
        loaded = run_load_pre_hooks(self, dict(state_dict))
        check_saved_param_lists(loaded, each_once=False)  # repeats: with the groups, below
        self._check_param_shapes(loaded)  # first: before any layout conversion complains
        state_dict = self._prepare_loaded(self._localized(loaded))
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise StateDictError(
                    f"the state dict lacks {key!r}; pass the dict MemOptimizer.state_dict() returns"
                )
        meta = saved_meta(state_dict)
        seed = self._checked_meta(meta)
        saved_groups = state_dict["param_groups"]
        if not isinstance(saved_groups, (list, tuple)):
            raise StateDictError("the state dict's 'param_groups' must be a list")
        if len(saved_groups) != len(self.param_groups):
            raise StateDictError(
                f"the state dict has {len(saved_groups)} param group(s), this optimizer has "
                f"{len(self.param_groups)}"
            )
        norm_beta2 = self._checked_norm_meta(meta, saved_groups)
        merged_groups: list[dict[str, Any]] = []
        id_map: dict[Any, tuple[int, Tensor]] = {}
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if not isinstance(saved, Mapping) or "params" not in saved:
                raise StateDictError(
                    f"param group {gi} of the state dict is not a param group dict"
                )
            if len(saved["params"]) != len(group["params"]):
                raise StateDictError(
                    f"param group {gi} of the state dict has {len(saved['params'])} parameters, "
                    f"this optimizer's has {len(group['params'])}"
                )
            missing = [k for k in _HYPER if k not in saved]
            if missing:
                raise StateDictError(
                    f"param group {gi} of the state dict lacks {missing}: it was not saved by a "
                    "memopt optimizer (a torch optimizer's converts with "
                    "memopt_checkpoint.load_torch_state_dict)"
                )
            # float32 parameters keep an fp32 master whatever the group's says: a group of
            # only those stores the same states under any master
            master_unused = all(local_shard(p).dtype == torch.float32 for p in group["params"])
            # moments convert through torch's AdamW layout (memopt_checkpoint's interop); a
            # master's bits below the parameter's do not survive that, so say how to keep them
            how = {
                "master": "or convert through memopt_checkpoint.to_torch_state_dict and "
                "load_torch_state_dict, which keep the moments but not the master's bits below "
                "the parameter's: carry those over with memopt_ecc.get_fp32_model_state_dict "
                "before and set_fp32_model_state_dict after",
                "moments": "or convert the moments with memopt_checkpoint.to_torch_state_dict "
                "and load_torch_state_dict",
            }
            for k in ("master", "moments"):
                if saved[k] != group[k] and not (k == "master" and master_unused):
                    raise StateDictError(
                        f"param group {gi} of the state dict holds {k}={saved[k]!r} states; this "
                        f"optimizer uses {k}={group[k]!r}: build the optimizer with the same "
                        f"format ({how[k]})"
                    )
            # the memopt entry describes the dict, not the group: never a live group's key
            merged = without_meta({k: v for k, v in group.items() if k != "params"})
            merged.update({k: deepcopy(v) for k, v in without_meta(saved).items() if k != "params"})
            merged["master"] = group["master"]  # the same, or unused (above)
            if isinstance(merged.get("betas"), list):
                merged["betas"] = tuple(merged["betas"])
            try:
                merged["betas"] = self._check_group(merged, f"(param group {gi} of the state dict)")
            except ConfigError as e:
                raise StateDictError(str(e)) from None
            merged["params"] = group["params"]
            merged_groups.append(merged)
            for key, p in zip(saved["params"], group["params"], strict=True):
                if key in id_map:
                    raise StateDictError(f"parameter index {key!r} appears twice in the state dict")
                id_map[key] = (gi, p)
        saved_state = state_dict["state"]
        if not isinstance(saved_state, Mapping):
            raise StateDictError("the state dict's 'state' must be a dict")
        new_state: dict[Tensor, dict[str, Any]] = {}
        for key, entry in saved_state.items():
            if key not in id_map:
                raise StateDictError(
                    f"the state dict holds state for parameter index {key!r}, which none of its "
                    "param groups lists"
                )
            gi, p = id_map[key]
            new_state[p] = self._validated_state(
                p, gi, key, merged_groups[gi], entry, norm_beta2[gi]
            )
        # everything is valid: commit
        for group, merged in zip(self.param_groups, merged_groups, strict=True):
            group.clear()
            group.update(merged)
            self._record_formats(group)  # the states loaded are checked in its format
        self.state = TrackedState(self._writes)
        for p, entry in new_state.items():
            self.state[p] = entry
        self.seed = seed
        self._norm_beta2 = norm_beta2
        self._reset_plans()
        if new_state:
            # under gradient release every trainable parameter's state, as enabling it made
            # (else the first backward's hooks would allocate it)
            self._ensure_plans(trainable=self.gradient_release_active)
        run_load_post_hooks(self)
        if getattr(self, "_captured", False):  # absent in an optimizer pickled before
            self._captured = False
            warnings.warn(
                f"{type(self).__name__}.load_state_dict() after a CUDA graph captured its step: "
                "the loaded state lives in new memory, and that graph replays the old addresses "
                "(freed now: a replay would read and write freed memory). Take one eager step "
                "and capture the step again before replaying",
                RuntimeWarning,
                stacklevel=2,
            )

    def _checked_meta(self, meta: Any, what: str = "the state dict") -> int:
        """The seed to run with after loading a dict whose ``memopt`` entry is ``meta`` (None:
        none, this optimizer's seed), once its version, rule and seed are checked
        (:class:`StateDictError`; ``what`` names the dict in the messages). Keys it lacks are
        not checked."""
        if meta is None:
            return self.seed
        if not isinstance(meta, Mapping):
            raise StateDictError(f"{what}'s 'memopt' entry must be a dict")
        version = meta.get("version", _STATE_DICT_VERSION)
        if (
            isinstance(version, bool)
            or not isinstance(version, int)
            or not 1 <= version <= _STATE_DICT_VERSION
        ):
            raise StateDictError(
                f"{what} has version {version!r}; this memopt reads versions 1 to "
                f"{_STATE_DICT_VERSION} (a newer memopt wrote it?)"
            )
        if meta.get("rule", self.rule) != self.rule:
            raise StateDictError(
                f"{what} was saved by a {meta['rule']!r} optimizer; this one runs {self.rule!r}"
            )
        seed = meta.get("seed", self.seed)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise StateDictError(f"{what}'s seed must be an int in [0, 2**64), got {seed!r}")
        return seed

    def _checked_norm_meta(self, meta: Any, saved_groups: Any) -> dict[int, float]:
        """The normalizing beta2 of each group after loading a dict whose ``memopt`` entry is
        ``meta`` (checked by :meth:`_checked_meta`) and whose param groups are
        ``saved_groups``: its ``decay_norm_beta2`` list (None: 0.0); 0.0 for every group of a
        version-1 dict. 0.0 means the second moments are ``v`` itself (``decay_norm`` 1.0),
        normalized at the next step. A dict without the list (torch's
        ``flatten_optimizer_state_dict=True`` drops the whole entry) is taken as this
        version's format, its moments normalized with each saved group's beta2, which
        :meth:`state_dict` makes sure of."""
        saved = meta.get(_NORM_KEY) if isinstance(meta, Mapping) else None
        if saved is None:
            if isinstance(meta, Mapping) and meta.get("version") == 1:
                return dict.fromkeys(range(len(self.param_groups)), 0.0)
            return {gi: _group_beta2(saved_groups, gi) for gi in range(len(self.param_groups))}
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self.param_groups):
            raise StateDictError(
                f"the state dict's {_NORM_KEY!r} must list one beta2 (or None) per param group "
                f"({len(self.param_groups)}), got {saved!r}"
            )
        out: dict[int, float] = {}
        for gi, b in enumerate(saved):
            if b is None:  # saved as v itself (a group that was not normalized)
                out[gi] = 0.0
                continue
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
                raise StateDictError(
                    f"the state dict's {_NORM_KEY!r} of param group {gi} must be None or a "
                    f"beta2 in [0, 1), got {b!r}"
                )
            out[gi] = float(b)
        # The list is by the saved groups' order, and torch's set_state_dict hands the groups
        # back in the live optimizer's (matched by parameter names), each with a copy of the
        # whole list. state_dict() records each group's own beta2 (converting first where it
        # changed), so a list that holds exactly the values the groups say, in another order,
        # is such a reordering: each group's own value is the right one. A list that does not
        # (a group the last state_dict() could not convert) is read by position.
        own = {
            gi: _group_beta2(saved_groups, gi)
            if self._kind == "adam"
            and isinstance(saved_groups[gi], Mapping)
            and self._decay_normalized(saved_groups[gi])
            else 0.0
            for gi in out
        }
        return own if sorted(own.values()) == sorted(out.values()) else out

    @staticmethod
    def _master_code_mismatch(label: str, p: Tensor, master: str, missing: list[str]) -> str:
        """The message for a state whose ECC code is missing or unexpected: saved for a
        parameter of another dtype (a model cast with memopt-ecc's ``cast_model`` on one side
        only) or another master, which the generic lists of entries did not say."""
        if missing:
            return (
                f"the state of {label} lacks {_CODE_KEY!r}, the {master} code of this {p.dtype} "
                "parameter: it was saved for a parameter that keeps none (a float32 one, its "
                "own master, or master_weight_bits=None). For a model cast to bf16 since "
                "(memopt_ecc.cast_model), carry the weights over with set_fp32_model_state_dict "
                "and start the optimizer afresh; otherwise build it as the saved one was"
            )
        return (
            f"the state of {label} holds a {_CODE_KEY!r} (a bf16/fp16 parameter's ECC code), "
            f"but this parameter is {p.dtype} with master {master!r}, which keeps none: was the "
            "saved model cast (memopt_ecc.cast_model) and this one not, or built with another "
            "master_weight_bits? Prepare the model and optimizer as the saved ones were"
        )

    def _check_param_shapes(self, state_dict: Mapping[str, Any]) -> None:
        """Check every entry's ``param_shape`` against its parameter before anything converts
        the entries (malformed dicts pass: the other checks explain them)."""
        saved_groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if (
            not isinstance(saved_groups, (list, tuple))
            or not isinstance(state, Mapping)
            or len(saved_groups) != len(self.param_groups)
        ):
            return
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            keys = saved.get("params", ()) if isinstance(saved, Mapping) else ()
            if not isinstance(keys, (list, tuple)) or len(keys) != len(group["params"]):
                continue
            for p, key in zip(group["params"], keys, strict=True):
                try:
                    entry = state.get(key)
                except TypeError:  # an unhashable key: the other checks name it
                    continue
                if isinstance(entry, Mapping):
                    self._check_param_shape(p, gi, key, entry)

    @staticmethod
    def _check_param_shape(p: Tensor, gi: int, key: Any, entry: Mapping) -> None:
        """``entry``'s ``param_shape``, when it has one, must be ``p``'s shape (global for a
        sharded parameter): the state of another parameter may fit ``p``'s tensors."""
        if _PARAM_SHAPE not in entry:
            return  # a state dict of an older version
        saved = entry[_PARAM_SHAPE]
        label = f"parameter index {key!r} ({_describe_tensor(p)}, param group {gi})"
        if (
            isinstance(saved, Tensor)
            and saved.dim() == 1
            and not saved.is_floating_point()
            and not saved.is_complex()
            and saved.dtype != torch.bool
        ):
            saved = saved.tolist()
        if not isinstance(saved, (tuple, list)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in saved
        ):
            raise StateDictError(
                f"{_PARAM_SHAPE!r} of {label} must be the parameter's shape (a 1-D integer "
                f"tensor, or a tuple of ints >= 0), got {saved!r}"
            )
        if tuple(saved) != tuple(p.shape):
            raise StateDictError(
                f"the state of {label} was saved for a parameter of shape {tuple(saved)}; this "
                f"parameter's shape is {tuple(p.shape)}: the state belongs to another parameter "
                "(were the parameters reordered, or the model changed, since it was saved?)"
            )

    def _validated_state(
        self, p: Tensor, gi: int, key: Any, group: Mapping, entry: Any, norm_beta2: float
    ) -> dict:
        """``entry`` (the saved state of ``p``, param group ``gi``, index ``key``) checked against
        ``group``'s format, as the state to load (:class:`StateDictError` naming what is wrong);
        ``norm_beta2``: the beta2 its second moments are normalized with (0.0: ``v`` itself)."""
        label = f"parameter index {key!r} ({_describe_tensor(p)}, param group {gi})"
        if not isinstance(entry, Mapping):
            raise StateDictError(f"the state of {label} must be a dict, got {type(entry).__name__}")
        owner, p = p, local_shard(p)  # a sharded parameter's state is its local shard's
        spec = self._spec(group, p.dtype)
        master = spec.master_for(p.dtype)
        padded = round_up(p.numel(), padding_unit(spec))
        # SGD's momentum buffer appears at the first step with momentum: one switched on after
        # a step has none until then, and a state saved in between loads without it (the
        # buffer starts at zero either way)
        needed = set(self._needed_names(group)) if self._kind != "sgd" else set()
        allowed = self._allowed_names()
        layout = {
            name: expected_layout({name: self._codec_of(name, spec)}, None, p.shape, padded)
            for name in allowed
        }
        expected: dict[str, tuple] = {}
        for name in allowed:
            present = [k for k in layout[name] if k in entry]
            if name in needed or present:
                expected.update(layout[name])
        expected.update(expected_layout({}, master, p.shape, padded))
        required = set(expected) | {"step"}
        missing = sorted(required - set(entry))
        unexpected_code = _CODE_KEY in entry and _CODE_KEY not in required
        if missing == [_CODE_KEY] or (unexpected_code and not missing):
            raise StateDictError(self._master_code_mismatch(label, p, master.name, missing))
        if missing:
            raise StateDictError(
                f"the state of {label} lacks {missing} (the format master={spec.master!r}, "
                f"moments={spec.moments!r} of rule {self.rule!r} stores {sorted(required)})"
            )
        extra = sorted(set(entry) - required - {_PARAM_SHAPE, _NORM_STEP_KEY}, key=str)
        foreign = [k for k in extra if k not in _MEMOPT_KEYS]
        extra = [k for k in extra if k in _MEMOPT_KEYS]
        if extra:
            raise StateDictError(
                f"the state of {label} has unexpected entries {extra} (the format "
                f"master={spec.master!r}, moments={spec.moments!r} of rule {self.rule!r} stores "
                f"{sorted(required)})"
            )
        out: dict[str, Any] = {"step": self._validated_step(entry["step"], label)}
        for k in foreign:  # the caller's entries, loaded as torch loads them
            v = entry[k]
            if isinstance(v, Tensor):
                v = v.to(device=p.device, dtype=p.dtype if p.is_floating_point() else v.dtype)
            out[k] = v
        for k, (shape, dtype) in expected.items():
            t = entry[k]
            if not isinstance(t, Tensor):
                raise StateDictError(
                    f"state {k!r} of {label} must be a tensor, got {type(t).__name__}"
                )
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                whole = (
                    " for this process's shard of the parameter. A larger state is a whole "
                    "tensor's (saved by one process?): it loads into a sharded optimizer through "
                    "torch.distributed.checkpoint (dcp.load into this optimizer's own "
                    "state_dict()), which reshards it"
                    if p is not owner and t.numel() > math.prod(shape)
                    else ""
                )
                raise StateDictError(
                    f"state {k!r} of {label} is {t.dtype} of shape {tuple(t.shape)}; the format "
                    f"master={spec.master!r}, moments={spec.moments!r} stores {dtype} of shape "
                    f"{tuple(shape)}{whole}"
                )
            if t.is_meta:  # no values to copy (torch raised NotImplementedError at the copy)
                raise StateDictError(
                    f"state {k!r} of {label} is on the meta device and holds no values (a state "
                    "dict built under a meta device context?)"
                )
            if k.endswith("_scale") and dtype == torch.uint8 and bool((t == 255).any()):
                # E8M0 block scales are 0..254: 255 decodes as an inf factor (inf and NaN)
                raise StateDictError(
                    f"state {k!r} of {label} holds the block scale byte 255, which no memopt "
                    "format writes (scales are 0..254): the state is corrupt or not memopt's"
                )
            if k == "exp_avg_sq" and t.is_floating_point():  # q8's codes are unsigned
                conversions.check_second_moment(t, f"state {k!r} of {label}")
            out[k] = t
        if _NORM_STEP_KEY in entry:
            self._convert_edited_count(out, entry[_NORM_STEP_KEY], group, norm_beta2, label)
        return out

    def _convert_edited_count(
        self, out: dict[str, Any], record: Any, group: Mapping, beta2: float, label: str
    ) -> None:
        """A state dict's q8/fp8 second moments in ``out`` are stored for the count in their
        ``decay_norm_step`` ``record``. Where the dict's ``step`` was edited since it was saved,
        copies of them are re-encoded for the new count, as an edit of the count in the
        optimizer is (:meth:`_sync_step_edits`): read against the new count's ``N``, ``v`` would
        be rescaled up to 256-fold, silently."""
        was = int(self._validated_step(record, label, _NORM_STEP_KEY).item())
        now = int(out["step"].item())
        if was == now or beta2 == 0.0 or not self._decay_normalized(group):
            return  # the same count; v itself (a version-1 dict); or another format's moments
        codec = moment_codec(MOMENT_PRESETS[group["moments"]][1])
        keys = [state_key("exp_avg_sq", sfx) for sfx in codec.fields]
        if self._kind != "adam" or not all(k in out for k in keys):
            return
        for k in keys:  # the caller's dict keeps its tensors
            out[k] = out[k].clone()
        self._renormalize(group, out, (beta2, was), (beta2, now), None)

    def _convert_written_count(
        self, p: Tensor, plan: GroupPlan, saved: Any, prev: Mapping[str, Any], state: ParamState
    ) -> None:
        """A state ``prev`` now copied into ``state`` (a rebuild), whose second moments are
        stored for the count ``saved`` (its ``decay_norm_step`` record: a state dict entry
        written into ``self.state`` from outside, as ZeroRedundancyOptimizer's load writes them;
        or its plan's record of a count edited in place since): they are converted to its
        ``step`` where they differ, as :meth:`load_state_dict` converts them."""
        record = conversions.saved_step_count(saved)
        if record is None:
            raise ConfigError(
                f"state[{_NORM_STEP_KEY!r}] of {self._param_label(p)} is "
                f"{saved!r}: the count its second moments are stored for is a "
                "whole number >= 0"
            )
        count = conversions.saved_step_count(state["step"])
        beta2 = self._normalizing_beta2(plan.group_index)
        if count is None or beta2 is None or record == count:
            return  # (a count that is none: refused where the counters are read, _check_counts)
        codec = self._codec_of("exp_avg_sq", plan.spec)
        if not all(state_key("exp_avg_sq", sfx) in prev for sfx in codec.fields):
            return  # moments not written: the new ones are zero, any count's
        group = self.param_groups[plan.group_index]
        self._renormalize(group, state, (beta2, record), (beta2, count), None)

    @staticmethod
    def _validated_step(step: Any, label: str, key: str = "step") -> Tensor:
        value = step
        if isinstance(value, Tensor):
            if value.numel() != 1 or value.is_complex() or value.is_meta:
                raise StateDictError(f"{key!r} of {label} must be a single number, got {value!r}")
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise StateDictError(f"{key!r} of {label} must be a number, got {step!r}")
        try:
            # counts are float32 tensors: 1e300 passed as finite and was stored as inf, which
            # every later step failed to convert
            whole = 0 <= float(value) <= _F32_MAX and value == int(value)
        except (OverflowError, ValueError):  # an int beyond float's range; NaN
            whole = False
        if not whole:
            raise StateDictError(
                f"{key!r} of {label} must be a whole number >= 0 that float32 holds, got {value}"
            )
        return _step_tensor(value)

    # ------------------------------------------------------------------------ pickle, deepcopy
    def __getstate__(self) -> dict[str, Any]:
        # an edited count's moments convert first, as state_dict() does: the copy's counters
        # are built from the counts it holds, with no record of the old ones (a changed beta2
        # needs nothing: the record of the one they are normalized with is pickled)
        self._sync_all_step_edits()
        # compact copies of the state (views would pickle whole arenas once per view)
        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        for p, s in self.state.items():
            state[p] = {k: (_Picklable(v) if isinstance(v, Tensor) else v) for k, v in s.items()}
        return {
            "defaults": self.defaults,
            "state": state,
            "param_groups": self.param_groups,
            "rule": self.rule,
            "seed": self.seed,
            "check_numerics": self.check_numerics,
            "backend": self.backend,
            "_capturable": self._capturable,
            "_norm_beta2": dict(self._norm_beta2),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("rule", "adamw")
        self.__dict__.setdefault("seed", 0)
        self.__dict__.setdefault("check_numerics", False)
        self.__dict__.setdefault("backend", None)
        self.__dict__.setdefault("_capturable", False)
        # pickled before the decay normalization: its 8-bit second moments are v itself
        self.__dict__.setdefault("_norm_beta2", dict.fromkeys(range(len(self.param_groups)), 0.0))
        self._reset_release()  # the hooks belong to the original
        self._in_step = False
        for st in self.state.values():  # a shallow copy.copy() gets the pickling wrappers
            for k, v in st.items():
                if isinstance(v, _Picklable):
                    st[k] = v.__reduce__()[0](*v.__reduce__()[1])
        self._writes = WriteCounter()
        self._writes_seen = 0
        self._norm_writes_seen = None
        self._warned_step_limit = False
        self._warned_rne = False
        self._initial_ids = None
        self.state = TrackedState(self._writes, self.state)
        self._reset_plans()
        self._group_formats = {}  # the groups' own: what they hold was saved with them
        for group in self.param_groups:
            self._record_formats(group)


def require_memopt_optimizer(optimizer: object) -> MemOptimizer:
    """``optimizer`` when it is a :class:`MemOptimizer`, else ``TypeError`` naming its type: the
    conversions of memopt-ecc and memopt-checkpoint read a memopt optimizer's state."""
    if not isinstance(optimizer, MemOptimizer):
        bridge = type(optimizer).__name__ == "AdamBridge"
        raise TypeError(
            "expected a memopt optimizer (memopt_core.MemOptimizer, a memopt_ecc Flash* or "
            f"memopt_apexw.ApexW), got {type(optimizer).__name__}"
            + (
                ": AdamBridge's state dict is its own, in torch's layout, and has no converter; "
                "save and load it with its state_dict() / load_state_dict() (or "
                "memopt_checkpoint.save / load)"
                if bridge
                else ""
            )
        )
    return optimizer


class _Picklable:
    """A compact copy of a state tensor for pickling (a view would pickle its whole arena once per
    view). torch 2.13's plain pickle cannot rebuild float8 tensors, so they travel as uint8."""

    def __init__(self, t: Tensor) -> None:
        self.t = t

    def __reduce__(self):
        t = self.t.detach()
        if t.dtype.itemsize == 1 and t.dtype.is_floating_point:
            return (_from_bytes, (t.clone().view(torch.uint8), str(t.dtype).removeprefix("torch.")))
        return (_identity, (t.clone(),))


def _identity(t: Tensor) -> Tensor:
    return t


def _from_bytes(t: Tensor, dtype: str) -> Tensor:
    return t.view(getattr(torch, dtype))


_F32_MAX = torch.finfo(torch.float32).max


def check_saved_param_lists(state_dict: Mapping[str, Any], *, each_once: bool = True) -> None:
    """StateDictError unless every saved param group's ``params`` is a list of parameter keys
    (None, a number or nested lists raised a bare TypeError in the conversions before the
    checks), each listed once over all groups (a load maps each key to the parameter at its
    position: a key listed twice gave one parameter another's state and left one without).
    For every loader of saved groups (this optimizer's, memopt-checkpoint's torch interop,
    memopt-offload's AdamBridge); ``each_once=False`` leaves the repeats to the caller (this
    optimizer's loader names a wrong number of groups first)."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, (list, tuple)):
        return  # the checks explain it
    listed: set[Hashable] = set()
    for gi, saved in enumerate(groups):
        if not isinstance(saved, Mapping) or "params" not in saved:
            continue  # likewise
        keys = saved["params"]
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, Hashable) for k in keys):
            raise StateDictError(
                f"param group {gi} of the state dict: 'params' must be a list of parameter "
                f"indices, got {reprlib.repr(keys)}"
            )
        for key in keys if each_once else ():
            if key in listed:
                raise StateDictError(f"parameter index {key!r} appears twice in the state dict")
            listed.add(key)


def _step_tensor(value: Any) -> Tensor:
    if isinstance(value, Tensor):
        value = value.item()
    return torch.tensor(float(value), dtype=torch.float32, device="cpu")
