"""Kernel backends: the registry, the ``KERNEL_API`` level and capability queries.

A backend performs one optimizer step over a group of tensors (:class:`GroupStep`). Core ships
the always-available pure-torch backend (``"torch"``, :mod:`memopt_core.torch_backend`); kernel
packages register theirs through the ``memopt.kernels`` entry-point group, e.g. in their
``pyproject.toml``::

    [project.entry-points."memopt.kernels"]
    cpu = "memopt_kernels_cpu:backend"

The entry point's name is the backend's name (``MEMOPT_BACKEND=cpu`` picks it). It resolves to a
backend object, or to a class / zero-argument factory returning one, with an integer
``KERNEL_API`` equal to :data:`KERNEL_API`, ``available() -> (bool, reason)``,
``supports(rule, spec, device, param_dtype) -> bool`` and ``step(work) -> None`` (optionally
``fused_staging = True`` when ``step`` writes :attr:`GroupStep.staging` itself, and
``device_steps = True`` when it runs :attr:`GroupStep.device_step`, ``prepare(work)`` for the
cached step's replays, ``codecs(device)`` for :mod:`memopt_core.conversions`, ``check(work)``
raising what ``step(work)`` would raise without changing anything: :func:`check_works` runs it
on every group of a step before the first one runs, so a step either updates every group or
none; ``merges_groups = True`` with ``step_all(works, prepared, done)``, see
:func:`merges_groups`, and ``merges_step_counts = True``, see :func:`merges_step_counts`).
A backend that
fails to import, has another ``KERNEL_API`` or reports itself unavailable is listed with its
reason (:func:`available_backends`) and never breaks ``import memopt_core``.

Selection (:func:`select_backend`): an explicit ``backend=`` name, else ``MEMOPT_BACKEND``
(``torch``, ``cpu``, ``triton`` or another registered name; empty means no choice; an explicit
``backend="auto"`` chooses automatically and ignores the variable),
forces one backend and raises :class:`~memopt_core.errors.BackendUnavailableError` with the reason
when it cannot run the group. Otherwise the first usable backend supporting the group in the order
``triton`` (CUDA tensors), ``cpu`` (CPU tensors), then ``torch``.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from memopt_core.errors import BackendUnavailableError, ConfigError
from memopt_core.formats import StateSpec
from memopt_core.plan import GroupPlan, StateArena

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "KERNEL_API",
    "KERNEL_MOMENT_IDS",
    "PARAM_DTYPES",
    "RULES",
    "Backend",
    "BackendStatus",
    "DeviceStep",
    "GroupStep",
    "available_backends",
    "backend_capabilities",
    "check_works",
    "default_order",
    "forced_backend",
    "get_backend",
    "grad_dtype_ok",
    "kernel_master_id",
    "kernel_moment_id",
    "launch_then_done",
    "mark_written",
    "merges_groups",
    "merges_step_counts",
    "refresh_backends",
    "runs_device_steps",
    "select_backend",
    "supports_formats",
    "writes_staging",
]

#: The interface level between core and kernel packages; a backend must declare the same.
#: 2: backends honour :attr:`GroupStep.index_bases` (sharded parameters).
#: 3: stochastic rounding draws :mod:`memopt_core.rng`'s per-step Philox keys and per-element
#: ``lowbias32`` words (before: one Philox block per element), so a backend built for 2 rounds
#: with other bits.
#: 4: ``q8_sqrt`` stores a positive ``v`` that would round to code 0 as code 1.
#: 5: ``fp8_e5m2`` stores a finite non-zero element that would round to code 0 as the smallest
#: code of its sign.
#: 6: an ECC master's ``+-0`` parameter with a carrying code (which no encode makes: a weight
#: zeroed in place after its code was written) decodes to that zero, not to a NaN.
#: 7: ``q8_sqrt``'s stochastic rounding decides with integer arithmetic on ``s``'s fraction
#: between its two codes (before: a division in ``v``), the same probability up to 2**-24.
#: 8: Adam's 8-bit second moments are stored divided by their decay
#: (``reference.adam_scalars(normalized=True)``), and a capturable step's words follow
#: ``DeviceStep.normalized``: a backend of 7 would compute them for ``v`` itself.
KERNEL_API = 8
ENTRY_POINT_GROUP = "memopt.kernels"
ENV_VAR = "MEMOPT_BACKEND"
#: Rule names a backend sees (SGDW/AdamW are SGD/Adam with decoupled decay in their scalars).
RULES = ("sgd", "adam", "lion")
#: Parameter dtypes every rule and format is defined for.
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grad_dtype_ok(param: torch.dtype, grad: torch.dtype) -> bool:
    """Gradients have the parameter's dtype or float32; a float32 parameter (its own master)
    also takes a bfloat16/float16 gradient, widened exactly (unscaled first in its own dtype,
    as ``GradScaler.unscale_`` does), on every backend."""
    return grad in (param, torch.float32) or (
        param == torch.float32 and grad in (torch.bfloat16, torch.float16)
    )


_INSTALL_HINT = {
    "cpu": "from a checkout: pip install packages/memopt-kernels-cpu",
    "triton": "from a checkout: pip install packages/memopt-kernels-triton, on a CUDA machine",
}


@dataclass
class DeviceStep:
    """The device-resident part of a capturable step (``MemOptimizer(capturable=True)``).

    ``steps``: float32 tensor on the group's device, one count of completed steps per plan slot
    (``len(plan.slots)``; exact below 2**24, as torch's capturable step counters). The backend
    computes the step being taken from it on the device (``steps[slot] + 1``: Adam's bias
    corrections through :func:`memopt_core.reference.adam_bias_table`, the stochastic-rounding
    counter, SGD's first step) and advances the participating slots, so the host never reads a
    step count. ``lr`` and ``betas`` are the group's (the host scalars of
    :attr:`GroupStep.scalars` then only give the step-independent words). ``lr`` may be a
    one-element tensor on the group's device: the backend reads it there at every launch (a
    captured graph uses its value at each replay), and computes from it the words that depend on
    it, the decoupled decay factor among them (``decoupled``: the rule decays as AdamW, SGDW or
    Lion do, by ``1 - lr * weight_decay``, or ``1 - (lr / initial_lr) * weight_decay`` with
    ``initial_lr``, a float or a tensor on the device, for ``decouple_lr``). ``weight_decay``
    may likewise be a one-element tensor on the group's device: the decay factor (decoupled) or
    the L2 coefficient (not) is then computed or read there, and an L2 term whose coefficient is
    0 leaves the gradient as the host step does (no ``0 * p`` is added).

    AMP (a ``torch.amp.GradScaler``, see ``MemOptimizer``): ``grad_scale`` (None, or the scaler's
    scale: the gradients are multiplied by ``float32(1 / float64(scale))`` as
    ``GradScaler.unscale_`` does, inside the update) and ``found_inf`` (None, or a float32 tensor:
    nonzero means skip the step: no parameter, state or step count changes). Both are read on
    the device.

    ``normalized`` (Adam): the second moments are stored divided by their decay
    (``StateSpec.decay_normalized``); the backend computes Adam's ``beta2``,
    ``one_minus_beta2`` and ``bc2_sqrt`` words per tensor as
    :func:`memopt_core.reference.adam_scalars` does with ``normalized=True``, from
    :func:`memopt_core.reference.decay_norm_table` at ``j = step % P``. ``norm_steps``
    (None, or a tensor like ``steps``): the optimizer's record of the counts those moments are
    stored for, which the backend advances exactly as ``steps`` (the same values, skipped
    steps included), so that an edited count is seen against it without a copy per step.
    """

    steps: Tensor
    lr: float | Tensor
    betas: tuple[float, float]
    grad_scale: Tensor | None = None
    found_inf: Tensor | None = None
    weight_decay: float | Tensor = 0.0
    decoupled: bool = False
    initial_lr: float | Tensor | None = None
    normalized: bool = False
    norm_steps: Tensor | None = None


@dataclass
class GroupStep:
    """One step of one group of tensors, as the optimizer hands it to a backend.

    ``slots`` are the indices (into ``plan.slots``/``plan.params``) of the tensors taking part,
    ascending; ``params``, ``grads`` and ``tensor_ids`` are aligned with them. All of them share
    ``step`` (1-based: the step being computed), so ``scalars`` (from
    :func:`memopt_core.reference.adam_scalars` / ``sgd_scalars`` / ``lion_scalars``, in double)
    hold for all. ``first_step`` is ``step == 1`` (SGD's momentum buffer starts as the gradient).
    Gradients have the parameter's dtype or float32. Stochastic rounding (when
    ``spec.stochastic_rounding``) draws ``memopt_core.rng.uniform_bits(seed, tensor_id, index,
    step, stream)`` with ``index = index_bases[k] + i`` for element ``i`` of ``params[k]`` (padding
    continues it). ``index_bases`` (None: all 0) holds, for a shard of a sharded parameter
    (FSDP2), the position of the shard's first element in the whole tensor, so a shard draws the
    words the whole tensor would: the same bits as one process. A backend updates ``params`` and
    the arena in place.

    ``device_step`` (None: a host step): the step counts and AMP flags live on the device
    (:class:`DeviceStep`); ``step``, ``first_step`` and the step-dependent scalars are then
    placeholders. Only backends with ``device_steps = True`` get such work.

    ``staging`` (None, or aligned with ``params``): contiguous bfloat16 tensors (or None) that
    receive each updated parameter rounded to nearest-even bf16, e.g. the copy memopt-offload
    sends back to the GPU. A backend whose ``fused_staging`` attribute is true writes them in the
    same pass as the update; for any other backend the optimizer copies after ``step()``.

    ``grads_checked``: the caller already checked each gradient (a dense tensor of its
    parameter's device and size, of a dtype :func:`grad_dtype_ok` takes), as ``MemOptimizer``
    does before every step: the torch backend then skips its own per-tensor check, which would
    cost its many-small-tensor steps (``ApexW(mode="torch")``) about 2 µs per tensor again.
    """

    rule: str
    spec: StateSpec
    plan: GroupPlan
    slots: list[int]
    params: list[Tensor]
    grads: list[Tensor]
    arena: StateArena
    scalars: Any
    step: int
    seed: int
    tensor_ids: list[int]
    first_step: bool
    staging: list[Tensor | None] | None = None
    extra: dict = field(default_factory=dict)
    index_bases: list[int] | None = None
    owners: list[Tensor] | None = None
    device_step: DeviceStep | None = None
    grads_checked: bool = False

    @property
    def param_owners(self) -> list[Tensor]:
        """The optimizer's parameters behind ``params`` (a sharded parameter's DTensor where
        ``params`` holds its local shard; the state is keyed by these). Backends ignore them."""
        return self.params if self.owners is None else self.owners

    def index_base(self, pos: int) -> int:
        """The stochastic-rounding index of the first element of ``params[pos]`` (see the class doc)."""
        return 0 if self.index_bases is None else self.index_bases[pos]

    @property
    def full(self) -> bool:
        """True when every tensor of the plan takes part."""
        return len(self.slots) == len(self.plan.slots)


@runtime_checkable
class Backend(Protocol):
    """What a kernel package registers (see the module doc)."""

    name: str
    KERNEL_API: int

    def available(self) -> tuple[bool, str]:
        """Whether the backend can run here at all, and why (not): shown by
        :func:`available_backends`."""
        ...

    def supports(
        self, rule: str, spec: StateSpec, device: torch.device, param_dtype: torch.dtype
    ) -> bool:
        """Whether it steps ``rule`` with the formats of ``spec`` for ``param_dtype`` parameters
        on ``device``; the optimizer then picks it for such a group."""
        ...

    def step(self, work: GroupStep) -> None:
        """Run one step of ``work`` (a state group's parameters, gradients, state arena and
        scalars) in place, with core's reference bits."""
        ...


