"""End-to-end offload benchmark: Qwen2.5-0.5B's shape, one training step per iteration.

Rows (``--rows`` picks a subset; each in a fresh model built with the same seed):

- ``torch-adamw``: fp32 model, ``torch.optim.AdamW(fused=True)``, forward and loss under
  ``torch.autocast(bf16)``, backward outside it (PyTorch's recipe). The "vs torch AdamW" base.
- ``torchao-offload``: bf16 model, torchao's ``CPUOffloadOptimizer(params, torch.optim.AdamW,
  offload_gradients=True, fused=True)`` (CUDA only), ``step()`` then ``zero_grad()``.
- ``bridge-fp32``, ``bridge-bf16``, ``bridge-fp8``, ``bridge-bf16-ecc24``, ``bridge-compact``:
  bf16 model, ``memopt_offload.AdamBridge(precision=...)`` with ``attach_hooks(model)``; the step is
  ``step_sync()``. ``bridge-bf16-nohooks``: plain ``step()`` and ``zero_grad()``.
  ``bridge-bf16-overlap``, ``bridge-bf16-ecc24-overlap``: ``attach_hooks(model,
  overlap_forward=True)``: ``step_sync()`` returns at once and the next forward overlaps the
  updates (each module waits for its own weights), so their "forward" column holds that wait
  and "after backward" is only the closing of the step.
- ``bridge-device``: bf16 model, ``AdamBridge(precision="bf16-ecc24", update="device")`` with
  ``attach_hooks(model)``: the state (ECC-24 code and bf16 moments) stays in pinned host memory
  and the GPU updates it bucket by bucket during backward (memopt_offload.device_update).
- ``deepspeed-offload``: bf16 model under DeepSpeed's ZeRO-Offload (``deepspeed.initialize``,
  one process: ZeRO stage 2, ``offload_optimizer`` on pinned CPU memory, ``overlap_comm`` and
  ``contiguous_gradients``, 2e8-element buckets as DeepSpeed's ZeRO-Offload tutorial sets them,
  AdamW through its ``DeepSpeedCPUAdam``: fp32 master, moments and gradients on the host); the
  backward is ``engine.backward(loss)`` and the step ``engine.step()``.
- ``fwd-bwd-bf16``: the bf16 model's forward and backward with no optimizer: the floor every
  offload row is measured against; it also records when each gradient becomes final.

The model is ``transformers.Qwen2ForCausalLM`` (sdpa attention, random init) where transformers
imports, else ``qwen2_shape.Qwen2ForCausalLM``, a plain-torch replica with the same parameters and
arithmetic (``--model`` forces either; the report says which ran). All rows use lr 1e-4, betas
(0.9, 0.999), eps 1e-8, weight decay 0.01, random token batches (a pool of
``--distinct-batches`` cycled, the same for every row) and transformers' causal-LM loss: fp32
cross entropy of each position's logits against the next token. Missing packages skip their rows
with the reason (printed and recorded).

On CUDA each row runs in its own process (``--isolate``, the default there), so nothing an
earlier row leaves allocated (registered host memory, the caching allocators' blocks, cuBLAS
workspaces) counts against a later one. In one process (``--no-isolate``, the default on a CPU) rows
are freed in between (del, gc, cuBLAS workspaces, ``empty_cache``) and a row that begins with
more than 0.1 GiB of device memory still allocated says so.

Timed: ``--warmup`` untimed steps, then ``--iters`` steps; each step is forward + loss, backward,
optimizer (step, or step_sync, and zero_grad), between CUDA events after a synchronize (on a CPU,
``perf_counter``); the table gives median and min, the JSON every step and each phase. Peak VRAM
is ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``) since a reset taken after the
model is built and before the first step: model, optimizer state, activations and transients.

Byte model of an AdamBridge step, bytes per parameter (r+w = read and written):

| precision | master | m and v | grad read | staging write | kernel | DMA: grad in + weight out | host total | link |
|---|---|---|---|---|---|---|---|---|
| fp32    | fp32 4 r+w = 8            | 2 x (4 r+w) = 16 | 2 | 2 | 28 | 2 + 2 | 32 | 2 down + 2 up |
| bf16    | fp32 4 r+w = 8            | 2 x (2 r+w) = 8  | 2 | 2 | 20 | 2 + 2 | 24 | 2 down + 2 up |
| fp8     | fp32 4 r+w = 8            | 2 x (1 r+w) = 4  | 2 | 2 | 16 | 2 + 2 | 20 | 2 down + 2 up |
| bf16-ecc24 | bf16 2 r+w + ECC 1 r+w = 6 | 2 x (2 r+w) = 8 | 2 | 0 | 16 | 2 + 2 | 20 | 2 down + 2 up |
| compact | bf16 2 r+w + ECC 1 r+w = 6 | 2 x (q8 1 r+w) = 4 | 2 | 0 | 12 | 2 + 2 | 16 | 2 down + 2 up |

"kernel" is what the CPU update reads and writes; the DMA legs (the copy engine writing the bf16
gradient into pinned host memory and reading the bf16 weight back out) load the same host memory,
so the host-memory bound uses the total. The ECC-24 masters (bf16-ecc24, compact) need no
staging: their bf16 parameter is the weight that goes up. q8 and fp8 group scales (a few
hundredths of a byte) are left out.
(memopt_offload.bridge's docstring gives the kernel column.)

Lower bound per AdamBridge row: link time = max(2 B·n / D2H, 2 B·n / H2D, 4 B·n / both at once),
host time = host total·n / host bandwidth, with the bandwidths measured at the start of this run
(pinned ``copy_`` of ``--bw-mib`` MiB each way and both ways at once; a host ``copy_`` of as many
MiB, read + write counted). A set S of parameters whose gradients are final t ms into backward
cannot be done before t + max(link(S), host(S)). With hooks the bound is forward + backward + the
largest excess over backward's end of that sum over the suffixes of the gradient-ready order
(from one profiled step of ``fwd-bwd-bf16``, stretched to that row's median backward; its median
forward and backward are the ones added); the suffix that
sets it is the part that cannot hide behind backward: every parameter from the first gradient on
when the host work outlasts backward, else the last gradients (on Qwen2 the tied embedding,
final only when backward ends). Without hooks every parameter waits for backward's end. With
``overlap_forward`` the next forward can hide up to its own length of that excess: the bound is
forward + backward + max(0, excess - forward), optimistic since the weight the forward needs
first (the embedding) is the last one updated. The "after backward" column is the measured
counterpart: from backward's end to the step's end.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import qwen2_shape
import torch
import torch.nn.functional as F

GIB = 2**30
LEFTOVER_GIB = 0.1  # device memory a row may find allocated before it starts without a warning


@dataclass(frozen=True)
class ByteModel:
    """Host-memory and link bytes per parameter and step of one AdamBridge precision."""

    master: int  # master weight (or bf16 parameter and ECC code) read + written
    moments: int  # m and v read + written
    grad: int  # the kernel reads the bf16 gradient
    staging: int  # the kernel writes the bf16 weight that goes up
    dma: int  # copy engine: gradient written into, weight read out of host memory
    link_down: int = 2
    link_up: int = 2

    @property
    def kernel(self) -> int:
        return self.master + self.moments + self.grad + self.staging

    @property
    def host(self) -> int:
        return self.kernel + self.dma

    @property
    def link(self) -> int:
        return self.link_down + self.link_up


BYTE_MODEL: dict[str, ByteModel] = {
    "fp32": ByteModel(master=8, moments=16, grad=2, staging=2, dma=4),
    "bf16": ByteModel(master=8, moments=8, grad=2, staging=2, dma=4),
    "fp8": ByteModel(master=8, moments=4, grad=2, staging=2, dma=4),
    "bf16-ecc24": ByteModel(master=6, moments=8, grad=2, staging=0, dma=4),
    "compact": ByteModel(master=6, moments=4, grad=2, staging=0, dma=4),
    # update="device": no CPU arithmetic; the state (ECC-24 code 1 + bf16 m, v 4) goes to the
    # GPU and back by DMA
    "bf16-ecc24 device": ByteModel(
        master=0, moments=0, grad=0, staging=0, dma=10, link_down=5, link_up=5
    ),
}


def byte_model_key(row: Any) -> str:
    """The BYTE_MODEL entry of a row (or spec): its precision, and the update's place."""
    precision = row.precision or "bf16"
    return precision if row.update == "host" else f"{precision} {row.update}"


