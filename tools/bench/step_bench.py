"""Optimizer-step benchmark: the step alone, against torch AdamW and the copy bandwidth.

For each parameter profile and each optimizer configuration (``--optimizers``/``--rows``), time
``opt.step()`` (median of ``--iters`` after ``--warmup`` steps; CUDA events on a GPU,
``perf_counter`` on a CPU) with fixed random gradients, and report the bandwidth it reaches for the
bytes its format must move. Rows: torch AdamW, memopt's configurations, ``memopt_apexw.ApexW``
and the peers torchao ``AdamW8bit``, bitsandbytes ``AdamW8bit`` and FlashOptim's ``FlashAdamW``;
a row whose package does not import (or that needs CUDA on a CPU run) is skipped with the reason.

Byte model, per parameter and step: the weights are read and written (2 W), the gradient is read
(G = W) and every byte of optimizer state is read and written (2 S, S from the optimizer's own
count after a step). torch AdamW fp32: 2·4 + 4 + 2·8 = 28 B; ECC-24 with q8 moments about 12.
The fraction of copy bandwidth compares that rate with a large ``copy_`` measured in the same run.

``--param-groups`` splits the parameters into param groups, as training scripts do: ``N``
contiguous groups of about equal size, each with its own lr (layer-wise lr decay: ``1e-3 *
0.9**(N - 1 - i)``), or ``no-decay-1d``: 1-D tensors (biases, norm gains) in a group without
weight decay, the rest with it (what the Hugging Face Trainer builds).

Each timed step starts on an idle GPU (the timer synchronizes first), so the host's part of a step
before its launch counts in full. ``--pipelined N`` also times N steps run back to back, as a
training loop runs them, where each step's host part overlaps the GPU's work on the step before.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

Shape = tuple[int, ...]
Builder = Callable[[Any, Iterable[torch.nn.Parameter], torch.device], torch.optim.Optimizer]
CPU_SCALE = 256  # default --scale on a CPU, so that a run with the slowest backend stays short


def qwen25_05b_shapes() -> list[Shape]:
    """Parameter shapes of Qwen2.5-0.5B (tied embedding): 290 tensors, 494,032,768 parameters."""
    hidden, mlp, kv = 896, 4864, 128
    layer = [
        (hidden, hidden), (hidden,),  # q
        (kv, hidden), (kv,),  # k
        (kv, hidden), (kv,),  # v
        (hidden, hidden),  # o
        (mlp, hidden), (mlp, hidden), (hidden, mlp),  # gate, up, down
        (hidden,), (hidden,),  # input and post-attention norms
    ]  # fmt: skip
    return [(151936, hidden), *layer * 24, (hidden,)]


def resnet50_shapes() -> list[Shape]:
    """Parameter shapes of torchvision's ResNet-50 in ``named_parameters()`` order: 161 tensors,
    25,557,032 parameters (conv weights, batch-norm weight and bias, fc weight and bias)."""
    shapes: list[Shape] = [(64, 3, 7, 7), (64,), (64,)]  # conv1, bn1
    inplanes = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):  # layer1..layer4, Bottleneck
        for block in range(blocks):
            out = 4 * width  # Bottleneck.expansion
            shapes += [(width, inplanes, 1, 1), (width,), (width,)]  # conv1, bn1
            shapes += [(width, width, 3, 3), (width,), (width,)]  # conv2, bn2
            shapes += [(out, width, 1, 1), (out,), (out,)]  # conv3, bn3
            if block == 0:  # downsample: 1x1 conv and bn (stride 2 or a channel change)
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    return [*shapes, (1000, 2048), (1000,)]  # fc


def many_small_shapes(count: int = 16384) -> list[Shape]:
    """``count`` tensors of 8192 elements: one in four 1-D ``(8192,)``, three in four ``(64, 128)``
    (biases and norms among matrices, as in a model; the step sees both layouts)."""
    return [(8192,) if i % 4 == 0 else (64, 128) for i in range(count)]


PROFILES: dict[str, list[Shape]] = {
    "64M": [(64 * 2**20,)],  # the CPU kernels' sizes (issue "Fused SIMD CPU kernels")
    "256M": [(64 * 2**20,)] * 4,
    "8x64M": [(64 * 2**20,)] * 8,
    "4096x32K": [(32 * 2**10,)] * 4096,
    "16384x8K": many_small_shapes(),
    "qwen2.5-0.5b": qwen25_05b_shapes(),
    "resnet50": resnet50_shapes(),
}


def scaled(shapes: list[Shape], scale: int) -> list[Shape]:
    """Divide each tensor's first dimension by ``scale`` (rounding up): same count, fewer bytes."""
    return [(-(-s[0] // scale), *s[1:]) for s in shapes]


@dataclass(frozen=True)
class BenchConfig:
    """One optimizer configuration; ``module`` is imported first and its absence skips it.

    ``cuda_only`` skips it on a CPU run, ``cpu_only`` on a CUDA one. ``full_warmup`` rows run ``--full-warmup`` untimed
    steps whatever the time budget, then get the budget again for the timed ones: their first
    steps differ from the rest (a CUDA graph captured, a mode picked, the peers' kernels
    compiled per shape, memopt's cached step resolved at the first step and its launch prepared
    at the second, which on 4096 bf16 tensors left one step to time, the first replay, 5.7 ms); ``settled(opt)``, where given, must be true before timing starts (untimed steps
    run until it is, ``SETTLE_STEPS`` at most). ``notes(opt)`` fills the row's notes column.
    """

    name: str
    label: str
    module: str
    param_dtype: torch.dtype
    build: Builder
    cuda_only: bool = False
    cpu_only: bool = False
    full_warmup: bool = False
    settled: Callable[[Any], bool] | None = None
    notes: Callable[[Any], str] | None = None


def _torch_adamw(impl: str) -> Builder:
    # "fused" is torch's fastest AdamW on CUDA and on CPU alike; "foreach" is its multi-tensor default.
    def build(_: Any, params: Iterable[torch.nn.Parameter], __: torch.device):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **{impl: True})

    return build


def _memopt(master: str, moments: str) -> Builder:
    def build(mod: Any, params: Iterable[torch.nn.Parameter], _: torch.device):
        return mod.MemOptimizer(
            params, rule="adamw", lr=1e-3, weight_decay=0.01, master=master, moments=moments
        )

    return build


def _flash_adamw(mod: Any, params: Iterable[torch.nn.Parameter], _: torch.device):
    # memopt's own FlashOptim-compatible class (memopt_ecc), not the FlashOptim peer below.
    return mod.FlashAdamW(params, lr=1e-3, weight_decay=0.01, master_weight_bits=24)


def _flash_adamw_capturable(mod: Any, params: Iterable[torch.nn.Parameter], _: torch.device):
    # step counts on the device: one more small launch per group, no host synchronisation
    return mod.FlashAdamW(
        params, lr=1e-3, weight_decay=0.01, master_weight_bits=24, capturable=True
    )


class CapturedStep:
    """``opt.step()`` in a CUDA graph: the first call runs eagerly (tables and step counters are
    built), the second captures and replays, later calls replay. The benchmark keeps gradients
    in their buffers, which is what a captured step needs. Other attributes are the optimizer's."""

    def __init__(self, opt: Any) -> None:
        self._opt = opt
        self._graph: Any = None
        self._warm = False

    def step(self) -> None:
        if not self._warm:
            self._opt.step()
            self._warm = True
            return
        if self._graph is None:
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(graph, stream=stream):
                self._opt.step()
            torch.cuda.current_stream().wait_stream(stream)
            self._graph = graph
        self._graph.replay()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._opt, name)


def _flash_adamw_graph(mod: Any, params: Iterable[torch.nn.Parameter], device: torch.device):
    return CapturedStep(_flash_adamw_capturable(mod, params, device))


def _captured_notes(_: Any) -> str:
    return "capturable=True; opt.step() captured in a CUDA graph by the benchmark, replayed"


def _apexw(state: str, mode: str = "fused", capturable: bool = False) -> Builder:
    def build(mod: Any, params: Iterable[torch.nn.Parameter], _: torch.device):
        return mod.ApexW(
            params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
            state=state, capturable=capturable, mode=mode,
        )  # fmt: skip

    return build


def _mode_decided(opt: Any) -> bool:
    return getattr(opt, "mode_decision", None) is not None


def _mode_notes(opt: Any) -> str:
    """ApexW's mode="auto" choice and the timings it made it from."""
    decision = getattr(opt, "mode_decision", None)
    if decision is None:
        return f"auto: no decision after {SETTLE_STEPS} untimed steps"
    timings = getattr(decision, "timings_ms", None) or {}
    why = [getattr(decision, "source", None)]  # ApexW: "measured", or "cache" from an earlier run
    why += [f"{k} {v:.3f} ms" for k, v in timings.items()]
    why_text = ", ".join(w for w in why if w)
    return f"auto chose {decision.mode}" + (f" ({why_text})" if why_text else "")


def _graph_notes(_: Any) -> str:
    return "capturable=True; timed after the untimed full warmup (graph capture)"


def _deepspeed_cpu_adam(mod: Any, params: Iterable[torch.nn.Parameter], _: torch.device):
    # ZeRO-Offload's host optimizer: fp32 moments, AVX-512/AVX2 (as the host has them), OpenMP
    # threads; built with ninja the first time it is constructed (outside the timed steps).
    return mod.DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=0.01, adamw_mode=True)