def runs_device_steps(backend: object) -> bool:
    """Whether ``backend.step`` runs :attr:`GroupStep.device_step` work (its optional
    ``device_steps`` attribute): what ``MemOptimizer(capturable=True)`` needs."""
    return bool(getattr(backend, "device_steps", False))


def merges_groups(backend: object) -> bool:
    """Whether ``backend`` steps several param groups in one launch (its optional
    ``merges_groups`` attribute). Such a backend has ``step_all(works, prepared, done)``: it
    runs every work of ``works`` (all host steps or, where it also has ``device_steps``, all
    capturable ones with a ``device_step``; none with ``staging``), launching together the
    works whose arenas are views of one family arena
    (:func:`memopt_core.plan.family_arenas`), with the same bits as one launch each.
    ``prepared`` is None or, for host steps, aligned with ``works``: each work's prepared
    launch from the backend's ``prepare`` (a cached step's), or None. It validates every work before the first
    launch and calls ``done(i)`` once work ``i``'s launch is issued (also when a
    KeyboardInterrupt comes out of it). memopt's optimizers give such backends family arenas
    for the param groups that can share one."""
    return bool(getattr(backend, "merges_groups", False))


def merges_step_counts(backend: object) -> bool:
    """Whether ``backend.step_all`` (see :func:`merges_groups`) runs together the works that
    share one arena (its optional ``merges_step_counts`` attribute). A state group whose
    parameters are at several step counts (a MoE's experts that skipped steps, their
    ``.grad`` None) is stepped as one work per count; such a backend steps them in one launch
    or call, each tensor with its own work's step and scalars, with the same bits as one each.
    Without ``merges_groups`` core builds no family arenas for the backend."""
    return bool(getattr(backend, "merges_step_counts", False))


