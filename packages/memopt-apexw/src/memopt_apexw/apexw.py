"""``ApexW``: AdamW with compact state whose step costs O(1) host work per group after the first.

State bytes per parameter element (next to the parameter itself):

================== ============================== ===================================
parameters         ``state="bf16"``               ``state="q8"``
================== ============================== ===================================
float32            4 (bf16 m, v; SR)              2.0625 (q8 m, v with E8M0 scales)
bfloat16 (ECC-24)  5 (+1 B master code)           3.0625
bfloat16 (ECC-32)  6 (+2 B, an exact fp32 master) 4.0625
================== ============================== ===================================

torch's AdamW holds 8 B per float32 parameter: ApexW holds at most half (as torch, of the
parameters that got a gradient: state is created at a parameter's first step with one). Moments round
stochastically (core's counter-based generator), so a bf16 second moment decays like fp32's
instead of stalling. Semantics are core's ``reference.adam`` (AdamW scalars) bit for bit
(torch's AdamW within a few ulps per step, DESIGN "Exactness in practice"), on every backend and
mode.

The step: core's cached step (:mod:`memopt_core.cached_step`), one per mode: the first step (and
any step after something changed) is an ordinary ``MemOptimizer`` step, whose per-group launches
are then kept; while every parameter and gradient keeps its address, later steps replay them with
scalars from the group's current lr/betas/eps/weight_decay (schedulers work), one fused launch
per group (Triton on CUDA, memopt-kernels-cpu on CPU). ``capturable=True`` (CUDA) captures the
launches in a CUDA graph that reads lr and step from device memory
(:mod:`memopt_apexw.graph_step`). ``mode="auto"`` times the fused and the pure-torch step on the
first steps and keeps the faster, cached per model signature (:mod:`memopt_apexw.auto_mode`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from memopt_apexw import auto_mode
from memopt_apexw.auto_mode import ModeDecision, Trial
from memopt_apexw.graph_step import GraphStep
from memopt_core import MemOptimizer, backends
from memopt_core.cached_step import CachedStep
from memopt_core.eager import run_eagerly
from memopt_core.errors import BackendUnavailableError, ConfigError
from memopt_core.formats import StateSpec
from memopt_core.optimizer import check_bool, forgets_scaler_flags_on_error
from memopt_core.sharding import is_dtensor, local_shard

__all__ = ["MODES", "STATES", "ApexW", "state_bytes_per_param"]

#: ``state=`` values: moment format presets of memopt-core
STATES = ("bf16", "q8")
#: ``mode=`` values
MODES = ("auto", "fused", "torch")
_MASTERS = ("ecc24", "ecc32")
_PARAM_DTYPES = (torch.float32, torch.bfloat16)
_DEFAULT_CACHE = "default"
_TAKES = "ApexW takes float32 or bfloat16 parameters"
#: mode="auto" decisions that hold for one model signature (not "fixed" or "forced")
_DECIDED_FOR_A_MODEL = ("measured", "cache", "only candidate")
#: core's group keys of its other rules, with their defaults: an ApexW group keeps them there
_NOT_ADAMW: dict[str, Any] = {
    "momentum": 0.0,
    "dampening": 0.0,
    "nesterov": False,
    "decouple_lr": False,
}
_NO_AMSGRAD = (
    "ApexW does not implement amsgrad=True (it would need a compact running maximum of the second "
    "moment); use torch.optim.AdamW(amsgrad=True)"
)


def _differs(value: Any, default: Any) -> bool:
    """Whether a group key holds other than ``default`` (compared by value: a one-element
    tensor or numpy number too; what cannot be compared differs)."""
    try:
        return bool(value != default)
    except (RuntimeError, TypeError, ValueError):  # a tensor of several elements, ...
        return True


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name} must be one of {choices}, got {value!r}")


_ON_CPU = "capturable=True captures a CUDA graph; parameters are on CPU"


def _strided_error(group_index: int) -> ConfigError:
    return ConfigError(
        "capturable=True needs contiguous parameters and gradients (the captured kernels "
        f"address them directly); a parameter or gradient of param group {group_index} is "
        "strided: make it contiguous before training"
    )


def _devices_error(devices: set[torch.device]) -> ConfigError:
    return ConfigError(
        "capturable=True captures one CUDA graph on one device; parameters are on "
        f"{sorted(map(str, devices))}"
    )


class ApexW(MemOptimizer):
    """AdamW with bf16 or q8 moments and a cached, optionally graph-captured fused step.

    State per parameter: 4 B (``state="bf16"``) or about 2.06 B (``"q8"``), plus the master
    code of a bfloat16 parameter, 1 B (ECC-24) or 2 B (ECC-32); torch's AdamW keeps 8 B.

    Args:
        params, lr, betas, eps, weight_decay, maximize: as ``torch.optim.AdamW``.
        amsgrad: must be False (a compact max-of-second-moments state does not exist yet; use
            ``torch.optim.AdamW(amsgrad=True)``).
        state: ``"bf16"`` (2 B per moment, stochastic rounding) or ``"q8"`` (about 1 B).
        master: master format of bfloat16 parameters, ``"ecc24"`` (bf16 + 8-bit correction, the
            ECC family's default) or ``"ecc32"`` (exact fp32 master); float32 parameters are
            their own master. float16 parameters are refused.
        capturable: on CUDA, replay the step as a CUDA graph reading lr and step from device
            memory. Needs contiguous tensors on CUDA and gradients that stay in their buffers
            (this optimizer's ``zero_grad()`` then zeroes in place by default).
        mode: ``"fused"`` (a kernel backend; an error when none is installed), ``"torch"``
            (core's pure-torch backend), or ``"auto"``: decided by timed trial steps, cached per
            model signature (:attr:`mode_decision` says what and why).
        mode_cache: JSON file of ``mode="auto"`` decisions: ``"default"``
            (:func:`memopt_apexw.auto_mode.default_cache_path`), a non-empty path (a folder,
            named with a trailing separator or existing, holds ``apexw-modes.json``), or None
            (decide in memory, every time).
        backend: advanced: force a kernel backend by name (e.g. ``"triton"`` on CPU under
            ``TRITON_INTERPRET=1``, for tests); None defers to ``MEMOPT_BACKEND`` as read here,
            ``"auto"`` ignores it (core's rule). A forced backend is the only candidate of
            ``mode="auto"`` and ``"fused"``; ``MEMOPT_BACKEND=torch`` forces core's torch step.
            Checked here, with the registry's reason.
        seed, check_numerics: as :class:`memopt_core.MemOptimizer`. Every backend uses only
            the low 32 bits of ``seed``: seeds 0 and 2**32 train identically.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        state: str = "bf16",
        master: str = "ecc24",
        capturable: bool = False,
        mode: str = "auto",
        maximize: bool = False,
        mode_cache: str | os.PathLike[str] | None = _DEFAULT_CACHE,
        backend: str | None = None,
        seed: int = 0,
        check_numerics: bool = False,
    ) -> None:
        check_bool("amsgrad", amsgrad)
        if amsgrad:
            raise ConfigError(_NO_AMSGRAD)
        _check_choice("state", state, STATES)
        _check_choice("master", master, _MASTERS)
        _check_choice("mode", mode, MODES)
        check_bool("capturable", capturable)
        if capturable and mode == "torch":
            raise ConfigError(
                "capturable=True captures the fused Triton step; mode='torch' has none: use "
                "mode='fused' or 'auto'"
            )
        if backend is not None and (
            not isinstance(backend, str) or backends.forced_backend(backend) == "torch"
        ):
            raise ConfigError(
                f"backend names the kernel backend of mode='fused' (e.g. 'triton', 'cpu'); got "
                f"{backend!r} (mode='torch' selects core's torch backend)"
            )
        if mode == "torch" and backend not in (None, "auto"):
            # it would run core's torch step and drop the named backend without a word
            raise ConfigError(
                f"backend={backend!r} names the kernel backend of mode='fused' or 'auto'; "
                "mode='torch' runs core's torch step: leave backend out, or use mode='fused'"
            )
        # backend=, else MEMOPT_BACKEND; mode="torch" runs core's torch step whatever the
        # variable says (an unusable name there refused the construction)
        forced = backends.forced_backend(backend) if mode != "torch" or backend else None
        if mode == "torch" and backend is None:
            backend = "torch"
        if capturable and forced == "torch":
            raise ConfigError(
                f"capturable=True captures the fused Triton step; {backends.ENV_VAR}=torch forces "
                "core's torch step, which has none"
            )
        if mode_cache is not None and not (
            isinstance(mode_cache, (str, os.PathLike))
            and isinstance(os.fspath(mode_cache), str)
            and os.fspath(mode_cache)
            and "\0" not in os.fspath(mode_cache)  # no file has it: the write raised at each step
        ):
            raise ConfigError(
                f"mode_cache must be None, {_DEFAULT_CACHE!r} or a non-empty path, got "
                f"{mode_cache!r}"
            )
        self.capturable = capturable
        self.mode = mode
        self.fused_backend = None if forced == "torch" else forced
        self.mode_cache = mode_cache
        self._reset_fast()
        super().__init__(
            params,
            rule="adamw",
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
            master=master,
            moments=state,
            stochastic_rounding=True,
            seed=seed,
            check_numerics=check_numerics,
            backend=backend,  # core checks the forced name, with the registry's reason
        )
        self._decision: ModeDecision | None = None
        if mode != "auto":
            self._decision = ModeDecision(mode, "fixed")
        if forced is not None and mode != "torch":  # one backend: nothing to choose or measure
            self._decision = ModeDecision("torch" if forced == "torch" else "fused", "forced")

    # ----------------------------------------------------------------------- configuration
    def _reset_fast(self) -> None:
        self._graph: GraphStep | None = None
        self._recaptures = 0
        self._trial: Trial | None = None
        self._sig: tuple[str, dict[str, Any]] | None = None

    def _drop_cached_steps(self) -> None:
        super()._drop_cached_steps()
        self._graph = None  # it replays a dropped cached step

    def _check_group(self, g: Mapping[str, Any], where: str) -> tuple[float, float]:
        # core's keys of other rules, in every group: a value other than its default was taken
        # silently (decouple_lr=True decayed by weight_decay instead of lr * weight_decay)
        odd = [f"{k}={g[k]!r}" for k, off in _NOT_ADAMW.items() if k in g and _differs(g[k], off)]
        if odd:
            raise ConfigError(
                f"{where} sets {', '.join(odd)}: ApexW is torch's AdamW (weight decay by "
                "lr * weight_decay, no momentum or nesterov setting); leave these keys at "
                f"their defaults ({', '.join(f'{k}={v!r}' for k, v in _NOT_ADAMW.items())})"
            )
        betas = super()._check_group(g, where)  # refuses amsgrad=True in a group too
        if "capturable" in g and g["capturable"] != self.capturable:
            # core ignores the key; here it would read as a CUDA graph for one group
            raise ConfigError(
                f"{where} sets capturable={g['capturable']!r}, but capturable is a constructor "
                f"argument of the whole ApexW, which runs with capturable={self.capturable!r}: "
                "build a new ApexW to change it"
            )
        if "mode" in g and g["mode"] != self.mode:  # read from the optimizer, never a group
            raise ConfigError(
                f"{where} sets mode={g['mode']!r}, but mode is a constructor argument of the "
                f"whole ApexW, which runs with mode={self.mode!r}: build a new ApexW to change it"
            )
        if "state" in g and g["state"] != g["moments"]:  # a key only a later edit puts there
            raise ConfigError(
                f"{where} sets state={g['state']!r}, but its moments are {g['moments']!r}: the "
                "state format cannot change in place (build a new ApexW; memopt_checkpoint "
                "converts saved states between formats)"
            )
        if g["moments"] not in STATES:
            raise ConfigError(f"ApexW keeps moments in {STATES}; {where} asks for {g['moments']!r}")
        if g["master"] not in _MASTERS:
            raise ConfigError(
                f"ApexW keeps bfloat16 masters as {_MASTERS}; {where} asks for {g['master']!r}"
            )
        if not g["stochastic_rounding"]:
            raise ConfigError(
                f"ApexW rounds its compact moments stochastically (round-to-nearest bf16 second "
                f"moments stall); {where} sets stochastic_rounding=False"
            )
        return betas

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch semantics; float32 and bfloat16 parameters only (CUDA ones when capturable)."""
        if isinstance(param_group, dict) and "state" in param_group:
            param_group = dict(param_group)
            state = param_group.pop("state")
            if param_group.setdefault("moments", state) != state:  # one of them won silently
                raise ConfigError(
                    f"a param group sets state={state!r} and moments="
                    f"{param_group['moments']!r}; give one (state)"
                )
        if isinstance(param_group, dict) and isinstance(param_group.get("params"), Iterator):
            param_group = {**param_group, "params": list(param_group["params"])}  # read twice
        params = param_group.get("params") if isinstance(param_group, dict) else None
        listed = params if isinstance(params, (list, tuple)) else ()  # else core says why
        for i, p in enumerate([params] if isinstance(params, Tensor) else listed):
            # before core's check, whose message offers float16 (core's own float16 message
            # explains the bfloat16 master split, and stands)
            if isinstance(p, Tensor) and p.dtype not in backends.PARAM_DTYPES:
                raise ConfigError(
                    f"parameter #{i} of param group {len(self.param_groups)} (shape "
                    f"{tuple(p.shape)}) is {p.dtype}; {_TAKES}: cast it or leave it out"
                )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):
            bad = None
            if p.dtype not in _PARAM_DTYPES:
                bad = f"is {p.dtype}; {_TAKES}"
            elif self.capturable and p.device.type != "cuda":
                bad = f"is on {p.device}; capturable=True captures a CUDA graph"
            if bad is not None:
                self.param_groups.pop()
                self._index = None
                raise ConfigError(
                    f"parameter #{i} of param group {len(self.param_groups)} (shape "
                    f"{tuple(p.shape)}) {bad}"
                )
        if self._trial is not None:
            # a trial under way timed the model before this group: it starts over on the new
            # one (its decision was stored under the old model's signature)
            self._trial = self._sig = None
        decision = getattr(self, "_decision", None)  # unset while the constructor adds groups
        if decision is not None and decision.source in _DECIDED_FOR_A_MODEL:
            # decided for the model before this group: look the new one up (cache or trial),
            # so the decision stays reproducible from the cache
            self._decision = self._sig = None

    @staticmethod
    def _check_dtypes(gi: int, group: Mapping[str, Any], members: list[Tensor]) -> None:
        """Core's check of a parameter cast after it was added, naming only ApexW's dtypes."""
        for p in members:
            if p.dtype not in _PARAM_DTYPES:
                i = next(i for i, q in enumerate(group["params"]) if q is p)
                raise ConfigError(
                    f"parameter #{i} of param group {gi} (shape {tuple(p.shape)}) is {p.dtype} "
                    f"since it was added to the optimizer (was the model cast?); {_TAKES}: cast "
                    "it back, or build the optimizer after casting"
                )

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """torch semantics; ``set_to_none`` defaults to False with ``capturable=True`` (gradients
        stay in their captured buffers) and to True otherwise."""
        if set_to_none is None:
            set_to_none = not self.capturable
        super().zero_grad(set_to_none=set_to_none)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # Without capturable, a torch.amp.GradScaler hands step() its scale and found-inf flag
        # (core's _update: the Triton kernel unscales and skips on the device, with no
        # synchronisation; the torch and CPU backends read the flag and unscale on the host).
        # ApexW's own graph (capturable=True) takes host scalars: the scaler's ordinary loop
        # unscales the captured gradient buffers and skips step() on an inf.
        return not self.capturable and super()._step_supports_amp_scaling

    @property
    def mode_decision(self) -> ModeDecision | None:
        """The mode in use and why (None while ``mode="auto"`` still runs its trial steps)."""
        return self._decision

    # ----------------------------------------------------------------------------- stepping
    @run_eagerly  # as MemOptimizer.step
    @forgets_scaler_flags_on_error
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step over every parameter with a gradient; returns the closure's loss."""
        self._refuse_inference_mode("step")
        if self._release_owner is not None:
            return super().step(closure)  # warns and does nothing
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise ConfigError(
                "ApexW.step() cannot be captured inside another CUDA graph: its host-side "
                "scalars (lr, bias corrections, step) would be frozen into it. Use "
                "ApexW(capturable=True), which captures its own step and feeds it lr and step "
                "from device memory, and keep step() outside your graph"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            # GradScaler.step sets these (see _step_supports_amp_scaling)
            amp = (getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
            mode, timed = self._next_mode()
            if timed:
                with auto_mode.timed(self._devices()) as t:
                    self._step_in(mode, amp)
                # recorded only when the step ran and updated: one that raised (a NumericsError
                # the caller catches) has no time, and one that updated nothing (a GradScaler's
                # skipped step, no gradients) would time the fast way to do nothing; the trial
                # takes the slot again
                assert self._trial is not None
                if self._updated(amp[1]):
                    self._trial.record(mode, t.ms)
            else:
                self._step_in(mode, amp)
        return loss

    def _updated(self, found_inf: Tensor | None) -> bool:
        """Whether the step just taken updated parameters (read once the timer synchronized):
        a GradScaler's found-inf flag skips it in either mode, as does a step without gradients."""
        if found_inf is not None and bool(found_inf.item()):
            return False
        return any(p.grad is not None for g in self.param_groups for p in g["params"])

    def _devices(self) -> set[torch.device]:
        return {p.device for g in self.param_groups for p in g["params"]}

    def _step_in(self, mode: str, amp: tuple[Tensor | None, Tensor | None]) -> None:
        self.backend = self._backend_name(mode)  # part of what a cached step was resolved for
        if amp[0] is not None or amp[1] is not None:  # a GradScaler's step, never capturable
            if mode == "fused":
                self._require_fused()
            self._device_counted_step(amp)  # as MemOptimizer.step
            return
        had = mode in self._cached_steps
        if self._replay(mode):
            return
        if had and mode == "fused" and self.capturable:
            self._recaptures += 1
            if self._recaptures == 3:
                warnings.warn(
                    "ApexW(capturable=True) resolved and captured its step again because a "
                    "gradient or parameter moved to another buffer; keep gradients in place "
                    "(optimizer.zero_grad(), which zeroes in place here, instead of "
                    "model.zero_grad() or set_to_none=True)",
                    UserWarning,
                    stacklevel=3,
                )
        if mode == "fused":
            self._graph = None
            self._require_fused()
        if self.capturable:
            self._refuse_uncapturable(fused=mode == "fused")
        self._update_and_cache(mode)

    def _backend_name(self, mode: str) -> str:
        return "torch" if mode == "torch" else (self.fused_backend or "auto")

    def _fused_selection(self) -> Iterator[tuple[torch.device, torch.dtype, StateSpec, Any]]:
        """(device, dtype, spec, backend) per state group that a step under mode='fused' runs:
        core's selection (:meth:`_resolve`), for the plans of the parameters with a gradient or
        a state (core's members, :meth:`_members`: one plan per device and dtype of a group),
        after core's checks of their groups and dtypes.

        Computed from the parameters, building no plan: it runs before the step (and before the
        mode="auto" trial), outside core's atomic section, so plans and states built here would
        outlive a step refused after it (core takes back only what its own checks build)."""
        name = self._backend_name("fused")
        for gi, group in enumerate(self.param_groups):
            # a parameter holding state (init_state(), a load, earlier steps) without a
            # gradient now counts too: mode="auto" decides once, and it will step
            members = self._members(group, trainable=False)
            if not members:
                continue
            self._check_group(group, f"(param group {gi})")  # names a key deleted by hand
            self._check_dtypes(gi, group, members)  # names a parameter cast since it was added
            for device, dtype in dict.fromkeys((local_shard(p).device, p.dtype) for p in members):
                spec = self._spec(group, dtype)
                chosen = backends.select_backend(self._kind, spec, device, dtype, name)
                yield device, dtype, spec, chosen

    def _fused_names(self) -> set[str]:
        """Backend names mode='fused' would run."""
        return {getattr(chosen, "name", "?") for *_, chosen in self._fused_selection()}

    def _require_fused(self) -> None:
        """BackendUnavailableError, with the registry's reasons, where a group would run on core's
        torch backend."""
        why = self._why_not_fused()
        if why:
            raise BackendUnavailableError(
                f"ApexW(mode='fused') found no kernel backend for some parameters: "
                f"{'; '.join(sorted(why))}. Use mode='auto' or mode='torch' to run core's "
                "pure-torch step"
            )

    def _why_not_fused(self) -> set[str]:
        """The registry's reasons why some group would run on core's torch backend (empty: none
        would)."""
        why: set[str] = set()
        for device, dtype, spec, chosen in self._fused_selection():
            if getattr(chosen, "name", "?") != "torch":
                continue
            kernel = backends.default_order(device)[0]
            if kernel == "torch":
                why.add(f"no kernel backend exists for {device.type} tensors")
                continue
            try:
                backends.get_backend(kernel)
            except BackendUnavailableError as e:  # not installed (what to install), or unusable
                why.add(str(e))
                continue
            caps = backends.backend_capabilities(self._kind, spec, device, dtype)
            why.add(f"memopt backend {kernel!r} {caps[kernel][1]}")
        return why

    def _refuse_uncapturable(self, fused: bool) -> None:
        """ConfigError, before the step changes anything, where its graph could not be captured:
        sharded parameters in any mode, strided tensors and other devices than one GPU in the
        ``fused`` mode, whose step is captured (:meth:`_check_capturable` checks its prepared
        launches again after the step)."""
        devices = set()
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if is_dtensor(p):
                    # FSDP2 hands over new gradient buffers every step: no captured step exists
                    raise ConfigError(
                        "ApexW(capturable=True) cannot capture a step of sharded (FSDP2) "
                        "parameters: their gradients arrive in new buffers every step; use "
                        "capturable=False"
                    )
                if not fused:
                    continue
                if not (p.is_contiguous() and g.is_contiguous()):
                    raise _strided_error(gi)
                if p.device.type != "cuda":
                    raise ConfigError(_ON_CPU)
                devices.add(p.device)
        if len(devices) > 1:
            raise _devices_error(devices)

    def _build_cached(self, works: list[tuple[Any, backends.GroupStep]]) -> CachedStep | None:
        cached = super()._build_cached(works)
        names = {getattr(e.backend, "name", "?") for e in cached.entries} if cached else set()
        # names is empty where cached is None: the first test only narrows it for mypy
        if cached is not None and self.capturable and names == {"triton"}:
            cached.prepare()  # the capture replays the prepared launches: check them now
            self._check_capturable(cached)
            cached.fixed_grads = True  # the graph holds the gradients' addresses
        return cached

    def _check_capturable(self, cached: CachedStep) -> None:
        for e in cached.entries:
            if e.prepared is None:
                raise _strided_error(e.group_index)
            if e.work.plan.device.type != "cuda":
                raise ConfigError(_ON_CPU)
        devices = {e.work.plan.device for e in cached.entries}
        if len(devices) > 1:
            raise _devices_error(devices)

    def _launch_cached(self, cached: CachedStep) -> None:
        if not (self.capturable and cached is self._cached_steps.get("fused") and cached.entries):
            super()._launch_cached(cached)
            return
        scalars = [e.work.scalars for e in cached.entries]
        graph = self._graph
        if graph is None or graph.cached is not cached or not graph.variant_matches(scalars):
            graph = self._graph = GraphStep(cached, cached.entries[0].work.plan.device)
        graph.run(scalars, self.seed, [e.work.step for e in cached.entries])
        for e in cached.entries:
            self._count_step(e.counters, e.work)
        self._check_step_limit(e.work for e in cached.entries)  # warns as the eager step does

    # ------------------------------------------------------------------------------ auto mode
    def _next_mode(self) -> tuple[str, bool]:
        if self._decision is not None:
            return self._decision.mode, False
        if self._trial is None:
            self._start_auto()
            if self._decision is not None:
                return self._decision.mode, False
        assert self._trial is not None
        nxt = self._trial.next()
        if nxt is None:
            self._finish_auto()
            assert self._decision is not None
            return self._decision.mode, False
        return nxt

    def _cache_path(self) -> Path | None:
        if self.mode_cache is None:
            return None
        if isinstance(self.mode_cache, str) and self.mode_cache == _DEFAULT_CACHE:
            try:
                return auto_mode.default_cache_path()
            except RuntimeError as e:  # no home directory (a uid without a passwd entry)
                warnings.warn(
                    f"ApexW(mode='auto'): no default decision cache ({e}); deciding without "
                    f"one (set {auto_mode.CACHE_ENV} to a file path to keep decisions)",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self.mode_cache = None  # decided once, without a cache, as mode_cache=None
                return None
        # a folder holds the file, as $MEMOPT_APEXW_CACHE's (a folder given here was never
        # written: each trial warned that the write failed)
        return auto_mode.cache_file(Path(self.mode_cache), os.fspath(self.mode_cache))

    def _start_auto(self) -> None:
        if self.capturable:
            why = self._why_not_fused()
            if why:  # as mode='torch' is refused: there would be no graph, silently
                raise ConfigError(
                    "capturable=True captures the fused Triton step, and mode='auto' found no "
                    f"kernel backend for some parameters: {'; '.join(sorted(why))}. Use "
                    "capturable=False to run core's pure-torch step"
                )
        # first: its selection runs core's group checks, which name a key deleted by hand
        # (the signature reads the group's keys)
        fused = "torch" not in self._fused_names()
        self._sig = auto_mode.signature(self.param_groups, self.capturable, self.check_numerics)
        key = self._sig[0]
        path = self._cache_path()
        if path is not None:
            found = auto_mode.load_decision(path, key)
            if found is not None:
                self._decide(found)
                return
        candidates = ["fused", "torch"] if fused else ["torch"]
        if len(candidates) == 1:
            self._decide(ModeDecision(candidates[0], "only candidate", {}, key, None))
            return
        self._trial = Trial(candidates)

    def _decide(self, decision: ModeDecision) -> None:
        self._decision = decision
        if decision.mode != "fused":
            self._graph = None  # release the fused step's CUDA graph and pinned ring

    def _finish_auto(self) -> None:
        assert self._trial is not None
        assert self._sig is not None
        key, about = self._sig
        path = self._cache_path()
        decision = ModeDecision(
            self._trial.decide(),
            "measured",
            self._trial.medians(),
            key,
            None if path is None else str(path),
        )
        if path is not None:
            try:
                auto_mode.save_decision(path, key, decision, about)
            except OSError as e:
                warnings.warn(
                    f"ApexW could not write its mode cache {path}: {e}; the decision holds for "
                    "this optimizer only",
                    UserWarning,
                    stacklevel=4,
                )
        self._decide(decision)
        self._trial = None
        for other in [m for m in self._cached_steps if m != decision.mode]:
            del self._cached_steps[other]  # release the other mode's resolved step

    # ------------------------------------------------------------------------ pickle, deepcopy
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(
            capturable=self.capturable,
            mode=self.mode,
            fused_backend=self.fused_backend,
            mode_cache=self.mode_cache,
            _decision=self._decision,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._reset_fast()
        super().__setstate__(state)
        if self._decision is not None and self._decision.source in _DECIDED_FOR_A_MODEL:
            # decided for the process that pickled it: its kernels may not run here, or run
            # here where they did not there (the cache key holds the usable backends, so the
            # cache answers for this process)
            self._decision = None


def state_bytes_per_param(state: str, param_dtype: torch.dtype, master: str = "ecc24") -> float:
    """Bytes of ApexW state per parameter element for a configuration (the module doc's table)."""
    _check_choice("state", state, STATES)
    _check_choice("master", master, _MASTERS)
    if not isinstance(param_dtype, torch.dtype) or param_dtype not in _PARAM_DTYPES:
        raise ConfigError(f"param_dtype must be one of {_PARAM_DTYPES}, got {param_dtype!r}")
    moments = {"bf16": 4.0, "q8": 2.0625}[state]
    if param_dtype == torch.float32:
        return moments
    return moments + {"ecc24": 1.0, "ecc32": 2.0}[master]
