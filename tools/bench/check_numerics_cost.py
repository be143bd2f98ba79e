"""What ``check_numerics=True`` costs a CPU step: FlashAdamW (bf16 parameters, its defaults)
with and without the check, and core's ``MemOptimizer`` (same formats) with the check alone,
on one large tensor and on many tiny ones, one thread, medians of timed steps.

    python tools/bench/check_numerics_cost.py [--rounds 2] [--reps 7]

Prints one line per round and profile. Figures: docs/benchmarks/2026-12-02-check-numerics-cpu.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from memopt_core import MemOptimizer
from memopt_ecc import FlashAdamW

PROFILES = {"1000 x 10": [(10,)] * 1000, "1 x 4M": [(4_000_000,)]}


def median_step_ms(opt: torch.optim.Optimizer, reps: int) -> float:
    for _ in range(2):  # plans, state, the cached step
        opt.step()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def params(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    out = [torch.nn.Parameter(torch.randn(s, dtype=torch.bfloat16)) for s in shapes]
    for p in out:
        p.grad = torch.randn_like(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if args.rounds < 1 or args.reps < 1:
        ap.error("--rounds and --reps must be at least 1")
    torch.set_num_threads(1)
    try:
        import memopt_kernels_cpu

        memopt_kernels_cpu.set_num_threads(1)
    except ImportError:  # core's torch backend then: slower steps, the same check
        print("memopt_kernels_cpu is not installed: the steps run core's torch backend", flush=True)
    for r in range(args.rounds):
        for label, shapes in PROFILES.items():
            off = median_step_ms(FlashAdamW(params(shapes)), args.reps)
            on = median_step_ms(FlashAdamW(params(shapes), check_numerics=True), args.reps)
            core = median_step_ms(
                MemOptimizer(
                    params(shapes), rule="adamw", master="ecc24", moments="q8", check_numerics=True
                ),
                args.reps,
            )
            print(
                f"round {r} {label:9s}: FlashAdamW {off:7.2f} ms | check_numerics=True "
                f"{on:7.2f} ms ({on / off:5.1f}x) | core MemOptimizer with the check {core:7.2f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
