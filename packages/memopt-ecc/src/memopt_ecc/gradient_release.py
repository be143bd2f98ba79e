"""Gradient release: update each parameter as soon as its gradient is final, then free it.

``enable_gradient_release(model, optimizer)`` registers ``register_post_accumulate_grad_hook`` on
every trainable parameter of ``model`` that ``optimizer`` holds. During ``backward`` the hook
calls ``optimizer.step_parameters([p])`` (the parameter's own slice of the fused step: same
formats, same stochastic-rounding words, so the result equals the ordinary ``step()`` bit for
bit) and sets ``p.grad = None``, so at most the gradients still being produced are alive. The
returned :class:`GradientReleaseHandle` undoes it with ``remove()`` (or as a context manager).

While active, the optimizer's ``step()`` and ``zero_grad()`` do nothing and warn once per
activation: the handle holds :class:`memopt_core.MemOptimizer`'s switch
(``begin_gradient_release`` / ``end_gradient_release``, ``gradient_release_active``), so this
holds for every memopt optimizer, Flash* or plain ``MemOptimizer``. Incompatible by
construction: gradient accumulation over micro-batches, global gradient clipping
(``clip_grad_norm_`` needs every gradient before any update), DDP and FSDP1 (refused with
``TypeError``). ``check_numerics`` errors surface from inside ``backward``, for the
parameter being updated (earlier parameters of the same backward are already updated).

**GradScaler** (``grad_scaler=``, a ``torch.amp.GradScaler``; FlashOptim has none): each hook
unscales its gradient in place with the scaler's ``1/scale`` (computed as ``unscale_`` does, by
the same ``torch._amp_foreach_non_finite_check_and_unscale_`` kernel, so clean steps equal the
ordinary ``scaler.step`` loop bit for bit; where that kernel lacks the dtype, e.g. bf16 on CUDA,
where ``GradScaler.unscale_`` itself fails, the same arithmetic in torch ops: an fp32 product
rounded once to the gradient's dtype) and checks it for inf/NaN. A non-finite gradient
**skips that parameter's update only** (its weights, moments and step count stay as they were;
parameters updated earlier in the same backward keep their updates, which the ordinary loop would
have skipped too). Every hook adds its found-inf flag to the scaler's record for this optimizer
(stage ``UNSCALED``, ``found_inf_per_device``), exactly where ``unscale_`` puts it, so the usual
``scaler.update()`` after ``backward`` backs the scale off when any gradient of the iteration was
non-finite and grows it after ``growth_interval`` clean iterations. Per iteration: call
``scaler.scale(loss).backward()`` then ``scaler.update()``; do not call ``scaler.unscale_`` (the
hooks did) — ``scaler.step(optimizer)`` is harmless but only calls the no-op ``step()``. Cost:
one host-device synchronisation per parameter to read its flag, except with a ``capturable=True``
optimizer, whose kernel reads the flag on the device (``step_parameters(found_inf=...)``); the
handle's ``skipped`` count then synchronises only when read.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from memopt_core import MemOptimizer
from memopt_core.errors import ConfigError
from memopt_core.hook_wrappers import reject_hook_wrappers

__all__ = ["GradientReleaseHandle", "enable_gradient_release"]


class GradientReleaseHandle:
    """Returned by :func:`enable_gradient_release`; :meth:`remove` restores the ordinary loop."""

    def __init__(self, optimizer: MemOptimizer, hooks: list[Any], scaler: Any = None) -> None:
        self._optimizer = optimizer
        self._hooks = hooks
        self._active = True
        self.grad_scaler = scaler
        self._skipped = 0
        # a capturable optimizer skips on the device: its flags are summed here, read on demand
        self._skipped_on_device: Tensor | None = None

    @property
    def skipped(self) -> int:
        """Parameters whose update was skipped for a non-finite gradient (GradScaler only),
        counted over the handle's life. With a capturable optimizer the flags stay on the device
        until this is read (one synchronisation per read)."""
        on_device = self._skipped_on_device
        return self._skipped + (0 if on_device is None else int(on_device.item()))

    def _count_on_device(self, found: Tensor) -> None:
        if self._skipped_on_device is None:
            self._skipped_on_device = found.detach().clone().reshape(())
        else:
            self._skipped_on_device += found.reshape(())

    @property
    def active(self) -> bool:
        """True until :meth:`remove`."""
        return self._active

    def remove(self) -> None:
        """Remove the hooks; ``step()`` and ``zero_grad()`` work normally again. Idempotent."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._active = False
        self._optimizer.end_gradient_release(self)

    def __enter__(self) -> GradientReleaseHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"GradientReleaseHandle(active={self.active}, hooks={len(self._hooks)})"


#: (device type, dtype) pairs torch's unscale kernel does not implement (bf16 on CUDA)
_NO_FOREACH_UNSCALE: set[tuple[str, torch.dtype]] = set()


