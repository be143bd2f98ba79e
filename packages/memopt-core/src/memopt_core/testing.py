"""Test helpers for kernel packages: build one group (plan, arena, parameters) the way
``MemOptimizer`` does, clone it, step two copies through two backends and report differing bits.

Every kernel package checks its backend against core's torch backend with these (one copy of the
group-building logic for the Triton and the C++ kernels, and for the GPU sweep). Optimizer
packages' DDP and FSDP2 tests build their one-process reference with :func:`set_mean_gradients`;
:func:`fsdp2_worker` is the rank process of their FSDP2 tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from memopt_core import reference
from memopt_core.backends import GroupStep
from memopt_core.formats import StateSpec
from memopt_core.plan import GroupPlan, StateArena

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "MASTERS",
    "MASTER_IDS",
    "PRESETS",
    "RULE_CONFIGS",
    "VARIANTS",
    "Fsdp2Job",
    "Group",
    "assert_same_optimizers",
    "at_offset",
    "bits",
    "diff_report",
    "fsdp2_worker",
    "group_state",
    "group_step",
    "init_rank",
    "json_ranks",
    "leave_group",
    "make_grads",
    "make_group",
    "q8_sqrt_threshold_cases",
    "record_codec_calls",
    "rule_names",
    "scalars_for",
    "set_mean_gradients",
    "spawn_ranks",
    "step_group",
]

#: (master format, parameter dtype) pairs every backend supports, and their test ids
MASTERS = [
    ("fp32", torch.float32),
    ("none", torch.bfloat16),
    ("none", torch.float16),
    ("ecc24", torch.bfloat16),
    ("ecc32", torch.bfloat16),
]
MASTER_IDS = [f"{m}-{str(d)[6:]}" for m, d in MASTERS]
#: moment presets (memopt_core.formats.MOMENT_PRESETS)
PRESETS = ["fp32", "bf16", "fp8", "q8"]
#: rule variants the exactness tests cover: name -> (optimizer rule, hyperparameters)
VARIANTS = {
    "adamw": ("adamw", dict(lr=1e-2, weight_decay=0.1)),
    "adam-l2-max": ("adam", dict(lr=3e-3, weight_decay=0.05, maximize=True, betas=(0.8, 0.99))),
    "sgd": ("sgd", dict(lr=0.05)),
    "sgd-mom-damp-l2": ("sgd", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd-nesterov": ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True)),
    "sgdw-mom": ("sgdw", dict(lr=0.05, momentum=0.8, weight_decay=0.1, maximize=True)),
    "lion": ("lion", dict(lr=1e-3, weight_decay=0.1, initial_lr=2e-3)),
}

#: One configuration per optimizer rule, the formats spread across them: (rule, master,
#: moments, parameter dtype, hyperparameters beyond the rule's defaults). What the tests of a
#: backend's paths that run several works at once (step counts, prepared steps) run each of.
RULE_CONFIGS = [
    ("adamw", "ecc24", "q8", torch.bfloat16, {}),
    ("adam", "fp32", "fp8", torch.float32, {"weight_decay": 0.01}),
    ("lion", "ecc32", "bf16", torch.bfloat16, {}),
    ("sgd", "none", "fp32", torch.float16, {"momentum": 0.9, "nesterov": True}),
    ("sgdw", "fp32", "q8", torch.float32, {"momentum": 0.9}),
]

#: optimizer rule -> (backend rule, decoupled)
RULE_KINDS = {
    "sgd": ("sgd", False),
    "sgdw": ("sgd", True),
    "adam": ("adam", False),
    "adamw": ("adam", True),
    "lion": ("lion", True),
}


def rule_names(kind: str, momentum: float = 0.9) -> tuple[str, ...]:
    """State names of a backend rule (the optimizer's convention)."""
    if kind == "adam":
        return ("exp_avg", "exp_avg_sq")
    if kind == "lion":
        return ("exp_avg",)
    return ("momentum_buffer",) if momentum != 0.0 else ()


@dataclass
class Group:
    """One plan group with its arena and parameters (``params`` are the plan's tensors)."""

    rule: str
    kind: str
    spec: StateSpec
    plan: GroupPlan
    arena: StateArena
    hyper: dict
    seed: int
    tensor_ids: list[int]
    index_bases: list[int] | None = None

    @property
    def params(self) -> list[Tensor]:
        return self.plan.params

    def clone(self, offset: int = 0) -> Group:
        """An independent copy (new parameter tensors, new plan, arena fields copied). With
        ``offset``, each new parameter starts ``offset`` elements into a larger buffer: contiguous,
        at an address a kernel cannot assume aligned."""
        params = [_at_offset(p.detach(), offset) for p in self.params]
        plan = GroupPlan(
            params, self.spec, device=self.plan.device, param_dtype=self.plan.param_dtype
        )
        arena = StateArena(plan, self.arena.codecs, self.arena.master)
        for name, fields in self.arena.fields.items():
            for suffix, t in fields.items():
                arena.fields[name][suffix].copy_(t)
        if self.arena.master_code is not None:
            assert arena.master_code is not None
            arena.master_code.copy_(self.arena.master_code)
        return Group(
            self.rule, self.kind, self.spec, plan, arena, dict(self.hyper), self.seed,
            list(self.tensor_ids),
            None if self.index_bases is None else list(self.index_bases),
        )  # fmt: skip


def _at_offset(t: Tensor, offset: int) -> Tensor:
    """A contiguous copy of ``t`` that starts ``offset`` elements into its own buffer."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    out = buf[offset:].view(t.shape)
    out.copy_(t)
    return out


def at_offset(tensors: list[Tensor], offset: int) -> list[Tensor]:
    """Copies of ``tensors``, each ``offset`` elements into a larger buffer (unaligned data
    pointers for ``offset`` not a multiple of the alignment in question)."""
    return [_at_offset(t, offset) for t in tensors]


def make_group(
    rule: str,
    spec: StateSpec,
    dtype: torch.dtype,
    sizes: list[int],
    device: torch.device | str,
    *,
    seed: int = 0,
    gen_seed: int = 0,
    index_bases: list[int] | None = None,
    **hyper,
) -> Group:
    """Parameters of ``sizes`` elements (shapes vary: 1-D, 2-D where the size factors) with
    log-normal magnitudes, their arena as the optimizer builds it (master codes encoded from the
    initial parameters) and ``hyper`` (lr, betas, eps, weight_decay, momentum, ...).
    ``index_bases``: the steps' :attr:`GroupStep.index_bases` (the tensors as shards)."""
    kind, _ = RULE_KINDS[rule]
    # canonical ("cuda" -> "cuda:0")
    device = torch.empty(0, dtype=torch.uint8, device=device).device
    g = torch.Generator().manual_seed(gen_seed)
    params = []
    for i, n in enumerate(sizes):
        v = torch.randn(n, generator=g, dtype=torch.float32, device="cpu") * torch.exp(
            torch.randn(n, generator=g, dtype=torch.float32, device="cpu")
        )
        shape = (n // 4, 4) if n % 4 == 0 and n and i % 2 else (n,)
        params.append(v.to(dtype).to(device).view(shape))
    plan = GroupPlan(params, spec, device=device, param_dtype=dtype)
    master = spec.master_for(dtype)
    names = rule_names(kind, hyper.get("momentum", 0.0))
    codecs = {n: (spec.second if n == "exp_avg_sq" else spec.first) for n in names}
    arena = StateArena(plan, codecs, master)
    if arena.master_code is not None:
        for slot, p in zip(plan.slots, params, strict=True):
            _, code = master.encode(p.detach().float().reshape(-1))
            assert code is not None
            arena.master_code[slot.offset : slot.offset + slot.numel].copy_(code)
    tensor_ids = [1000 + 7 * i for i in range(len(sizes))]
    return Group(rule, kind, spec, plan, arena, hyper, seed, tensor_ids, index_bases)


def make_grads(
    group: Group, step: int, *, grad_dtype: torch.dtype | None = None, scale: float = 1.0
) -> list[Tensor]:
    """Deterministic gradients for ``step`` (a few exact zeros, magnitudes over decades)."""
    g = torch.Generator().manual_seed(10_000 + step)
    out = []
    for p in group.params:
        n = p.numel()
        v = (
            torch.randn(n, generator=g, dtype=torch.float32, device="cpu")
            * torch.exp(2 * torch.randn(n, generator=g, dtype=torch.float32, device="cpu"))
            * scale
        )
        if n > 3:
            v[::7] = 0.0
        dt = grad_dtype or p.dtype
        out.append(v.to(dt).to(p.device).view(p.shape))
    return out


def scalars_for(group: Group, step: int):
    """The rule's scalars (core's reference functions, in double) for ``step`` (Adam's
    normalized for the 8-bit presets, as the optimizer computes them)."""
    kind, decoupled = RULE_KINDS[group.rule]
    h = group.hyper
    lr = h.get("lr", 1e-2)
    wd = h.get("weight_decay", 0.0)
    maximize = h.get("maximize", False)
    initial_lr = h.get("initial_lr")
    if kind == "adam":
        return reference.adam_scalars(
            lr=lr,
            betas=h.get("betas", (0.9, 0.999)),
            eps=h.get("eps", 1e-8),
            weight_decay=wd,
            step=step,
            decoupled=decoupled,
            maximize=maximize,
            initial_lr=initial_lr,
            normalized=group.spec.decay_normalized,
        )
    if kind == "lion":
        return reference.lion_scalars(
            lr=lr,
            betas=h.get("betas", (0.9, 0.99)),
            weight_decay=wd,
            maximize=maximize,
            initial_lr=initial_lr,
        )
    return reference.sgd_scalars(
        lr=lr,
        momentum=h.get("momentum", 0.0),
        dampening=h.get("dampening", 0.0),
        nesterov=h.get("nesterov", False),
        weight_decay=wd,
        decoupled=decoupled,
        maximize=maximize,
        initial_lr=initial_lr,
    )


def group_step(
    group: Group, grads: list[Tensor], step: int, slots: list[int] | None = None
) -> GroupStep:
    """The :class:`GroupStep` of one step of ``group`` (all tensors, or ``slots``)."""
    slots = list(range(len(group.params))) if slots is None else slots
    return GroupStep(
        rule=group.kind,
        spec=group.spec,
        plan=group.plan,
        slots=slots,
        params=[group.params[i] for i in slots],
        grads=[grads[i] for i in slots],
        arena=group.arena,
        scalars=scalars_for(group, step),
        step=step,
        seed=group.seed,
        tensor_ids=[group.tensor_ids[i] for i in slots],
        first_step=step == 1,
        index_bases=None if group.index_bases is None else [group.index_bases[i] for i in slots],
    )


def step_group(
    backend, group: Group, grads: list[Tensor], step: int, slots: list[int] | None = None
) -> None:
    """One backend step of ``group`` (all tensors, or ``slots``)."""
    backend.step(group_step(group, grads, step, slots))


def group_state(group: Group) -> dict[str, Tensor]:
    """Every tensor of the group's state as raw bits (parameters, codes, moment fields)."""
    out: dict[str, Tensor] = {}
    for i, p in enumerate(group.params):
        out[f"param{i}"] = bits(p)
    if group.arena.master_code is not None:
        out["master_code"] = bits(group.arena.master_code)
    for name, fields in group.arena.fields.items():
        for suffix, t in fields.items():
            out[f"{name}[{suffix}]"] = bits(t)
    return out


def record_codec_calls(monkeypatch: Any, ops: Any) -> list[str]:
    """Patch the standalone codecs of a kernel package's ``ops`` module (pytest's
    ``monkeypatch``) so that each call is recorded; returns the list of their names, in call
    order (the calls still run). For tests that :mod:`memopt_core.conversions` reaches them."""
    calls: list[str] = []

    def recorded(name: str, real: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        return call

    for name in ("encode_moment", "decode_moment", "encode_master", "decode_master"):
        monkeypatch.setattr(ops, name, recorded(name, getattr(ops, name)))
    return calls


def assert_moment_conversions_exact(codec: Any, x: Tensor) -> None:
    """:mod:`memopt_core.conversions`' moment encode and decode of ``x`` (on whatever codecs it
    picks for ``x``'s device) give the reference codec's bits."""
    from memopt_core import conversions

    fields = conversions.encode_moment(codec, x)
    ref = codec.encode_sliced(x)
    for key in ref:
        assert torch.equal(bits(fields[key]), bits(ref[key])), key
    assert torch.equal(bits(conversions.decode_moment(codec, ref)), bits(codec.decode_sliced(ref)))


def master_patterns(codec: Any, n: int, seed: int) -> tuple[Tensor, Tensor | None]:
    """``(param, code)`` for decoding with master ``codec``: ``n`` random bit patterns of every
    class, then (ECC formats) ``+-0`` parameters with every carrying code, a pair no encode makes
    (left when a weight is zeroed in place; decoded to that zero since KERNEL_API 6)."""
    g = torch.Generator().manual_seed(seed)
    if codec.param_dtype == torch.float32:
        pr = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64, device="cpu").to(
            torch.int32
        )
        return pr.view(torch.float32), None
    pr = torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int32, device="cpu").to(
        torch.int16
    )
    if codec.code_dtype is None:
        return pr.view(codec.param_dtype), None
    top = 1 << (8 * codec.code_dtype.itemsize)  # 256 or 65536
    codes = torch.randint(0, top, (n,), generator=g, device="cpu")
    carrying = torch.arange(top // 2, top, device="cpu").repeat(2)
    zeros = torch.tensor([0, -(2**15)], dtype=torch.int16, device="cpu").repeat_interleave(top // 2)
    pr, codes = torch.cat([pr, zeros]), torch.cat([codes, carrying])
    code = codes.to(torch.uint8) if top == 256 else codes.to(torch.int32).to(torch.int16)
    return pr.view(codec.param_dtype), code


def q8_sqrt_threshold_cases(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Second moments ``v`` at every ``q8_sqrt`` code ``lo`` from 1 to ``0xFD`` (subnormal and
    normal, each binade's last) at random fractions ``f`` of the way to the next code, where
    ``sqrt(v)`` is exact (``s = lo + f * spacing`` with a 19-bit ``f``), in blocks of 32 whose
    first element fixes the scale at ``2**0``; with the probability ``p`` of rounding up that
    keeps ``E[q*q] = s*s`` (``(s*s - lo*lo) / (hi*hi - lo*lo)``, fp64: every term is exact)
    and random words ``r`` whose ``r >> 8`` lies within two of ``p * 2**24``, on both sides.
    Returns ``(v, p, r)``; ``v`` is fp32, ``p`` fp64, ``r`` int64 32-bit words."""
    g = torch.Generator().manual_seed(seed)
    per_code = 31 * 4  # blocks of 32: one scale element, then 31 cases
    lo_code = torch.arange(1, 0xFE, device="cpu").repeat_interleave(per_code)

    def value(c: Tensor) -> Tensor:  # e4m4 code -> value, exact in fp64
        e, m = c >> 4, (c & 15).double()
        return torch.where(e == 0, m * 2.0**-18, (16 + m) * torch.pow(2.0, (e - 19).double()))

    lo, hi = value(lo_code), value(lo_code + 1)
    f = torch.randint(1, 2**19, lo_code.shape, generator=g, device="cpu").double() * 2.0**-19
    s = lo + f * (hi - lo)
    p = (s * s - lo * lo) / (hi * hi - lo * lo)
    r24 = torch.floor(p * 2**24).to(torch.int64) + torch.randint(
        -2, 3, s.shape, generator=g, device="cpu"
    )
    r = (r24.clamp(0, 2**24 - 1) << 8) | torch.randint(0, 256, s.shape, generator=g, device="cpu")
    n = s.numel() // 31
    v = torch.full(
        (n, 32), 1.875**2, dtype=torch.float64, device="cpu"
    )  # s = 1.875: scale byte 127
    v[:, 1:] = (s * s).view(n, 31)
    words = torch.zeros(n, 32, dtype=torch.int64, device="cpu")
    words[:, 1:] = r.view(n, 31)
    probs = torch.zeros(n, 32, dtype=torch.float64, device="cpu")
    probs[:, 1:] = p.view(n, 31)
    return v.reshape(-1).float(), probs.reshape(-1), words.reshape(-1)


def bits(t: Tensor) -> Tensor:
    """The raw bit patterns of ``t`` (flat, on the CPU) as a same-width integer tensor."""
    t = t.detach().reshape(-1).contiguous()
    size = t.element_size()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]).cpu()


def assert_same_optimizers(
    params_a: Sequence[Tensor], params_b: Sequence[Tensor], opt_a, opt_b, where: str = ""
) -> None:
    """Parameters ``params_a`` and ``params_b`` and their states in ``opt_a`` and ``opt_b`` are
    equal bit for bit, under the same state keys."""
    for i, (p, q) in enumerate(zip(params_a, params_b, strict=True)):
        assert torch.equal(bits(p), bits(q)), f"{where}: parameter {i} differs"
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert sorted(sa) == sorted(sb), f"{where}: parameter {i} state keys differ"
        for k in sa:
            assert torch.equal(bits(sa[k]), bits(sb[k])), f"{where}: state {k!r} of {i} differs"


def diff_report(a: Group, b: Group, *, nan_equal: bool = False) -> list[str]:
    """Names of the state tensors whose bits differ, with the first few differing positions.

    ``nan_equal``: floating tensors compare NaN == NaN whatever the payload (NaN payloads depend
    on the device's arithmetic, so tests with non-finite gradients use this)."""
    sa, sb = group_state(a), group_state(b)
    bad = []
    for key in sa:
        x, y = sa[key], sb[key]
        if torch.equal(x, y):
            continue
        diff = x != y
        if nan_equal:
            ta = _float_view(a, key)
            tb = _float_view(b, key)
            if ta is not None and tb is not None:
                diff = diff & ~(torch.isnan(ta) & torch.isnan(tb))
                if not bool(diff.any()):
                    continue
        where = diff.nonzero().flatten()[:5].tolist()
        bad.append(
            f"{key}: {int(diff.sum())} of {x.numel()} differ, e.g. at {where}: "
            f"{x[where].tolist()} vs {y[where].tolist()}"
        )
    return bad


def _float_view(group: Group, key: str) -> Tensor | None:
    if key == "master_code":  # NaN masters: the code holds payload bits
        codes, master = group.arena.master_code, group.arena.master
        # group_state names a master_code only for an arena that keeps one: an ECC master's
        assert codes is not None
        assert master is not None
        parts = []
        for slot, p in zip(group.plan.slots, group.params, strict=True):
            code = codes[slot.offset : slot.offset + slot.padded]
            low = torch.zeros(slot.padded, dtype=p.dtype, device=p.device)
            low[: slot.numel] = p.detach().reshape(-1)
            parts.append(master.decode(low, code).cpu())
        return torch.cat(parts) if parts else None
    if key.startswith("param"):
        p = group.params[int(key[5:])]
        return p.detach().reshape(-1).float().cpu()
    if key.endswith("[]"):
        t = group.arena.fields[key[:-2]][""]
        if t.dtype in (torch.float32, torch.bfloat16):
            return t.reshape(-1).float().cpu()
    return None


def set_mean_gradients(model: torch.nn.Module, losses: Sequence[Callable[[], Tensor]]) -> None:
    """Give every parameter of ``model`` the gradient DistributedDataParallel gives it with one
    rank per entry of ``losses`` (each a callable computing that rank's loss): each rank's
    gradient divided by the world size, summed in rank order. With two ranks over gloo that is
    ``g0 / 2 + g1 / 2`` bit for bit, so a one-process optimizer step on these gradients is the
    reference a DDP test compares every rank's weights with."""
    world = len(losses)
    per_rank = []
    for loss in losses:
        model.zero_grad()
        loss().backward()
        # every parameter takes part in every rank's loss (as DDP requires by default)
        per_rank.append([cast(Tensor, p.grad).clone() for p in model.parameters()])
    for p, *grads in zip(model.parameters(), *per_rank, strict=True):
        total = grads[0] / world
        for g in grads[1:]:
            total = total + g / world
        p.grad = total


@dataclass(frozen=True)
class Fsdp2Job:
    """One training run of :func:`fsdp2_worker` (picklable: module-level functions or
    ``functools.partial`` s of them). ``loss_of(model, step, rank)`` is a rank's loss.
    ``prepare(model, optimizer)`` runs once before training (e.g. enables gradient release,
    whose updates happen inside ``backward``: set ``step_in_backward`` so the loop calls
    neither ``step()`` nor ``zero_grad()``)."""

    name: str
    make_model: Callable[[], torch.nn.Module]
    make_optimizer: Callable[[Iterable[Tensor]], torch.optim.Optimizer]
    loss_of: Callable[[torch.nn.Module, int, int], Tensor]
    steps: int
    reshard_after_forward: bool = True
    prepare: Callable[[torch.nn.Module, torch.optim.Optimizer], object] | None = None
    step_in_backward: bool = False


def init_rank(rank: int, world: int, init_file: str, device: str = "cpu") -> None:
    """Join the process group of a distributed test's rank ``rank``: gloo on the CPU, or NCCL
    with GPU ``rank`` as the current device (``device="cuda"``); rendezvous through
    ``init_file``. The caller destroys the group. Collectives time out after 2 minutes (torch's
    default is 30), so a rank that died fails its test instead of hanging the suite."""
    from datetime import timedelta

    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=2),
    )


def leave_group() -> None:
    """End a distributed test rank that finished its work: a barrier, so that no rank closes its
    connections while another still uses them, then ``destroy_process_group``. (A rank that
    failed only destroys its group: a barrier would wait for it in vain.)"""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(fn: Callable, args: tuple, nprocs: int, outputs: Sequence[str | Path]) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` for the distributed tests, whose ranks
    write their results to ``outputs``.

    Now and then gloo aborts a rank as its process group is torn down: SIGABRT, "terminate called
    without an active exception". CI saw it in 3 of about 30 runs (FSDP2 over gloo on 2 cores),
    each time in the rank's exit. Such an exit is accepted when every file of ``outputs`` exists:
    the ranks finished all that the test checks. Any other failure is raised."""
    import torch.multiprocessing as mp

    try:
        mp.spawn(fn, args=args, nprocs=nprocs, join=True)
    except mp.ProcessExitedException as e:
        if e.signal_name != "SIGABRT" or not all(Path(o).exists() for o in outputs):
            raise


def json_ranks(worker: Callable, out: Path, world: int = 2) -> list[Any]:
    """Run ``worker(rank, world, init_file, out)`` on ``world`` processes (:func:`spawn_ranks`;
    the worker joins with :func:`init_rank`) and read back what each rank wrote to
    ``{out}/rank{rank}.json``."""
    import json

    files = [out / f"rank{r}.json" for r in range(world)]
    spawn_ranks(worker, (world, str(out / "init"), str(out)), world, files)
    return [json.loads(f.read_text()) for f in files]


def fsdp2_worker(
    rank: int, world: int, init_file: str, out: str, jobs: Sequence[Fsdp2Job], device: str = "cpu"
) -> None:
    """One rank of FSDP2 tests (a ``torch.multiprocessing.spawn`` target): runs every job in one
    process group, so a test module pays the start-up of its ranks once.

    Each job shards ``make_model()`` with ``fully_shard`` (each submodule holding parameters,
    then the root), builds ``make_optimizer(model.parameters())``, trains ``steps`` steps and
    saves the full (all-gathered) parameters by name to ``{out}/{name}-rank{rank}.pt``. FSDP2
    averages gradients across ranks; with two ranks that is what :func:`set_mean_gradients`
    gives one process (these tests' reference). ``device="cuda"``: NCCL, one GPU per rank.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    init_rank(rank, world, init_file, device)
    try:
        for job in jobs:
            model = job.make_model().to(device)
            for m in list(model.modules())[1:]:
                if any(True for _ in m.parameters(recurse=False)):
                    fully_shard(m, reshard_after_forward=job.reshard_after_forward)
            fully_shard(model, reshard_after_forward=job.reshard_after_forward)
            opt = job.make_optimizer(model.parameters())
            if job.prepare is not None:
                job.prepare(model, opt)
            for t in range(job.steps):
                job.loss_of(model, t, rank).backward()
                if not job.step_in_backward:
                    opt.step()
                    opt.zero_grad()
            # fully_shard made every parameter a DTensor
            full = {n: cast("DTensor", p).full_tensor().cpu() for n, p in model.named_parameters()}
            torch.save(full, f"{out}/{job.name}-rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()