def launch_then_done(
    launch: Callable[[], None], works: Iterable[int], done: Callable[[int], None] | None
) -> None:
    """``launch()`` (one kernel launch or call into C++ that runs the works ``works``), then
    ``done(i)`` for each of them (None: nothing), also when a KeyboardInterrupt comes out of
    ``launch``: Python delivers a Ctrl-C that arrives during a C++ kernel or a GPU launch once
    the call returns, so the works have run, and without their bookkeeping (step counts) a
    retried step would repeat their step number (its bias correction and rounding words). An
    error raised by validation before the kernel skips ``done``. What ``step_all`` promises
    (:func:`merges_groups`), and what the optimizer does around each work it runs alone."""
    try:
        launch()
    except KeyboardInterrupt:
        if done is not None:
            for i in works:
                done(i)
        raise
    if done is not None:
        for i in works:
            done(i)


def writes_staging(backend: object) -> bool:
    """Whether ``backend.step`` fills :attr:`GroupStep.staging` itself (its optional
    ``fused_staging`` attribute); otherwise the caller copies the updated parameters."""
    return bool(getattr(backend, "fused_staging", False))


#: Moment format -> the integer id the kernel packages' kernels switch on (fp8_e4m3 and q8_signed
#: share one layout); 5 stands for "no such state". Part of the kernel interface, like KERNEL_API.
KERNEL_MOMENT_IDS = {
    "fp32": 0,
    "bf16": 1,
    "fp8_e4m3": 2,
    "q8_signed": 2,
    "fp8_e5m2": 3,
    "q8_sqrt": 4,
}