# DESIGN section 7's peers and section 8's targets, for runs that do not measure the peers.
PEER_TORCH_ADAMW_MS = 89.7
PEER_TORCHAO_MS = 197.6
TARGET_PEAK_GIB = 13.3
TARGET_SPEEDUP_VS_TORCHAO = 1.8
STRETCH_VS_ADAMW = 1.10


@dataclass(frozen=True)
class RowSpec:
    """One benchmark row: how the model is held and which optimizer steps it."""

    name: str
    label: str
    kind: str  # "torch" | "torchao" | "bridge" | "deepspeed" | "none"
    dtype: torch.dtype
    autocast: bool = False
    precision: str | None = None
    hooks: bool = False
    overlap: bool = False  # attach_hooks(model, overlap_forward=True)
    update: str = "host"  # AdamBridge(update=...)


BF16, FP32 = torch.bfloat16, torch.float32
ROWS: tuple[RowSpec, ...] = (
    RowSpec("torch-adamw", "torch AdamW fp32 fused + bf16 autocast", "torch", FP32, autocast=True),
    RowSpec("torchao-offload", "torchao CPUOffloadOptimizer, bf16 model", "torchao", BF16),
    RowSpec("bridge-fp32", "AdamBridge fp32", "bridge", BF16, precision="fp32", hooks=True),
    RowSpec("bridge-bf16", "AdamBridge bf16", "bridge", BF16, precision="bf16", hooks=True),
    RowSpec("bridge-fp8", "AdamBridge fp8", "bridge", BF16, precision="fp8", hooks=True),
    RowSpec("bridge-bf16-ecc24", "AdamBridge bf16-ecc24", "bridge", BF16, precision="bf16-ecc24", hooks=True),
    RowSpec("bridge-compact", "AdamBridge compact", "bridge", BF16, precision="compact", hooks=True),
    RowSpec("bridge-bf16-nohooks", "AdamBridge bf16, step() without hooks", "bridge", BF16, precision="bf16"),
    RowSpec("bridge-bf16-overlap", "AdamBridge bf16, overlap_forward", "bridge", BF16, precision="bf16", hooks=True, overlap=True),
    RowSpec("bridge-bf16-ecc24-overlap", "AdamBridge bf16-ecc24, overlap_forward", "bridge", BF16, precision="bf16-ecc24", hooks=True, overlap=True),
    RowSpec("bridge-device", "AdamBridge bf16-ecc24, update='device'", "bridge", BF16, precision="bf16-ecc24", hooks=True, update="device"),
    RowSpec("deepspeed-offload", "DeepSpeed ZeRO-2 Offload (CPUAdam), bf16 model", "deepspeed", BF16),
    RowSpec("fwd-bwd-bf16", "bf16 forward + backward, no optimizer", "none", BF16),
)  # fmt: skip
SPECS = {spec.name: spec for spec in ROWS}


@dataclass
class Row:
    """One row's numbers (JSON-ready); ``skipped`` or ``error`` instead when it did not run."""

    name: str
    label: str
    precision: str | None = None
    hooks: bool = False
    overlap: bool = False
    update: str = "host"
    median_ms: float | None = None
    min_ms: float | None = None
    step_ms: list[float] = field(default_factory=list)
    fwd_ms: float | None = None  # medians of the phases
    bwd_ms: float | None = None
    opt_ms: float | None = None  # from backward's end to the step's end: the exposed part
    peak_gib: float | None = None
    reserved_gib: float | None = None
    leftover_gib: float | None = None  # still allocated when the row began (earlier rows' leaks)
    host_gib: float | None = None
    losses: list[float] = field(default_factory=list)
    final_loss: float | None = None
    vs_torch_adamw: float | None = None
    bound: dict[str, Any] | None = None
    round_median_ms: list[float] = field(default_factory=list)  # --rounds: each round's median
    skipped: str | None = None
    error: str | None = None


def new_row(spec: RowSpec, **kw: Any) -> Row:
    """An empty :class:`Row` of ``spec`` (``kw``: ``error``, ``skipped``...)."""
    return Row(spec.name, spec.label, spec.precision, spec.hooks, spec.overlap, spec.update, **kw)


# ----------------------------------------------------------------------------- model and data


@dataclass
class ModelChoice:
    """Which implementation builds the model, and why."""

    impl: str  # "transformers" | "plain"
    note: str
    module: Any = None


