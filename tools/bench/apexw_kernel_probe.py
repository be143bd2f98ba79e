"""Where ApexW's step time goes on a GPU: the fused kernel alone, per state format, with and
without stochastic rounding, over launch geometries; and the host cost of the cached step's
validity check. One process, CUDA only.

    python tools/bench/apexw_kernel_probe.py [--numel 67108864] [--tensors 8] [--out probe.json]

Kernel rows time a prepared launch (``memopt_kernels_triton.ops.prepare_step``) between CUDA
events, median of ``--iters``; GB/s counts the bytes the format must move per parameter (fp32
weight read + write, fp32 gradient read, state read + write) against a ``copy_`` measured in the
same run. SR off is not a configuration ApexW offers (its bf16 moments would stall): it isolates
the cost of the stochastic-rounding words and rounding. Host rows time
``CachedStep.current_grads`` (the check before every replay) over many small parameters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from memopt_core import reference
from memopt_core.backends import GroupStep
from memopt_core.formats import StateSpec
from memopt_core.plan import GroupPlan, StateArena


def events_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def copy_gbs() -> float:
    x = torch.empty(2**29, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    ms = events_ms(lambda: y.copy_(x), 10)
    return 2 * x.numel() * 4 / (ms * 1e-3) / 1e9


def prepared(n_tensors: int, numel: int, moments: str, sr: bool):
    from memopt_kernels_triton import ops

    spec = StateSpec(master="fp32", moments=moments, stochastic_rounding=sr)
    params = [torch.randn(numel, device="cuda") for _ in range(n_tensors)]
    grads = [torch.randn(numel, device="cuda") * 1e-3 for _ in range(n_tensors)]
    plan = GroupPlan(params, spec)
    arena = StateArena(
        plan, {"exp_avg": spec.first, "exp_avg_sq": spec.second}, spec.master_for(torch.float32)
    )
    s = reference.adam_scalars(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=10, decoupled=True
    )
    ids = list(range(n_tensors))
    work = GroupStep("adam", spec, plan, ids, params, grads, arena, s, 10, 0, ids, False)
    state_b = arena.nbytes() / plan.total
    return ops, work, 12 + 2 * state_b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--numel", type=int, default=64 * 2**20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_gbs()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s")
    rows = []
    # (rows, warps, num_stages): elements per thread = rows * 32 / (warps * 32)
    geometries = [
        (16, 8, None),
        (16, 4, None),
        (32, 8, None),
        (32, 4, None),
        (64, 8, None),
        (64, 4, None),
        (8, 4, None),
        (4, 4, None),
        (16, 4, 1),
        (32, 4, 2),
        (32, 4, 4),
    ]
    for moments, sr in (
        ("fp32", False),
        ("bf16", True),
        ("bf16", False),
        ("q8", True),
        ("q8", False),
    ):
        ops, work, moved = prepared(args.tensors, args.numel, moments, sr)
        geos = geometries if sr else geometries[:1]
        for r, w, ns in geos:
            cfg = ops.KernelConfig(rows=r, num_warps=w, num_stages=ns)
            p = ops.prepare_step(work, cfg)
            ms = events_ms(lambda p=p, s=work.scalars: p.launch(s, 10, 0, False), args.iters)
            gbs = args.tensors * args.numel * moved / (ms * 1e-3) / 1e9
            row = {
                "moments": moments,
                "sr": sr,
                "rows": r,
                "warps": w,
                "stages": ns,
                "ms": ms,
                "moved_B": moved,
                "gbs": gbs,
                "of_copy": gbs / bw,
            }
            rows.append(row)
            print(
                f"{moments:5s} SR={'on ' if sr else 'off'} rows={r:2d} warps={w:2d} stages={ns}: {ms:7.3f} ms  {gbs:6.0f} GB/s  {gbs / bw:4.0%} of copy  [{moved:.2f} B/param]"
            )
        del work, p
        torch.cuda.empty_cache()
    from memopt_core.cached_step import CachedStep

    host = []
    for n in (290, 4096, 16384):
        ps = [torch.zeros(8, device="cuda", requires_grad=True) for _ in range(n)]
        for p in ps:
            p.grad = torch.zeros_like(p)
        groups = [
            {
                "params": ps,
                "master": "ecc24",
                "moments": "bf16",
                "stochastic_rounding": True,
                "maximize": False,
            }
        ]
        cached = CachedStep([], groups, ())
        t0 = time.perf_counter()
        for _ in range(50):
            assert cached.current_grads(groups, ()) is not None
        us = (time.perf_counter() - t0) / 50 * 1e6
        host.append({"tensors": n, "matches_us": us})
        print(
            f"CachedStep.current_grads over {n:5d} tensors: {us:8.1f} us ({us / n * 1e3:.0f} ns per tensor)"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "copy_gbs": bw,
                    "kernel": rows,
                    "host": host,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