def mark_written(params: list[Tensor]) -> None:
    """Tell autograd that ``params`` changed in place. Kernels write through raw pointers,
    which torch does not see: without this, a graph that saved a parameter before the step
    (``retain_graph=True``, a forward that reads a weight again during gradient release)
    would use the new values silently instead of raising, as torch's own optimizers make it
    do. One C-level call for the list."""
    torch.autograd.graph.increment_version(params)


def check_works(works: list[tuple[Any, GroupStep]]) -> None:
    """Run the optional ``check(work)`` of each (backend, work) pair's backend. Callers pass
    every work of a step but the first, before any runs: a step whose third group a backend
    refuses (for the cpu backend, a gradient that shares its parameter's memory) must not have
    updated the first two; the first needs no check, its own step validates it before writing
    anything."""
    for backend, work in works:
        check = getattr(backend, "check", None)
        if check is not None:
            check(work)


def kernel_moment_id(name: str) -> int:
    """Kernel id of moment format ``name`` (:data:`KERNEL_MOMENT_IDS`)."""
    if name not in KERNEL_MOMENT_IDS:
        from memopt_core.formats.registry import MOMENT_FORMATS

        raise ConfigError(f"unknown moment format {name!r}; choose one of {MOMENT_FORMATS}")
    return KERNEL_MOMENT_IDS[name]


def kernel_master_id(name: str, param_dtype: torch.dtype) -> int:
    """Kernel id of master format ``name`` for ``param_dtype`` parameters: fp32 0, none with
    bf16 1, none with fp16 2, ecc24 3, ecc32 4 (ConfigError for an impossible pair)."""
    from memopt_core.formats import master_codec

    master_codec(name, param_dtype)  # raises ConfigError for unknown names and impossible pairs
    if name == "fp32":
        return 0
    if name == "none":
        return 1 if param_dtype == torch.bfloat16 else 2
    return 3 if name == "ecc24" else 4


