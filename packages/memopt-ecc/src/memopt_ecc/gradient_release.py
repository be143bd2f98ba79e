"""Gradient release: update parameters during ``backward``, as soon as their gradients are
final, and free the gradients.

``enable_gradient_release(model, optimizer)`` registers ``register_post_accumulate_grad_hook`` on
every trainable parameter of ``model`` that ``optimizer`` holds. The hook takes the parameter's
gradient (``p.grad`` becomes None at once) into a bucket; when the bucket holds ``bucket_mb`` MiB
of gradients, and at the end of every ``backward`` (a callback queued on autograd's engine), one
``optimizer.step_parameters(bucket)`` updates them all: one fused launch per bucket instead of
one per parameter, so release costs little host time. Each parameter's update is the same slice
of the fused step whatever bucket it lands in (same formats, same stochastic-rounding words), so
the result equals the ordinary ``step()`` bit for bit. ``bucket_mb=0`` updates each parameter in
its own hook. The returned :class:`GradientReleaseHandle` undoes it with ``remove()`` (or as a
context manager).

A ``backward`` that raises before its end leaves its bucket unapplied: the next ``backward``
drops those gradients with a warning (never applies them late), and ``remove()`` drops them too.

While active, the optimizer's ``step()`` and ``zero_grad()`` do nothing and warn once per
activation: the handle holds :class:`memopt_core.MemOptimizer`'s switch
(``begin_gradient_release`` / ``end_gradient_release``, ``gradient_release_active``), so this
holds for every memopt optimizer, Flash* or plain ``MemOptimizer``. Incompatible by
construction: gradient accumulation over micro-batches, global gradient clipping
(``clip_grad_norm_`` needs every gradient before any update), DDP and FSDP1 (refused with
``TypeError``). ``check_numerics`` errors surface from inside ``backward``, for the bucket being
updated (earlier buckets of the same backward are already updated).

**GradScaler** (``grad_scaler=``, a ``torch.amp.GradScaler``; FlashOptim has none): each bucket's
gradients are unscaled in place with the scaler's ``1/scale`` (computed as ``unscale_`` does, by
the same ``torch._amp_foreach_non_finite_check_and_unscale_`` kernel, so clean steps equal the
ordinary ``scaler.step`` loop bit for bit; where that kernel lacks the dtype, e.g. bf16 on CUDA,
where ``GradScaler.unscale_`` itself fails, the same arithmetic in torch ops: an fp32 product
rounded once to the gradient's dtype) and checked for inf/NaN. A non-finite gradient **skips the
update of its bucket** (weights, moments and step counts stay as they were; with
``bucket_mb=0``: that parameter only). Buckets updated earlier in the same backward keep their
updates, which the ordinary loop would have skipped too. Every bucket adds its found-inf flag to
the scaler's record for this optimizer (stage ``UNSCALED``, ``found_inf_per_device``), exactly
where ``unscale_`` puts it, so the usual ``scaler.update()`` after ``backward`` backs the scale off
when any gradient of the iteration was non-finite and grows it after ``growth_interval`` clean
iterations. Per iteration: call ``scaler.scale(loss).backward()`` then ``scaler.update()``; do not
call ``scaler.unscale_`` (the buckets were) — ``scaler.step(optimizer)`` is harmless but only calls
the no-op ``step()``. The update kernel reads each bucket's flag on the device
(``step_parameters(found_inf=...)``; Triton, CUDA tensors), so no bucket synchronises; the handle's
``skipped`` count synchronises only when read. Where a backend has no device steps (the torch
backend forced on CUDA tensors), the flag is read on the host: one synchronisation per bucket.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable

from memopt_core import MemOptimizer
from memopt_core.errors import ConfigError
from memopt_core.hook_wrappers import (
    reject_hook_wrappers,
    reject_pending_gradients,
    reject_unsynchronized,
    remove_hooks,
)
from memopt_core.optimizer import check_bool, grad_dtype_ok

__all__ = ["GradientReleaseHandle", "enable_gradient_release"]


#: bucket size of :func:`enable_gradient_release` (MiB of gradients per fused update)
DEFAULT_BUCKET_MB = 32.0


class _Bucket:
    """Gradients of one device waiting for one fused update, with the backward (autograd graph
    task) each came from."""

    __slots__ = ("grads", "nbytes", "params", "tasks")

    def __init__(self) -> None:
        self.params: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.tasks: list[int] = []
        self.nbytes = 0


class _Release:
    """One activation's state, held by the optimizer (its ``begin_gradient_release`` owner) and
    by the handle, and only weakly by the hooks: with no strong path from a parameter's hook
    back to that parameter, dropping the model, the optimizer and the handle frees them without
    ``remove()`` (a hook that held its group held its own parameter, a cycle through autograd
    that Python's collector cannot see), and the hooks go with them (:func:`weakref.finalize`).
    Either of the optimizer and the handle keeps the release active."""

    __slots__ = ("__weakref__", "buckets", "frozen", "groups", "hooks")

    def __init__(self, groups: dict[int, dict[str, Any]], frozen: list[Tensor], cap: int) -> None:
        self.groups = groups  # id(parameter) -> its param group (pre_step's second argument)
        self.frozen = frozen  # held parameters frozen at enable time (they get no hook)
        self.buckets = _Buckets(cap)
        self.hooks: list[Any] = []


class _EndOfBackward:
    """The callback queued on a backward's graph task. autograd's engine runs it at the end of
    that backward, or drops it unrun when the backward raises: a dead weak reference to an
    instance whose task is still listed means the latter."""

    __slots__ = ("__weakref__", "run")

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run

    def __call__(self) -> None:
        self.run()


#: id(parameter) -> (the parameter, its release), weakly, for each parameter with a release
#: hook: a second optimizer's hook on it would always find its gradient taken. (Keyed by id:
#: weak-keyed dicts compare tensors with ==.)
_RELEASED: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _is_released(p: Tensor) -> bool:
    """Whether a live release hooks ``p``."""
    entry = _RELEASED.get(id(p))
    return entry is not None and entry[0]() is p and entry[1]() is not None


class _Buckets:
    """What gradient release holds between hooks: a bucket per device (a launch and a
    GradScaler flag are per device), and the backwards whose end is awaited."""

    __slots__ = ("by_device", "cap", "last_task", "tasks")

    def __init__(self, cap: int) -> None:
        self.cap = cap  # bytes; a bucket is updated as soon as it holds this many (0: each one)
        self.by_device: dict[torch.device, _Bucket] = {}
        self.tasks: dict[int, weakref.ref] = {}  # graph task id -> its _EndOfBackward
        self.last_task: dict[int, int] = {}  # id(parameter) -> the backward its gradient came in

    def arrived_twice(self, p: Tensor, task: int) -> bool:
        """Record that ``p``'s gradient arrived in backward ``task``; True when it also arrived
        in another backward that is still running or began after ``task`` did (graph task ids
        grow): one backward nested in the other, as a reentrant checkpoint
        (``torch.utils.checkpoint(use_reentrant=True)``) runs its region's backward. Each
        backward would then update ``p`` with its part of the gradient."""
        last = self.last_task.get(id(p))
        self.last_task[id(p)] = task
        if last is None or last == task:
            return False
        ref = self.tasks.get(last)
        return last > task or (ref is not None and ref() is not None)

    def add(self, p: Tensor, grad: Tensor, task: int) -> bool:
        """Hold ``grad`` for ``p``; True when its device's bucket is full."""
        b = self.by_device.get(grad.device)
        if b is None:
            b = self.by_device[grad.device] = _Bucket()
        b.params.append(p)
        b.grads.append(grad)
        b.tasks.append(task)
        b.nbytes += grad.numel() * grad.element_size()
        return b.nbytes >= self.cap

    def take(self, device: torch.device) -> tuple[list[Tensor], list[Tensor]]:
        b = self.by_device.pop(device, None)
        return ([], []) if b is None else (b.params, b.grads)

    def drop_failed(self) -> int:
        """Forget the gradients of backwards that raised before their end (their callback was
        dropped unrun); the number of parameters they belonged to. A backward still running
        (one that a reentrant backward is nested in) keeps its gradients."""
        dead = {t for t, ref in self.tasks.items() if ref() is None}
        if not dead:
            return 0
        for t in dead:
            del self.tasks[t]
        n = 0
        for device, b in list(self.by_device.items()):
            keep = [i for i, t in enumerate(b.tasks) if t not in dead]
            n += len(b.tasks) - len(keep)
            if not keep:
                del self.by_device[device]
            elif len(keep) < len(b.tasks):
                kept = _Bucket()
                for i in keep:
                    kept.params.append(b.params[i])
                    kept.grads.append(b.grads[i])
                    kept.tasks.append(b.tasks[i])
                    kept.nbytes += b.grads[i].numel() * b.grads[i].element_size()
                self.by_device[device] = kept
        return n

    def drop(self) -> None:
        """Forget everything held (the handle's ``remove()``)."""
        self.by_device.clear()
        self.tasks.clear()
        self.last_task.clear()


class GradientReleaseHandle:
    """Returned by :func:`enable_gradient_release`; :meth:`remove` restores the ordinary loop."""

    def __init__(self, optimizer: MemOptimizer, release: _Release, scaler: Any = None) -> None:
        self._optimizer = optimizer
        self._release = release
        self._active = True
        self.grad_scaler = scaler
        # the buckets' found-inf flags, summed where they live and read on demand
        self._skipped: Tensor | None = None
        # the hooks go when the release does: at remove(), or once nothing holds it
        self._finalizer = weakref.finalize(release, remove_hooks, release.hooks)

    @property
    def skipped(self) -> int:
        """Parameters whose update was skipped for a non-finite gradient (GradScaler only; every
        parameter of a skipped bucket counts), over the handle's life. The flags stay on the
        device until this is read (one synchronisation per read)."""
        return 0 if self._skipped is None else int(self._skipped.item())

    def _count_skipped(self, skipped: Tensor) -> None:
        if self._skipped is None:
            self._skipped = skipped.detach().clone().reshape(())
        else:
            self._skipped += skipped.reshape(())

    @property
    def active(self) -> bool:
        """True until :meth:`remove`."""
        return self._active

    def remove(self) -> None:
        """Remove the hooks; ``step()`` and ``zero_grad()`` work normally again. Gradients held
        by a backward that raised before its end are dropped, not applied. Idempotent. Raises
        ``ConfigError`` inside a running backward (a hook, ``pre_step``): the gradients it
        holds would be dropped, and its remaining parameters left to the ordinary loop."""
        if self._active and torch._C._current_graph_task_id() >= 0:
            raise ConfigError(
                "GradientReleaseHandle.remove() inside a running backward: the parameters "
                "already released in it would miss this backward's update. Call it between "
                "backwards"
            )
        self._finalizer()
        self._release.buckets.drop()
        self._active = False
        for key in [k for k, (_, r) in _RELEASED.items() if r() is self._release]:
            del _RELEASED[key]
        self._optimizer.end_gradient_release(self._release)

    def __enter__(self) -> GradientReleaseHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"GradientReleaseHandle(active={self.active}, hooks={len(self._release.hooks)})"


#: (device type, dtype) pairs torch's unscale kernel does not implement (bf16 on CUDA)
_NO_FOREACH_UNSCALE: set[tuple[str, torch.dtype]] = set()


def _unscale_(grads: list[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
    """``GradScaler.unscale_`` for gradients of one device: each ``grad *= inv_scale`` in place
    and ``found_inf = 1`` when any holds an inf or NaN.

    torch's ``_amp_foreach_non_finite_check_and_unscale_`` does it where it is implemented (per
    dtype, as ``unscale_`` calls it); for the rest (bf16 gradients on CUDA in torch 2.11, where
    GradScaler itself fails) the same arithmetic in torch ops: the product in fp32, rounded once
    to the gradient's dtype.
    """
    by_kind: dict[tuple[str, torch.dtype], list[Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device.type, g.dtype), []).append(g)
    for key, same in by_kind.items():
        if key not in _NO_FOREACH_UNSCALE:
            try:
                torch._amp_foreach_non_finite_check_and_unscale_(same, found_inf, inv_scale)
                continue
            except NotImplementedError:
                _NO_FOREACH_UNSCALE.add(key)
        for g in same:
            bad = (~torch.isfinite(g)).any().to(found_inf.dtype)
            found_inf.copy_(torch.maximum(found_inf, bad))
            g.copy_(g.float() * inv_scale)


def _scaler_record(scaler: Any, optimizer: MemOptimizer, found: Tensor) -> None:
    """Add ``found`` to the scaler's per-optimizer inf record, where ``unscale_`` keeps it."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        state["stage"] = OptState.UNSCALED
        state["found_inf_per_device"] = {}
    record = state["found_inf_per_device"]
    if found.device in record:
        record[found.device] += found
    else:
        record[found.device] = found.clone()


def _check_assigned(optimizer: MemOptimizer | None, p: Tensor, grad: Tensor) -> None:
    """ConfigError unless ``grad``, which a ``pre_step`` assigned to ``p.grad``, is a gradient
    that the update of ``p`` takes. Checked in the parameter's hook: in a bucket, the error
    would come later, and the bucket's other updates would be lost with it. (torch's ``.grad``
    setter checks the same unless ``p.grad_dtype`` was changed; the update checks the rest.)"""
    if grad.shape == p.shape and grad.device == p.device and grad_dtype_ok(p.dtype, grad.dtype):
        return
    label = optimizer._param_label(p) if optimizer is not None else "a parameter"
    raise ConfigError(
        f"gradient release: pre_step set the .grad of {label} to a tensor of shape "
        f"{tuple(grad.shape)}, {grad.dtype}, on {grad.device}; the update takes gradients of "
        "the parameter's shape and device, in its dtype or float32 (a float32 parameter also "
        "bfloat16 or float16): assign such a gradient, or None to skip the update"
    )


def enable_gradient_release(
    model: nn.Module,
    optimizer: MemOptimizer,
    *,
    grad_scaler: torch.amp.GradScaler | None = None,
    pre_step: Callable[[Tensor, dict[str, Any]], bool] | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    allow_unsynchronized: bool = False,
) -> GradientReleaseHandle:
    """Update every trainable parameter of ``model`` held by ``optimizer`` during ``backward``.

    Args:
        model: the module whose parameters train (not wrapped in DDP or FSDP1: ``TypeError``).
        optimizer: a memopt optimizer (``MemOptimizer`` or a subclass such as the Flash*
            classes); its ``step()``/``zero_grad()`` become warning no-ops while active.
        grad_scaler: an enabled ``torch.amp.GradScaler`` whose scale the updates undo and whose
            inf record they fill (module doc); None or a disabled scaler: no unscaling.
        pre_step: ``(param, group) -> bool`` called in the parameter's hook, with ``p.grad``
            still set (scaled, with a GradScaler). The update takes what ``p.grad`` holds when
            it returns, as the ordinary ``step()`` after it would: the gradient edited in place
            or a tensor assigned to ``p.grad`` (of the parameter's shape, device and a dtype the
            optimizer takes, else ``ConfigError``); ``p.grad = None`` or returning False skips
            its update (the gradient is freed either way, and ``.grad`` is None again after
            the call, also when it raises).
        bucket_mb: MiB of gradients held before they are updated in one fused step (the rest
            at the end of backward); 0 updates each parameter in its own hook. Bigger buckets
            mean fewer launches and more gradient memory held during backward.
        allow_unsynchronized: with several processes (``torch.distributed``), parameters that
            are not sharded by FSDP2 are refused (``TypeError``): data parallelism averages
            their gradients after the hooks have run. True lets a run whose processes each
            train parameters of their own.

    Creates the optimizer's state up front (:meth:`~memopt_core.MemOptimizer.init_state`), so
    it is not allocated inside the first backward. Returns a :class:`GradientReleaseHandle`.
    Raises ``ConfigError`` when the optimizer holds trainable parameters that are not in
    ``model`` (nothing would ever update them), when release is already active on the
    optimizer, or for a ``bucket_mb`` that is not a finite number >= 0.

    Hooks cover the parameters that train when this is called. While active, the optimizer's
    ``add_param_group`` raises ``ConfigError``, and a held parameter that was frozen here but
    receives a gradient later makes its backward raise ``ConfigError`` at the end (after the
    other updates): remove the handle and enable release again after such changes.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, MemOptimizer):
        raise TypeError(
            "enable_gradient_release() needs a memopt optimizer (a memopt_ecc Flash* or "
            f"memopt_core.MemOptimizer), which can update one parameter at a time; got "
            f"{type(optimizer).__name__}"
        )
    if (
        isinstance(bucket_mb, bool)
        or not isinstance(bucket_mb, (int, float))
        or not math.isfinite(bucket_mb)
        or bucket_mb < 0
    ):
        raise ConfigError(f"bucket_mb must be a finite number of MiB >= 0, got {bucket_mb!r}")
    # a string flag read as true skipped the check below; a pre_step that is no function
    # failed in the first backward's hooks, with that gradient dropped
    check_bool("allow_unsynchronized", allow_unsynchronized)
    if pre_step is not None and not callable(pre_step):
        raise TypeError(
            f"pre_step must be a function (param, group) -> bool or None, got "
            f"{type(pre_step).__name__}"
        )
    reject_hook_wrappers(model, "enable_gradient_release()")
    if not allow_unsynchronized:
        reject_unsynchronized(model, "enable_gradient_release()", "pass allow_unsynchronized=True")
    if optimizer.gradient_release_active:
        raise ConfigError(
            "gradient release is already active on this optimizer: call handle.remove() first"
        )
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(
            f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}"
        )
    scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None

    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    in_model = {id(p) for p in model.parameters()}
    orphans = [
        tuple(p.shape)
        for g in optimizer.param_groups
        for p in g["params"]
        if p.requires_grad and id(p) not in in_model
    ]
    if orphans:
        raise ConfigError(
            f"the optimizer holds {len(orphans)} trainable parameter(s) that are not in the model "
            f"(shapes {orphans[:4]}); with gradient release step() does nothing, so they would "
            "never be updated: pass the model that owns every parameter"
        )

    reject_pending_gradients(
        model, {id(p) for g in optimizer.param_groups for p in g["params"]},
        "enable_gradient_release()",
    )  # fmt: skip
    # the state now, not in the first hook: there it would be allocated in the middle of the
    # first backward, on top of the live activations (measured: a 3 GiB higher first-step peak
    # on the Qwen2.5-0.5B shape). The same bits either way (MemOptimizer.init_state).
    optimizer.init_state()
    # held parameters frozen now get no hook: one unfrozen later would never be updated
    frozen = [p for g in optimizer.param_groups for p in g["params"] if not p.requires_grad]
    release = _Release(groups, frozen, int(bucket_mb * 2**20))
    handle = GradientReleaseHandle(optimizer, release, grad_scaler)
    # the hooks reach all of these weakly (_Release says why)
    opt_ref = weakref.ref(optimizer)
    handle_ref = weakref.ref(handle)
    release_ref = weakref.ref(release)

    def update(device: torch.device) -> None:
        """One fused update of ``device``'s bucket."""
        opt, rel = opt_ref(), release_ref()
        if opt is None or rel is None:
            return
        params, grads = rel.buckets.take(device)
        if not params:
            return
        held = dict(zip(params, grads, strict=True))
        if scaler is None:
            opt.step_parameters(params, grads=held)
            return
        scale = scaler._scale
        # hook() raised before bucketing any gradient while the scaler had no scale
        assert scale is not None
        with torch.no_grad():
            inv = scale.double().reciprocal().float().to(device)
            found = torch.zeros((), dtype=torch.float32, device=device)
            _unscale_(grads, inv, found)
            _scaler_record(scaler, opt, found)
        # the kernel reads the flag where it runs on the device: no synchronisation
        opt.step_parameters(params, grads=held, found_inf=found.reshape(1))
        h = handle_ref()
        if h is not None:
            h._count_skipped(found * len(params))

    def update_all(task: int) -> None:
        rel = release_ref()
        if rel is None:
            return
        rel.buckets.tasks.pop(task, None)
        for device in list(rel.buckets.by_device):
            update(device)  # gradients of an enclosing backward too: they are final
        opt = opt_ref()
        late = [p for p in rel.frozen if p.requires_grad and p.grad is not None]
        if late and opt is not None:
            listed = "; ".join(opt._param_label(p) for p in late[:4])
            more = f" and {len(late) - 4} more" if len(late) > 4 else ""
            raise ConfigError(
                f"gradient release: {listed}{more} had requires_grad=False when "
                "enable_gradient_release() ran, so no hook updates it, but it now receives "
                "gradients, which would pile up in its .grad: call handle.remove() and "
                "enable_gradient_release() again after unfreezing parameters (the other "
                "parameters of this backward were updated)"
            )

    def hold(buckets: _Buckets, p: Tensor, grad: Tensor) -> bool:
        """Hold ``grad`` until its bucket is full or its backward ends; True: update now."""
        task = torch._C._current_graph_task_id()
        if task < 0:  # not inside autograd's engine (nothing to wait for): update at once
            buckets.add(p, grad, task)
            return True
        if task not in buckets.tasks:  # the first hook of this backward
            dropped = buckets.drop_failed()
            if dropped:
                warnings.warn(
                    f"gradient release: an earlier backward raised before its end; the "
                    f"gradients it held for {dropped} parameter(s) were dropped, not applied",
                    RuntimeWarning,
                    stacklevel=3,
                )
            end = _EndOfBackward(lambda: update_all(task))
            Variable._execution_engine.queue_callback(end)
            buckets.tasks[task] = weakref.ref(end)
        if buckets.arrived_twice(p, task):
            opt = opt_ref()
            label = opt._param_label(p) if opt is not None else "a parameter"
            raise ConfigError(
                f"gradient release: {label} received gradients in two backward passes, one "
                "nested in the other (a reentrant checkpoint, torch.utils.checkpoint("
                "use_reentrant=True), around a module whose parameters are also used outside "
                "it): each pass would update the parameter with its part of the gradient. Use "
                "use_reentrant=False, or the ordinary loop (handle.remove())"
            )
        return buckets.add(p, grad, task)

    def hook(p: Tensor) -> None:
        grad = p.grad
        rel = release_ref()
        if rel is None or opt_ref() is None or grad is None:
            return
        # the gradient leaves .grad before anything that can raise: left there, the next
        # backward would add its own to it and apply both (never late, as ecc.md says)
        p.grad = None
        if scaler is not None and scaler._scale is None:
            raise RuntimeError(
                "gradient release with a GradScaler: the scaler has no scale yet; call "
                "scaler.scale(loss).backward()"
            )
        take = True
        if pre_step is not None:
            p.grad = grad  # pre_step reads the gradient there, edits it or assigns another
            try:
                take = pre_step(p, rel.groups[id(p)])
                # the gradient is what .grad holds now, as step() would read it after a
                # pre_step of the ordinary loop: an assigned one (p.grad = p.grad.clamp(-1, 1))
                # replaces it, None skips the update (the old one was used: audit 2026-12-06)
                new = p.grad
            finally:
                p.grad = None  # out again, also when pre_step raised
            if new is not grad and new is not None:
                _check_assigned(opt_ref(), p, new)
            grad = new
        if not isinstance(take, bool):  # a logging callback without `return True`
            raise TypeError(
                f"gradient release: pre_step must return True (update) or False (skip), "
                f"got {take!r}"
            )
        if take and grad is not None and hold(rel.buckets, p, grad):
            update(grad.device)

    hooked = [
        p  # deduplicated: a tied parameter gets one hook
        for p in model.parameters()
        if id(p) in groups and p.requires_grad
    ]
    for key in [k for k, (p, _) in _RELEASED.items() if p() is None]:
        del _RELEASED[key]  # parameters that no longer exist
    for p in hooked:
        if _is_released(p):
            raise ConfigError(
                f"gradient release: {optimizer._param_label(p)} is already released by another "
                "optimizer's handle, whose hook takes its gradient first: this optimizer would "
                "never update it. Give each parameter to one optimizer, or remove that handle"
            )
    optimizer.begin_gradient_release(release)  # step()/zero_grad() become warning no-ops
    try:
        for p in hooked:
            release.hooks.append(p.register_post_accumulate_grad_hook(hook))
            _RELEASED[id(p)] = (weakref.ref(p), release_ref)
    except BaseException:
        handle.remove()
        raise
    return handle