def choose_model(kind: str) -> ModelChoice:
    """transformers' Qwen2ForCausalLM where importable (or demanded), else the plain replica."""
    if kind != "plain":
        try:
            transformers = importlib.import_module("transformers")
        except ImportError as exc:
            if kind == "transformers":
                raise
            return ModelChoice(
                "plain",
                f"qwen2_shape.Qwen2ForCausalLM (plain torch replica; transformers not "
                f"importable: {exc})",
            )
        return ModelChoice(
            "transformers",
            f"transformers {transformers.__version__} Qwen2ForCausalLM (sdpa)",
            transformers,
        )
    return ModelChoice("plain", "qwen2_shape.Qwen2ForCausalLM (plain torch replica, asked for)")


def build_model(
    choice: ModelChoice, shape: qwen2_shape.Qwen2Shape, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """A randomly initialized model of ``shape`` on ``device`` in ``dtype``, in training mode."""
    with torch.device(device):
        if choice.impl == "transformers":
            tf = choice.module
            config = tf.Qwen2Config(**shape.config_kwargs(), attn_implementation="sdpa")
            model = tf.Qwen2ForCausalLM(config)
        else:
            model = qwen2_shape.Qwen2ForCausalLM(shape)
    return model.to(dtype).train()


def logits_of(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, qwen2_shape.Qwen2ForCausalLM):
        return model(input_ids)
    return model(input_ids=input_ids, use_cache=False).logits


def loss_of(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss: fp32 cross entropy against the next token (the logits are
    local here, so they are freed as soon as backward no longer needs them)."""
    logits = logits_of(model, input_ids).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def make_batches(
    count: int, batch: int, seq: int, vocab: int, seed: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` random (input_ids, shifted labels) pairs, the same on every device."""
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        labels = F.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
        out.append((ids.to(device), labels.to(device)))
    return out


# ----------------------------------------------------------------------------- clocks


class Clock:
    """Marks points of a step: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        """Milliseconds from mark ``a`` to mark ``b`` (after a ``sync``)."""
        return a.elapsed_time(b) if self.cuda else 1e3 * (b - a)


# ----------------------------------------------------------------------------- bandwidths


@dataclass
class Bandwidth:
    """GB/s measured at the start of the run (None where there is no GPU)."""

    d2h_gbs: float | None
    h2d_gbs: float | None
    both_gbs: float | None  # both directions at once, bytes of both counted
    host_gbs: float  # host copy_, read + write counted
    mib: int

    def link_ms(self, down_bytes: float, up_bytes: float) -> float:
        """Least time the link needs for these bytes (0 without a GPU: nothing crosses)."""
        if self.d2h_gbs is None or self.h2d_gbs is None:
            return 0.0
        times = [down_bytes / self.d2h_gbs, up_bytes / self.h2d_gbs]
        if self.both_gbs:
            times.append((down_bytes + up_bytes) / self.both_gbs)
        return max(times) / 1e6

    def host_ms(self, nbytes: float) -> float:
        return nbytes / self.host_gbs / 1e6


def _median_ms(clock: Clock, fn: Callable[[], object], reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        clock.sync()
        a = clock.mark()
        fn()
        b = clock.mark()
        clock.sync()
        times.append(clock.ms(a, b))
    return statistics.median(times)


def measure_bandwidth(device: torch.device, mib: int) -> Bandwidth:
    """Pinned copies each way and both at once (GPU only), and a host copy_."""
    nbytes = mib * 2**20
    host_src = torch.ones(nbytes // 4)
    host_dst = torch.empty_like(host_src)
    host_gbs = (
        2 * nbytes / _median_ms(Clock(torch.device("cpu")), lambda: host_dst.copy_(host_src)) / 1e6
    )
    if device.type != "cuda":
        return Bandwidth(None, None, None, host_gbs, mib)
    clock = Clock(device)
    pinned = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    dev = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    h2d = nbytes / _median_ms(clock, lambda: dev[0].copy_(pinned[0], non_blocking=True)) / 1e6
    d2h = nbytes / _median_ms(clock, lambda: pinned[1].copy_(dev[1], non_blocking=True)) / 1e6
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]

    def both() -> None:
        for s in streams:
            s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(streams[0]):
            dev[0].copy_(pinned[0], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            pinned[1].copy_(dev[1], non_blocking=True)
        for s in streams:
            torch.cuda.current_stream(device).wait_stream(s)

    both_gbs = 2 * nbytes / _median_ms(clock, both) / 1e6
    return Bandwidth(d2h, h2d, both_gbs, host_gbs, mib)


def autotune() -> dict[str, Any]:
    """Apply memopt_offload's measured kernel settings; its fields, or why there are none."""
    try:
        from memopt_offload.autotune import AutoTuneConfig

        config = AutoTuneConfig.load_or_measure()
        config.apply()
    except Exception as exc:  # the rows still run, with the kernels' own defaults
        print(f"autotune unavailable: {_error(exc)}", file=sys.stderr)
        return {"error": _error(exc)}
    fields = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    print(f"autotune applied: {fields}", file=sys.stderr)
    return fields


# ----------------------------------------------------------------------------- optimizers


def importable(specs: list[RowSpec], device: torch.device) -> tuple[dict[str, Any], dict[str, str]]:
    """``{row: module}`` for the rows that can run here, ``{row: reason}`` for the others."""
    modules: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for spec in specs:
        if spec.kind == "torchao":
            try:
                modules[spec.name] = importlib.import_module("torchao.optim")
            except Exception as exc:  # torchao's import can fail on a torch ABI mismatch too
                skipped[spec.name] = f"torchao cannot be imported ({type(exc).__name__}: {exc})"
                continue
            if device.type != "cuda":
                del modules[spec.name]
                skipped[spec.name] = "torchao's CPUOffloadOptimizer supports CUDA and XPU only"
        elif spec.kind == "deepspeed":
            try:
                modules[spec.name] = importlib.import_module("deepspeed")
            except Exception as exc:  # its import pulls in many packages
                skipped[spec.name] = f"deepspeed cannot be imported ({type(exc).__name__}: {exc})"
        elif spec.kind == "bridge":
            try:
                module = importlib.import_module("memopt_offload")
            except ImportError as exc:
                skipped[spec.name] = f"memopt_offload cannot be imported ({exc})"
                continue
            if not hasattr(module, "AdamBridge"):
                skipped[spec.name] = "memopt_offload has no AdamBridge yet"
                continue
            modules[spec.name] = module
    return modules, skipped


HYPER = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def _deepspeed_engine(deepspeed: Any, model: torch.nn.Module, hyper: dict[str, Any], batch: int):
    """A one-process ZeRO-Offload engine over ``model`` (``deepspeed-offload`` in the doc)."""
    cuda = next(model.parameters()).is_cuda
    if not torch.distributed.is_initialized():
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": cuda},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 2e8,
            "allgather_bucket_size": 2e8,
        },
        "optimizer": {"type": "AdamW", "params": {**hyper, "betas": list(hyper["betas"])}},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def make_optimizer(
    spec: RowSpec,
    module: Any,
    model: torch.nn.Module,
    hyper: dict[str, Any],
    batch: int = 8,
    bridge: dict[str, Any] | None = None,
) -> tuple[Any, Callable[[], None], Callable[[torch.Tensor], None]]:
    """(optimizer, what ends a step after backward, the backward) for one row; ``bridge``: more
    AdamBridge arguments (``--bucket-mb``, ``--prefetch-mb``)."""
    params = list(model.parameters())
    backward = torch.Tensor.backward
    if spec.kind == "deepspeed":  # its backward flushes the last gradient bucket to the host
        engine = _deepspeed_engine(module, model, hyper, batch)
        return engine.optimizer, engine.step, engine.backward
    if spec.kind == "torch":
        opt = torch.optim.AdamW(params, fused=True, **hyper)
    elif spec.kind == "torchao":
        opt = module.CPUOffloadOptimizer(
            params, torch.optim.AdamW, offload_gradients=True, fused=True, **hyper
        )
    elif spec.kind == "bridge":
        extra = dict(bridge or {})
        if spec.update == "host":
            extra.pop("prefetch_mb", None)
        opt = module.AdamBridge(
            params, precision=spec.precision, update=spec.update, **extra, **hyper
        )
        if spec.hooks:
            opt.attach_hooks(model, overlap_forward=spec.overlap)
            return opt, opt.step_sync, backward
    else:
        return None, lambda: model.zero_grad(set_to_none=True), backward

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return opt, step, backward


def host_bytes(opt: Any) -> int:
    """Host RAM the optimizer holds: AdamBridge's own count, torchao's pinned copies and state,
    DeepSpeed's fp32 partitions (with their gradients) and CPUAdam state."""
    if opt is None:
        return 0
    if callable(getattr(opt, "host_bytes", None)):
        return int(opt.host_bytes())
    total = 0
    if hasattr(opt, "single_partition_of_fp32_groups"):  # DeepSpeed's ZeRO optimizer
        for part in opt.single_partition_of_fp32_groups:
            total += part.nbytes + (part.grad.nbytes if part.grad is not None else 0)
        for state in opt.optimizer.state.values():  # its DeepSpeedCPUAdam
            total += sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))
    for p_host in getattr(opt, "param_d2h_map", {}).values():
        total += p_host.nbytes + (p_host.grad.nbytes if p_host.grad is not None else 0)
    for inner in getattr(opt, "optim_dict", {}).values():
        for state in inner.state.values():
            total += sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))
    return total