def supports_formats(rule: str, spec: StateSpec, param_dtype: torch.dtype) -> bool:
    """True when ``rule`` with ``spec`` is defined for ``param_dtype`` parameters: a known rule,
    one of :data:`PARAM_DTYPES`, and a master format that exists for that dtype. Backends add their
    own device (and block size) conditions in ``supports()``."""
    if rule not in RULES or param_dtype not in PARAM_DTYPES:
        return False
    try:
        spec.master_for(param_dtype)
    except ConfigError:
        return False
    return True


@dataclass(frozen=True)
class BackendStatus:
    """A registry entry: ``usable`` says whether it can run at all here, ``reason`` why (not)."""

    name: str
    usable: bool
    reason: str
    origin: str
    backend: Any = None


_lock = threading.Lock()
_registry: dict[str, BackendStatus] | None = None


def _builtin() -> BackendStatus:
    from memopt_core.torch_backend import TorchBackend

    return BackendStatus(
        "torch",
        True,
        "pure-torch reference backend (always available)",
        "memopt_core.torch_backend",
        TorchBackend(),
    )


def _broken(name: str, reason: str, origin: str, obj: Any = None) -> BackendStatus:
    """The status of an installed backend that cannot load (a stale build, another
    KERNEL_API), said once as a warning too: a user who only runs optimizers would otherwise
    not see that steps fall back to another backend. "Unavailable here" (no CUDA) stays quiet."""
    warnings.warn(
        f"memopt: the installed kernel backend {name!r} cannot be used: {reason}. Steps run on "
        "another backend (memopt_core.available_backends() lists them); reinstall the kernel "
        "package, or set MEMOPT_BACKEND=torch to choose the torch backend deliberately",
        RuntimeWarning,
        stacklevel=4,
    )
    return BackendStatus(name, False, reason, origin, obj)


def _load_entry_point(ep: Any) -> BackendStatus:
    name = getattr(ep, "name", "?")
    origin = f"entry point {name} = {getattr(ep, 'value', '?')}"
    try:
        obj = ep.load()
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return _broken(name, f"failed to import: {type(e).__name__}: {e}", origin)
    try:
        if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "step")):
            obj = obj()
    except Exception as e:
        return _broken(name, f"failed to construct: {type(e).__name__}: {e}", origin)
    api = getattr(obj, "KERNEL_API", None)
    if api != KERNEL_API:
        return _broken(
            name,
            f"built for KERNEL_API {api!r} but memopt-core needs KERNEL_API {KERNEL_API}: install "
            "versions of the kernel package and memopt-core that match",
            origin,
            obj,
        )
    missing = [m for m in ("available", "supports", "step") if not callable(getattr(obj, m, None))]
    if missing:
        return _broken(name, f"is not a backend: it lacks {', '.join(missing)}()", origin, obj)
    try:
        ok, why = obj.available()
    except Exception as e:
        return BackendStatus(
            name, False, f"available() failed: {type(e).__name__}: {e}", origin, obj
        )
    return BackendStatus(name, bool(ok), str(why), origin, obj)


def _discover() -> dict[str, BackendStatus]:
    reg = {"torch": _builtin()}
    try:
        eps = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception as e:  # a broken installation must not break import
        reg["<entry points>"] = BackendStatus(
            "<entry points>", False, f"could not list entry points: {type(e).__name__}: {e}", ""
        )
        return reg
    for ep in eps:
        status = _load_entry_point(ep)
        if status.name == "torch":
            reg["torch (shadowed)"] = BackendStatus(
                status.name,
                False,
                "the name 'torch' belongs to core's built-in backend; rename the entry point",
                status.origin,
            )
            continue
        old = reg.get(status.name)
        if old is not None and old.usable:
            continue  # first usable registration of a name wins
        reg[status.name] = status
    return reg


def _get_registry() -> dict[str, BackendStatus]:
    global _registry
    with _lock:
        if _registry is None:
            _registry = _discover()
        return _registry


def refresh_backends() -> dict[str, BackendStatus]:
    """Rediscover the entry points (after installing a kernel package, or in tests)."""
    global _registry
    with _lock:
        _registry = None
    return _get_registry()


def available_backends() -> dict[str, BackendStatus]:
    """Every known backend, usable or not, with the reason: ``{name: BackendStatus}``."""
    return dict(_get_registry())


