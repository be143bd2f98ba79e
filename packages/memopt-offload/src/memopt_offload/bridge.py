"""``AdamBridge``: AdamW with its master weights and moments in host RAM, pipelined into backward.

Only the model's weights (bfloat16, or float32) stay on the GPU. For each trainable parameter the
host holds, in a few exact-size slabs (:mod:`memopt_offload.host_memory`):

============== ================================= =============================================
precision      host state per parameter          host bytes moved per update
============== ================================= =============================================
``fp32``       fp32 master + fp32 m, v: 12 B     master 4 r+w, m 4 r+w, v 4 r+w, bf16 gradient
                                                 2 r, bf16 staging copy 2 w: 28 B
``bf16``       fp32 master + bf16 m, v: 8 B      20 B
``fp8``        fp32 master + fp8 m, v: ~6.1 B    ~16.1 B
``bf16-ecc24`` bf16 weight + ECC-24 code + bf16  weight 2 r+w, code 1 r+w, m 2 r+w, v 2 r+w,
               m, v: 7 B                         gradient 2 r (no staging copy): 16 B
``compact``    bf16 weight + ECC-24 code + q8    weight 2 r+w, code 1 r+w, m, v ~1 r+w each,
               m, v: ~5.1 B                      gradient 2 r (no staging copy): ~12.1 B
============== ================================= =============================================

plus the pinned bf16 gradient buffer (2 B) and, except for the ECC-24 masters (``"bf16-ecc24"``
and ``"compact"``, whose bf16 host parameter is itself the copy sent back), a pinned bf16
staging copy (2 B). An ECC-24 master holds about 16 significant bits and rounds its last one
stochastically, so small updates are not lost on average (memopt-ecc's format). ``"bf16-ecc24"``
holds 9 B of host memory per parameter where ``"bf16"`` holds 12 and moves 16 B where it moves
20, through the same kind of one-loop C++ kernel; on the H200's host its step took 0.75-1.07x
bf16's (docs/benchmarks/2026-11-30-paired-e2e-and-tiles.md). The link carries 2 B
per parameter down (the bf16 gradient) and 2 B up (the updated bf16 weight); float32 parameters
4 B each way. Low-precision moments and the ECC master round stochastically (core's
counter-based generator), so they do not stall; every update is bit-exact with
``memopt_core``'s reference AdamW on the same host tensors.

The pipeline (:meth:`AdamBridge.attach_hooks`): a post-accumulate-grad hook on each parameter
adds its final gradient to the open bucket; when the bucket holds about ``bucket_mb`` of
gradients, they are copied to their pinned host buffers on a side stream (one copy call for the
bucket) and freed on the GPU; a dispatcher thread waits for each bucket's copy, runs the fused
C++ AdamW kernel (memopt-kernels-cpu, GIL released, its own thread pool) over the bucket,
which writes the bf16 staging copy in the same pass, and queues the host-to-device copy of the
new weights on another stream, all while backward continues.
:meth:`AdamBridge.step_sync` waits until every update has landed and makes the current stream wait
for the uploads, so the next forward never reads a half-updated weight. Without hooks,
:meth:`AdamBridge.step` runs the same pipeline over all gradients at once. With the model on the
CPU the same pipeline runs with plain copies (this is what CPU CI tests).

A weight is written back while backward still runs. That is safe because a parameter's
post-accumulate-grad hook fires after every backward node that produces its gradient has run
(and the dispatcher waits for the GPU work queued before the hook), and no standard backward
node reads a weight after producing its gradient. A graph that reads a *detached* copy of a
weight in backward after the weight's gradient is final (rare) should use :meth:`step` without
hooks; the in-place upload bumps the weight's version counter, so autograd reports such a read
instead of using a changed value where it can.

Weights written by the caller (``model.load_state_dict`` after the optimizer was built, an
``nn.init`` call, ``p.copy_`` under ``no_grad``, ``p.data = t``) are what the next update
starts from, as with a torch optimizer: ``update="host"`` compares each parameter's version
counter and address with those of its last upload when its gradient arrives (and in
``state_dict()`` and ``master_weight()``), and reads a changed weight into its master first (an
ECC-24 master keeps its code, as a weight written in place under memopt-ecc does). Weights are
written between steps: a write that an update finds before its upload raises
:class:`OffloadError` (with ``overlap_forward``, call :meth:`synchronize` first). Writes
through ``p.data`` (``p.data.copy_(t)``) bypass the version counter, so they are not seen:
write the parameter itself under ``torch.no_grad()``.
``update="device"`` updates the device weight itself, so it sees every write.

Overlapping the next forward (``attach_hooks(model, overlap_forward=True)``): the host is
usually behind when backward ends (the tied embedding of a language model, final only then, and
whatever the host has not caught up with), and the next forward needs only one module's weights
at a time. With this option :meth:`AdamBridge.step_sync` closes the step and returns at once; a
forward pre-hook on every module that holds parameters of this optimizer waits for those
parameters' updates and orders their uploads before the module's kernels. The dispatcher runs
the newest bucket whose gradients have arrived first, so the buckets left when backward ends are
updated in the order the next forward reads them (backward's order reversed). The contract is
that every weight is read through a module that holds it; the first forward that overlaps
updates runs under a check (a ``TorchFunctionMode``) that raises :class:`OffloadError` when a
torch function reads a weight before its module's pre-hook waited (metadata such as ``shape``
excepted), and a weight that receives a gradient although no pre-hook waited for it raises too.
Reading weights outside the model's forward needs :meth:`AdamBridge.synchronize` first
(``model.state_dict()`` and this optimizer's own methods do it by themselves). The updates are
the same bits either way; a step takes (and checks) every group's hyperparameters when it opens,
at its first gradient, so an LR scheduler stepped right after ``step_sync()`` changes the next
step, not the one in flight.

The update on the device (``update="device"``, ``precision="bf16-ecc24"`` only): the host keeps
only the state, an ECC-24 code and bf16 moments (5 B per bf16 parameter, pinned), and the GPU
updates it. As the last gradient of a bucket becomes final, the bucket's state is copied to the
device (or was, ahead of time), one fused Triton launch updates the bf16 weights and the state
on a side stream, the gradients are freed and the state goes back to the host; the CPU does no
arithmetic, and host memory carries 10 B per parameter, all of it DMA. The bits are those of
``update="host"`` with the same precision (core's reference), and the state dicts are the
same, so a checkpoint moves between the two. :meth:`AdamBridge.step_sync` does not block the
host: it orders the updates before the current stream's next kernel (``overlap_forward`` is
therefore refused). Clipping, accumulation, schedulers, tied and frozen weights and param
groups work as below; with clipping the coefficient scales the device gradients in place.
See :mod:`memopt_offload.device_update`.

Gradient clipping by global norm (``max_grad_norm``) cannot use ``clip_grad_norm_`` with hooks
(the gradients have left the GPU when backward returns). ``clip_mode="wait"`` (the default)
computes each gradient's fp32 norm on the device when its bucket leaves (the total is the L2
norm of those norms stacked in parameter order, so it does not depend on backward's order),
starts no update before backward ends, then scales the host gradients by
``min(1, max_grad_norm / (total_norm + 1e-6))`` (the formula of
``torch.nn.utils.clip_grad_norm_``; a NaN total clips nothing, docs/offload.md) and updates:
exact clipping, transfers still overlap backward, updates do not. ``clip_mode="overlap"``
updates during backward with the coefficient of the *previous* step's total norm (one step
stale; the first step waits), so updates overlap backward but a gradient spike is clipped one
step late. ``last_grad_norm`` holds the total norm of the latest step either way.
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import threading
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypedDict

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from memopt_core.aliasing import check_parameters_apart, labelled_parameters
from memopt_core.backends import forced_backend
from memopt_core.eager import run_eagerly
from memopt_core.errors import ConfigError, OffloadError, StateDictError
from memopt_core.formats import MOMENT_PRESETS, master_codec, moment_codec
from memopt_core.hook_wrappers import (
    reject_hook_wrappers,
    reject_pending_gradients,
    reject_unsynchronized,
    remove_hooks,
)
from memopt_core.optimizer import (
    MemOptimizer,
    adam_hyperparameters,
    check_bool,
    check_saved_param_lists,
    real_as_float,
)
from memopt_core.plan import StateArena, own_storage
from memopt_core.sharding import is_dtensor
from memopt_core.state_dict_hooks import (
    finished_state_dict,
    load_hooks_suspended,
    run_load_post_hooks,
    run_load_pre_hooks,
)
from memopt_core.state_dict_meta import META_KEY, add_group_meta, saved_meta, without_meta
from memopt_kernels_cpu import ops as cpu_ops
from memopt_offload.autotune import AutoTuneConfig, machine_key
from memopt_offload.device_update import DeviceUpdater, refuse_valueless
from memopt_offload.host_memory import HostSlab, SlabLayout, check_host_memory

#: the ``memopt`` entry's list of the host optimizer's normalizing beta2 per group (core's)
_NORM_KEY = "decay_norm_beta2"

__all__ = ["PRECISIONS", "UPDATES", "AdamBridge"]

#: precision -> (moment preset, master format of bf16 parameters)
PRECISIONS: dict[str, tuple[str, str]] = {
    "fp32": ("fp32", "none"),
    "bf16": ("bf16", "none"),
    "fp8": ("fp8", "none"),
    "bf16-ecc24": ("bf16", "ecc24"),
    "compact": ("q8", "ecc24"),
}
#: Where the update runs: the host's CPU kernels, or the device with the state in host RAM
#: (:mod:`memopt_offload.device_update`).
UPDATES = ("host", "device")
#: update -> bucket_mb when None is given (docs/benchmarks/2026-12-01-offload-device-update.md)
_DEFAULT_BUCKET_MB = {"host": 32.0, "device": 64.0}
#: update="device": prefetch_mb when None is given (the host update copies no state ahead)
_DEFAULT_PREFETCH_MB = 512.0
_HYPER = ("lr", "betas", "eps", "weight_decay")
_CLIP_MODES = ("wait", "overlap")
_STATE_DICT_VERSION = 1


def _megabytes(v: Any, *, zero: bool) -> bool:
    """Whether ``v`` is a number of megabytes (> 0, or >= 0 when ``zero``) whose byte count is
    finite."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    mb = real_as_float(v)
    return (mb >= 0 if zero else mb > 0) and math.isfinite(mb * 2**20)


def _written(p: Tensor) -> tuple[int, int]:
    """What tells that ``p`` was written: its version counter (in-place writes) and address
    (``p.data = t``)."""
    return p._version, p.data_ptr()


def _check_ordered_params(params: Any, what: str) -> None:
    """ConfigError unless ``params`` (``what``) is an ordered iterable. torch refuses a set: its
    order follows the tensors' ids, which differ between runs, so a state dict saved by index
    would load onto other parameters after a resume."""
    if isinstance(params, (set, frozenset)):
        raise ConfigError(
            f"{what} is a {type(params).__name__}, whose order changes between runs (a state "
            "dict would load onto other parameters): give a list"
        )
    if not isinstance(params, Iterable):
        raise ConfigError(f"{what} must be an iterable of tensors, got {type(params).__name__}")


def _named_item(item: Any, i: int, gi: int) -> Any:
    """The parameter of item ``i`` of param group ``gi``: torch reads a pair as ``(name,
    parameter)``, so its name must be a str (a pair of tensors is no named parameter)."""
    if not (isinstance(item, tuple) and len(item) == 2):
        return item
    if not isinstance(item[0], str):
        raise ConfigError(
            f"parameter #{i} of param group {gi} is a pair, read as (name, parameter), whose "
            f"name is a {type(item[0]).__name__}: give tensors, or (str, tensor) pairs as "
            "named_parameters() does"
        )
    return item[1]


def _live_params(group: Any, gi: int) -> list[Tensor] | tuple[Tensor, ...]:
    """The 'params' list of live param group ``gi`` (ConfigError where the group, or its list,
    was replaced by something else)."""
    if not isinstance(group, dict):
        raise ConfigError(f"param_groups[{gi}] must be a dict, got a {type(group).__name__}")
    params = group.get("params")
    if not isinstance(params, (list, tuple)):
        raise ConfigError(
            f"'params' of param group {gi} must be the list of its parameters, got "
            f"{type(params).__name__}"
        )
    return params


