"""Train a small byte-level GPT on the Python standard library with each optimizer and compare.

Every optimizer starts from the same initial weights and sees the same batches. The table gives
the final validation loss (and its difference from torch AdamW), the median time of the optimizer
step and of the whole training step, the optimizer-state bytes per parameter and the peak memory;
``loss_curves.png`` and ``results.json`` go to ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from corpus import fixed_batches, load_corpus, random_batches
from model import GPT, GPTConfig
from optimizers import CONFIGS, Hyper, OptimizerConfig, available, by_name, load, state_bytes
from png_plot import Panel, Series, write_chart_png
from progress import Progress

VAL_BATCHES = 16


@dataclass
class RunResult:
    """What one optimizer's run produced (JSON-ready)."""

    name: str
    label: str
    description: str
    param_dtype: str
    final_val_loss: float
    median_opt_step_ms: float
    median_train_step_ms: float
    params: int
    state_bytes: int
    state_bytes_per_param: float
    weights_and_state_bytes_per_param: float
    peak_memory_bytes: int
    seconds: float
    train_curve: list[tuple[int, float]]
    val_curve: list[tuple[int, float]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = ",".join(c.name for c in CONFIGS)
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--optimizers", help=f"comma-separated names from {names} (default: every importable one)"
    )
    p.add_argument("--steps", type=int, default=300, help="training steps (%(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (%(default)s)")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sequence (%(default)s)")
    p.add_argument("--d-model", type=int, default=64, help="model width (%(default)s)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (%(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (%(default)s)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (%(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay (%(default)s)")
    p.add_argument(
        "--eval-every", type=int, default=25, help="steps between validation losses (%(default)s)"
    )
    p.add_argument("--out", type=Path, default=Path("demo-out"), help="output folder (%(default)s)")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device (%(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of init and batches (%(default)s)")
    args = p.parse_args(argv)
    if min(args.steps, args.eval_every, args.batch_size, args.seq_len, args.d_model) < 1:
        p.error("--steps, --eval-every, --batch-size, --seq-len and --d-model must be positive")
    if args.layers < 0:
        p.error(f"--layers must be at least 0, got {args.layers}")
    if args.heads < 1 or args.d_model % args.heads:
        p.error(f"--heads must be positive and divide --d-model {args.d_model}")
    if not (0 < args.lr < math.inf and 0 <= args.weight_decay < math.inf):
        p.error("--lr must be finite and positive, --weight-decay finite and at least 0")
    if args.optimizers is not None:  # "" ran every optimizer
        try:
            by_name(args.optimizers.split(","))
        except ValueError as e:
            p.error(f"--optimizers: {e}")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:  # a traceback from the first tensor otherwise
        p.error(f"--device: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch build or machine has no CUDA device")
    return args


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup over the first 10% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


@torch.no_grad()
def evaluate(
    model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> float:
    """Mean loss over fixed validation batches."""
    model.eval()
    losses = [model.loss(x.to(device), y.to(device)).item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def _load_step_code(
    config: OptimizerConfig, module: Any, hyper: Hyper, device: torch.device
) -> None:
    """Build and step the optimizer once over a throwaway parameter before the memory baseline:
    an optimizer's first step imports code lazily (torch.optim's step imports torch._dynamo and
    sympy, about 150 MiB of peak RSS on a CPU), which is not optimizer memory."""
    p = torch.nn.Parameter(torch.zeros(64, dtype=config.param_dtype, device=device))
    opt = config.build(module, [p], hyper)
    p.grad = torch.zeros_like(p)
    opt.step()


def train_one(name: str, args: argparse.Namespace) -> RunResult:
    """Train a fresh model with the named optimizer; seeded so every optimizer gets the same run."""
    begin = time.perf_counter()
    (config,) = by_name([name])
    device = torch.device(args.device)
    corpus = load_corpus()
    train = random_batches(corpus.train, args.batch_size, args.seq_len, args.steps, args.seed)
    val = fixed_batches(corpus.val, args.batch_size, args.seq_len, VAL_BATCHES)
    module = load(config)  # imported before the memory baseline: code is not optimizer memory
    hyper = Hyper(lr=args.lr, weight_decay=args.weight_decay, seed=args.seed)
    _load_step_code(config, module, hyper, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base_mem = torch.cuda.memory_allocated(device)
    else:
        base_mem = _peak_rss_bytes()

    torch.manual_seed(args.seed)
    cfg = GPTConfig(
        seq_len=args.seq_len, d_model=args.d_model, layers=args.layers, heads=args.heads
    )
    model = GPT(cfg).to(config.param_dtype).to(device)
    opt = config.build(module, model.parameters(), hyper)

    bar = Progress(f"{config.name:>16}", args.steps)
    train_curve: list[tuple[int, float]] = []
    val_curve = [(0, evaluate(model, val, device))]
    opt_ms: list[float] = []
    step_ms: list[float] = []
    for step, (x, y) in enumerate(train):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        _sync(device)
        t0 = time.perf_counter()
        loss = model.loss(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        opt.step()
        _sync(device)
        t2 = time.perf_counter()
        opt_ms.append(1e3 * (t2 - t1))
        step_ms.append(1e3 * (t2 - t0))
        train_curve.append((step + 1, loss.item()))
        done = step + 1
        at_eval = done % args.eval_every == 0 or done == args.steps
        if at_eval:
            val_curve.append((done, evaluate(model, val, device)))
        bar.update(done, f"loss {train_curve[-1][1]:.3f} val {val_curve[-1][1]:.3f}", at_eval)
    bar.close()

    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base_mem
    else:
        peak = _peak_rss_bytes() - base_mem
    n_params = sum(p.numel() for p in model.parameters())
    n_state = state_bytes(opt)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return RunResult(
        name=config.name,
        label=config.label,
        description=config.description,
        param_dtype=str(config.param_dtype).removeprefix("torch."),
        final_val_loss=val_curve[-1][1],
        median_opt_step_ms=statistics.median(opt_ms),
        median_train_step_ms=statistics.median(step_ms),
        params=n_params,
        state_bytes=n_state,
        state_bytes_per_param=n_state / n_params,
        weights_and_state_bytes_per_param=(n_state + weight_bytes) / n_params,
        peak_memory_bytes=peak,
        seconds=time.perf_counter() - begin,
        train_curve=train_curve,
        val_curve=val_curve,
    )


def run(config: OptimizerConfig, args: argparse.Namespace) -> RunResult:
    """On CPU, run in a fresh process: the peak RSS of a process only grows, so each run needs
    its own to measure its peak. On CUDA, the allocator's peak statistics can be reset in place."""
    if torch.device(args.device).type == "cuda":
        return train_one(config.name, args)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(train_one, config.name, args).result()


def smoothed(curve: list[tuple[int, float]], decay: float = 0.9) -> list[tuple[int, float]]:
    """Bias-corrected exponential moving average, so noisy batch losses plot as readable lines."""
    out, avg = [], 0.0
    for k, (step, value) in enumerate(curve, start=1):
        avg = decay * avg + (1 - decay) * value
        out.append((step, avg / (1 - decay**k)))
    return out


def peak_memory_note(device: str) -> str:
    if torch.device(device).type == "cuda":
        return "peak memory: torch.cuda.max_memory_allocated growth during the run"
    return "peak memory: growth of peak RSS (getrusage) during the run, one fresh process each"


def format_table(results: list[RunResult], device: str) -> str:
    """The comparison as a Markdown table, AdamW's loss as the reference for the difference."""
    ref = next((r.final_val_loss for r in results if r.name == "adamw"), None)
    head = (
        "| optimizer | param dtype | val loss | Δ vs AdamW | opt step ms | train step ms "
        "| state B/param | weights+state B/param | peak mem MiB |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        delta = "-" if ref is None or r.name == "adamw" else f"{r.final_val_loss - ref:+.4f}"
        lines.append(
            f"| {r.label} | {r.param_dtype} | {r.final_val_loss:.4f} | {delta} "
            f"| {r.median_opt_step_ms:.2f} | {r.median_train_step_ms:.1f} "
            f"| {r.state_bytes_per_param:.2f} | {r.weights_and_state_bytes_per_param:.2f} "
            f"| {r.peak_memory_bytes / 2**20:.1f} |"
        )
    lines.append("")
    lines.append(f"step times: medians over all steps on {device}; {peak_memory_note(device)}")
    return "\n".join(lines)


def quality_lines(results: list[RunResult]) -> list[str]:
    """Each optimizer's final validation loss next to torch AdamW's, with the difference."""
    ref = next((r for r in results if r.name == "adamw"), None)
    if ref is None:
        return []
    return [
        f"{r.label}: final val loss {r.final_val_loss:.4f} vs torch AdamW "
        f"{ref.final_val_loss:.4f} (difference {r.final_val_loss - ref.final_val_loss:+.4f})"
        for r in results
        if r is not ref
    ]


def write_outputs(
    args: argparse.Namespace, argv: list[str], results: list[RunResult], skipped: dict[str, str]
) -> tuple[Path, Path]:
    """Write ``loss_curves.png`` and ``results.json`` into ``args.out``."""
    args.out.mkdir(parents=True, exist_ok=True)
    train = [Series(r.label, smoothed(r.train_curve)) for r in results]
    val = [Series(r.label, r.val_curve) for r in results]
    png = write_chart_png(
        args.out / "loss_curves.png",
        [Panel("train loss (EMA 0.9)", train), Panel("validation loss", val)],
    )
    device = torch.device(args.device)
    summary = {
        "command": " ".join(["python", "tools/demo/gpt_demo.py", *argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "peak_memory": peak_memory_note(args.device),
        "skipped": skipped,
        "results": [asdict(r) for r in results],
    }
    json_path = args.out / "results.json"
    json_path.write_text(json.dumps(summary, indent=1) + "\n")
    return png, json_path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    corpus = load_corpus()
    shortest = min(len(corpus.train), len(corpus.val))
    if args.seq_len + 1 >= shortest:  # a window holds seq_len inputs and their next bytes
        print(
            f"gpt_demo.py: error: --seq-len {args.seq_len} needs corpus splits longer than "
            f"{args.seq_len + 1} bytes; the shorter one has {shortest}",
            file=sys.stderr,
        )
        return 2
    begin = time.perf_counter()
    wanted = by_name(args.optimizers.split(",")) if args.optimizers is not None else list(CONFIGS)
    configs, skipped = available(wanted)
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", file=sys.stderr)
    if not configs:
        print("no optimizer to run", file=sys.stderr)
        return 1
    print(
        f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"GPT d_model {args.d_model} x {args.layers} layers, seq {args.seq_len}, "
        f"batch {args.batch_size}, {args.steps} steps",
        file=sys.stderr,
    )
    results = [run(config, args) for config in configs]
    print(format_table(results, args.device))
    print("\n".join(quality_lines(results)))
    png, json_path = write_outputs(args, argv, results, skipped)
    print(f"wrote {png} and {json_path} in {time.perf_counter() - begin:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