def get_backend(name: str) -> Any:
    """The usable backend called ``name``, or :class:`BackendUnavailableError` saying why not."""
    reg = _get_registry()
    status = reg.get(name)
    if status is None:
        hint = _INSTALL_HINT.get(name)
        raise BackendUnavailableError(
            f"memopt backend {name!r} is not installed"
            + (f" ({hint})" if hint else "")
            + f"; installed backends: {', '.join(sorted(n for n, s in reg.items() if s.usable))}"
        )
    if not status.usable:
        raise BackendUnavailableError(f"memopt backend {name!r} cannot run here: {status.reason}")
    return status.backend


def _describe(rule: str, spec: StateSpec, device: torch.device, dtype: torch.dtype) -> str:
    return (
        f"rule {rule!r} with master {spec.master!r}, moments {spec.moments!r} "
        f"(stochastic_rounding={spec.stochastic_rounding}) for {dtype} parameters on {device}"
    )


def backend_capabilities(
    rule: str, spec: StateSpec, device: torch.device | str, param_dtype: torch.dtype
) -> dict[str, tuple[bool, str]]:
    """``{backend name: (can run it, reason)}`` for one (rule, spec, device, dtype)."""
    device = torch.device(device)
    out: dict[str, tuple[bool, str]] = {}
    for name, status in _get_registry().items():
        if not status.usable:
            out[name] = (False, status.reason)
            continue
        try:
            ok = bool(status.backend.supports(rule, spec, device, param_dtype))
        except Exception as e:
            out[name] = (False, f"supports() failed: {type(e).__name__}: {e}")
            continue
        out[name] = (
            (True, "supported")
            if ok
            else (False, f"does not support {_describe(rule, spec, device, param_dtype)}")
        )
    return out


def default_order(device: torch.device | str) -> tuple[str, ...]:
    """Backends tried, in order, when none is forced."""
    kind = torch.device(device).type
    if kind == "cuda":
        return ("triton", "torch")
    if kind == "cpu":
        return ("cpu", "torch")
    return ("torch",)


def forced_backend(backend: str | None = None) -> str | None:
    """The backend forced by ``backend`` or else ``MEMOPT_BACKEND`` (None: choose automatically)."""
    name = backend if backend is not None else os.environ.get(ENV_VAR)
    if name is None:
        return None
    if not isinstance(name, str):
        raise ConfigError(
            f"backend must be a backend name (str) or None, got {type(name).__name__} {name!r}"
        )
    name = name.strip().lower()
    if not name and backend is not None:
        # an empty argument is a name that went missing (an unset config field), not a choice;
        # an empty MEMOPT_BACKEND is the shell's way to unset it
        raise ConfigError(
            f"backend={backend!r} names no backend: pass None or 'auto' to let memopt choose, or "
            "a name from memopt_core.available_backends()"
        )
    return None if name in ("", "auto") else name


def select_backend(
    rule: str,
    spec: StateSpec,
    device: torch.device | str,
    param_dtype: torch.dtype,
    backend: str | None = None,
) -> Any:
    """The backend that runs ``rule`` with ``spec`` for ``param_dtype`` tensors on ``device``.

    ``backend`` (else ``MEMOPT_BACKEND``) forces one by name; see the module doc.
    """
    device = torch.device(device)
    forced = forced_backend(backend)
    reg = _get_registry()
    if forced is not None:
        source = "backend=" if backend is not None else f"{ENV_VAR}="
        try:
            chosen = get_backend(forced)
        except BackendUnavailableError as e:
            raise BackendUnavailableError(f"{e} (forced by {source}{forced!r})") from None
        if not chosen.supports(rule, spec, device, param_dtype):
            raise BackendUnavailableError(
                f"memopt backend {forced!r} (forced by {source}{forced!r}) does not support "
                f"{_describe(rule, spec, device, param_dtype)}; unset {ENV_VAR} or pass "
                "backend=None to let memopt choose"
            )
        return chosen
    for name in default_order(device):
        status = reg.get(name)
        if status is None or not status.usable:
            continue
        try:
            if status.backend.supports(rule, spec, device, param_dtype):
                return status.backend
        except Exception:
            continue
    torch_backend = reg["torch"].backend
    if not torch_backend.supports(rule, spec, device, param_dtype):  # nor does any other
        raise BackendUnavailableError(
            f"no memopt backend supports {_describe(rule, spec, device, param_dtype)}"
        )
    return torch_backend