# ----------------------------------------------------------------------------- one row


@dataclass
class Context:
    """What every row shares."""

    args: argparse.Namespace
    device: torch.device
    choice: ModelChoice
    shape: qwen2_shape.Qwen2Shape
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    clock: Clock
    hyper: dict[str, Any]
    grad_ready: list[dict[str, Any]] | None = None  # filled by the fwd-bwd row


def release(device: torch.device) -> None:
    """Free what the last row left: Python cycles, cuBLAS workspaces, the allocator's cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:  # ~64 MiB per handle, held by the caching allocator
            clear_workspaces()
        torch.cuda.empty_cache()


def _error(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".replace("|", "/").split())
    return text if len(text) <= 200 else text[:197] + "..."


def run_row(spec: RowSpec, module: Any, ctx: Context) -> Row:
    """Build a fresh model, time ``warmup + iters`` steps, then free everything."""
    row = new_row(spec)
    model = opt = finish = backward = None
    if ctx.device.type == "cuda":
        release(ctx.device)
        row.leftover_gib = torch.cuda.memory_allocated(ctx.device) / GIB
    try:
        torch.manual_seed(ctx.args.seed)
        model = build_model(ctx.choice, ctx.shape, ctx.device, spec.dtype)
        opt, finish, backward = make_optimizer(
            spec, module, model, ctx.hyper, ctx.args.batch, bridge_arguments(ctx.args)
        )
        cuda = ctx.device.type == "cuda"
        release(ctx.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        steps, phases = [], []
        for i in range(ctx.args.warmup + ctx.args.iters):
            ids, labels = ctx.batches[i % len(ctx.batches)]
            ctx.clock.sync()
            t0 = ctx.clock.mark()
            with torch.autocast(ctx.device.type, dtype=BF16, enabled=spec.autocast):
                loss = loss_of(model, ids, labels)
            t1 = ctx.clock.mark()
            backward(loss)
            t2 = ctx.clock.mark()
            finish()
            t3 = ctx.clock.mark()
            ctx.clock.sync()
            row.losses.append(loss.item())
            if i >= ctx.args.warmup:
                clock = ctx.clock
                steps.append(clock.ms(t0, t3))
                phases.append((clock.ms(t0, t1), clock.ms(t1, t2), clock.ms(t2, t3)))
            del loss
        row.step_ms = steps
        row.median_ms, row.min_ms = statistics.median(steps), min(steps)
        row.fwd_ms, row.bwd_ms, row.opt_ms = (
            statistics.median(p) for p in zip(*phases, strict=True)
        )
        row.final_loss = row.losses[-1]
        row.host_gib = host_bytes(opt) / GIB
        if cuda:
            row.peak_gib = torch.cuda.max_memory_allocated(ctx.device) / GIB
            row.reserved_gib = torch.cuda.max_memory_reserved(ctx.device) / GIB
        if spec.kind == "none":
            ctx.grad_ready = grad_ready_profile(model, ctx)
    except Exception as exc:  # one failing row must not hide the others
        row.error = _error(exc)
    finally:
        if opt is not None and spec.hooks and hasattr(opt, "detach_hooks"):
            try:
                opt.detach_hooks()
            except Exception as exc:
                row.error = row.error or f"detach_hooks: {_error(exc)}"
        model = opt = finish = backward = None  # bound methods hold the optimizer too
        if spec.kind == "deepspeed" and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # the engine's, which the row set up
        release(ctx.device)
    return row


def grad_ready_profile(model: torch.nn.Module, ctx: Context) -> list[dict[str, Any]]:
    """When each parameter's gradient is final, in ms after backward starts (one extra step)."""
    marks: list[tuple[str, int, Any]] = []
    handles = [
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: marks.append((name, p.numel(), ctx.clock.mark()))
        )
        for name, p in model.named_parameters()
    ]
    ids, labels = ctx.batches[0]
    try:
        loss = loss_of(model, ids, labels)
        ctx.clock.sync()
        start = ctx.clock.mark()
        loss.backward()
        end = ctx.clock.mark()
        ctx.clock.sync()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    ready = [{"name": n, "numel": k, "ms": ctx.clock.ms(start, m)} for n, k, m in marks]
    ready.append({"name": "<backward end>", "numel": 0, "ms": ctx.clock.ms(start, end)})
    return ready