def _refuse_clipping_change(name: str, value: Any) -> NoReturn:
    raise ConfigError(
        f"AdamBridge.{name} is fixed at construction, got an assignment of {value!r}: pass "
        f"{name} to the constructor of a new AdamBridge (load_state_dict() of this one's "
        "state_dict() carries the state over)"
    )


def _warn_unused_arguments(
    *,
    update: str,
    precision: str,
    max_grad_norm: float | None,
    clip_mode: str | None,
    seed: int | None,
    prefetch_mb: float | None,
) -> None:
    """A UserWarning (at the caller of ``AdamBridge(...)``) for each argument given a value
    that has no effect with the others: their defaults (None) say "the update's default" and
    never warn. Contradictions are ConfigErrors, raised before this runs."""
    unused = []
    if prefetch_mb is not None and update == "host":
        unused.append(
            f"prefetch_mb={prefetch_mb!r} has no effect with update='host': it is the device "
            "update's budget of state copied to the GPU ahead of the gradients "
            "(update='device'); the host update copies gradients, not state"
        )
    if clip_mode is not None and max_grad_norm is None:
        unused.append(
            f"clip_mode={clip_mode!r} has no effect without max_grad_norm: it says when a "
            "step's gradients are clipped, and max_grad_norm=None clips nothing (updates "
            "overlap backward either way)"
        )
    if seed is not None and precision == "fp32":
        unused.append(
            f"seed={seed!r} has no effect with precision='fp32': it keys stochastic rounding, "
            "and fp32 masters and moments round nothing (the bf16 weights are rounded to "
            "nearest)"
        )
    for message in unused:
        # AdamBridge.__init__ called this: its caller is the user's line
        warnings.warn(f"AdamBridge: {message}; leave it out", UserWarning, stacklevel=3)


def _saved_float(v: Any, what: str, allowed: str) -> float:
    """Saved number ``v`` (``what``) as a float; StateDictError for anything else, an int
    beyond float's range included (no step saves one)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise StateDictError(f"{what} must be None or a number {allowed}, got {v!r}")
    try:
        return float(v)
    except OverflowError:
        raise StateDictError(
            f"{what} must be None or a number {allowed}, got an int beyond float's range"
        ) from None


def _first_touched_zeros(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zeroed host tensor whose pages the CPU kernels' threads touch first (NUMA locality)."""
    t = torch.empty(n, dtype=dtype, device=device)
    if t.device.type == "cpu":
        cpu_ops.first_touch(t)
    else:  # pragma: no cover - the host optimizer only holds CPU tensors
        t.zero_()
    return t


#: AdamBridge's own settings, one per optimizer: in a param group they would be ignored
_BRIDGE_WIDE = (
    "precision",
    "max_grad_norm",
    "clip_mode",
    "bucket_mb",
    "pin_memory",
    "seed",
    "autotune",
    "backend",
    "update",
    "prefetch_mb",
)


def _check_hyper(group: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``group``'s AdamW hyperparameters as floats, checked as the host update's optimizer
    checks them (core's check): one check for both updates, when a group is added and at every
    step (a flag set in a group later is refused, not ignored)."""
    for flag in ("maximize", "amsgrad"):  # torch AdamW's, which this update does not do
        if group.get(flag):
            raise ConfigError(
                f"AdamBridge does not support {flag}=True {where}; its update is AdamW without it"
            )
    # torch's Adam sets it False for L2 decay through the gradient; this update decouples it
    dwd = group.get("decoupled_weight_decay")
    if dwd is not None:
        check_bool(f"decoupled_weight_decay {where}", dwd)  # "no" read as true
    if dwd is False:
        raise ConfigError(
            f"AdamBridge does not support decoupled_weight_decay="
            f"{group['decoupled_weight_decay']!r} {where}; its weight decay is AdamW's "
            "(decoupled)"
        )
    for key in _BRIDGE_WIDE:
        if key in group:
            raise ConfigError(
                f"{key} {where}: it is an AdamBridge-wide setting (a constructor argument), "
                "the same for every param group"
            )
    if "betas" not in group:  # a key deleted from a live group
        raise ConfigError(f"betas {where} is missing; expected a pair (beta1, beta2)")
    return adam_hyperparameters(group, group["betas"], where)


class _HostAdamW(MemOptimizer):
    """The host half of AdamBridge: AdamW over host tensors, state first-touched."""

    def _new_arena(self, plan, codecs, master) -> StateArena:
        return StateArena(plan, codecs, master, zeros=_first_touched_zeros)

    def add_group_with_state(self, group: dict[str, Any]) -> None:
        """add_param_group and the group's state, or neither (a failed AdamBridge
        add_param_group leaves everything as it was)."""
        self.add_param_group(group)
        try:
            self.init_state()
        except BaseException:
            self.param_groups.pop()
            self._index = None  # may list the group's masters now
            raise


@dataclass
class _Slot:
    """One trainable parameter: the model's tensor and its host tensors."""

    param: Tensor
    group: int
    # update="host" only (None with update="device", which holds state only):
    master: Tensor | None  # host master the kernel updates (fp32, or bf16 with an ECC-24 code)
    grad: Tensor | None  # pinned host gradient buffer (the parameter's dtype and shape)
    upload: Tensor | None  # host tensor copied back to the parameter (staging or master)
    staging: Tensor | None  # bf16 copy the kernel writes, when the master is fp32
    label: str
    index: int  # position among all parameters of the optimizer (orders the norm's sum)
    shape: torch.Size  # the parameter's shape and dtype when its state was built
    dtype: torch.dtype
    addr: int  # its address when last found apart from every other parameter
    pos: int = -1  # update="device": the parameter's position in the DeviceUpdater
    # update="host": the parameter's (version counter, address) when its master last matched
    # it (built from it, or uploaded to it); another value means the weight was written since
    seen: tuple[int, int] = (-1, -1)

    # update="host" builds every slot with its master, gradient buffer and upload (and
    # update="device" none): its code reads them through these
    @property
    def host_master(self) -> Tensor:
        assert self.master is not None
        return self.master

    @property
    def host_grad(self) -> Tensor:
        assert self.grad is not None
        return self.grad

    @property
    def host_upload(self) -> Tensor:
        assert self.upload is not None
        return self.upload


class _HostArgs(TypedDict):
    """AdamBridge's keyword arguments of its host optimizer (:class:`_HostAdamW`)."""

    seed: int
    backend: str


class _DeviceArgs(TypedDict):
    """AdamBridge's keyword arguments of its :class:`DeviceUpdater`."""

    seed: int
    bucket_bytes: int
    prefetch_bytes: int
    backend: str | None


class _Dispatcher:
    """The thread that runs updates, one bucket at a time: newest ready bucket first
    (``newest_first``, the host update), else in submission order (the device update).

    Newest first because backward produces gradients in the reverse of the order the next
    forward reads the weights: when the host falls behind backward, the buckets left at its end
    are then updated in the order the next forward needs them (``overlap_forward``). A bucket is
    ready when its device-to-host copy has finished; when none is, the oldest runs (its copy
    finishes first). It holds no reference to the optimizer (only to the callables queued), so
    an unused AdamBridge is collected, and the first error of a step is kept for :meth:`wait`
    (later updates of that step are skipped)."""

    def __init__(self, newest_first: bool = True) -> None:
        self._newest_first = newest_first
        self._cond = threading.Condition()
        self._items: list[tuple[_Bucket, Any, tuple]] = []  # in submission order
        self._submitted = 0
        self._done = 0
        self._error: BaseException | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._forked_busy = False
        _DISPATCHERS.add(self)

    def after_fork_in_child(self) -> None:
        """A forked child has no dispatcher thread, and its lock may be held by the parent's.
        Updates in flight at the fork cannot finish here (one may have been half-written into
        the host state the child copied): every later wait or submit raises."""
        self._cond = threading.Condition()
        self._thread = None
        self._forked_busy = self._done != self._submitted

    def _check_not_forked_busy(self) -> None:
        if self._forked_busy:
            raise OffloadError(
                "this process was forked while AdamBridge updates were in flight: their host "
                "state is undefined in the child. Call optimizer.synchronize() before forking "
                "(DataLoader workers: create them before training, or use the 'spawn' start "
                "method)"
            )

    def submit(self, bucket: _Bucket, fn: Any, *args: Any) -> None:
        self._check_not_forked_busy()
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=_dispatch_loop,
                    args=(self,),
                    name="memopt-offload-dispatcher",
                    daemon=True,
                )
                self._thread.start()
            self._items.append((bucket, fn, args))
            self._submitted += 1
            self._cond.notify_all()

    def next_item(self) -> tuple[_Bucket, Any, tuple] | None:
        """The next item to run (blocks while there is none); None once stopped."""
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._stopped)
            if self._stopped:
                return None
            items = self._items
            if self._newest_first:
                for i in range(len(items) - 1, 0, -1):
                    if items[i][0].ready():
                        return items.pop(i)
            return items.pop(0)

    def run(self, bucket: _Bucket, fn: Any, args: tuple) -> None:
        """Run one item (skipped after an earlier error of the same step) and record it."""
        with self._cond:
            failed = self._error is not None
        error = None
        if not failed:
            try:
                fn(bucket, *args)
            except BaseException as e:  # handed to step_sync()
                error = e
        with self._cond:
            if error is not None and self._error is None:
                self._error = error
            bucket.done = True
            self._done += 1
            self._cond.notify_all()

    def fail_queued(self, error: BaseException) -> None:
        """The loop itself failed outside an update (``ready()``'s ``event.query()`` raises
        after a device error): keep ``error`` as the step's, and mark every queued item done
        (skipped), so that no wait blocks for a thread that has ended."""
        with self._cond:
            if self._error is None:
                self._error = error
            for bucket, _, _ in self._items:
                bucket.done = True
            self._done += len(self._items)
            self._items.clear()
            # the calling thread returns next but is still alive for a moment: a submit()
            # in that window saw is_alive(), started no thread and queued an item nobody ran
            # (wait() blocked forever). Marked dead under the lock, the next submit starts one
            if self._thread is threading.current_thread():
                self._thread = None
            self._cond.notify_all()

    def wait_bucket(self, bucket: _Bucket) -> bool:
        """Block until ``bucket`` ran (or was skipped); False when a step's update failed."""
        self._check_not_forked_busy()
        with self._cond:
            self._cond.wait_for(lambda: bucket.done)
            return self._error is None

    def wait(self) -> BaseException | None:
        """Block until every submitted item ran; returns (and clears) the first error."""
        self._check_not_forked_busy()
        with self._cond:
            self._cond.wait_for(lambda: self._done == self._submitted)
            err, self._error = self._error, None
        return err

    def stop(self) -> None:
        """Drop the queued items and end the thread after the one it runs. Joined (unless
        called on the thread itself), so that at interpreter exit no update is still inside
        the C++ kernels when their thread pool is torn down."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


#: every live dispatcher, for the fork handler below
_DISPATCHERS: weakref.WeakSet[_Dispatcher] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for dispatcher in list(_DISPATCHERS):
        dispatcher.after_fork_in_child()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _dispatch_loop(dispatcher: _Dispatcher) -> None:
    # grad mode is per thread, and a new thread's is on: the updates write parameters in place
    torch.set_grad_enabled(False)
    while True:
        try:
            item = dispatcher.next_item()
        except BaseException as e:  # the thread ends here: step_sync() raises it, not hangs
            dispatcher.fail_queued(e)
            return
        if item is None:
            return
        dispatcher.run(*item)
        del item  # drop the optimizer reference before blocking again


#: Tensor methods and attributes that read only metadata: using them on a weight in flight is
#: safe (``.data``, ``.T`` and other views are not in these lists: they read values later)
_METADATA_METHODS = frozenset(
    {"size", "dim", "ndimension", "numel", "nelement", "element_size", "stride",
     "storage_offset", "is_contiguous", "is_floating_point", "is_complex", "get_device"}
)  # fmt: skip
_METADATA_ATTRIBUTES = frozenset(
    {"shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad", "grad_fn",
     "names", "itemsize", "nbytes", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
     "is_nested", "_version"}
)  # fmt: skip


def _called_modules(m: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``m``, or where ``m`` is a container without a forward of its own (``ModuleList``,
    ``ModuleDict``), the modules in it that run: their callers call them, never ``m``, so a
    forward hook on ``m`` would not run (memopt_ecc's ``cast_model`` hooks the same way)."""
    if type(m).forward is not torch.nn.Module.forward:
        yield m
        return
    for child in m.children():
        yield from _called_modules(child)