def _torchao_adamw8bit(mod: Any, params: Iterable[torch.nn.Parameter], _: torch.device):
    return mod.AdamW8bit(params, lr=1e-3, weight_decay=0.01)


def _bnb_adamw8bit(mod: Any, params: Iterable[torch.nn.Parameter], _: torch.device):
    return mod.optim.AdamW8bit(params, lr=1e-3, weight_decay=0.01)


def _flashoptim_adamw(mod: Any, params: Iterable[torch.nn.Parameter], _: torch.device):
    # FlashOptim's defaults (ECC-24 master, int8 moments, fused Triton step); lr and weight decay
    # are its defaults too, spelled out to match the other rows.
    return mod.FlashAdamW(params, lr=1e-3, weight_decay=0.01)


BF16 = torch.bfloat16
APEXW = "memopt_apexw"
SETTLE_STEPS = 50  # untimed steps at most while a row's settled() is false
CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig("adamw", "torch AdamW fp32 fused", "torch", torch.float32, _torch_adamw("fused")),
    BenchConfig("adamw-foreach", "torch AdamW fp32 foreach", "torch", torch.float32, _torch_adamw("foreach")),
    BenchConfig("adamw-bf16", "torch AdamW pure bf16 fused", "torch", BF16, _torch_adamw("fused")),
    BenchConfig("memopt-fp32", "memopt fp32 moments", "memopt_core.optimizer", torch.float32, _memopt("none", "fp32"), full_warmup=True),
    BenchConfig("memopt-q8", "memopt q8", "memopt_core.optimizer", torch.float32, _memopt("none", "q8"), full_warmup=True),
    BenchConfig("memopt-bf16", "memopt bf16 moments", "memopt_core.optimizer", torch.float32, _memopt("none", "bf16"), full_warmup=True),
    BenchConfig("memopt-fp8", "memopt fp8 moments", "memopt_core.optimizer", torch.float32, _memopt("none", "fp8"), full_warmup=True),
    BenchConfig("memopt-ecc32-q8", "memopt bf16+ecc32+q8", "memopt_core.optimizer", BF16, _memopt("ecc32", "q8"), full_warmup=True),
    BenchConfig("flash-adamw", "memopt_ecc FlashAdamW (ecc24+q8)", "memopt_ecc", BF16, _flash_adamw, full_warmup=True),
    BenchConfig("flash-adamw-capturable", "memopt_ecc FlashAdamW capturable", "memopt_ecc", BF16, _flash_adamw_capturable, cuda_only=True, full_warmup=True),
    BenchConfig("flash-adamw-graph", "memopt_ecc FlashAdamW capturable, graph", "memopt_ecc", BF16, _flash_adamw_graph, cuda_only=True, full_warmup=True, notes=_captured_notes),
    BenchConfig("apexw-bf16", "ApexW bf16 state fused", APEXW, torch.float32, _apexw("bf16"), cuda_only=True, full_warmup=True),
    BenchConfig("apexw-q8", "ApexW q8 state fused", APEXW, torch.float32, _apexw("q8"), cuda_only=True, full_warmup=True),
    BenchConfig("apexw-bf16-graph", "ApexW bf16 state graph", APEXW, torch.float32, _apexw("bf16", capturable=True), cuda_only=True, full_warmup=True, notes=_graph_notes),
    BenchConfig("apexw-q8-graph", "ApexW q8 state graph", APEXW, torch.float32, _apexw("q8", capturable=True), cuda_only=True, full_warmup=True, notes=_graph_notes),
    BenchConfig("apexw-auto-bf16", "ApexW bf16 state auto", APEXW, torch.float32, _apexw("bf16", mode="auto"), full_warmup=True, settled=_mode_decided, notes=_mode_notes),
    BenchConfig("apexw-bf16-params", "ApexW bf16+ecc24+q8 fused", APEXW, BF16, _apexw("q8"), cuda_only=True, full_warmup=True),
    BenchConfig("flashoptim-peer", "FlashOptim FlashAdamW (peer)", "flashoptim", BF16, _flashoptim_adamw, cuda_only=True, full_warmup=True),
    BenchConfig("bnb-adamw8bit", "bitsandbytes AdamW8bit (peer)", "bitsandbytes", torch.float32, _bnb_adamw8bit, cuda_only=True, full_warmup=True),
    BenchConfig("deepspeed-cpuadam", "DeepSpeed CPUAdam fp32 (peer)", "deepspeed.ops.adam", torch.float32, _deepspeed_cpu_adam, cpu_only=True, full_warmup=True),
    BenchConfig("torchao-adamw8bit", "torchao AdamW8bit (peer)", "torchao.optim", torch.float32, _torchao_adamw8bit, full_warmup=True),
)  # fmt: skip


