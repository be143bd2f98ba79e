"""AdamBridge's device update (``update="device"``): state in pinned host RAM, AdamW on the GPU.

The host holds only optimizer state, in exact-size pinned slabs laid out in parameter order:
for a bfloat16 parameter its ECC-24 code and bf16 moments (1 + 2 + 2 = 5 B), the bf16 weight on
the device being the master's high part (memopt-ecc's format); a float32 parameter is its own
master and holds bf16 moments (4 B). No gradient buffer, no master copy, no upload buffer.

The parameters are cut, in parameter order, into buckets of about ``bucket_mb`` of gradients; a
parameter larger than a bucket is cut into pieces, each stepped as a range of its tensor with the
stochastic-rounding index base of its first element, so a piece draws the words the whole tensor
would. When the last gradient of a bucket is final (post-accumulate-grad hooks), the hook
records an event and AdamBridge's dispatcher thread runs the bucket (:meth:`DeviceUpdater.run`):
the bucket's state is copied to the device (unless it was prefetched), one fused multi-tensor
launch on a side stream updates the weights and the state (core's backend registry:
memopt-kernels-triton on CUDA, bit-exact with core's reference AdamW, so with
``update="host"``), the gradients are freed and the state is copied back. The backward thread
does none of this: about 1 ms of Python and driver calls per bucket, which on the backward
thread stretched backward (docs/benchmarks/2026-12-01-offload-device-update.md). Per bf16
parameter the link carries 5 B each way and host memory 10 B, all
of it DMA: the CPU does no arithmetic.

Prefetch: the state of buckets whose gradients are not final yet is copied ahead, in the order the
buckets became ready at the previous step, within ``prefetch_mb`` of device memory (staged,
running and writing-back buckets count). It starts when the step's first bucket runs: state
staged during the forward would add to the peak, which comes at the start of backward.

:meth:`DeviceUpdater.finish` makes the current stream wait for the updates, not for the copies
of state back to the host: the next step's copies and every host read of the state wait for those.
With the model on the CPU the same code runs with plain copies (the CPU tests).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from memopt_core import conversions, reference
from memopt_core.backends import GroupStep, mark_written, select_backend
from memopt_core.errors import BackendUnavailableError, ConfigError, StateDictError
from memopt_core.formats import StateSpec
from memopt_core.optimizer import MemOptimizer
from memopt_core.plan import GroupPlan, StateArena, make_plans
from memopt_offload.host_memory import HostSlab, SlabLayout, check_host_memory

__all__ = ["DeviceUpdater"]

#: The state formats of the device update: bf16 moments (stochastic rounding) with an ECC-24
#: master for bf16 parameters; float32 parameters are their own master.
_MOMENTS = "bf16"
_NAMES = ("exp_avg", "exp_avg_sq")
#: Pieces of a parameter cut across buckets start at multiples of this many elements, so every
#: piece keeps the 16-byte alignment of the kernels' vector accesses.
_PIECE_ALIGN = 1024


def _spec(dtype: torch.dtype) -> StateSpec:
    return StateSpec(
        master="fp32" if dtype == torch.float32 else "ecc24",
        moments=_MOMENTS,
        stochastic_rounding=True,
    )


@dataclass(eq=False)
class _Region:
    """The host state of one (param group, dtype) plan: a state arena in pinned slabs."""

    plan: GroupPlan  # over the device parameters, in parameter order
    arena: StateArena  # host tensors (views of ``slabs``, one per field)
    slabs: list[HostSlab]
    backend: Any
    positions: list[int]  # plan slot -> position in DeviceUpdater.params


@dataclass(eq=False)
class _Bucket:
    """Consecutive pieces of one region: host state ``[h0, h1)`` of each field."""

    region: _Region
    h0: int
    h1: int
    plan: GroupPlan  # over the pieces (views of the parameters); its arena is [h0, h1)
    positions: list[int]  # plan slot -> parameter position
    starts: list[int]  # plan slot -> index of the piece's first element in its parameter
    members: tuple[int, ...]  # distinct parameter positions
    waiting: int = 0  # members whose gradient is not final yet this step
    ran: bool = False  # updated this step
    nbytes: int = 0  # state bytes
    staged: StateArena | None = None  # its state on the device, copied or being copied
    staged_event: Any = None
    ready_event: Any = None  # after the work that made its gradients final
    dispatched: bool = False  # handed to AdamBridge this step (a retried close skips it)
    done: bool = False  # set by AdamBridge's dispatcher once the update ran


@dataclass
class _StepState:
    # position -> its final gradient, until its last piece ran (then None)
    arrived: dict[int, Tensor | None] = field(default_factory=dict)
    ran: list[_Bucket] = field(default_factory=list)  # in the order they ran
    open: bool = False
    prefetch_at: int = 0  # next index into DeviceUpdater.order


def refuse_valueless(what: str, t: Tensor) -> None:
    """StateDictError naming ``what`` when state dict tensor ``t`` has no values to copy in (on
    the meta device, or sparse): checked before a load changes anything, since the copy itself
    failed inside torch after the entries before it were loaded."""
    if t.is_meta or t.layout != torch.strided:
        detail = (
            "on the meta device and holds no values (torch.load with map_location='meta'?)"
            if t.is_meta
            else f"a {t.layout} tensor; the state is dense"
        )
        raise StateDictError(f"{what} is {detail}")


class DeviceUpdater:
    """The device half of ``AdamBridge(update="device")`` (see the module doc): host state,
    buckets, staging copies and the fused launches. AdamBridge owns hooks, clipping and the
    step's bookkeeping; it calls :meth:`arrived`, :meth:`run`, :meth:`unfinished` and
    :meth:`finish`."""

    def __init__(
        self,
        device: torch.device,
        *,
        seed: int,
        bucket_bytes: int,
        prefetch_bytes: int,
        pin: bool,
        backend: str | None,
    ) -> None:
        self.device = device
        self.seed = seed
        self.bucket_bytes = bucket_bytes
        self.prefetch_bytes = prefetch_bytes
        self.pin = pin and device.type == "cuda"
        self.backend_name = backend
        self.params: list[Tensor] = []  # position -> parameter
        self.tensor_ids: list[int] = []  # position -> stochastic-rounding tensor id
        self.groups: list[int] = []  # position -> param group
        self.steps: list[int] = []  # position -> updates so far
        self.homes: list[tuple[_Region, int]] = []  # position -> (region, plan slot)
        self.of_param: list[list[_Bucket]] = []  # position -> buckets holding its pieces
        self.regions: list[_Region] = []
        self.buckets: list[_Bucket] = []
        self.order: list[_Bucket] = []  # the order buckets ran in at the last step
        self._in_flight: dict[_Bucket, Any] = {}  # staged bucket -> write-back event or None
        self._streams: tuple[Any, Any, Any] | None = None  # host-to-device, update, device-to-host
        self._step = _StepState()

    # ------------------------------------------------------------------------ allocation
    def add_group(self, gi: int, params: Sequence[Tensor], first_id: int, what: str) -> None:
        """Allocate the host state of param group ``gi``'s trainable ``params`` (tensor ids
        ``first_id``, ``first_id + 1``, ...: the host update's ids, so the bits match it).
        On failure (no backend, host memory short) this updater is left as it was."""
        base = len(self.params)
        regions = []
        for plan in make_plans(params, _spec, group_index=gi):
            master = plan.spec.master_for(plan.param_dtype)
            backend = self._backend(plan)
            codecs = {n: plan.spec.first if n == "exp_avg" else plan.spec.second for n in _NAMES}
            arena, slabs = _host_arena(plan, codecs, master, self.pin, what)
            positions = []
            for slot, p in zip(plan.slots, plan.params, strict=True):
                k = next(i for i, q in enumerate(params) if q is p)
                positions.append(base + k)
                code = arena.views(slot).get("master_code")
                if code is not None:
                    with torch.no_grad():
                        conversions.encode_master_into(master, p.detach().cpu(), None, code)
            regions.append(_Region(plan, arena, slabs, backend, positions))
        for region in regions:
            self.regions.append(region)
            self._cut(region)
        for k, p in enumerate(params):
            self.params.append(p)
            self.tensor_ids.append(first_id + k)
            self.groups.append(gi)
            self.steps.append(0)
            self.of_param.append([])
        homes: dict[int, tuple[_Region, int]] = {}
        for region in self.regions:
            for si, pos in enumerate(region.positions):
                homes[pos] = (region, si)
        self.homes = [homes[i] for i in range(len(self.params))]
        self._link(self.buckets)

    def _backend(self, plan: GroupPlan) -> Any:
        try:
            backend = select_backend(
                "adam", plan.spec, plan.device, plan.param_dtype, backend=self.backend_name
            )
        except BackendUnavailableError as e:
            raise ConfigError(f"update='device': {e}") from None
        if plan.device.type == "cuda" and backend.name != "triton" and self.backend_name is None:
            raise ConfigError(
                "update='device' runs memopt-kernels-triton's fused kernels on CUDA, and its "
                "backend is not usable here (from a checkout: pip install packages/memopt-kernels-triton; "
                "memopt_core.backends.available_backends() says why); backend='torch' runs "
                "core's reference kernels instead (slow, for checks)"
            )
        return backend

    def _cut(self, region: _Region) -> None:
        """Cut ``region`` into buckets of consecutive pieces of about ``bucket_bytes`` of
        gradients each."""
        plan = region.plan
        limit = max(1, self.bucket_bytes // plan.param_dtype.itemsize)
        if limit > _PIECE_ALIGN:
            limit -= limit % _PIECE_ALIGN
        pieces: list[tuple[int, int, int]] = []  # (plan slot, start, stop)
        size = 0

        def close() -> None:
            nonlocal pieces, size
            if pieces:
                self._add_bucket(region, pieces)
            pieces, size = [], 0

        for si, slot in enumerate(plan.slots):
            p = plan.params[si]
            n = slot.numel
            if n > limit and p.is_contiguous():
                close()
                for a in range(0, n, limit):
                    self._add_bucket(region, [(si, a, min(n, a + limit))])
                continue
            if size and size + n > limit:
                close()
            pieces.append((si, 0, n))
            size += n
        close()

    def follow_moved(self, positions: Sequence[int]) -> None:
        """The parameters at ``positions`` got new memory since their buckets were cut
        (``p.data = t``, ``model.to(memory_format=torch.channels_last)``): cut again the buckets
        of each region where one of them is in pieces, which are views of its old memory (a
        whole parameter is the Parameter itself and follows by itself). Between steps only:
        nothing is staged for a step then."""
        moved = set(positions)
        regions = []
        for b in self.buckets:
            if b.region not in regions and any(
                self._is_piece(b, si) for si, pos in enumerate(b.positions) if pos in moved
            ):
                regions.append(b.region)
        for region in regions:
            self.buckets = [b for b in self.buckets if b.region is not region]
            self.order = [b for b in self.order if b.region is not region]
            for pos in region.positions:
                self.of_param[pos] = []
            first = len(self.buckets)
            self._cut(region)
            self._link(self.buckets[first:])

    def _link(self, buckets: Sequence[_Bucket]) -> None:
        """Record each of ``buckets`` under the parameters it holds pieces of (``of_param``)."""
        for b in buckets:
            for pos in b.members:
                if b not in self.of_param[pos]:
                    self.of_param[pos].append(b)

    def _is_piece(self, b: _Bucket, si: int) -> bool:
        """Whether bucket ``b``'s plan slot ``si`` is a piece (a view) of its parameter."""
        return b.plan.slots[si].numel != self.params[b.positions[si]].numel()

    def _add_bucket(self, region: _Region, pieces: list[tuple[int, int, int]]) -> None:
        plan = region.plan
        views, positions, starts = [], [], []
        for si, a, b in pieces:
            p = plan.params[si]
            whole = a == 0 and b == plan.slots[si].numel
            views.append(p if whole else p.detach().view(-1)[a:b])
            positions.append(region.positions[si])
            starts.append(a)
        si0, a0, _ = pieces[0]
        si1, _, b1 = pieces[-1]
        h0 = plan.slots[si0].offset + a0
        h1 = plan.slots[si1].offset + b1
        bplan = plan.over(views)
        assert bplan.total == h1 - h0  # padding unit 1: the bucket's arena is the host range
        members = tuple(dict.fromkeys(positions))
        per = sum(t.element_size() for t in region.arena.tensors())  # per-element fields only
        bucket = _Bucket(region, h0, h1, bplan, positions, starts, members, nbytes=(h1 - h0) * per)
        self.buckets.append(bucket)

    # -------------------------------------------------------------------------- sizes
    def state_bytes(self) -> int:
        return sum(r.arena.nbytes() for r in self.regions)

    def host_bytes(self) -> int:
        return sum(s.nbytes for r in self.regions for s in r.slabs)

    def pinned_bytes(self) -> int:
        return sum(s.nbytes for r in self.regions for s in r.slabs if s.pinned)

    # ------------------------------------------------------------------------- stepping
    def _stream_triple(self) -> tuple[Any, Any, Any]:
        if self._streams is None:
            h2d, comp, d2h = (torch.cuda.Stream(self.device) for _ in range(3))
            self._streams = (h2d, comp, d2h)
        return self._streams

    def _open(self) -> None:
        """Start a step at its first gradient: reset the buckets and order this step's copies
        of state after the last step's write-backs."""
        st = self._step
        if st.open:
            return
        st.open = True
        for b in self.buckets:
            b.waiting = len(b.members)
            b.ran = b.done = b.dispatched = False
            b.ready_event = None
        if self.device.type == "cuda":
            h2d, _, d2h = self._stream_triple()
            h2d.wait_stream(d2h)  # the last step's state is back on the host before it is read

    def _mark_ready(self, buckets: list[_Bucket]) -> list[_Bucket]:
        """Record, on the current stream, that ``buckets``' gradients are final: :meth:`run`
        may run on another thread, whose current stream is not backward's."""
        if buckets and self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            for b in buckets:
                b.ready_event = ready
        for b in buckets:
            b.dispatched = True
        return buckets

    def arrived(self, pos: int, grad: Tensor) -> list[_Bucket]:
        """Parameter ``pos``'s gradient ``grad`` is final (held until its update ran; the
        caller takes it off the parameter); returns the buckets it completes."""
        self._open()
        # what can raise comes first: an interrupted call leaves the gradient not counted
        done = self._mark_ready([b for b in self.of_param[pos] if b.waiting == 1])
        self._step.arrived[pos] = grad
        for b in self.of_param[pos]:
            b.waiting -= 1
        return done

    def unfinished(self) -> list[_Bucket]:
        """Buckets that some parameter's final gradient joined but that are not complete (a
        parameter of theirs got no gradient this step): what closing the step still runs.
        Complete buckets went to :meth:`run` (or are held for the norm) already, and so did
        those an interrupted close returned: a retried close only collects."""
        arrived = self._step.arrived
        return self._mark_ready(
            [
                b
                for b in self.buckets
                if b.waiting > 0 and not b.dispatched and any(p in arrived for p in b.members)
            ]
        )

    def _stage(self, b: _Bucket) -> StateArena:
        """Start copying ``b``'s state to the device; returns the device arena (``b.staged``)."""
        region = b.region
        cuda = self.device.type == "cuda"
        h2d = self._stream_triple()[0] if cuda else None
        written = self._in_flight.get(b)
        if h2d is not None and written is not None:  # h2d: on CUDA
            # a write-back of this step (_open orders only the last step's): read after it
            h2d.wait_event(written)
        with torch.cuda.stream(h2d) if cuda else nullcontext():
            staged = StateArena(
                b.plan,
                region.arena.codecs,
                region.arena.master,
                zeros=lambda n, dt, dev: torch.empty(n, dtype=dt, device=dev),
            )
            for dst, src in _field_pairs(staged, region.arena, b.h0, b.h1):
                dst.copy_(src, non_blocking=cuda)
            if cuda:
                b.staged_event = torch.cuda.Event()
                b.staged_event.record(h2d)
        b.staged = staged
        self._in_flight[b] = None
        return staged

    def _prefetch(self) -> None:
        # prefetch_mb=0: none (a positive budget below one bucket still stages one)
        if self.device.type != "cuda" or not self.order or not self.prefetch_bytes:
            return
        for b, ev in list(self._in_flight.items()):
            if ev is not None and ev.query():
                del self._in_flight[b]
        used = sum(b.nbytes for b in self._in_flight)
        st = self._step
        while st.prefetch_at < len(self.order):
            b = self.order[st.prefetch_at]
            if b.ran or b.staged is not None:
                st.prefetch_at += 1
                continue
            if used + b.nbytes > self.prefetch_bytes and used > 0:
                return
            self._stage(b)
            used += b.nbytes
            st.prefetch_at += 1

    def run(self, b: _Bucket, groups: Mapping[int, Mapping[str, Any]], coef: float | None) -> None:
        """Update ``b``'s parameters that have a final gradient (scaled by ``coef`` when it is
        below 1: clipping) with ``groups[group index]``'s hyperparameters (floats, checked when
        the step opened). AdamBridge calls it on its dispatcher thread: the backward thread only
        counts gradients (:meth:`arrived`)."""
        if b.ran:  # at most once a step: a second run would write its staged old state back
            return
        group = groups[b.plan.group_index]
        arrived = self._step.arrived
        cuda = self.device.type == "cuda"
        staged = self._stage(b) if b.staged is None else b.staged
        b.staged, b.ran = None, True
        self._step.ran.append(b)
        if cuda:
            _, comp, d2h = self._stream_triple()
            comp.wait_event(b.ready_event)  # the gradients are final
            comp.wait_event(b.staged_event)
        arrived_grads = {pos: g for pos in b.members if (g := arrived.get(pos)) is not None}
        if cuda:
            # the caching allocator reuses these only after the streams that use them; marked
            # before the first launch, so a run that raises after it frees them no earlier
            for t in staged.tensors():
                t.record_stream(comp)
                t.record_stream(d2h)
            for g in arrived_grads.values():  # their contiguous copies are comp's own
                g.record_stream(comp)
        with torch.cuda.stream(comp) if cuda else nullcontext():
            # a non-contiguous gradient's copy runs on the update stream, after the event that
            # says it is final: on this thread's own stream it was unordered with the update
            grads = {
                pos: g if g.is_contiguous() else g.contiguous() for pos, g in arrived_grads.items()
            }
            # each piece's range of its gradient; one work per step count (a parameter that
            # missed a step is one update behind)
            pieces: dict[int, Tensor] = {}
            by_step: dict[int, list[int]] = {}
            for si, pos in enumerate(b.positions):
                if pos in grads:
                    g, a, n = grads[pos], b.starts[si], b.plan.slots[si].numel
                    pieces[si] = g if n == g.numel() else g.view(-1)[a : a + n]
                    by_step.setdefault(self.steps[pos], []).append(si)
            if coef is not None and coef < 1.0:
                # mul_ as update="host" scales its host copies (torch._foreach_mul_ rounds
                # the coefficient to bf16 on the CPU: other bits)
                for piece in pieces.values():
                    piece.mul_(coef)
            for done, slots in by_step.items():
                self._launch(b, staged, slots, pieces, group, done + 1)
        region = b.region
        with torch.cuda.stream(d2h) if cuda else nullcontext():
            if cuda:
                d2h.wait_stream(comp)
            for src, dst in _field_pairs(staged, region.arena, b.h0, b.h1):
                dst.copy_(src, non_blocking=cuda)
            if cuda:
                written = torch.cuda.Event()
                written.record(d2h)
                self._in_flight[b] = written
            else:
                self._in_flight.pop(b, None)
        for pos in grads:
            if all(x.ran for x in self.of_param[pos]):  # its last piece: the update is done
                self.steps[pos] += 1
                arrived[pos] = None  # the gradient's memory goes now, not at the step's end
        self._prefetch()

    def _launch(self, b, staged, slots, pieces, group, step) -> None:
        region = b.region
        scalars = reference.adam_scalars(
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=step,
            decoupled=True,
        )
        region.backend.step(
            GroupStep(
                rule="adam",
                spec=b.plan.spec,
                plan=b.plan,
                slots=slots,
                params=[b.plan.params[si] for si in slots],
                grads=[pieces[si] for si in slots],
                arena=staged,
                scalars=scalars,
                step=step,
                seed=self.seed,
                tensor_ids=[self.tensor_ids[b.positions[si]] for si in slots],
                first_step=step == 1,
                index_bases=[b.starts[si] for si in slots],
            )
        )
        mark_written([b.plan.params[si] for si in slots])  # written by raw pointer

    def finish(self) -> None:
        """Close the step (every bucket with a final gradient ran): the current stream waits
        for the updates; the next step prefetches in this step's order."""
        st = self._step
        if st.ran:
            self.order = list(st.ran)
        for b in [b for b in self._in_flight if b.staged is not None]:
            b.staged = None  # prefetched, never run: not held through the next forward
            del self._in_flight[b]
        if self.device.type == "cuda" and self._streams is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._streams[1])
        self._step = _StepState()

    def abandon(self) -> None:
        """After a failed update: drop the step (its gradients with it) and the state staged
        for it; the step counts of the buckets that did run stay advanced. Waits for the
        streams first: a kernel of the failed step may still be queued, and must neither use
        freed buffers nor write the weights after a reload."""
        with suppress(RuntimeError):  # a CUDA error of the failed step: it is lost
            self.synchronize_host()
        for b in list(self._in_flight):
            if self._in_flight[b] is None:  # staged, never written back
                b.staged = None
                del self._in_flight[b]
        self._step = _StepState()

    def synchronize_host(self) -> None:
        """Block until the state in host memory is current (every write-back landed)."""
        if self.device.type == "cuda" and self._streams is not None:
            for s in self._streams:
                s.synchronize()

    # ---------------------------------------------------------------------- state dicts
    def views(self, pos: int) -> dict[str, Tensor]:
        """Parameter ``pos``'s host state under the optimizer's keys (live views)."""
        region, si = self.homes[pos]
        return region.arena.views(region.plan.slots[si])

    def state_entry(self, pos: int) -> dict[str, Any]:
        """The state dict entry of parameter ``pos``: ``step``, the moments and ECC code (live
        host views) and ``master`` (a host copy of the device weight), as ``update="host"``
        saves them."""
        entry: dict[str, Any] = {
            "step": torch.tensor(float(self.steps[pos]), dtype=torch.float32, device="cpu")
        }
        entry.update(self.views(pos))
        entry["master"] = self.params[pos].detach().to("cpu", copy=True)
        return entry

    def check_entry(self, pos: int, entry: Mapping[str, Any], key: Any) -> None:
        """StateDictError unless ``entry`` holds exactly what :meth:`state_entry` gives."""
        region, si = self.homes[pos]
        slot = region.plan.slots[si]
        expected = dict(region.arena.layout(slot))
        p = self.params[pos]
        expected["master"] = (tuple(p.shape), p.dtype)
        missing = sorted(set(expected) - set(entry))
        extra = sorted(set(entry) - set(expected) - {"step"})
        if missing or extra or "step" not in entry:
            raise StateDictError(
                f"the state of parameter index {key!r} must hold step, "
                f"{', '.join(sorted(expected))}; it lacks {missing + ([] if 'step' in entry else ['step'])} "
                f"and has unexpected {extra}"
            )
        for k, (shape, dtype) in expected.items():
            t = entry[k]
            if not isinstance(t, Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                got = (
                    f"{t.dtype} of shape {tuple(t.shape)}"
                    if isinstance(t, Tensor)
                    else type(t).__name__
                )
                raise StateDictError(
                    f"{k!r} of parameter index {key!r} must be {dtype} of shape {tuple(shape)}, "
                    f"got {got}"
                )
            refuse_valueless(f"{k!r} of parameter index {key!r}", t)
        # the host update's checks, so that a state dict moves between the two updates (a
        # negative second moment steps to NaN weights through its square root)
        conversions.check_second_moment(
            entry["exp_avg_sq"], f"'exp_avg_sq' of parameter index {key!r}"
        )
        MemOptimizer._validated_step(entry["step"], f"parameter index {key!r}")

    def load_entry(self, pos: int, entry: Mapping[str, Any]) -> None:
        """Copy a checked entry in: host state, step count, and the device weight."""
        step = entry["step"]
        self.steps[pos] = int(step.item() if isinstance(step, Tensor) else step)
        for k, view in self.views(pos).items():
            view.copy_(entry[k])
        self.params[pos].detach().copy_(entry["master"])

    def reset_steps(self, positions: Sequence[int]) -> None:
        """Parameters absent from a loaded state dict start over: step 0, zero moments, the
        code of their current weights."""
        for pos in positions:
            self.steps[pos] = 0
            master = self.homes[pos][0].arena.master
            for k, view in self.views(pos).items():
                if k == "master_code":
                    assert master is not None  # an arena holds a code only for a master codec
                    conversions.encode_master_into(
                        master, self.params[pos].detach().cpu(), None, view
                    )
                else:
                    view.zero_()


def _host_arena(plan, codecs, master, pin: bool, what: str) -> tuple[StateArena, list[HostSlab]]:
    """``plan``'s state arena in exact-size host slabs (pinned when ``pin``), zeroed: one slab
    per field, since ``torch.save`` refuses views of one storage under different dtypes."""
    layouts: list[SlabLayout] = []

    def reserve(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        layouts.append(SlabLayout())
        layouts[-1].add((n,), dtype)
        return torch.empty(n, dtype=dtype, device="meta")

    StateArena(plan, codecs, master, zeros=reserve)  # sizes only (meta tensors)
    nbytes = sum(x.nbytes for x in layouts)
    check_host_memory(nbytes, nbytes if pin else 0, what)
    slabs = [HostSlab(x, pin=pin, what=what) for x in layouts]
    views = iter([slab.view(0) for slab in slabs])
    return StateArena(plan, codecs, master, zeros=lambda n, dt, dev: next(views)), slabs


def _field_pairs(
    staged: StateArena, host: StateArena, h0: int, h1: int
) -> list[tuple[Tensor, Tensor]]:
    """(device field, host range) of every field of a bucket (per-element fields only)."""
    pairs = [
        (staged.fields[name][suffix], host.fields[name][suffix][h0:h1])
        for name in staged.fields
        for suffix in staged.fields[name]
    ]
    if staged.master_code is not None:
        # both arenas have the region's master codec, so the host one holds a code too
        assert host.master_code is not None
        pairs.append((staged.master_code, host.master_code[h0:h1]))
    return pairs