def _unscale_(grad: Tensor, inv_scale: Tensor, found_inf: Tensor) -> None:
    """``GradScaler.unscale_`` for one gradient: ``grad *= inv_scale`` in place and
    ``found_inf = 1`` when ``grad`` holds an inf or NaN.

    torch's ``_amp_foreach_non_finite_check_and_unscale_`` does it where it is implemented; for the
    rest (bf16 gradients on CUDA in torch 2.11, where GradScaler itself fails) the same
    arithmetic in torch ops: the product in fp32, rounded once to the gradient's dtype.
    """
    key = (grad.device.type, grad.dtype)
    if key not in _NO_FOREACH_UNSCALE:
        try:
            torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf, inv_scale)
            return
        except NotImplementedError:
            _NO_FOREACH_UNSCALE.add(key)
    bad = (~torch.isfinite(grad)).any().to(found_inf.dtype)
    found_inf.copy_(torch.maximum(found_inf, bad))
    grad.copy_(grad.float() * inv_scale)


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


def enable_gradient_release(
    model: nn.Module,
    optimizer: MemOptimizer,
    *,
    grad_scaler: torch.amp.GradScaler | None = None,
    pre_step: Callable[[Tensor, dict[str, Any]], bool] | None = None,
) -> GradientReleaseHandle:
    """Update every trainable parameter of ``model`` held by ``optimizer`` during ``backward``.

    Args:
        model: the module whose parameters train (not wrapped in DDP or FSDP1: ``TypeError``).
        optimizer: a memopt optimizer (``MemOptimizer`` or a subclass such as the Flash*
            classes); its ``step()``/``zero_grad()`` become warning no-ops while active.
        grad_scaler: an enabled ``torch.amp.GradScaler`` whose scale the hooks undo and whose
            inf record they fill (module doc); None or a disabled scaler: no unscaling.
        pre_step: ``(param, group) -> bool`` called before each update; False skips it (the
            gradient is freed either way).

    Creates the optimizer's state up front (:meth:`~memopt_core.MemOptimizer.init_state`), so
    it is not allocated inside the first backward. Returns a :class:`GradientReleaseHandle`.
    Raises ``ConfigError`` when the optimizer holds
    trainable parameters that are not in ``model`` (nothing would ever update them) or when
    release is already active on the optimizer.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, MemOptimizer):
        raise TypeError(
            "enable_gradient_release() needs a memopt optimizer (a memopt_ecc Flash* or "
            f"memopt_core.MemOptimizer), which can update one parameter at a time; got "
            f"{type(optimizer).__name__}"
        )
    reject_hook_wrappers(model, "enable_gradient_release()")
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

    # the state now, not in the first hook: there it would be allocated in the middle of the
    # first backward, on top of the live activations (measured: a 3 GiB higher first-step peak
    # on the Qwen2.5-0.5B shape). The same bits either way (MemOptimizer.init_state).
    optimizer.init_state()
    handle = GradientReleaseHandle(optimizer, [], grad_scaler)
    on_device = bool(optimizer._step_supports_amp_scaling)  # capturable: skips on the device
    opt_ref = weakref.ref(optimizer)
    handle_ref = weakref.ref(handle)

    def make_hook(group: dict[str, Any]) -> Callable[[Tensor], None]:
        def hook(p: Tensor) -> None:
            opt = opt_ref()
            if opt is None or p.grad is None:
                return
            if scaler is not None:
                if scaler._scale is None:
                    raise RuntimeError(
                        "gradient release with a GradScaler: the scaler has no scale yet; call "
                        "scaler.scale(loss).backward()"
                    )
                with torch.no_grad():
                    grad = p.grad
                    inv = scaler._scale.double().reciprocal().float().to(grad.device)
                    found = torch.zeros((), dtype=torch.float32, device=grad.device)
                    _unscale_(grad, inv, found)
                    _scaler_record(scaler, opt, found)
                h = handle_ref()
                if on_device:  # the kernel reads the flag: no synchronisation per parameter
                    if pre_step is None or pre_step(p, group):
                        opt.step_parameters([p], found_inf=found.reshape(1))
                    if h is not None:
                        h._count_on_device(found)
                    p.grad = None
                    return
                if found.item():
                    if h is not None:
                        h._skipped += 1
                    p.grad = None
                    return
            if pre_step is None or pre_step(p, group):
                opt.step_parameters([p])
            p.grad = None

        return hook

    optimizer.begin_gradient_release(handle)  # step()/zero_grad() become warning no-ops
    try:
        for p in model.parameters():  # deduplicated: a tied parameter gets one hook
            group = groups.get(id(p))
            if group is None or not p.requires_grad:
                continue
            handle._hooks.append(p.register_post_accumulate_grad_hook(make_hook(group)))
    except BaseException:
        handle.remove()
        raise
    return handle