# ----------------------------------------------------------------------------- lower bound


def lower_bound(
    row: Row, n_params: int, bw: Bandwidth, base: Row | None, ready: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """The step-time lower bound of an AdamBridge row from its byte model (module docstring)."""
    bm = BYTE_MODEL[byte_model_key(row)]

    def cost(numel: int) -> tuple[float, float]:
        return bw.link_ms(bm.link_down * numel, bm.link_up * numel), bw.host_ms(bm.host * numel)

    link_ms, host_ms = cost(n_params)
    src = base if base is not None and base.median_ms is not None else row
    fwd, bwd = src.fwd_ms or 0.0, src.bwd_ms or 0.0
    out: dict[str, Any] = {
        "host_bytes_per_param": bm.host,
        "kernel_bytes_per_param": bm.kernel,
        "link_bytes_per_param": bm.link,
        "link_ms": link_ms,
        "host_ms": host_ms,
        "bound_by": "host memory" if host_ms >= link_ms else "link",
        "fwd_ms": fwd,
        "bwd_ms": bwd,
        "compute_from": src.name,
    }
    if row.update == "device":
        # state copies go ahead of the gradients (prefetch) and back after the step (the next
        # forward needs only the weights, updated on the GPU): they may span forward + backward
        tail = max(0.0, max(link_ms, host_ms) - fwd - bwd)
        exposed = "the link bytes beyond forward + backward" if tail else "nothing: fits in fwd+bwd"
    elif not row.hooks:
        tail, exposed = max(link_ms, host_ms), "every parameter: the update starts after backward"
    elif ready:
        # the profile is one step: stretch its timeline to the median backward used here
        scale = bwd / ready[-1]["ms"] if bwd > 0 and ready[-1]["ms"] > 0 else 1.0
        params = [{**r, "ms": r["ms"] * scale} for r in ready if r["numel"]]
        bwd_end = ready[-1]["ms"] * scale
        tail, exposed = 0.0, "nothing: the updates fit inside backward"
        for k in range(len(params)):
            suffix = params[k:]
            numel = sum(r["numel"] for r in suffix)
            excess = params[k]["ms"] + max(cost(numel)) - bwd_end
            if excess > tail:
                tail = excess
                exposed = (
                    f"{len(suffix)} tensor(s), {numel:,} params from {params[k]['name']} on, "
                    f"final {bwd_end - params[k]['ms']:.1f} ms before backward ends"
                )
    else:
        tail = max(0.0, max(link_ms, host_ms) - bwd)
        exposed = "unknown (run fwd-bwd-bf16 for the gradient-ready order)"
    if row.overlap:
        tail = max(0.0, tail - fwd)
        exposed += "; the next forward may hide up to its own length of it"
    out.update(tail_ms=tail, step_ms=fwd + bwd + tail, exposed=exposed)
    return out


# ----------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def machine_info(device: torch.device) -> dict[str, Any]:
    """GPU, CPU, memory and versions of what ran the benchmark."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
    }
    cpuinfo, meminfo = Path("/proc/cpuinfo"), Path("/proc/meminfo")
    if cpuinfo.exists():
        names = [ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        if names:
            info["cpu"] = names[0].split(":", 1)[1].strip()
    if meminfo.exists():
        total = meminfo.read_text().splitlines()[0].split()
        info["host_ram_gib"] = round(int(total[1]) * 1024 / GIB, 1)
    for name in (
        "triton", "transformers", "torchao", "deepspeed", "memopt_offload", "memopt_kernels_cpu"
    ):  # fmt: skip
        try:
            info[name] = getattr(importlib.import_module(name), "__version__", "installed")
        except Exception:
            info[name] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gib"] = round(props.total_memory / GIB, 1)
        info["cuda"] = torch.version.cuda
    else:
        info["gpu"] = None
    info["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return info


def targets(rows: list[Row], full_size: bool) -> list[str]:
    """DESIGN section 8's offload targets, row by row (full-size CUDA runs only)."""
    if not full_size:
        return ["not checked: the targets are for the full Qwen2.5-0.5B shape at 8 x 512 on a GPU"]
    by_name = {r.name: r for r in rows}
    adamw = by_name.get("torch-adamw")
    torchao = by_name.get("torchao-offload")
    adamw_ms, adamw_src = (
        (adamw.median_ms, "this run")
        if adamw and adamw.median_ms
        else (PEER_TORCH_ADAMW_MS, "DESIGN §7")
    )
    ao_ms, ao_src = (
        (torchao.median_ms, "this run")
        if torchao and torchao.median_ms
        else (PEER_TORCHAO_MS, "DESIGN §7")
    )
    fast = ao_ms / TARGET_SPEEDUP_VS_TORCHAO
    stretch = STRETCH_VS_ADAMW * adamw_ms
    lines = [
        f"peak VRAM ≤ {TARGET_PEAK_GIB} GiB; step ≤ {fast:.1f} ms (torchao {ao_ms:.1f} ms "
        f"({ao_src}) / {TARGET_SPEEDUP_VS_TORCHAO}); stretch: step ≤ {stretch:.1f} ms "
        f"({STRETCH_VS_ADAMW:.2f} x torch AdamW {adamw_ms:.1f} ms ({adamw_src}))",
    ]
    for r in rows:
        if not r.name.startswith("bridge") or r.median_ms is None:
            continue
        mem = r.peak_gib is not None and r.peak_gib <= TARGET_PEAK_GIB
        lines.append(
            f"{r.name}: VRAM {'met' if mem else 'missed'} ({_fmt(r.peak_gib, '.2f')} GiB), "
            f"speed {'met' if r.median_ms <= fast else 'missed'} "
            f"({ao_ms / r.median_ms:.2f}x torchao), stretch "
            f"{'met' if r.median_ms <= stretch else 'missed'} "
            f"({r.median_ms / adamw_ms:.2f} x AdamW)"
        )
    return lines


def markdown(rows: list[Row], header: dict[str, Any], target_lines: list[str]) -> str:
    """The report: how it was made, the end-to-end table, the bound table, the targets."""
    lines = ["# Offload end to end", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    lines += [
        "",
        "| optimizer | median step ms | min | peak VRAM GiB | reserved GiB | vs torch AdamW "
        "| final loss | lower bound ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.skipped or r.error:
            lines.append(f"| {r.label} | {'skipped' if r.skipped else 'failed'}: "
                         f"{r.skipped or r.error} | | | | | | |")  # fmt: skip
            continue
        bound = r.bound["step_ms"] if r.bound else None
        lines.append(
            f"| {r.label} | {r.median_ms:.1f} | {r.min_ms:.1f} | {_fmt(r.peak_gib, '.2f')} "
            f"| {_fmt(r.reserved_gib, '.2f')} | {_fmt(r.vs_torch_adamw, '.2f')} "
            f"| {_fmt(r.final_loss, '.4f')} | {_fmt(bound, '.1f')} |"
        )
    bounded = [r for r in rows if r.bound]
    if bounded:
        lines += [
            "",
            "Lower bound and exposure (ms; host and link: all parameters' bytes over the measured "
            "bandwidths; after backward: measured from backward's end to the step's end):",
            "",
            "| optimizer | host B/param | link B/param | host ms | link ms | bound by | fwd + bwd "
            "| bound tail | step bound | measured | after backward | host GiB | exposed (bound) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in bounded:
            b = r.bound
            lines.append(
                f"| {r.label} | {b['host_bytes_per_param']} | {b['link_bytes_per_param']} "
                f"| {b['host_ms']:.1f} | {b['link_ms']:.1f} | {b['bound_by']} "
                f"| {b['fwd_ms'] + b['bwd_ms']:.1f} | {b['tail_ms']:.1f} | {b['step_ms']:.1f} "
                f"| {r.median_ms:.1f} | {_fmt(r.opt_ms, '.1f')} | {_fmt(r.host_gib, '.2f')} "
                f"| {b['exposed']} |"
            )
    lines += ["", "Targets (DESIGN section 8):", ""]
    lines += [f"- {line}" for line in target_lines]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def make_context(
    args: argparse.Namespace,
    device: torch.device,
    choice: ModelChoice,
    shape: qwen2_shape.Qwen2Shape,
) -> Context:
    batches = make_batches(
        args.distinct_batches, args.batch, args.seq, shape.vocab_size, args.seed, device
    )
    return Context(args, device, choice, shape, batches, Clock(device), {**HYPER, "lr": args.lr})


def bridge_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The AdamBridge arguments the command line sets (none: AdamBridge's defaults)."""
    out: dict[str, Any] = {}
    if args.bucket_mb is not None:
        out["bucket_mb"] = args.bucket_mb
    if args.prefetch_mb is not None:
        out["prefetch_mb"] = args.prefetch_mb
    return out


def child_argv(args: argparse.Namespace, choice: ModelChoice) -> list[str]:
    """The options that make a row's own process measure what this one would."""
    argv = ["--device", args.device, "--tiny" if args.tiny else "--no-tiny", "--no-isolate"]
    argv += ["--model", choice.impl, "--batch", str(args.batch), "--seq", str(args.seq)]
    argv += ["--warmup", str(args.warmup), "--iters", str(args.iters), "--lr", repr(args.lr)]
    argv += ["--distinct-batches", str(args.distinct_batches), "--seed", str(args.seed)]
    if args.layers is not None:
        argv += ["--layers", str(args.layers)]
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    if args.autotune:
        argv.append("--autotune")
    for flag, value in (("--bucket-mb", args.bucket_mb), ("--prefetch-mb", args.prefetch_mb)):
        if value is not None:
            argv += [flag, repr(value)]
    return argv


def positive_int(text: str) -> int:
    """An argparse ``type``: an int >= 1 (a size of 0 or less would fail deep inside a row)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_rounds_argument(p: argparse.ArgumentParser) -> None:
    """``--rounds`` (this benchmark's and ``apexw_e2e``'s): see :func:`round_order`."""
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the rows this many times, in reverse order every other round, and report "
        "each row over all its rounds (%(default)s)",
    )


def round_order(names: list[str], rounds: int) -> list[list[str]]:
    """The rows' order in each of ``--rounds`` rounds: as given, then reversed, alternately, so
    that every row sits at the same mean position in the run (on the H200, the Qwen shape's
    backward took 40.5 ms in a run's first row and 69.5 ms in its second, whatever the
    optimizer). ``apexw_e2e`` uses it too."""
    return [names if k % 2 == 0 else names[::-1] for k in range(rounds)]


#: Relative difference allowed between the rounds' losses of a CUDA run. Backward on the GPU is
#: not deterministic (atomic additions in backward kernels), so two runs of the same training
#: drift apart slowly: on the Qwen2.5-0.5B shape, two rounds' final losses after 13 steps
#: differed by 0.002-0.11% (torchao 8.9788 and 8.9790, AdamBridge bf16-ecc24 9.2147 and 9.2042),
#: while the forward alone repeated exactly. A CPU run must repeat bit for bit.
CUDA_LOSS_RTOL = 0.01


def merge_rounds(
    runs: list[Any],
    medians: tuple[str, ...] = ("fwd_ms", "bwd_ms", "opt_ms"),
    maxima: tuple[str, ...] = ("peak_gib", "reserved_gib", "leftover_gib", "host_gib"),
    loss_rtol: float = 0.0,
) -> Any:
    """One row from its runs in several rounds (this module's ``Row`` or ``apexw_e2e``'s, with
    their per-phase ``medians`` and memory ``maxima`` fields): median and minimum over every
    timed step of every round, the phase medians' median, the largest memory figures, each
    round's median in ``round_median_ms``; losses from the first round that ran (every round
    starts from the same seed and batches: rounds whose losses differ by more than ``loss_rtol``
    relative, or differ at all where it is 0, are an error)."""
    ran = [r for r in runs if r.median_ms is not None]
    if not ran:
        return runs[0]
    out = replace(ran[0])
    out.step_ms = [t for r in ran for t in r.step_ms]
    out.median_ms, out.min_ms = statistics.median(out.step_ms), min(out.step_ms)
    for name in medians:
        values = [getattr(r, name) for r in ran if getattr(r, name) is not None]
        setattr(out, name, statistics.median(values) if values else None)
    for name in maxima:
        values = [getattr(r, name) for r in ran if getattr(r, name) is not None]
        setattr(out, name, max(values) if values else None)
    out.round_median_ms = [r.median_ms for r in ran]
    problems = [r.error for r in runs if r.error]
    rel = [
        abs(a - b) / max(abs(b), 1e-30)
        for r in ran
        for a, b in zip(r.losses, out.losses, strict=False)
    ]
    if any(len(r.losses) != len(out.losses) for r in ran) or not all(x <= loss_rtol for x in rel):
        worst = max((x for x in rel if not math.isnan(x)), default=0.0)
        problems.append(f"rounds gave different losses (largest relative difference {worst:.2g})")
    out.error = "; ".join(problems) or None
    return out


def run_isolated(
    spec: RowSpec, args: argparse.Namespace, choice: ModelChoice, tmp: Path
) -> tuple[Row, list[dict[str, Any]] | None]:
    """One row in a fresh process (nothing an earlier row left behind can count against it)."""
    out = tmp / f"{spec.name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), *child_argv(args, choice)]
    cmd += ["--child-row", spec.name, "--child-out", str(out)]
    proc = subprocess.run(cmd, check=False)
    if not out.exists():
        error = f"the row's process exited with status {proc.returncode} and no result"
        return new_row(spec, error=error), None
    data = json.loads(out.read_text())
    return Row(**data["row"]), data["grad_ready"]


def child_main(
    args: argparse.Namespace,
    device: torch.device,
    choice: ModelChoice,
    shape: qwen2_shape.Qwen2Shape,
) -> int:
    """Run the one row ``--child-row`` names and write it to ``--child-out``."""
    if args.autotune:
        autotune()
    spec = SPECS[args.child_row]
    modules, skipped = importable([spec], device)
    ctx = make_context(args, device, choice, shape)
    if spec.name in skipped:
        row = new_row(spec, skipped=skipped[spec.name])
    else:
        row = run_row(spec, modules.get(spec.name), ctx)
    data = {"row": asdict(row), "grad_ready": ctx.grad_ready}
    args.child_out.write_text(json.dumps(data))
    return 0


def set_threads(n: int) -> None:
    """Use ``n`` CPU threads in torch and in memopt's C++ kernels (when installed)."""
    torch.set_num_threads(n)
    try:
        import memopt_kernels_cpu
    except ImportError:
        return
    memopt_kernels_cpu.set_num_threads(n)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="torch device (%(default)s)")
    p.add_argument("--rows", default=",".join(SPECS), help="comma list (%(default)s)")
    p.add_argument(
        "--tiny",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a toy model of the same architecture (default: on a CPU only)",
    )
    p.add_argument("--layers", type=positive_int, help="decoder layers (default: the shape's, 24)")
    p.add_argument("--batch", type=positive_int, help="sequences per batch (default 8; tiny 2)")
    p.add_argument("--seq", type=positive_int, help="tokens per sequence (default 512; tiny 32)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (%(default)s)")
    p.add_argument("--iters", type=int, default=10, help="timed steps (%(default)s)")
    add_rounds_argument(p)
    p.add_argument(
        "--distinct-batches", type=int, default=2, help="random batches, cycled (%(default)s)"
    )
    p.add_argument(
        "--model",
        choices=("auto", "transformers", "plain"),
        default="auto",
        help="transformers' Qwen2 where importable, else qwen2_shape's replica (%(default)s)",
    )
    p.add_argument(
        "--bw-mib", type=positive_int, default=256, help="bandwidth buffers (%(default)s)"
    )
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (%(default)s)")
    p.add_argument("--bucket-mb", type=float, help="AdamBridge rows' bucket_mb (its default)")
    p.add_argument(
        "--prefetch-mb", type=float, help="update='device' rows' prefetch_mb (its default)"
    )
    p.add_argument("--seed", type=int, default=0, help="model and data seed (%(default)s)")
    p.add_argument("--json", type=Path, help="write every number here")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each row in its own process (default: on CUDA only)",
    )
    p.add_argument("--child-row", help=argparse.SUPPRESS)  # internal: one row, then exit
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument(
        "--autotune",
        action="store_true",
        help="apply memopt_offload's AutoTuneConfig.load_or_measure() (CPU kernel threads and "
        "chunk size) before the rows and record its bandwidths (the bounds use this run's own)",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="torch's CPU threads, and memopt's C++ kernels' where installed (default: theirs)",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.tiny is None:
        args.tiny = device.type != "cuda"
    if args.isolate is None:
        args.isolate = device.type == "cuda"
    if args.child_row and (args.child_row not in SPECS or args.child_out is None):
        p.error("--child-row needs a known row and --child-out")
    unknown = set(args.rows.split(",")) - set(SPECS)
    if unknown:
        p.error(f"unknown rows: {sorted(unknown)} (known: {', '.join(SPECS)})")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    if args.warmup < 0 or min(args.iters, args.distinct_batches, args.rounds) < 1:
        p.error("--warmup must be at least 0, --iters, --distinct-batches and --rounds at least 1")
    args.batch = args.batch or (2 if args.tiny else 8)
    args.seq = args.seq or (32 if args.tiny else 512)
    return args


def report_row(spec: RowSpec, row: Row, k: int, rounds: int) -> None:
    """One line on stderr for a row just run (in round ``k`` of ``rounds``)."""
    done = row.error or (
        f"median {row.median_ms:.1f} ms, min {row.min_ms:.1f}, peak "
        f"{_fmt(row.peak_gib, '.2f')} GiB, loss {row.final_loss:.4f}"
    )
    where = f" (round {k + 1} of {rounds})" if rounds > 1 else ""
    print(f"{spec.name:>20}{where}: {done}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads is not None:
        set_threads(args.threads)
    began = time.perf_counter()
    device = torch.device(args.device)
    shape = (qwen2_shape.TINY if args.tiny else qwen2_shape.QWEN25_05B).with_layers(args.layers)
    choice = choose_model(args.model)
    if args.child_row:
        return child_main(args, device, choice, shape)
    print(f"model: {choice.note}", file=sys.stderr)
    with torch.device("meta"):
        meta = qwen2_shape.Qwen2ForCausalLM(shape)
    n_params = sum(p.numel() for p in meta.parameters())
    n_tensors = len(list(meta.parameters()))
    del meta

    bw = measure_bandwidth(device, args.bw_mib)
    release(device)
    print(
        f"bandwidth GB/s: D2H {_fmt(bw.d2h_gbs, '.1f')}, H2D {_fmt(bw.h2d_gbs, '.1f')}, both "
        f"{_fmt(bw.both_gbs, '.1f')}, host copy {bw.host_gbs:.1f} (read + write)",
        file=sys.stderr,
    )
    tuned = autotune() if args.autotune else None
    specs = [SPECS[name] for name in args.rows.split(",")]
    modules, skipped = importable(specs, device)
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", file=sys.stderr)
    ctx = make_context(args, device, choice, shape)
    # the no-optimizer row first: its gradient-ready order feeds the bounds
    order = [s.name for s in sorted(specs, key=lambda s: s.kind != "none")]
    runs: dict[str, list[Row]] = {name: [] for name in order}
    with tempfile.TemporaryDirectory(prefix="offload_e2e_") as tmp:
        for k, names in enumerate(round_order(order, args.rounds)):
            for spec in (SPECS[name] for name in names):
                if spec.name in skipped:
                    if not k:
                        runs[spec.name].append(new_row(spec, skipped=skipped[spec.name]))
                    continue
                if args.isolate:
                    row, ready = run_isolated(spec, args, choice, Path(tmp))
                    ctx.grad_ready = ready or ctx.grad_ready
                else:
                    row = run_row(spec, modules.get(spec.name), ctx)
                runs[spec.name].append(row)
                report_row(spec, row, k, args.rounds)
    rtol = CUDA_LOSS_RTOL if torch.device(args.device).type == "cuda" else 0.0
    results = {name: merge_rounds(rows, loss_rtol=rtol) for name, rows in runs.items()}
    for row in results.values():
        if (row.leftover_gib or 0) > LEFTOVER_GIB:
            print(
                f"{row.name:>20}: began with {row.leftover_gib:.2f} GiB still allocated by "
                "earlier rows (a leak; --isolate runs each row in its own process)",
                file=sys.stderr,
            )
    rows = [results[s.name] for s in specs]

    base = results.get("fwd-bwd-bf16")
    adamw = results.get("torch-adamw")
    for r in rows:
        if r.median_ms is None:
            continue
        if adamw is not None and adamw.median_ms:
            r.vs_torch_adamw = r.median_ms / adamw.median_ms
        if r.name.startswith("bridge"):
            r.bound = lower_bound(r, n_params, bw, base, ctx.grad_ready)

    info = machine_info(device)
    full_size = device.type == "cuda" and not args.tiny and shape == qwen2_shape.QWEN25_05B
    full_size = full_size and (args.batch, args.seq) == (8, 512)
    header = {
        "command": " ".join(["python", "tools/bench/offload_e2e.py", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{info.get('gpu') or 'no GPU'}; {info['cpu']}, {info['cpu_count']} CPUs"
        + (f", {info['host_ram_gib']} GiB RAM" if "host_ram_gib" in info else ""),
        "versions": f"torch {info['torch']}, triton {info['triton']}, python {info['python']}, "
        f"torchao {info['torchao']}, memopt_offload {info['memopt_offload']}",
        "model": f"{choice.note}; {n_tensors} tensors, {n_params:,} params, "
        f"{shape.num_hidden_layers} layers{' (tiny)' if args.tiny else ''}",
        "batch": f"{args.batch} x {args.seq} random tokens (vocab {shape.vocab_size}), "
        f"{args.distinct_batches} distinct batches cycled",
        "timing": f"{args.warmup} untimed then {args.iters} timed steps "
        f"({'CUDA events' if device.type == 'cuda' else 'perf_counter'} around forward + "
        "backward + optimizer, synchronized); vs torch AdamW = step time / torch AdamW's"
        + (
            f"; {args.rounds} rounds, rows in reverse order every other round, medians over "
            "every round's timed steps (round medians in the JSON)"
            if args.rounds > 1
            else ""
        ),
        "bandwidth": f"pinned D2H {_fmt(bw.d2h_gbs, '.1f')}, H2D {_fmt(bw.h2d_gbs, '.1f')}, both "
        f"{_fmt(bw.both_gbs, '.1f')} GB/s; host copy_ {bw.host_gbs:.1f} GB/s read + write "
        f"({bw.mib} MiB buffers)",
        "byte model": "host B/param (kernel + DMA): "
        + ", ".join(f"{k} {v.kernel} + {v.dma} = {v.host}" for k, v in BYTE_MODEL.items())
        + "; link 2 down + 2 up (device update: 5 + 5)",
        "autotune": "not asked for (--autotune)" if tuned is None else json.dumps(tuned),
        "isolation": "each row in its own process"
        if args.isolate
        else "one process, rows freed in between (del, gc, cuBLAS workspaces, empty_cache)",
        "leftovers": "; ".join(
            f"{r.name} began with {r.leftover_gib:.2f} GiB of earlier rows"
            for r in rows
            if (r.leftover_gib or 0) > LEFTOVER_GIB
        )
        or "none",
        "skipped": "; ".join(f"{k}: {v}" for k, v in skipped.items()) or "none",
    }
    target_lines = targets(rows, full_size)
    header["seconds"] = f"{time.perf_counter() - began:.0f}"
    report = markdown(rows, header, target_lines)
    print(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "argv": [sys.argv[0], *argv],
            "header": header,
            "machine": info,
            "model": {
                "impl": choice.impl,
                "note": choice.note,
                "shape": asdict(shape),
                "params": n_params,
                "tensors": n_tensors,
            },
            "bandwidth": asdict(bw),
            "autotune": tuned,
            "byte_model": {
                k: {**asdict(v), "kernel": v.kernel, "host": v.host} for k, v in BYTE_MODEL.items()
            },
            "hyper": ctx.hyper,
            "rows": [asdict(r) for r in rows],
            "grad_ready": ctx.grad_ready,
            "targets": target_lines,
            "full_size": full_size,
        }
        args.json.write_text(json.dumps(data, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