class _WeakHook:
    """A hook calling the bound ``method`` (with the arguments ``first`` before the hook's own)
    through a weak reference: the modules and tensors a hook is registered on must not keep
    the optimizer alive (its host memory and thread), and once it is collected the hook does
    nothing (its finalizer removes the hooks too). Copying or pickling it (a model copied with
    the hooks attached) refuses as the optimizer itself does: a copy would share its hooks."""

    __slots__ = ("_first", "_ref")

    def __init__(self, method: Any, *first: Any) -> None:
        self._ref, self._first = weakref.WeakMethod(method), first

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._ref()
        return None if bound is None else bound(*self._first, *args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        bound = self._ref()
        if bound is None:
            raise TypeError("a hook of a collected AdamBridge cannot be copied")
        return bound.__self__.__getstate__()  # raises the optimizer's TypeError


class _ReadGuard(TorchFunctionMode):
    """The check of the first forward that overlaps updates (``overlap_forward``): a torch
    function that reads a parameter whose update is still in flight, before any forward
    pre-hook waited for it, raises :class:`OffloadError` instead of reading a stale weight.
    Metadata (``shape``, ``dtype``, ``numel()``...) may be read; ``.data`` may not."""

    def __init__(self, bridge: AdamBridge) -> None:
        super().__init__()
        self._bridge = bridge

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inflight = self._bridge._inflight
        if inflight and not _reads_metadata_only(func):
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, Tensor) and id(t) in inflight:
                    slot = self._bridge._slots[id(t)]
                    raise OffloadError(
                        f"{getattr(func, '__name__', func)} read {slot.label} before the "
                        "forward pre-hook of a module holding it waited for its update "
                        "(overlap_forward): read each weight through the module that holds "
                        "it, call optimizer.synchronize() first, or attach the hooks without "
                        "overlap_forward"
                    )
        return func(*args, **kwargs)