@dataclass
class Row:
    """One measurement (JSON-ready); ``error`` is set instead of the numbers when a config failed."""

    profile: str
    config: str
    label: str
    tensors: int
    params: int
    ms: float | None = None
    timed: int = 0
    state_bytes_per_param: float | None = None
    moved_bytes_per_param: float | None = None
    gb_per_s: float | None = None
    copy_fraction: float | None = None
    triad_fraction: float | None = None
    time_vs_adamw: float | None = None
    pipelined_ms: float | None = None
    pipelined_vs_adamw: float | None = None
    backend: str = "-"
    notes: str = ""
    error: str | None = None


class Timer:
    """Times a callable: CUDA events on a GPU (queued work only), perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], object]) -> float:
        """Milliseconds one call of ``fn`` took."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)

    def pipelined(self, fn: Callable[[], object], calls: int) -> float:
        """Milliseconds per call of ``calls`` calls of ``fn`` run back to back, nothing
        synchronized between them (on a GPU the host queues the next call while the last runs)."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end) / calls
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return 1e3 * (time.perf_counter() - t0) / calls

    def median(
        self,
        fn: Callable[[], object],
        warmup: int,
        iters: int,
        budget_s: float,
        full_warmup: int = 0,
        settled: Callable[[], bool] | None = None,
    ) -> tuple[float, int]:
        """(median ms, calls timed): up to ``warmup`` untimed calls, then up to ``iters`` timed
        ones. The first call is always untimed (it creates the state) and one call is always
        timed; the others stop once ``budget_s`` is spent, so a slow fallback cannot stall the run.

        ``full_warmup`` untimed calls run whatever the budget (a CUDA graph captured in the first
        steps), then, until ``settled()`` holds, up to ``SETTLE_STEPS`` more; past any of
        them the budget starts again for the timed calls.
        """
        deadline = time.perf_counter() + budget_s
        self(fn)
        calls = 1
        for _ in range(max(warmup, full_warmup) - 1):
            if calls >= full_warmup and time.perf_counter() > deadline:
                break
            self(fn)
            calls += 1
        extra = 0
        while settled is not None and not settled() and extra < SETTLE_STEPS:
            self(fn)
            extra += 1
        if full_warmup > 1 or extra:
            deadline = time.perf_counter() + budget_s
        times = [self(fn)]
        while len(times) < iters and time.perf_counter() < deadline:
            times.append(self(fn))
        return statistics.median(times), len(times)


def copy_bandwidth(device: torch.device, nbytes: int, timer: Timer) -> float:
    """GB/s of a large ``copy_`` counting the bytes read plus the bytes written."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms, _ = timer.median(lambda: dst.copy_(src), warmup=2, iters=10, budget_s=5.0)
    return 2 * nbytes / ms / 1e6


