"""Time the fused AdamW step (ECC-24 master + q8 moments, bf16 parameters and gradients) against
``torch.optim.AdamW(fused=True)`` in fp32, in one process, on the H200 profiles of DESIGN section 7.

    python tools/bench/triton_kernel_bench.py [--profiles big,small] [--iters 20] [--sweep]

Reports median ms (CUDA events around each step), achieved GB/s for the bytes each format moves
per step (ECC-24 + q8 with bf16 grads: 12.125 B/param; torch fp32 AdamW: 28 B/param) and that
figure over the measured device-to-device copy bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from memopt_core import reference
from memopt_core.backends import GroupStep
from memopt_core.formats import StateSpec
from memopt_core.plan import GroupPlan, StateArena
from memopt_kernels_triton import ops

PROFILES = {"big": (8, 64 * 2**20), "small": (4096, 32 * 2**10)}
ECC24_Q8_BYTES = 2 + 1 + 2 + 2 * (1 + 1 / 32) + 2 + 1 + 2 * (1 + 1 / 32)  # 12.125
TORCH_FP32_BYTES = 28


def timed(fn, iters: int, warmup: int = 3) -> tuple[float, float]:
    """(median GPU ms over ``iters`` single-step event pairs, median host ms per call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b))
    return statistics.median(gpu), statistics.median(host)


def copy_bandwidth() -> float:
    x = torch.empty(2**30, dtype=torch.float32, device="cuda")  # 4 GiB
    y = torch.empty_like(x)
    ms, _ = timed(lambda: y.copy_(x), 10)
    return 2 * 4 * 2**30 / (ms * 1e-3) / 1e9


def fused_setup(n_tensors: int, numel: int, sr: bool):
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=sr)
    params = [torch.randn(numel, device="cuda").to(torch.bfloat16) for _ in range(n_tensors)]
    grads = [
        (torch.randn(numel, device="cuda") * 1e-3).to(torch.bfloat16) for _ in range(n_tensors)
    ]
    plan = GroupPlan(params, spec)
    arena = StateArena(
        plan, {"exp_avg": spec.first, "exp_avg_sq": spec.second}, spec.master_for(torch.bfloat16)
    )
    s = reference.adam_scalars(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=10, decoupled=True
    )
    work = GroupStep(
        "adam",
        spec,
        plan,
        list(range(n_tensors)),
        params,
        grads,
        arena,
        s,
        10,
        0,
        list(range(n_tensors)),
        False,
    )
    return work


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profiles", default="big,small")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also try other launch geometries")
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    bw = copy_bandwidth()
    print(f"copy bandwidth (read+write): {bw:.0f} GB/s")
    configs = [ops.kernel_config(blocked=True)]  # the default of a group with q8 moments
    if args.sweep:
        configs += [
            ops.KernelConfig(rows=16, num_warps=8, waves=64),
            ops.KernelConfig(rows=8, num_warps=8),
            ops.KernelConfig(rows=8, num_warps=8, waves=64),
            ops.KernelConfig(rows=8, num_warps=4, waves=32),
            ops.KernelConfig(rows=32, num_warps=8, waves=32),
        ]
    for prof in args.profiles.split(","):
        n_t, numel = PROFILES[prof]
        total = n_t * numel
        print(f"\n== profile {prof}: {n_t} x {numel} = {total / 1e6:.1f}M params")
        # torch fused AdamW, fp32
        ps = [torch.randn(numel, device="cuda", requires_grad=True) for _ in range(n_t)]
        for p in ps:
            p.grad = torch.randn(numel, device="cuda") * 1e-3
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)
        ms, host = timed(opt.step, args.iters)
        gbs = total * TORCH_FP32_BYTES / (ms * 1e-3) / 1e9
        print(
            f"torch AdamW fused fp32     : {ms:8.3f} ms  host {host:7.3f} ms  {gbs:6.0f} GB/s ({gbs / bw:.0%} of copy)  [28 B/param]"
        )
        del opt, ps
        torch.cuda.empty_cache()
        for sr in (True, False):
            work = fused_setup(n_t, numel, sr)
            for cfg in configs:
                ms, host = timed(lambda cfg=cfg, work=work: ops.fused_step(work, cfg), args.iters)
                gbs = total * ECC24_Q8_BYTES / (ms * 1e-3) / 1e9
                print(
                    f"fused AdamW ECC-24+q8 SR={'on ' if sr else 'off'}: {ms:8.3f} ms  host {host:7.3f} ms  "
                    f"{gbs:6.0f} GB/s ({gbs / bw:.0%} of copy)  [{ECC24_Q8_BYTES} B/param] {cfg}"
                )
            work = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