def _reads_metadata_only(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # an attribute: the descriptor's name says which
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_ATTRIBUTES
    return name in _METADATA_METHODS and getattr(func, "__qualname__", "").startswith("TensorBase.")


@dataclass(eq=False)
class _Bucket:
    slots: list[_Slot] = field(default_factory=list)
    nbytes: int = 0
    event: Any = None  # torch.cuda.Event after the bucket's device-to-host copies
    # until the bucket closes: the gradients to copy (taken off their parameters by the hooks)
    grads: list[Tensor] = field(default_factory=list)
    uploaded: Any = None  # torch.cuda.Event after the bucket's host-to-device copies
    hyper: dict[int, dict[str, Any]] = field(default_factory=dict)  # group -> lr, betas, ...
    done: bool = False  # set by the dispatcher once the update ran (or was skipped)
    copied: bool = False  # the gradients are on their way to the host buffers

    def ready(self) -> bool:
        """Whether the gradients are in host memory (the device-to-host copies finished)."""
        return self.event is None or self.event.query()


class _HostHeldState(defaultdict):
    """AdamBridge's ``optimizer.state``: empty, since the state lives in pinned host memory
    (:meth:`AdamBridge.state_dict` hands it out), but true, since that state exists from
    construction. torch's ``get_state_dict`` / ``set_state_dict`` take an optimizer whose
    ``state`` is false for one never stepped and, when no parameter holds a gradient, step it
    once with zero gradients at lr 0 to create its state: that advanced every step count and
    decayed the moments of the training run itself."""

    def __bool__(self) -> bool:
        return True


class AdamBridge(Optimizer):
    """AdamW whose master weights and moments live in host RAM (see the module doc).

    Host state per trainable parameter: 12 B for ``precision="fp32"`` (fp32 master, m, v),
    8 B ``"bf16"``, about 6.1 B ``"fp8"``, 7 B ``"bf16-ecc24"`` (bf16 weight + ECC-24 code +
    bf16 m, v), about 5.1 B ``"compact"`` (q8 moments); the GPU keeps only the bf16 (or
    float32) weights. ``update="host"`` steps on the CPU with the C++ kernels while backward
    runs; ``update="device"`` (``"bf16-ecc24"`` only) copies the state in per bucket and steps
    it with one fused Triton launch.

    Args:
        params: the model's parameters (bfloat16 or float32, all on one device: a GPU, or the
            CPU), or param-group dicts; frozen parameters get no host memory.
        lr, betas, eps, weight_decay: AdamW's (decoupled decay ``lr * weight_decay``), per group.
        precision: host state format: ``"fp32"``, ``"bf16"``, ``"fp8"``, ``"bf16-ecc24"`` or
            ``"compact"`` (the last two: an ECC-24 master for bf16 parameters, with bf16 or q8
            moments; float32 parameters keep an fp32 master).
        max_grad_norm: clip gradients to this global L2 norm (None: no clipping).
        clip_mode: with ``max_grad_norm``: ``"wait"`` (exact; what None picks) or
            ``"overlap"`` (previous step's norm), see module doc. Without clipping a value
            given has no effect, and warns.
        bucket_mb: gradient megabytes per update call (latency vs. call overhead); None: 32
            for ``update="host"``, 64 for ``update="device"`` (each bucket costs the device
            update about 1 ms of Python; 64 was faster than 32 on the Qwen2.5-0.5B shape).
        pin_memory: page-lock the host buffers (GPU parameters only).
        seed: key of the stochastic-rounding generator (None: 0); its low 32 bits key it
            (docs/formats.md), so seeds equal modulo 2**32 round alike. ``precision="fp32"``
            rounds nothing stochastically: a seed given there has no effect, and warns.
        autotune: an :class:`memopt_offload.autotune.AutoTuneConfig` to apply (the C++ CPU
            kernels' threads and chunk size, process-wide), True to load or measure one, None
            to leave the settings as they are. Where no update runs those kernels
            (``backend="torch"``, or ``update="device"`` on a GPU) it warns.
        backend: kernel backend. ``update="host"``: ``"cpu"`` (the C++ kernels, what None
            picks) or ``"torch"`` (core's reference). ``update="device"``: None picks the
            Triton kernels on CUDA (the C++ kernels for a CPU model); ``"torch"`` forces core's
            reference.
        update: ``"host"`` (the CPU updates the host state, module doc) or ``"device"``: the
            state stays in pinned host RAM and the GPU updates it, bucket by bucket, during
            backward (:mod:`memopt_offload.device_update`); needs ``precision="bf16-ecc24"``
            and no ``overlap_forward``.
        prefetch_mb: ``update="device"``: device megabytes of state copied ahead of the
            gradients (None: 512; 0: none; a positive budget below one bucket copies one
            bucket ahead). ``update="host"`` copies no state: a value given there has no
            effect, and warns.

    Host memory is allocated when a param group is added (at construction), with an
    :class:`~memopt_core.errors.OffloadError` before anything is allocated when the host lacks it.

    Fused: ``update="host"`` runs one C++ kernel call per bucket that decodes the host state,
    applies AdamW and encodes it back, writing the bf16 copy of the new weights for the GPU in
    the same pass; ``update="device"`` one Triton launch per bucket on the state copied in.
    """

    # set by _reset_pipeline (below the methods that use them)
    _read_guard: _ReadGuard | None
    _callback_queued: bool

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        precision: str = "bf16",
        max_grad_norm: float | None = None,
        clip_mode: str | None = None,
        bucket_mb: float | None = None,
        pin_memory: bool = True,
        seed: int | None = None,
        autotune: bool | AutoTuneConfig | None = None,
        backend: str | None = None,
        update: str = "host",
        prefetch_mb: float | None = None,
    ) -> None:
        # a str first: a list (precision=["bf16"]) is unhashable, a TypeError in the dict lookup
        if not isinstance(precision, str) or precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {precision!r}; choose one of {tuple(PRECISIONS)}")
        if update not in UPDATES:
            raise ConfigError(f"update must be one of {UPDATES}, got {update!r}")
        if update == "device" and precision != "bf16-ecc24":
            raise ConfigError(
                f"update='device' keeps precision='bf16-ecc24' state (ECC-24 code and bf16 "
                f"moments, 5 B per bf16 parameter), got precision={precision!r}"
            )
        if prefetch_mb is not None and not _megabytes(prefetch_mb, zero=True):
            raise ConfigError(f"prefetch_mb must be a finite number >= 0, got {prefetch_mb!r}")
        if max_grad_norm is not None:
            if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
                raise ConfigError(f"max_grad_norm must be a number or None, got {max_grad_norm!r}")
            if not (math.isfinite(real_as_float(max_grad_norm)) and max_grad_norm > 0):
                raise ConfigError(f"max_grad_norm must be finite and > 0, got {max_grad_norm}")
        if clip_mode is not None and clip_mode not in _CLIP_MODES:
            raise ConfigError(f"clip_mode must be one of {_CLIP_MODES}, got {clip_mode!r}")
        if bucket_mb is None:
            bucket_mb = _DEFAULT_BUCKET_MB[update]
        if not _megabytes(bucket_mb, zero=False):
            raise ConfigError(f"bucket_mb must be a finite number > 0, got {bucket_mb!r}")
        check_bool("pin_memory", pin_memory)
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64
        ):
            raise ConfigError(f"seed must be an int in [0, 2**64) or None, got {seed!r}")
        tuned = None
        if autotune is True:
            tuned = AutoTuneConfig.load_or_measure()
        elif autotune is not None and autotune is not False:  # 0 is no bool: refused below
            if not isinstance(autotune, AutoTuneConfig):  # the class itself, say
                raise ConfigError(
                    f"autotune must be None, True or an AutoTuneConfig instance, got {autotune!r}"
                )
            tuned = autotune
            here = machine_key()
            if autotune.machine != here:
                warnings.warn(
                    f"autotune: this AutoTuneConfig was measured on {autotune.machine!r}, not "
                    f"on this machine ({here!r}); its thread count and chunk size may not suit "
                    "it. autotune=True measures this one (and caches the result)",
                    UserWarning,
                    stacklevel=2,
                )
        _warn_unused_arguments(
            update=update,
            precision=precision,
            max_grad_norm=max_grad_norm,
            clip_mode=clip_mode,
            seed=seed,
            prefetch_mb=prefetch_mb,
        )
        # applied before the host state is allocated (the pool's threads first-touch its
        # pages), and taken back if the construction fails: the settings are process-wide
        untune = None
        if tuned is not None:
            prev = (cpu_ops.get_num_threads(), cpu_ops.get_chunk_size())
            tuned.apply()

            def untune() -> None:
                cpu_ops.set_num_threads(prev[0])
                cpu_ops.set_chunk_size(prev[1])

        self.precision = precision
        self.update = update
        self._max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self._clip_mode = "wait" if clip_mode is None else clip_mode
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.pin_memory = pin_memory
        self.last_grad_norm: float | None = None
        self._device: torch.device | None = None
        self._slots: dict[int, _Slot] = {}
        self._slabs: list[HostSlab] = []
        self._host: _HostAdamW | None = None
        seed = 0 if seed is None else seed
        self._host_args = _HostArgs(seed=seed, backend="cpu" if backend is None else backend)
        self._dev: DeviceUpdater | None = None
        if prefetch_mb is None:
            prefetch_mb = _DEFAULT_PREFETCH_MB
        self._dev_args = _DeviceArgs(
            seed=seed,
            bucket_bytes=self.bucket_bytes,
            prefetch_bytes=int(prefetch_mb * 2**20),
            backend=backend,
        )
        self._hooks: list[Any] = []
        self._accumulating = False
        # (parameter, group) of params frozen when their group was added, until step() warns
        # that one of them holds a gradient
        self._untrained: list[tuple[Tensor, int]] = []
        # each group's parameters when it was added: one appended to its "params" list later,
        # or put in place of one, has no slot, and step() (which walks the slots) would never
        # train it
        self._group_params: list[tuple[Tensor, ...]] = []
        self._hyper: list[dict[str, Any]] = []  # the open step's hyperparameters, per group
        self._warned_late_hyper = False
        self._reset_pipeline()
        try:
            self._add_initial_groups(
                params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
            )
            if tuned is not None:
                self._warn_untuned_kernels()
        except BaseException:
            if untune is not None:
                untune()
            raise

    def _warn_untuned_kernels(self) -> None:
        """Warn (at the caller of ``AdamBridge(...)``) when ``autotune`` has no effect on this
        optimizer's updates: it sets the C++ CPU kernels' thread count and chunk size, and
        ``backend="torch"``, or ``update="device"`` on a GPU (Triton), runs no update there."""
        if self.update == "device":
            regions = self._dev.regions if self._dev is not None else []
            names = sorted({region.backend.name for region in regions})
            if not names or "cpu" in names:  # nothing to update yet, or a CPU model's update
                return
            runs = f"update='device' runs its updates with the {' and '.join(names)} backend"
        else:
            name = forced_backend(self._host_args["backend"])
            if name in (None, "cpu"):
                return
            runs = f"backend={name!r} runs the host updates"
        warnings.warn(
            "AdamBridge: autotune has no effect on this optimizer: it sets the thread count and "
            f"chunk size of the C++ CPU kernels (memopt-kernels-cpu), and {runs}; leave it out "
            "(the settings were applied, process-wide)",
            UserWarning,
            stacklevel=3,
        )

    def _add_initial_groups(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        """The constructor's param groups and their host state (torch's ``__init__``)."""
        if isinstance(params, Tensor):
            raise ConfigError(
                "params must be an iterable of tensors or param groups: wrap it in a list"
            )
        _check_ordered_params(params, "params")
        # While the constructor adds its groups, the checks against the groups already held and
        # the host optimizer wait for the last one: made per group, they made construction
        # quadratic in the number of groups (14.7 s for 1000 one-parameter groups)
        self._initial_ids: set[int] | None = set()
        self._initial_host_groups: list[dict[str, Any]] | None = []
        super().__init__(params, defaults)
        self.state = _HostHeldState(dict)
        host_groups, self._initial_host_groups, self._initial_ids = (
            self._initial_host_groups,
            None,
            None,
        )
        check_parameters_apart(labelled_parameters(self.param_groups), [])
        if host_groups:
            self._host = self._new_host(host_groups)

    # A step's buckets wait for its norm (or not) by the clipping they found when they
    # closed, and the hooks close them during backward: a change between backward and
    # step_sync() left buckets held forever or ran them twice. Fixed at construction.
    @property
    def max_grad_norm(self) -> float | None:
        """The global L2 norm gradients are clipped to (None: no clipping), as constructed."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        _refuse_clipping_change("max_grad_norm", value)

    @property
    def clip_mode(self) -> str:
        """``"wait"`` or ``"overlap"`` (see the module doc), as constructed."""
        return self._clip_mode

    @clip_mode.setter
    def clip_mode(self, value: str) -> None:
        _refuse_clipping_change("clip_mode", value)

    # ------------------------------------------------------------------------- host memory
    @property
    def _cuda(self) -> bool:
        return self._device is not None and self._device.type == "cuda"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (torch semantics) and allocate its host memory now. When it
        fails, the optimizer is left as it was."""
        if self._hooks:
            raise ConfigError("add_param_group while hooks are attached: call detach_hooks() first")
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise ConfigError("a param group must be a dict with a 'params' entry")
        gi = len(self.param_groups)
        raw = param_group["params"]
        if not isinstance(raw, Tensor):
            _check_ordered_params(raw, f"'params' of param group {gi}")
        # a generator is used up by the checks below: torch must get the same items
        raw = param_group["params"] = [raw] if isinstance(raw, Tensor) else list(raw)
        params = [_named_item(item, i, gi) for i, item in enumerate(raw)]
        device = self._device
        seen: set[int] = set()
        held = (
            self._initial_ids
            if self._initial_ids is not None
            else {id(q) for g in self.param_groups for q in g["params"]}
        )
        for i, p in enumerate(params):
            if not isinstance(p, Tensor):
                raise ConfigError(f"parameter #{i} of param group {gi} is a {type(p).__name__}")
            if torch.nn.parameter.is_lazy(p):
                raise ConfigError(
                    f"parameter #{i} of param group {gi} is not initialized yet (a lazy "
                    "module's): run one forward pass before creating the optimizer"
                )
            if is_dtensor(p):
                raise ConfigError(
                    f"parameter #{i} of param group {gi} is a DTensor (FSDP2 / tensor parallel): "
                    "AdamBridge takes whole parameters; under FSDP2 run one AdamBridge per "
                    "process on unsharded (DDP or single-device) models"
                )
            if p.dtype not in (torch.bfloat16, torch.float32):
                raise ConfigError(
                    f"parameter #{i} of param group {gi} (shape {tuple(p.shape)}) is {p.dtype}; "
                    "AdamBridge keeps bfloat16 (or float32) weights on the device: cast the "
                    "model, e.g. model.to(torch.bfloat16)"
                )
            if device is None:
                device = p.device
            if p.device != device:
                raise ConfigError(
                    f"parameter #{i} of param group {gi} is on {p.device}, the others on "
                    f"{device}: AdamBridge runs one device per optimizer (one per process)"
                )
            if p.is_meta:
                raise ConfigError(
                    f"parameter #{i} of param group {gi} (shape {tuple(p.shape)}) is on the meta "
                    "device and holds no data: materialize the model first (e.g. "
                    "model.to_empty(device=...) and load its weights)"
                )
            if p.layout != torch.strided:
                raise ConfigError(f"parameter #{i} of param group {gi} is a {p.layout} tensor")
            if p.is_inference():
                raise ConfigError(
                    f"parameter #{i} of param group {gi} (shape {tuple(p.shape)}) was created "
                    "under torch.inference_mode(): it cannot be updated in place outside it "
                    "(clone it outside inference mode)"
                )
            if id(p) in seen:
                raise ConfigError(
                    f"parameter #{i} of param group {gi} (shape {tuple(p.shape)}) appears twice "
                    "in the group: list each parameter once"
                )
            if id(p) in held:
                raise ConfigError(
                    f"parameter #{i} of param group {gi} (shape {tuple(p.shape)}) is already in "
                    "another param group; each parameter belongs to one group"
                )
            seen.add(id(p))
        if self._initial_ids is None:
            check_parameters_apart(
                [(p, f"parameter #{i} of param group {gi}") for i, p in enumerate(params)],
                labelled_parameters(self.param_groups),
            )
        _check_hyper({**self.defaults, **param_group}, f"(param group {gi})")
        prev_device, self._device = self._device, device
        try:
            super().add_param_group(param_group)
            self._allocate_group(gi, self.param_groups[-1], raw)
        except BaseException:
            # _allocate_group keeps what it built only once all of it succeeded
            del self.param_groups[gi:]
            self._device = prev_device
            raise
        self._untrained += [(p, gi) for p in self.param_groups[gi]["params"] if not p.requires_grad]
        self._group_params.append(tuple(self.param_groups[gi]["params"]))
        if self._initial_ids is not None:
            self._initial_ids.update(map(id, params))

    def _label(self, gi: int, names: list[Any], p: Tensor, idx: int) -> tuple[str, int]:
        """(label, index among all parameters of the optimizer) of ``p``, parameter ``idx`` of
        group ``gi``."""
        label = names[idx] if idx < len(names) and names[idx] else f"#{idx}"
        index = sum(len(g["params"]) for g in self.param_groups[:gi]) + idx
        return f"parameter {label} of param group {gi} (shape {tuple(p.shape)})", index

    def _allocate_group(self, gi: int, group: dict[str, Any], raw: list[Any]) -> None:
        """Allocate group ``gi``'s host memory and state; nothing of it is kept on failure."""
        train = [p for p in group["params"] if p.requires_grad]
        # torch records the names of named_parameters() and of a group's own "param_names"
        names = group.get("param_names") or [
            item[0] if isinstance(item, tuple) else None for item in raw
        ]
        where = {id(q): i for i, q in enumerate(group["params"])}
        labels = [self._label(gi, names, p, where[id(p)]) for p in train]
        if self.update == "device":
            self._allocate_device_group(gi, train, labels)
            return
        moments, master = PRECISIONS[self.precision]
        pin = self.pin_memory and self._cuda
        pinned, plain = SlabLayout(), SlabLayout()
        layout: list[tuple[int, int, int, int | None]] = []  # master, grad, upload, staging
        for p in train:
            if p.dtype == torch.float32 or self._ecc_master(p):
                # the master itself is what goes back to the device: it must be pinned
                m = pinned.add(p.shape, p.dtype)
                g = pinned.add(p.shape, p.dtype)
                layout.append((m, g, m, None))
            else:
                m = plain.add(p.shape, torch.float32)
                g = pinned.add(p.shape, p.dtype)
                st = pinned.add(p.shape, torch.bfloat16)
                layout.append((m, g, st, st))
        # the state arena from the formats' own byte counts, plus block padding per tensor
        first, second = MOMENT_PRESETS[moments]
        per = moment_codec(first).bytes_per_element() + moment_codec(second).bytes_per_element()
        arena = 0.0
        for p in train:
            codec = master_codec("fp32" if p.dtype == torch.float32 else master, p.dtype)
            code = codec.code_dtype.itemsize if codec.code_dtype is not None else 0
            arena += p.numel() * (per + code)
        needed = pinned.nbytes + plain.nbytes + int(arena) + 64 * len(train)
        hint = "; precision='compact' holds about 7 B per parameter"
        if self.precision == "compact":
            hint = ""
        what = f"AdamBridge param group {gi}"
        check_host_memory(needed, pinned.nbytes if pin else 0, what, hint)
        pslab = HostSlab(pinned, pin=pin, what=what)
        uslab = HostSlab(plain, pin=False, what=what)
        slots, masters = [], []
        with torch.no_grad():
            for p, (m, g, u, s), (label, index) in zip(train, layout, labels, strict=True):
                slab_m = pslab if p.dtype == torch.float32 or s is None else uslab
                mt = slab_m.view(m)
                mt.copy_(p.detach())  # the device weight (bf16 widens exactly)
                mt.requires_grad_(True)
                slot = _Slot(
                    param=p,
                    group=gi,
                    master=mt,
                    grad=pslab.view(g),
                    upload=mt if s is None else pslab.view(u),
                    staging=None if s is None else pslab.view(s),
                    label=label,
                    index=index,
                    shape=p.shape,
                    dtype=p.dtype,
                    addr=p.data_ptr(),
                    seen=_written(p),
                )
                slots.append(slot)
                masters.append(mt)
        host_group = {k: group[k] for k in _HYPER}
        host_group["params"] = masters
        if self._initial_host_groups is not None:
            self._initial_host_groups.append(host_group)
        elif self._host is None:
            self._host = self._new_host([host_group])
        else:
            self._host.add_group_with_state(host_group)
        self._slabs += [pslab, uslab]
        self._slots.update((id(slot.param), slot) for slot in slots)

    def _new_host(self, groups: list[dict[str, Any]]) -> _HostAdamW:
        """The host optimizer over the masters of ``groups``, its state created."""
        moments, master = PRECISIONS[self.precision]
        host = _HostAdamW(
            groups,
            rule="adamw",
            moments=moments,
            master=master,
            stochastic_rounding=True,
            **self._host_args,
        )
        host.init_state()
        return host

    def _allocate_device_group(
        self, gi: int, train: list[Tensor], labels: list[tuple[str, int]]
    ) -> None:
        dev = self._dev
        if dev is None:
            assert self._device is not None
            dev = DeviceUpdater(self._device, pin=self.pin_memory and self._cuda, **self._dev_args)
        first = len(dev.params)  # the host update's tensor ids: trainable ones in order
        dev.add_group(gi, train, first, f"AdamBridge param group {gi}")  # all of it, or nothing
        self._dev = dev
        for k, (p, (label, index)) in enumerate(zip(train, labels, strict=True)):
            self._slots[id(p)] = _Slot(
                param=p,
                group=gi,
                master=None,
                grad=None,
                upload=None,
                staging=None,
                label=label,
                index=index,
                shape=p.shape,
                dtype=p.dtype,
                addr=p.data_ptr(),
                pos=first + k,
            )

    def host_bytes(self) -> int:
        """Host RAM held: the slabs (gradient, staging and master buffers) plus the moments
        (``update="device"``: the state slabs alone)."""
        if self._dev is not None:
            return self._dev.host_bytes()
        assert self._host is not None
        return sum(s.nbytes for s in self._slabs) + self._host.state_bytes()

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on the host: the masters (fp32, or the bf16 copy of
        ECC-24 masters) plus moments, scales and ECC codes; not the transfer buffers
        (``update="device"``: moments and codes; the bf16 weights are on the device)."""
        if self._dev is not None:
            return self._dev.state_bytes()
        assert self._host is not None
        masters = sum(
            s.host_master.numel() * s.host_master.element_size() for s in self._slots.values()
        )
        return masters + self._host.state_bytes()

    def pinned_bytes(self) -> int:
        """Page-locked host bytes (0 on a CPU model or with ``pin_memory=False``)."""
        if self._dev is not None:
            return self._dev.pinned_bytes()
        return sum(s.nbytes for s in self._slabs if s.pinned)

    def master_weight(self, p: Tensor) -> Tensor:
        """The host fp32 master of parameter ``p`` (a copy; an ECC-24 master decoded)."""
        slot = self._slot(p)
        if self._pending:  # updates started between backward and step_sync(): collect them
            self._finish()
        self.synchronize()
        if self._dev is not None:
            self._dev.synchronize_host()
            with torch.no_grad():
                code = self._dev.views(slot.pos).get("master_code")
                if code is None:  # a float32 parameter is its own master
                    return slot.param.detach().to("cpu", torch.float32, copy=True)
                return cpu_ops.decode_master("ecc24", slot.param.detach().to("cpu"), code)
        assert self._host is not None  # update="host"
        self._reread_written([slot])
        master = slot.host_master
        with torch.no_grad():
            if self._ecc_master(slot.param):
                code = self._host.state[master]["master_code"]
                return cpu_ops.decode_master("ecc24", master.detach(), code)
            return master.detach().clone()

    def _ecc_master(self, p: Tensor) -> bool:
        """Whether ``p``'s host master is its bf16 weight plus an ECC-24 code."""
        return PRECISIONS[self.precision][1] == "ecc24" and p.dtype == torch.bfloat16

    def _slot(self, p: Tensor) -> _Slot:
        if not isinstance(p, Tensor):
            raise ConfigError(f"master_weight takes a parameter tensor, got {type(p).__name__}")
        slot = self._slots.get(id(p))
        if slot is None or slot.param is not p:
            raise ConfigError(
                f"a tensor of shape {tuple(p.shape)} that this AdamBridge does not train (not in "
                "its param groups, or frozen when the group was added)"
            )
        return slot

    # ------------------------------------------------------------------------------ hooks
    def attach_hooks(self, model: torch.nn.Module, *, overlap_forward: bool = False) -> None:
        """Update each parameter of ``model`` from a post-accumulate-grad hook as soon as its
        gradient is final (see the module doc); a forward pre-hook on ``model`` (on each
        module in it that runs, for a container without a forward such as a ``ModuleList`` of
        two models) raises :class:`~memopt_core.errors.OffloadError` when a forward starts before
        :meth:`step_sync` collected the updates of the last backward. DDP and FSDP1 models
        are refused (``TypeError``: their hooks see un-reduced gradients); with DDP, call
        :meth:`step` after backward instead, one AdamBridge per process.

        ``overlap_forward=True``: :meth:`step_sync` returns without waiting for the updates,
        and the next forward overlaps them: a forward pre-hook on every module that holds one
        of the optimizer's parameters waits for that module's own parameters (module doc,
        "Overlapping the next forward")."""
        check_bool("overlap_forward", overlap_forward)
        if overlap_forward and self.update == "device":
            raise ConfigError(
                "overlap_forward is for update='host': with update='device' step_sync() does "
                "not block the host (the next forward is ordered after the updates on the GPU)"
            )
        if self._hooks:
            raise ConfigError(
                "hooks are already attached: call detach_hooks() first (to hook two models, "
                "attach once to a torch.nn.ModuleList of both)"
            )
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"attach_hooks takes a torch.nn.Module, got {type(model).__name__}")
        reject_hook_wrappers(model, "AdamBridge.attach_hooks()")
        reject_unsynchronized(model, "AdamBridge.attach_hooks()")
        reject_pending_gradients(
            model,
            {id(s.param) for s in self._slots.values() if s.param.requires_grad},
            "AdamBridge.attach_hooks()",
        )
        self._reject_sparse_modules(model)
        try:
            self._attach(model, overlap_forward)
        except BaseException:
            self.detach_hooks()  # nothing half-attached
            raise

    def _reject_sparse_modules(self, model: torch.nn.Module) -> None:
        """ConfigError for an embedding of this optimizer's with ``sparse=True``: its sparse
        gradient is refused, and with hooks only in its own hook, after the layers whose
        gradients came first were updated."""
        for name, module in model.named_modules():
            if not isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
                continue
            w = module.weight
            slot = self._slots.get(id(w))
            if module.sparse and w.requires_grad and slot is not None and slot.param is w:
                raise ConfigError(
                    f"{type(module).__name__} {name or 'model'!r} has sparse=True: AdamBridge "
                    "takes dense gradients (as torch's AdamW), and with hooks a sparse one is "
                    "only refused in its own hook, after other layers were updated. Build the "
                    "embedding with sparse=False"
                )

    def _attach(self, model: torch.nn.Module, overlap_forward: bool) -> None:
        hooked = 0
        for p in model.parameters():
            slot = self._slots.get(id(p))
            if slot is None or slot.param is not p:
                continue
            if not p.requires_grad:  # frozen for now: step() takes a gradient it gets later
                continue
            self._hooks.append(p.register_post_accumulate_grad_hook(_WeakHook(self._on_grad)))
            hooked += 1
        if not hooked:
            raise ConfigError(
                "attach_hooks found none of this optimizer's trainable parameters in the model "
                "(that require gradients)"
            )
        # on the modules that run: a container without a forward of its own (the ModuleList
        # of two models that the message of a second attach_hooks() advises) is never called,
        # so a hook on it alone left a forward before step_sync() unchecked
        called = list({id(m): m for m in _called_modules(model)}.values())  # one hook each
        for module in called:
            self._hooks.append(module.register_forward_pre_hook(_WeakHook(self._check_synced)))
        self._overlap = overlap_forward
        if overlap_forward:
            for module in model.modules():
                # MultiheadAttention's forward reads its out_proj's weights directly
                reads = (
                    module.parameters()
                    if isinstance(module, torch.nn.MultiheadAttention)
                    else module._parameters.values()
                )
                own = tuple(
                    id(p)
                    for p in reads
                    if p is not None and id(p) in self._slots and self._slots[id(p)].param is p
                )
                if own:
                    await_own = _WeakHook(self._await_params, own)
                    self._hooks.append(module.register_forward_pre_hook(await_own))
            for module in called:
                self._hooks.append(
                    module.register_forward_hook(_WeakHook(self._end_read_guard), always_call=True)
                )
            self._guard_next_forward = True
        # model.state_dict() reads the weights outside any forward; model.load_state_dict()
        # writes them (the root's pre-hook runs before any copy): pending updates land first
        self._hooks.append(model.register_state_dict_pre_hook(_WeakHook(self._sync_before_read)))
        self._hooks.append(
            model.register_load_state_dict_pre_hook(_WeakHook(self._sync_before_read))
        )

    def detach_hooks(self) -> None:
        """Remove the hooks (waits for in-flight updates first); idempotent."""
        try:
            if self._pending or self._inflight:
                self._finish()  # raises a failed update's error
        finally:
            # removed even then: detach_hooks() raised and left them attached (a second call
            # was needed, and the caller that gave up after the error kept hooked weights)
            remove_hooks(self._hooks)  # the same list: the finalizer holds it
            self._overlap = False
            self._guard_next_forward = False
            # a forward interrupted by a BaseException (KeyboardInterrupt: the always-called
            # forward hook only sees Exceptions) left its read guard on torch's mode stack
            guard, self._read_guard = self._read_guard, None
            if guard is not None:
                guard.__exit__(None, None, None)

    @property
    def hooks_attached(self) -> bool:
        return bool(self._hooks)

    @contextlib.contextmanager
    def no_update(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside leave their gradients on the device to
        accumulate (like DDP's ``no_sync``); the next backward outside sends the sum (or
        :meth:`step_sync` right after applies it, and frees it)."""
        prev, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = prev

    def _check_synced(self, module: torch.nn.Module, args: Any) -> None:
        if self._pending:
            raise OffloadError(
                f"a forward of {type(module).__name__} started while {len(self._pending)} "
                "parameter update(s) of the last backward are not collected: call "
                "optimizer.step_sync() (or step()) after backward and before the next forward, "
                "or the forward could read half-updated weights. After a backward that raised, "
                "the updates its hooks started are already under way and step_sync() "
                "completes them: to drop that batch instead, reload the last checkpoint. A "
                "backward through this model for another optimizer's loss (a GAN's generator "
                "step through its discriminator) updates it too, and zero_grad() cannot undo "
                "that: freeze it for that backward (requires_grad_(False))"
            )
        if self._guard_next_forward and self._inflight and self._read_guard is None:
            # the first forward that overlaps updates checks that no weight is read before
            # its module's pre-hook waited for it
            self._guard_next_forward = False
            self._read_guard = _ReadGuard(self)
            self._read_guard.__enter__()

    def _end_read_guard(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        guard, self._read_guard = self._read_guard, None
        if guard is not None:
            guard.__exit__(None, None, None)

    def _await_params(self, ids: tuple[int, ...], module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook (overlap_forward): wait for the updates of the module's own
        parameters and order their uploads before the current stream's next kernel."""
        if not self._inflight:
            return
        for i in ids:
            bucket = self._inflight.pop(i, None)
            if bucket is not None:
                self._await_bucket(bucket)

    def _await_bucket(self, bucket: _Bucket) -> None:
        if not self._dispatcher.wait_bucket(bucket):
            self._finish()  # raises the failed update's error
        if bucket.uploaded is not None:
            torch.cuda.current_stream(self._device).wait_event(bucket.uploaded)
            bucket.uploaded = None  # one wait per bucket is enough

    def _sync_before_read(self, *args: Any) -> None:
        if self._pending:
            # the last backward's updates are under way: collected first, as this optimizer's
            # own state_dict() collects them (else some weights were read before their update
            # and others after it)
            self._finish()
        if self._inflight:
            self.synchronize()

    def _on_grad(self, p: Tensor) -> None:
        if self._accumulating:
            return
        if p.grad is None:  # an earlier post-accumulate-grad hook took it (AttributeError before)
            raise OffloadError(
                f"{self._slots[id(p)].label} has no gradient in AdamBridge's hook: a hook "
                "registered before attach_hooks() took it (p.grad = None; memopt_ecc's "
                "enable_gradient_release does so). Give each parameter to one optimizer's hooks"
            )
        self._offload(self._slots[id(p)], free=True)
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._close_bucket()

    # --------------------------------------------------------------------------- pipeline
    def _reset_pipeline(self) -> None:
        # parameter id -> its bucket: gradients taken but the step not closed yet
        self._pending: dict[int, _Bucket | None] = {}
        # parameter id -> the gradient taken this step, weakly (a freed one must not be kept
        # alive): step() tells a gradient taken and left in place from one that came later
        self._taken: dict[int, weakref.ref[Tensor]] = {}
        # parameter id -> its bucket: updates of a closed step that no forward waited for yet
        # (overlap_forward)
        self._inflight: dict[int, _Bucket] = {}
        self._overlap = False
        self._guard_next_forward = False
        self._read_guard = None
        self._bucket = _Bucket()
        self._held: list[Any] = []  # buckets of either update waiting for the step's norm
        self._norms: dict[int, Tensor] = {}
        # a gradient opened the step that step() ends next (its norm, possibly taken by an
        # earlier close, is the step's; else step() reports 0.0)
        self._step_had_grads = False
        self._callback_queued = False
        # the device update runs buckets in order: each waits for its own copies, not the host
        self._dispatcher = _Dispatcher(newest_first=self.update == "host")
        # stops the thread when the optimizer is collected (the thread holds no reference to it)
        weakref.finalize(self, self._dispatcher.stop)
        # an AdamBridge dropped with hooks attached: they hold it weakly, and go with it
        weakref.finalize(self, remove_hooks, self._hooks)
        self._streams: tuple[Any, Any] | None = None
        self._prev_coef: float | None = None

    def _clear_pending(self) -> None:
        self._pending.clear()
        self._taken.clear()

    def _norm_stream(self) -> contextlib.AbstractContextManager:
        """Where the step's total norm is read: on CUDA the copy stream, after the current one.
        ``_copy_out`` takes the host path's norms on the copy stream and the device update
        takes them on the current one; read on the current stream alone, the former would
        race their kernels (the stack read unwritten memory: a wrong norm, wrong clipping)."""
        if not self._cuda:
            return contextlib.nullcontext()
        d2h = self._stream_pair()[0]
        d2h.wait_stream(torch.cuda.current_stream(self._device))
        return torch.cuda.stream(d2h)

    def _stream_pair(self) -> tuple[Any, Any]:
        if self._streams is None:
            self._streams = (
                torch.cuda.Stream(self._device),
                torch.cuda.Stream(self._device),
            )
        return self._streams

    def _offload(self, slot: _Slot, *, free: bool) -> None:
        """Add the gradient to the open bucket; its trip to the host starts when the bucket
        closes (one stream wait and one copy call per bucket: per gradient they cost the
        backward thread about 80 µs of Python under the GIL, 25 ms per step on Qwen2.5-0.5B)."""
        p = slot.param
        if id(p) in self._pending:
            raise OffloadError(
                f"the gradient of {slot.label} arrived twice before step_sync(): accumulate "
                "micro-batches inside `with optimizer.no_update():`, and call step_sync() "
                "after each optimizer step's last backward. Reentrant activation checkpointing "
                "(checkpoint(..., use_reentrant=True)) runs a backward per segment, so a "
                "weight two segments use gets its hook called twice: use use_reentrant=False"
            )
        if id(p) in self._inflight:
            raise OffloadError(
                f"{slot.label} has a new gradient, but no forward pre-hook waited for its "
                "update of the last step (overlap_forward): the forward read it outside the "
                "module that holds it, or the loss read it outside the model's forward. Call "
                "optimizer.synchronize() before reading weights outside the model's forward, "
                "or attach the hooks without overlap_forward"
            )
        g = p.grad
        assert g is not None  # its callers offload parameters that hold a gradient
        self._check_grad(slot, g)
        if not self._pending:  # the step opens: every group's hyperparameters, checked once
            self._check_group_params()
            self._check_moved()
            self._hyper = [
                _check_hyper(g, f"(param group {gi})") for gi, g in enumerate(self.param_groups)
            ]
            self._step_had_grads = True  # its norm is this step's, whoever closes it
        if self._dev is not None:
            norm = None
            if self.max_grad_norm is not None:
                norm = torch.linalg.vector_norm(g, dtype=torch.float32)
            done = self._dev.arrived(slot.pos, g)
            # handed over: only now taken (an exception before, an OOM in the norm or Ctrl-C,
            # leaves the gradient on the parameter for step_sync() to take)
            if norm is not None:
                self._norms[slot.index] = norm
            self._taken[id(p)] = weakref.ref(g)
            self._pending[id(p)] = None
            if free:
                p.grad = None
            for b in done:
                self._dispatch(b)
            return
        self._taken[id(p)] = weakref.ref(g)
        if free:
            # taken now, not when the bucket leaves: a later backward (or a hook registered
            # after AdamBridge's) sees no gradient, whatever the bucket size or update
            p.grad = None
        if _written(p) != slot.seen:
            self._reread_master(slot)
        if self._bucket.copied:  # an interrupted close left it copied but not handed on
            self._close_bucket()
        bucket = self._bucket
        self._pending[id(p)] = bucket
        bucket.slots.append(slot)
        bucket.grads.append(g)
        bucket.nbytes += g.numel() * g.element_size()
        if bucket.nbytes >= self.bucket_bytes:
            self._close_bucket()

    @classmethod
    def _reread_written(cls, slots: Iterable[_Slot]) -> None:
        """Read into its master each weight written since its last upload (update="host"),
        as its next gradient would: a checkpoint or a master read before that gradient must
        hold the written weight, or a resume restores the one before the write."""
        for slot in slots:
            if _written(slot.param) != slot.seen:
                cls._check_param(slot)
                cls._reread_master(slot)

    @staticmethod
    def _reread_master(slot: _Slot) -> None:
        """Start the update of a weight written since its last upload from the written value
        (update="host"; see the module doc)."""
        p, master = slot.param, slot.host_master
        with torch.no_grad():
            w = p.detach()
            if master.dtype == torch.float32 and w.dtype != torch.float32:
                # an element still equal to its master rounded as the upload rounds it (RNE)
                # was not written: keep its master bits. A weight moved with its values
                # (model.to(memory_format=torch.channels_last), a copy) lost them all
                w = w.to(master.device)
                w = torch.where(master.to(w.dtype) == w, master, w.float())
            master.copy_(w)  # an ECC-24 master: its bf16 half; the code stays
        slot.seen = _written(p)

    def _check_group_params(self) -> None:
        """Before a step takes its first gradient: a parameter appended to a group's "params"
        list (or a group appended to ``param_groups``) after it was added, or put in place of
        one of its parameters, has no host state, and was silently never trained. One identity
        pass over each group (C-level, no per-parameter Python)."""
        groups = self.param_groups
        if len(groups) != len(self._group_params):
            raise ConfigError(
                f"param_groups has {len(groups)} groups, but {len(self._group_params)} were "
                "added: add a group with add_param_group() (detach_hooks() first), not by "
                "appending to param_groups"
            )
        for gi, (group, built) in enumerate(zip(groups, self._group_params, strict=True)):
            params = _live_params(group, gi)
            if len(params) == len(built) and all(map(operator.is_, params, built)):
                continue
            names = group.get("param_names", [])
            swapped = next(
                (i for i, (p, q) in enumerate(zip(params, built, strict=False)) if p is not q), None
            )
            if swapped is not None:
                label = self._label(gi, names, params[swapped], swapped)[0]
                what = f"{label} is not the parameter the group was built with at that place"
            elif len(params) > len(built):  # appended (list.append): the first one past the end
                label = self._label(gi, names, params[len(built)], len(built))[0]
                what = f"{label} was added to the group's 'params' list after the group was"
            else:
                what = (
                    f"param group {gi} has {len(params)} parameters, {len(built)} when it was added"
                )
            raise ConfigError(
                f"{what}: AdamBridge builds a parameter's host state when its group is added, "
                "so it would not train it. Add new parameters in a new group with "
                "add_param_group() (detach_hooks() first), or build a new optimizer"
            )

    def _check_moved(self) -> None:
        """Before a step takes its first gradient: a parameter given new memory since the last
        step (``p.data = t``, ``model.float()``) must still have the shape and dtype of its
        state, and must not share that memory with another parameter (a tie made after the
        optimizer was built, ``head.weight.data = emb.weight.data``): each is updated from its
        own state, so the last upload would overwrite the other's update."""
        moved = [slot for slot in self._slots.values() if slot.param.data_ptr() != slot.addr]
        if not moved:
            return
        for slot in moved:
            self._check_param(slot)
            if slot.param.device != self._device:  # model.to(other device): new memory too
                raise OffloadError(
                    f"{slot.label} is on {slot.param.device}, but this optimizer was built for "
                    f"parameters on {self._device}: moved after the optimizer was built. Move "
                    "the model first and build the optimizer after it"
                )
        ids = {id(slot.param) for slot in moved}
        try:
            check_parameters_apart(
                [(slot.param, slot.label) for slot in moved],
                [(q, w) for q, w in labelled_parameters(self.param_groups) if id(q) not in ids],
            )
        except ConfigError as e:
            raise ConfigError(
                f"{e}. A parameter got new memory since the optimizer was built (p.data = t) "
                "that it shares with another parameter: tie weights by assigning the "
                "Parameter itself (head.weight = emb.weight), and before building the optimizer"
            ) from None
        if self._dev is not None:
            self._dev.follow_moved([slot.pos for slot in moved])
        for slot in moved:
            slot.addr = slot.param.data_ptr()

    @staticmethod
    def _check_param(slot: _Slot) -> None:
        """The parameter still has the shape and dtype its state was built for."""
        p = slot.param
        if p.shape != slot.shape:  # p.data = t of a new shape
            raise OffloadError(
                f"{slot.label} has shape {tuple(p.shape)}, but its host state was built for "
                f"{tuple(slot.shape)}: reshaped after the optimizer was built. Build a "
                "new optimizer (or add the parameter in a new param group) after reshaping"
            )
        if p.dtype != slot.dtype:  # model.float(): the state would go on rounding to bf16
            raise OffloadError(
                f"{slot.label} is {p.dtype}, but its host state was built for {slot.dtype}: "
                "cast after the optimizer was built. Cast the model first and build the "
                "optimizer after it"
            )

    @classmethod
    def _check_grad(cls, slot: _Slot, g: Tensor) -> None:
        p = slot.param
        if g.shape != p.shape or g.dtype != p.dtype or g.layout != torch.strided:
            raise OffloadError(
                f"{slot.label} has a {g.dtype} {g.layout} gradient of shape {tuple(g.shape)}; "
                f"AdamBridge takes dense gradients of the parameter's dtype and shape"
            )
        cls._check_param(slot)

    def _copy_out(self, bucket: _Bucket) -> None:
        """Copy the bucket's gradients to their pinned host buffers (on the side stream, after
        the work that produced them), take their norms when clipping, and free them.

        Safe to run again after it was interrupted (a Ctrl-C in a hook, an out-of-memory error
        in a norm): the bucket keeps its gradients until they are copied and freed, and stays
        open (see :meth:`_close_bucket`), so the next close copies them again."""
        grads = [g.detach() for g in bucket.grads]  # backward(create_graph)
        hosts = [s.host_grad for s in bucket.slots]
        clip = self.max_grad_norm is not None
        if self._cuda:
            d2h = self._stream_pair()[0]
            d2h.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(d2h):
                if clip:
                    for s, g in zip(bucket.slots, grads, strict=True):
                        self._norms[s.index] = torch.linalg.vector_norm(g, dtype=torch.float32)
                torch._foreach_copy_(hosts, grads, non_blocking=True)
            for g in grads:
                g.record_stream(d2h)
            bucket.event = torch.cuda.Event()
            bucket.event.record(d2h)
        else:
            if clip:
                for s, g in zip(bucket.slots, grads, strict=True):
                    self._norms[s.index] = torch.linalg.vector_norm(g, dtype=torch.float32)
            torch._foreach_copy_(hosts, grads)
        bucket.copied = True
        bucket.grads = []

    def _close_bucket(self) -> None:
        bucket = self._bucket
        if not bucket.slots:
            return
        if not bucket.copied:
            # the bucket stays open until its gradients left: an exception here leaves it for
            # the next close (step() / step_sync() close the open bucket), instead of orphaning
            # gradients that the hooks had taken
            self._copy_out(bucket)
        self._bucket = _Bucket()
        self._dispatch(bucket)

    def _dispatch(self, bucket: Any) -> None:
        """Submit a closed bucket's update, or hold it until the step's norm is known."""
        if self.max_grad_norm is None:
            self._submit(bucket, None)
        elif self.clip_mode == "wait" or self._prev_coef is None:
            self._held.append(bucket)  # needs this step's norm: updates wait for backward's end
        else:
            self._submit(bucket, self._prev_coef)

    def _submit(self, bucket: Any, coef: float | None) -> None:
        # the hyperparameters the step opened with (checked then): an LR scheduler stepped
        # while the update is still queued (overlap_forward) must not change it
        if self._dev is not None:
            gi = bucket.plan.group_index
            self._dispatcher.submit(bucket, self._dev.run, {gi: self._hyper[gi]}, coef)
            return
        for gi in {s.group for s in bucket.slots}:
            bucket.hyper[gi] = self._hyper[gi]
        self._dispatcher.submit(bucket, self._update, coef)

    def _update(self, bucket: _Bucket, coef: float | None) -> None:
        """Dispatcher thread: one host update of a bucket, then its upload."""
        if bucket.event is not None:
            bucket.event.synchronize()  # the gradients are in host memory
        host = self._host
        assert host is not None  # update="host"
        for gi, hyper in bucket.hyper.items():
            host.param_groups[gi].update(hyper)
        with torch.no_grad():
            if coef is not None and coef < 1.0:
                for s in bucket.slots:
                    s.host_grad.mul_(coef)
            host.step_parameters(
                [s.host_master for s in bucket.slots],
                grads={s.host_master: s.host_grad for s in bucket.slots},
                staging={s.host_master: s.staging for s in bucket.slots if s.staging is not None},
            )
            # a weight written after its gradient arrived (with overlap_forward, after
            # step_sync() and before synchronize()): the upload would overwrite the write
            written = [s.label for s in bucket.slots if _written(s.param) != s.seen]
            if written:
                raise OffloadError(
                    f"{written[0]}{f' (and {len(written) - 1} more)' if len(written) > 1 else ''}"
                    " was written while its update was in flight, and the update's upload "
                    "would overwrite the write. Write weights between steps: after "
                    "step_sync(), and with attach_hooks(overlap_forward=True) after "
                    "optimizer.synchronize() (a write that races the upload unseen is lost)"
                )
            # one copy call per bucket (a copy_ per tensor cost about 25 µs of Python each)
            weights = [s.param for s in bucket.slots]
            uploads = [s.host_upload for s in bucket.slots]
            if self._cuda:
                h2d = self._stream_pair()[1]
                with torch.cuda.stream(h2d):
                    torch._foreach_copy_(weights, uploads, non_blocking=True)
                bucket.uploaded = torch.cuda.Event()
                bucket.uploaded.record(h2d)
            else:
                torch._foreach_copy_(weights, uploads)
            for s in bucket.slots:  # the copies bumped the version counters
                s.seen = _written(s.param)

    def _wait_all(self) -> None:
        err = self._dispatcher.wait()
        if err is not None:
            if self._dev is not None:
                self._dev.abandon()
            # the failed step is over: a later step without gradients reports 0, not its norm
            self._step_had_grads = False
            self._clear_pending()
            self._inflight.clear()
            self._held.clear()
            raise OffloadError(
                f"an update failed ({type(err).__name__}: {err}); the parameters of that "
                "step are in an undefined state: reload the last checkpoint"
            ) from err

    def _close_step(self) -> None:
        """Close the step: its last bucket and, when clipping waits for the norm, the norm and
        the held buckets."""
        # a backward that raised never ran its end-of-backward callback: queue one again
        self._callback_queued = False
        if self._dev is not None:
            for bucket in self._dev.unfinished():  # some of their parameters got no gradient
                self._dispatch(bucket)
        self._close_bucket()
        if self.max_grad_norm is not None and self._norms:
            # summed in parameter order, whatever order backward produced the gradients in
            norms = [self._norms[i] for i in sorted(self._norms)]
            with self._norm_stream():
                total = torch.linalg.vector_norm(torch.stack(norms)).item()
            self._norms = {}
            self.last_grad_norm = total
            # torch's clip_grad_norm_ formula; a NaN total (a NaN gradient element) gives 1.0
            # here (Python's min), where clip_grad_norm_ would make every gradient NaN: only
            # the NaN elements' weights go NaN. An infinite total gives 0.
            coef = min(1.0, self.max_grad_norm / (total + 1e-6))
            held, self._held = self._held, []
            for bucket in held:
                self._submit(bucket, coef)
            if self.clip_mode == "overlap":
                self._prev_coef = coef
        # no reset to 0.0 here: this also runs as a second close of a step whose norm was
        # already taken (model.state_dict() or master_weight() before step_sync(), a retry
        # after an interrupted step_sync(), state_dict() after an overlapped step); step()
        # resets it for a step that no gradient opened

    def _finish(self) -> None:
        """Collect the step and every update in flight, and order the uploads before the
        current stream's next work."""
        self._close_step()
        self._wait_all()
        if self._dev is not None:
            self._dev.finish()
        if self._cuda and self._streams is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._streams[1])
        self._clear_pending()
        self._inflight.clear()

    def synchronize(self) -> None:
        """Wait until every update of the closed steps has landed and order the uploads before
        the current stream's next kernel. Needed with ``overlap_forward`` before reading
        weights outside the model's forward (``model.state_dict()`` does it by itself, and
        this optimizer's methods that read state do too); without it, :meth:`step_sync`
        already did this. A step whose backward ran but whose :meth:`step_sync` did not is
        left open."""
        if self._inflight:
            for bucket in dict.fromkeys(self._inflight.values()):
                self._await_bucket(bucket)
            self._inflight.clear()

    # --------------------------------------------------------------------------- stepping
    @run_eagerly  # under torch.compile too: its hooks, threads and host buffers are no graph
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step. With hooks attached: collect the updates the hooks started (this is what
        :meth:`step_sync` calls). Any parameter holding a gradient the hooks did not take (no
        hooks, a backward inside :meth:`no_update`, or a parameter outside the hooked model)
        is offloaded and updated now; with hooks attached its gradient is then freed, as the
        hooks free theirs, else it is left in place, as torch's ``step`` does. With
        ``overlap_forward`` it returns once the updates are queued (the next forward waits for
        them). Raises :class:`~memopt_core.errors.ConfigError`, changing nothing, when a
        group's hyperparameter is invalid. Returns the closure's loss."""
        MemOptimizer._refuse_inference_mode("step")
        if hasattr(self, "found_inf"):  # GradScaler.step with hooks (_step_supports_amp_scaling)
            del self.found_inf
            self.__dict__.pop("grad_scale", None)
            raise OffloadError(
                "a torch.amp.GradScaler with attach_hooks(): the hooks update each parameter "
                "during backward from its gradient as it arrives, still scaled, so the scaler "
                "can neither unscale it nor skip a step with an inf. That backward updated the "
                "weights from scaled gradients: reload the last checkpoint. With a GradScaler, "
                "call step() without hooks"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()  # overlap_forward: the last step's updates no forward waited for
        if self._untrained:
            self._warn_untrained()
        if self._pending and not self._warned_late_hyper:
            self._warn_late_hyperparameters()
        # the loop with hooks has no zero_grad(): a gradient left here would be added to the
        # next backward's and applied twice
        free = bool(self._hooks)
        todo = []
        for slot in self._slots.values():
            g = slot.param.grad
            if g is None:
                continue
            if id(slot.param) in self._pending:
                if self._taken[id(slot.param)]() is not g:
                    # the hook took one gradient and freed it; this one came later (a backward
                    # inside no_update()), and would be added to the next step's
                    raise OffloadError(
                        f"the gradient of {slot.label} arrived twice before step_sync(): "
                        "accumulate micro-batches inside `with optimizer.no_update():` before "
                        "the last backward of the step, not after it. The later gradient stays "
                        "in .grad and every step_sync() refuses it until zero_grad() drops it; "
                        "step_sync() then completes the step of the first one"
                    )
                continue
            todo.append((slot, g))
        # every gradient valid before any leaves: a refused step changes nothing
        for slot, g in todo:
            self._check_grad(slot, g)
        for slot, _ in todo:
            self._offload(slot, free=free)
        if self._overlap:
            self._close_step()
            # update="host" (overlap_forward's): every pending gradient is in a bucket
            self._inflight.update((i, b) for i, b in self._pending.items() if b is not None)
            self._clear_pending()
        else:
            self._finish()
        if self.max_grad_norm is not None and not self._step_had_grads:
            # a step without gradients: clip_grad_norm_ over none gives 0, and a logger (or a
            # skip on a NaN norm) must not see the last step's norm again. Decided here, at
            # the step's end, not in _close_step(): a step collected early (state_dict(),
            # master_weight(), an interrupted step_sync()) had its norm taken by that close
            self.last_grad_norm = 0.0
        self._step_had_grads = False  # after the close: an interrupted one keeps its norm
        return loss

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # with hooks, GradScaler.step hands step() its scale (which step() refuses, saying
        # why) instead of unscaling gradients the hooks already took, where torch failed with
        # "No inf checks were recorded for this optimizer"
        return bool(self._hooks)

    def step_sync(self) -> float | None:
        """Wait until every update of the last backward has landed and the new weights are
        back on the device (ordered before the current stream's next kernel). Calls
        :meth:`step` (so LR schedulers and step hooks see a step); with hooks attached a second
        call without new gradients does nothing (without hooks, :meth:`step` applies the
        gradients still present again). Returns the total gradient norm when clipping, else
        None.

        With ``attach_hooks(model, overlap_forward=True)`` it closes the step and returns
        without waiting: each module's forward pre-hook waits for its own weights, and
        :meth:`synchronize` waits for all of them."""
        self.step()
        return self.last_grad_norm if self.max_grad_norm is not None else None

    def _warn_late_hyperparameters(self) -> None:
        """Warn when a group's hyperparameters changed after the hooks opened this step (at
        its first gradient, in backward, where the step took them): a loop that sets the lr
        between backward and ``step()`` (a warmup written that way) gets it one step late."""
        for gi, group in enumerate(self.param_groups):
            try:
                now = _check_hyper(group, f"(param group {gi})")
            except ConfigError:
                return  # refused when the next step opens
            was = self._hyper[gi]
            changed = [k for k in now if now[k] != was.get(k)]
            if changed:
                k = changed[0]
                warnings.warn(
                    f"param group {gi}'s {k} changed from {was.get(k)} to {now[k]} after this "
                    "step's first gradient: with hooks attached the step takes the "
                    "hyperparameters when backward delivers its first gradient, so the new "
                    "value applies from the next step. Set hyperparameters (and step LR "
                    "schedulers) after step_sync() and before the next backward",
                    UserWarning,
                    stacklevel=3,
                )
                self._warned_late_hyper = True  # once: such a loop does it at every step
                return

    def _warn_untrained(self) -> None:
        """Warn once that a parameter frozen when its group was added holds a gradient."""
        held = [(p, gi) for p, gi in self._untrained if p.grad is not None]
        if not held:
            return
        self._untrained = []
        p, gi = held[0]
        group = self.param_groups[gi]
        idx = next(i for i, q in enumerate(group["params"]) if q is p)
        label = self._label(gi, group.get("param_names", []), p, idx)[0]
        more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
        warnings.warn(
            f"{label}{more} has a gradient but is not trained: it was frozen when its param "
            "group was added, so it has no host state. To train it, leave it out of the "
            "optimizer while it is frozen and add it in a new group with add_param_group() "
            "when you unfreeze it",
            UserWarning,
            stacklevel=2,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch semantics (with hooks, gradients are already freed after their copy)."""
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------------ state dicts
    def state_dict(self) -> dict[str, Any]:
        """torch's layout: ``state`` by parameter index with the host optimizer's named state
        (``step``, ``exp_avg``, ``exp_avg_sq``, scales, ``master_code``) plus ``master`` (the
        host master: fp32, or the bf16 weight of an ECC-24 master), ``param_groups`` as torch
        saves them, and ``memopt`` (precision, seed, version, clipping state; with
        ``update="host"`` also ``decay_norm_beta2``, what the host optimizer's 8-bit second
        moments are divided by: memopt-core's decay normalization), at the top level
        and a copy in every saved param group (torch's ``get_state_dict`` keeps only ``state``
        and ``param_groups``; the live groups do not hold it). The moments,
        scales and codes (and, with ``update="host"``, the step counts) are live host views
        that later steps change, ``master`` is a compact copy: keep ``copy.deepcopy`` of the
        dict to hold a checkpoint in memory. ``torch.save`` writes it without a trip through
        the device. State-dict post-hooks
        see this finished dict."""
        return finished_state_dict(self, self._full_state_dict)

    def _full_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` before its post-hooks."""
        if self._pending or self._inflight:
            self._finish()
        sd = super().state_dict()
        if self._dev is not None:
            self._dev.synchronize_host()
            index = {
                id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])
            }
            sd["state"] = {
                index[id(s.param)]: self._dev.state_entry(s.pos) for s in self._slots.values()
            }
            sd[META_KEY] = self._state_dict_meta(self._dev.seed)
            return add_group_meta(sd)
        host = self._host
        assert host is not None  # update="host"
        self._reread_written(self._slots.values())
        host_sd = host.state_dict()
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        host_index = {
            id(m): i for i, m in enumerate(m for g in host.param_groups for m in g["params"])
        }
        state: dict[int, dict[str, Any]] = {}
        for slot in self._slots.values():
            entry = dict(host_sd["state"].get(host_index[id(slot.host_master)], {}))
            # core's shape record is not part of this format (update="device" has none): the
            # "master" entry, shaped like the parameter, already ties the state to it
            entry.pop("param_shape", None)
            # a compact copy: the master is a view of a slab that also holds gradient buffers,
            # which torch.save would write whole (+2 B per parameter and more)
            entry["master"] = own_storage(slot.host_master.detach())
            state[index[id(slot.param)]] = entry
        sd["state"] = state
        sd[META_KEY] = self._state_dict_meta(host.seed)
        # the host optimizer's record of what its 8-bit second moments are divided by
        # (memopt-core's decay normalization): without it they would load as v itself
        sd[META_KEY][_NORM_KEY] = host_sd[META_KEY][_NORM_KEY]
        return add_group_meta(sd)

    def _state_dict_meta(self, seed: int) -> dict[str, Any]:
        """The ``memopt`` entry of :meth:`state_dict` (the same for either update)."""
        return {
            "family": "AdamBridge",
            "precision": self.precision,
            "seed": seed,
            "version": _STATE_DICT_VERSION,
            # clip_mode="overlap" clips the next step with this step's coefficient
            "clip_coef": self._prev_coef,
            "last_grad_norm": self.last_grad_norm,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict`'s output (validated before anything changes); the host
        masters, moments and step counts are restored and the device weights rewritten from
        the masters, so training continues bit-identically. Load pre-hooks see (and may
        replace) the caller's dict before anything is checked or changed; post-hooks run once
        everything, the device weights included, is loaded. The ``memopt`` entry is read from
        the top level, else from the param groups (torch's ``set_state_dict`` hands it over
        there; all must hold the same one); it never enters the live ``param_groups``."""
        state_dict = run_load_pre_hooks(self, state_dict)
        meta, saved_groups = self._saved_groups(state_dict)
        if self._pending or self._inflight:
            self._finish()
        params = [p for g in self.param_groups for p in g["params"]]
        if self._dev is not None:
            self._load_device_state(state_dict, params, saved_groups, meta)
        else:
            self._load_host_state(state_dict, params, saved_groups, meta)
        run_load_post_hooks(self)

    def _load_groups(self, saved_groups: list[Mapping[str, Any]]) -> None:
        """torch's ``load_state_dict`` of the (checked) saved groups' hyperparameters, which
        also replaces ``self.state``: set back to the :class:`_HostHeldState`."""
        with load_hooks_suspended(self):  # load_state_dict runs them around the whole load
            super().load_state_dict({"state": {}, "param_groups": saved_groups})
        self.state = _HostHeldState(dict)

    def _load_host_state(
        self,
        state_dict: Mapping[str, Any],
        params: list[Tensor],
        saved_groups: list[Mapping[str, Any]],
        meta: Mapping[str, Any],
    ) -> None:
        """:meth:`load_state_dict` of the host update (validated before anything changes)."""
        host = self._host
        assert host is not None  # update="host"
        host_params = [m for g in host.param_groups for m in g["params"]]
        host_index = {id(m): i for i, m in enumerate(host_params)}
        host_sd = host.state_dict()
        host_state: dict[int, Any] = {}
        masters: list[tuple[_Slot, Tensor]] = []
        pos: dict[Any, int] = {}  # saved parameter index -> position
        for g in saved_groups:
            for k in g["params"]:
                pos[k] = len(pos)
        for key, entry in state_dict["state"].items():
            if key not in pos or pos[key] >= len(params):
                raise StateDictError(f"the state dict holds state for unknown parameter {key!r}")
            p = params[pos[key]]
            slot = self._slots.get(id(p))
            if slot is None:
                raise StateDictError(
                    f"the state dict holds state for parameter index {key!r}, which is frozen here"
                )
            master = slot.host_master
            own = host_sd["state"].get(host_index[id(master)], {})
            masters.append((slot, self._checked_host_entry(key, entry, master, own)))
            host_state[host_index[id(master)]] = {k: v for k, v in entry.items() if k != "master"}
        host_groups = []
        for hg, saved in zip(host_sd["param_groups"], saved_groups, strict=True):
            merged = dict(hg)
            merged.update({k: deepcopy(saved[k]) for k in _HYPER})
            host_groups.append(merged)
        host.load_state_dict(
            {
                "state": host_state,
                "param_groups": host_groups,
                "memopt": {
                    "rule": "adamw",
                    "seed": meta.get("seed", host.seed),
                    _NORM_KEY: meta.get(_NORM_KEY),
                    # absent from dicts saved before the decay normalization, which hold v
                    # itself: the host optimizer's version 1 says so
                    **({} if meta.get(_NORM_KEY) is not None else {"version": 1}),
                },
            }
        )
        self._load_groups(saved_groups)
        with torch.no_grad():
            for slot, m in masters:
                slot.host_master.copy_(m)
                if slot.staging is not None:
                    slot.staging.copy_(slot.host_master)
                slot.param.copy_(slot.host_upload)
                slot.seen = _written(slot.param)
        loaded = {id(slot) for slot, _ in masters}
        self._restart_host_state([s for s in self._slots.values() if id(s) not in loaded])
        self._load_clipping(meta)

    @staticmethod
    def _checked_host_entry(
        key: Any, entry: Any, master: Tensor, saved_keys: Iterable[str]
    ) -> Tensor:
        """The saved master in ``entry`` (the state of parameter index ``key``, whose host
        master is ``master``), checked, once ``entry`` is found to hold no key but ``master``
        and the host optimizer's ``saved_keys``: that loader keeps any other as the caller's,
        where the device update refuses it, so a checkpoint would not move between them."""
        if not isinstance(entry, Mapping) or "master" not in entry:
            raise StateDictError(f"the state of parameter index {key!r} lacks 'master'")
        m = entry["master"]
        if not isinstance(m, Tensor) or m.dtype != master.dtype or m.shape != (master.shape):
            raise StateDictError(
                f"'master' of parameter index {key!r} must be {master.dtype} of shape "
                f"{tuple(master.shape)}"
            )
        refuse_valueless(f"'master' of parameter index {key!r}", m)
        extra = sorted(set(entry) - set(saved_keys) - {"master"}, key=str)
        if extra:
            expected = sorted({*saved_keys, "master"} - {"param_shape"})
            raise StateDictError(
                f"the state of parameter index {key!r} has unexpected entries {extra}; "
                f"AdamBridge saves {expected}"
            )
        return m

    def _restart_host_state(self, slots: list[_Slot]) -> None:
        """Parameters absent from a loaded state dict start over, as update="device"'s do
        (``DeviceUpdater.reset_steps``): the loader dropped their host state, and without it
        a later state_dict() wrote a 'master' alone, which no load takes. Step 0, zero
        moments, the master (and ECC code) of their current weight."""
        if not slots:
            return
        host = self._host
        assert host is not None  # update="host"
        with torch.no_grad():
            for slot in slots:
                slot.host_master.copy_(slot.param.detach())
                if slot.staging is not None:
                    slot.staging.copy_(slot.host_master)
                slot.seen = _written(slot.param)
        host.init_state()  # the state of every master without any: core's fresh state

    def _load_clipping(self, meta: Mapping[str, Any]) -> None:
        """The clipping state of a loaded dict (None in dicts from before it was saved). Its
        coefficient is kept only where this optimizer clips: one saved by a clipping run must
        not scale the gradients of one that does not."""
        self._prev_coef = meta.get("clip_coef") if self.max_grad_norm is not None else None
        self.last_grad_norm = meta.get("last_grad_norm")

    def _checked_meta(self, meta: Any, what: str = "the state dict") -> None:
        """Check a saved ``memopt`` entry (``meta``; None: none) against this optimizer: family,
        version, precision and the clipping state (:class:`~memopt_core.errors.StateDictError`;
        ``what`` names the dict in the messages). Also memopt-checkpoint's ``check_dcp_load``,
        before ``dcp.load`` writes into the host state."""
        # what a step can leave: an infinite total norm gives the coefficient 0, a NaN one
        # the norm NaN (and the coefficient 1, see _close_step)
        for key, allowed in (("clip_coef", "in [0, 1]"), ("last_grad_norm", ">= 0, inf or NaN")):
            v = meta.get(key) if isinstance(meta, Mapping) else None
            if v is None:
                continue
            x = _saved_float(v, f"{what}'s memopt[{key!r}]", allowed)
            if not (0 <= x <= 1 if key == "clip_coef" else math.isnan(x) or x >= 0):
                raise StateDictError(
                    f"{what}'s memopt[{key!r}] must be None or a number {allowed}, got {v!r}"
                )
        if not isinstance(meta, Mapping) or meta.get("family") != "AdamBridge":
            raise StateDictError(
                f"{what} was not saved by AdamBridge (no converter makes one: a torch or "
                "memopt optimizer's state does not load into AdamBridge, whose state is its "
                "own), or it lost AdamBridge's 'memopt' entry on the way (torch's "
                "get_optimizer_state_dict with flatten_optimizer_state_dict=True does not hand it "
                "back: use the default options)"
            )
        if meta.get("version") != _STATE_DICT_VERSION:
            raise StateDictError(
                f"{what} has version {meta.get('version')!r}; this AdamBridge reads "
                f"version {_STATE_DICT_VERSION}"
            )
        if meta.get("precision") != self.precision:
            raise StateDictError(
                f"{what} holds precision={meta.get('precision')!r} state; this "
                f"AdamBridge uses precision={self.precision!r}"
            )

    def _saved_groups(self, state_dict: Any) -> tuple[Mapping[str, Any], list[Mapping[str, Any]]]:
        """The ``memopt`` entry of ``state_dict`` (top level, else its param groups') and its
        param groups without that entry, once its containers, family, version and precision,
        and each group's size, indices (each listed once) and hyperparameters, are checked
        against this optimizer (:class:`~memopt_core.errors.StateDictError` otherwise)."""
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            raise StateDictError("expected the dict AdamBridge.state_dict() returns")
        meta = saved_meta(state_dict)
        self._checked_meta(meta)
        if not isinstance(state_dict["state"], Mapping):
            raise StateDictError(
                f"the state dict's 'state' must be a dict, got {type(state_dict['state']).__name__}"
            )
        saved_groups = state_dict["param_groups"]
        if not isinstance(saved_groups, list) or not all(
            isinstance(g, Mapping) for g in saved_groups
        ):
            raise StateDictError("the state dict's 'param_groups' must be a list of dicts")
        # torch's Optimizer.load_state_dict copies a saved group's keys into the live group
        saved_groups = [without_meta(g) for g in saved_groups]
        if len(saved_groups) != len(self.param_groups):
            raise StateDictError(
                f"the state dict has {len(saved_groups)} param group(s), this optimizer has "
                f"{len(self.param_groups)}"
            )
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            where = f"param group {gi} of the state dict"
            indices = saved.get("params")
            if not isinstance(indices, (list, tuple)):
                raise StateDictError(f"'params' of {where} must be a list of parameter indices")
            if len(indices) != len(group["params"]):
                raise StateDictError(
                    f"{where} has {len(indices)} parameter(s), this optimizer's has "
                    f"{len(group['params'])}"
                )
            missing = [k for k in _HYPER if k not in saved]
            if missing:
                raise StateDictError(f"{where} lacks {missing}")
            try:
                _check_hyper(saved, f"({where})")
            except ConfigError as e:
                raise StateDictError(str(e)) from None
        # the keys in them (a nested list: bare TypeError), each listed once (one listed twice
        # mapped a parameter's state onto another)
        check_saved_param_lists(state_dict)
        return meta, saved_groups

    def _load_device_state(
        self,
        state_dict: Mapping[str, Any],
        params: list[Tensor],
        saved_groups: list[Any],
        meta: Mapping[str, Any],
    ) -> None:
        """load_state_dict of ``update="device"``: every entry checked before any is copied."""
        dev = self._dev
        assert dev is not None
        seed = meta.get("seed", dev.seed)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise StateDictError(
                f"the state dict's seed must be an int in [0, 2**64), got {seed!r}"
            )
        pos: dict[Any, int] = {}  # saved parameter index -> position
        for g in saved_groups:
            for k in g["params"]:
                pos[k] = len(pos)
        loads: list[tuple[int, Mapping[str, Any]]] = []
        for key, entry in state_dict["state"].items():
            if key not in pos or pos[key] >= len(params):
                raise StateDictError(f"the state dict holds state for unknown parameter {key!r}")
            slot = self._slots.get(id(params[pos[key]]))
            if slot is None:
                raise StateDictError(
                    f"the state dict holds state for parameter index {key!r}, which is frozen here"
                )
            if not isinstance(entry, Mapping):
                raise StateDictError(f"the state of parameter index {key!r} is not a dict")
            dev.check_entry(slot.pos, entry, key)
            loads.append((slot.pos, entry))
        self._load_groups(saved_groups)
        dev.synchronize_host()
        loaded = {p for p, _ in loads}
        with torch.no_grad():
            for p, entry in loads:
                dev.load_entry(p, entry)
            dev.reset_steps([s.pos for s in self._slots.values() if s.pos not in loaded])
        dev.seed = seed
        self._load_clipping(meta)

    # ------------------------------------------------------------------------ lifetime
    def __getstate__(self) -> dict[str, Any]:
        message = (
            "AdamBridge holds pinned host buffers and a worker thread and cannot be pickled or "
            "deep-copied: save optimizer.state_dict() instead"
        )
        if self._hooks:  # they hold this optimizer: copying or pickling the model reaches it
            message += (
                "; its hooks are attached to a model: call detach_hooks() before copying or "
                "pickling the model"
            )
        raise TypeError(message)