def triad_bandwidth(device: torch.device, nbytes: int, timer: Timer) -> float:
    """GB/s of a STREAM-style triad ``a = b + s * c`` over ``nbytes`` arrays (two read, one
    written), in torch's own threads: the streaming rate a memory-bound optimizer can reach."""
    b = torch.ones(nbytes // 4, device=device)
    c = torch.ones_like(b)
    a = torch.empty_like(b)
    ms, _ = timer.median(
        lambda: torch.add(b, c, alpha=3.0, out=a), warmup=2, iters=10, budget_s=5.0
    )
    return 3 * nbytes / ms / 1e6


def make_params(
    shapes: list[Shape], dtype: torch.dtype, device: torch.device, seed: int
) -> list[torch.nn.Parameter]:
    """Seeded random parameters with fixed random gradients (about the scale of real ones)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device).to(dtype))
        p.grad = (torch.randn(shape, generator=gen, device=device) * 1e-3).to(dtype)
        params.append(p)
    return params


def param_groups(params: list[torch.nn.Parameter], spec: str) -> list[Any]:
    """``params`` as the param groups ``--param-groups`` names (see the module doc): the plain
    list for ``1``."""
    if spec == "no-decay-1d":
        return [
            {"params": [p for p in params if p.dim() > 1]},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
        ]
    n = int(spec)
    if n == 1:
        return params
    bounds = [len(params) * i // n for i in range(n + 1)]
    return [
        {"params": params[bounds[i] : bounds[i + 1]], "lr": 1e-3 * 0.9 ** (n - 1 - i)}
        for i in range(n)
    ]


def _plain_tensors(value: Any) -> Iterable[torch.Tensor]:
    """The plain tensors that hold ``value``'s bytes: a tensor subclass (torchao's 8-bit states)
    through ``__tensor_flatten__``, another object (FlashOptim's quantized-state holder) through
    its tensor attributes."""
    if isinstance(value, torch.Tensor):
        flatten = getattr(type(value), "__tensor_flatten__", None)
        if type(value) is torch.Tensor or type(value) is torch.nn.Parameter or flatten is None:
            yield value
            return
        names, _ = value.__tensor_flatten__()
        for name in names:
            yield from _plain_tensors(getattr(value, name))
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        for attr in vars(value).values():
            if isinstance(attr, torch.Tensor):
                yield from _plain_tensors(attr)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """``opt.state_bytes()`` where offered, else the bytes of the storages behind its state
    (each storage once: a table shared by all parameters counts once)."""
    method = getattr(opt, "state_bytes", None)
    if callable(method):
        return int(method())
    storages: dict[tuple[str, int], int] = {}
    for s in opt.state.values():
        for value in s.values():
            for t in _plain_tensors(value):
                if t.numel() == 0:
                    continue
                storage = t.untyped_storage()
                key = (str(t.device), storage.data_ptr())
                storages[key] = max(storages.get(key, 0), storage.nbytes())
    return sum(storages.values())


def free_memory(device: torch.device) -> None:
    """Drop what the last row left (cycles through tracebacks included) and, on CUDA, hand the
    cached blocks back, so that each row and profile starts from an empty device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(
    profile: str,
    shapes: list[Shape],
    config: BenchConfig,
    module: Any,
    args: argparse.Namespace,
    timer: Timer,
    copy_gbs: float,
    triad_gbs: float,
) -> Row:
    """Time one configuration on one profile."""
    device = torch.device(args.device)
    params = make_params(shapes, config.param_dtype, device, args.seed)
    n = sum(p.numel() for p in params)
    row = Row(profile, config.name, config.label, len(params), n)
    opt = config.build(module, param_groups(params, args.param_groups), device)
    row.ms, row.timed = timer.median(
        opt.step,
        args.warmup,
        args.iters,
        args.max_seconds,
        full_warmup=args.full_warmup if config.full_warmup else 0,
        settled=(lambda: config.settled(opt)) if config.settled else None,
    )
    if args.pipelined:
        row.pipelined_ms = timer.pipelined(opt.step, args.pipelined)
    row.backend = backend_of(opt, params, device)
    if config.notes is not None:
        row.notes = " ".join(config.notes(opt).replace("|", "/").split())
    weight = params[0].element_size()
    row.state_bytes_per_param = state_bytes(opt) / n
    row.moved_bytes_per_param = 3 * weight + 2 * row.state_bytes_per_param
    row.gb_per_s = row.moved_bytes_per_param * n / row.ms / 1e6
    row.copy_fraction = row.gb_per_s / copy_gbs
    row.triad_fraction = row.gb_per_s / triad_gbs
    return row


def set_threads(n: int) -> None:
    """Use ``n`` CPU threads in torch (DeepSpeed's CPUAdam too: its op runs in torch's OpenMP
    runtime) and in memopt's C++ kernels (when installed)."""
    torch.set_num_threads(n)
    try:
        import memopt_kernels_cpu
    except ImportError:
        return
    memopt_kernels_cpu.set_num_threads(n)


def backend_of(opt: torch.optim.Optimizer, params: list, device: torch.device) -> str:
    """Which memopt kernel backend ran the step ("torch" is core's pure-torch fallback; ApexW:
    its mode's backend, "+graph" when capturable); for other optimizers, their package
    ("torch.optim", "bitsandbytes", ...)."""
    if not (hasattr(opt, "rule") and hasattr(opt, "_spec") and hasattr(opt, "_kind")):
        package = type(opt).__module__.split(".")[0]
        return "torch.optim" if package == "torch" else package
    from memopt_core import backends

    name = opt.backend
    decision = getattr(opt, "mode_decision", None)  # ApexW: opt.backend is the last one built
    if decision is not None:
        if decision.mode == "torch":
            return "torch"
        name = getattr(opt, "fused_backend", None) or "auto"
    spec = opt._spec(opt.param_groups[0], params[0].dtype)  # the group's formats
    chosen = backends.select_backend(opt._kind, spec, device, params[0].dtype, name)
    graph = "+graph" if decision is not None and getattr(opt, "capturable", False) else ""
    return str(getattr(chosen, "name", chosen)) + graph


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _cpu_kernels() -> str:
    try:
        import memopt_kernels_cpu as k
    except ImportError:
        return ", memopt-kernels-cpu not installed"
    return f", memopt C++ kernels: {k.get_isa()} with {k.get_num_threads()} threads"


def _last_level_cache() -> str | None:
    # On a CPU a profile that fits in this cache runs faster than the copy bandwidth allows.
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"))
    sizes = {
        int((c / "level").read_text()): (c / "size").read_text().strip()
        for c in caches
        if (c / "level").exists() and (c / "size").exists()
    }
    return sizes[max(sizes)] if sizes else None


def machine(device: torch.device) -> str:
    """A one-line description of what ran the benchmark."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, host {os.cpu_count()} CPUs"
    llc = _last_level_cache()
    return (
        f"{_cpu_model()}, {os.cpu_count()} CPUs, torch using {torch.get_num_threads()} threads"
        + _cpu_kernels()
        + (f", last-level cache {llc}" if llc else "")
    )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: list[Row], header: dict[str, Any]) -> str:
    """The report: how it was made, then one table row per (profile, configuration)."""
    lines = ["# Optimizer step benchmark", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    piped = any(r.pipelined_ms is not None for r in rows)
    lines += [
        "",
        "| profile | optimizer | tensors | params | step ms | steps timed | moved B/param | GB/s "
        "| of copy BW | of triad BW | state B/param | time / AdamW | backend | notes |"
        + (" pipelined ms | pipelined / AdamW |" if piped else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if piped else ""),
    ]
    for r in rows:
        if r.error is not None:
            lines.append(
                f"| {r.profile} | {r.label} | {r.tensors} | {r.params:,} | failed: {r.error}"
            )
            continue
        lines.append(
            f"| {r.profile} | {r.label} | {r.tensors} | {r.params:,} | {_fmt(r.ms, '.3f')} "
            f"| {r.timed} "
            f"| {_fmt(r.moved_bytes_per_param, '.2f')} | {_fmt(r.gb_per_s, '.1f')} "
            f"| {_fmt(r.copy_fraction, '.0%')} | {_fmt(r.triad_fraction, '.0%')} "
            f"| {_fmt(r.state_bytes_per_param, '.2f')} "
            f"| {_fmt(r.time_vs_adamw, '.2f')} | {r.backend} | {r.notes} |"
            + (
                f" {_fmt(r.pipelined_ms, '.3f')} | {_fmt(r.pipelined_vs_adamw, '.2f')} |"
                if piped
                else ""
            )
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="torch device (%(default)s)")
    p.add_argument("--profiles", default=",".join(PROFILES), help="comma list (%(default)s)")
    p.add_argument(
        "--optimizers",
        "--rows",
        dest="optimizers",
        default=",".join(c.name for c in CONFIGS),
        help="comma list; unimportable ones (and CUDA-only ones on a CPU) are skipped with the "
        "reason (%(default)s)",
    )
    p.add_argument(
        "--scale",
        type=int,
        default=None,
        help=f"divide every tensor's first dimension (default: 1 on CUDA, {CPU_SCALE} on CPU)",
    )
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps, at most; at least 1 (%(default)s)"
    )
    p.add_argument(
        "--iters", type=int, default=20, help="timed steps, at most; at least 1 (%(default)s)"
    )
    p.add_argument(
        "--full-warmup",
        type=int,
        default=5,
        help="untimed steps that always run for rows whose first steps differ from the rest "
        "(graph capture, mode choice, per-shape compilation, memopt's cached step) (%(default)s)",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=3.0,
        help="budget per measurement: no further step starts past it (%(default)s)",
    )
    p.add_argument(
        "--copy-mib", type=int, help="copy-bandwidth buffer (default: 2048 on CUDA, 1024 on CPU)"
    )
    p.add_argument(
        "--out", type=Path, default=Path("out/bench"), help="output folder (%(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of params and grads (%(default)s)")
    p.add_argument(
        "--pipelined",
        type=int,
        default=0,
        metavar="N",
        help="also time N steps back to back, unsynchronized, per row (%(default)s: not)",
    )
    p.add_argument(
        "--param-groups",
        default="1",
        metavar="N|no-decay-1d",
        help="param groups of every row: N groups with their own lr, or 1-D tensors without "
        "weight decay apart (%(default)s)",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch and memopt's C++ kernels alike (default: their defaults)",
    )
    args = p.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:  # a traceback from the first tensor otherwise
        p.error(f"--device: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch build or machine has no CUDA device")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    on_cuda = device.type == "cuda"
    if args.scale is None:
        args.scale = 1 if on_cuda else CPU_SCALE
    if args.copy_mib is None:
        args.copy_mib = 2048 if on_cuda else 1024  # far beyond the caches either way
    unknown = set(args.profiles.split(",")) - set(PROFILES)
    unknown |= set(args.optimizers.split(",")) - {c.name for c in CONFIGS}
    if unknown:
        p.error(f"unknown profile or optimizer names: {sorted(unknown)}")
    if args.scale < 1:
        p.error("--scale must be at least 1")
    if args.copy_mib < 1:  # 0 MiB: every row's bandwidth figures would divide by zero
        p.error("--copy-mib must be at least 1")
    if args.param_groups != "no-decay-1d" and not (
        args.param_groups.isdigit() and int(args.param_groups) >= 1
    ):
        p.error(f"--param-groups must be a count >= 1 or no-decay-1d, got {args.param_groups!r}")
    if args.param_groups != "no-decay-1d":
        args.param_groups = str(int(args.param_groups))  # "01" labelled rows "(01 groups)"
    for name in args.profiles.split(","):
        shapes = PROFILES[name]
        if args.param_groups == "no-decay-1d":
            if all(len(s) <= 1 for s in shapes) or all(len(s) > 1 for s in shapes):
                p.error(
                    f"--param-groups no-decay-1d: profile {name} has "
                    f"{'only' if all(len(s) <= 1 for s in shapes) else 'no'} 1-D tensors, so one "
                    "of the two groups would be empty"
                )
        elif int(args.param_groups) > len(shapes):
            p.error(
                f"--param-groups {args.param_groups}: profile {name} has {len(shapes)} tensors, "
                "so some groups would be empty"
            )
    if args.pipelined < 0:
        p.error("--pipelined must be at least 0")
    if args.warmup < 1 or args.iters < 1:
        p.error(f"--warmup and --iters must be at least 1, got {args.warmup} and {args.iters}")
    return args


def importable(
    names: set[str], device: torch.device | str = "cpu"
) -> tuple[dict[str, Any], dict[str, str]]:
    """``{config name: module}`` for the named configs that import (and, when CUDA-only, run on
    a CUDA device), ``{name: reason}`` for the rest."""
    modules: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    on_cuda = torch.device(device).type == "cuda"
    for config in CONFIGS:
        if config.name not in names:
            continue
        try:
            module = importlib.import_module(config.module)
        except Exception as exc:  # a peer that fails at import (a missing native library) too
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())
            reason = reason if len(reason) <= 160 else reason[:157] + "..."
            skipped[config.name] = f"{config.module} cannot be imported ({reason})"
            continue
        if config.cuda_only and not on_cuda:
            skipped[config.name] = f"needs a CUDA device ({config.label})"
            continue
        if config.cpu_only and on_cuda:
            skipped[config.name] = f"steps CPU tensors only ({config.label})"
            continue
        modules[config.name] = module
    return modules, skipped


def versions(modules: dict[str, Any]) -> str:
    """The versions of the packages behind the imported rows, torch's aside."""
    found: dict[str, str] = {}
    for module in modules.values():
        top = module.__name__.split(".")[0]
        if top == "torch" or top in found:
            continue
        version = getattr(sys.modules.get(top), "__version__", None)
        if version is None:
            try:
                version = importlib.metadata.version(top.replace("_", "-"))
            except importlib.metadata.PackageNotFoundError:
                version = "from a checkout"
        found[top] = str(version)
    return ", ".join(f"{k} {v}" for k, v in found.items()) or "-"


def run_profile(
    profile: str,
    modules: dict[str, Any],
    args: argparse.Namespace,
    timer: Timer,
    copy_gbs: float,
    triad_gbs: float,
    done: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """Measure every importable configuration on one profile, then relate them to AdamW's time.
    ``done(rows so far)`` runs after each row (the partial report)."""
    shapes = scaled(PROFILES[profile], args.scale)
    name = profile if args.scale == 1 else f"{profile}/{args.scale}"
    if args.param_groups != "1":
        name += f" ({args.param_groups} groups)"
    rows: list[Row] = []
    for config in (c for c in CONFIGS if c.name in modules):
        try:
            row = measure(
                name, shapes, config, modules[config.name], args, timer, copy_gbs, triad_gbs
            )
        except Exception as exc:  # one broken configuration must not hide the others
            n = sum(math.prod(s) for s in shapes)
            error = " ".join(f"{type(exc).__name__}: {exc}".replace("|", "/").split())
            error = error if len(error) <= 160 else error[:157] + "..."  # one table cell
            row = Row(name, config.name, config.label, len(shapes), n, error=error)
            traceback.clear_frames(exc.__traceback__)  # its frames hold the row's tensors
        rows.append(row)
        result = row.error or f"{row.ms:.3f} ms" + (f" ({row.notes})" if row.notes else "")
        print(f"{name:>20} {config.label:<28} {result}", file=sys.stderr)
        free_memory(timer.device)
        if done is not None:
            done(rows)
    for timed, ratio in (("ms", "time_vs_adamw"), ("pipelined_ms", "pipelined_vs_adamw")):
        base = next((getattr(r, timed) for r in rows if r.config == "adamw"), None)
        for r in rows:
            if getattr(r, timed) is not None and base:
                setattr(r, ratio, getattr(r, timed) / base)
    return rows


def report_header(
    args: argparse.Namespace, argv: list[str], copy_gbs: float, skipped: dict[str, str]
) -> dict[str, str]:
    """How the numbers were made: command, date, machine, versions, method and byte model."""
    device = torch.device(args.device)
    clock = "CUDA events" if device.type == "cuda" else "perf_counter"
    return {
        "command": " ".join(["python", "tools/bench/step_bench.py", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "scale": f"first dimension of every tensor divided by {args.scale}",
        "timing": f"median of up to {args.iters} steps after up to {args.warmup} warmup steps "
        f"({clock}); no step starts after {args.max_seconds:g} s, except the first of each",
        "copy bandwidth": f"{copy_gbs:.1f} GB/s (copy_ of {args.copy_mib} MiB, read + write)",
        "byte model": "per param, moved = 2 W (weights read + write) + W (grad read) "
        "+ 2 S (state read + write); S = optimizer state bytes after the steps / params",
        "time / AdamW": "step time over torch AdamW fp32 fused's on the same profile, this run",
        "param groups": args.param_groups
        if args.param_groups != "1"
        else "one (every parameter in one group)",
        **(
            {
                "pipelined": f"{args.pipelined} steps back to back, not synchronized between "
                "them (the host's part of a step overlaps the previous step's GPU work), per step"
            }
            if args.pipelined
            else {}
        ),
        "skipped": "; ".join(f"{k}: {v}" for k, v in skipped.items()) or "none",
        "warmup of memopt and peer rows": f"{args.full_warmup} untimed steps whatever the "
        "budget (CUDA graph capture, mode choice, the peers' per-shape compilation, memopt's "
        "cached step resolved and prepared), then the timed ones with a fresh budget",
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads is not None:
        set_threads(args.threads)
    began = time.perf_counter()
    timer = Timer(torch.device(args.device))
    copy_gbs = copy_bandwidth(timer.device, args.copy_mib * 2**20, timer)
    triad_gbs = triad_bandwidth(timer.device, args.copy_mib * 2**20, timer)
    print(f"copy {copy_gbs:.1f} GB/s, triad {triad_gbs:.1f} GB/s (read + write)", file=sys.stderr)
    free_memory(timer.device)
    modules, skipped = importable(set(args.optimizers.split(",")), args.device)
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", file=sys.stderr)
    header = report_header(args, argv, copy_gbs, skipped)
    header["triad bandwidth"] = (
        f"{triad_gbs:.1f} GB/s (a = b + 3 c over {args.copy_mib} MiB arrays, 2 read + 1 written)"
    )
    header["versions"] = versions(modules)

    rows: list[Row] = []

    def save(done_rows: list[Row], status: str) -> str:
        # Written after every row too, so that a run stopped from outside keeps what it measured.
        header["seconds"] = f"{time.perf_counter() - began:.0f}"
        header["status"] = status
        report = markdown(done_rows, header)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_bench.md").write_text(report)
        (args.out / "step_bench.json").write_text(
            json.dumps({"header": header, "rows": [asdict(r) for r in done_rows]}, indent=1)
        )
        return report

    def partial(part: list[Row]) -> None:  # the profiles done, then the current one's rows
        save([*rows, *part], f"partial: {len(rows) + len(part)} rows so far")

    for profile in args.profiles.split(","):
        rows += run_profile(profile, modules, args, timer, copy_gbs, triad_gbs, done=partial)
        free_memory(timer.device)  # a profile's tensors are gone before the next one's
    report = save(rows, "complete")
    print(report)
    md, js = args.out / "step_bench.md", args.out / "step_bench.json"
    print(f"wrote {md} and {js}", file=sys.stderr)
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
