"""Launch-geometry sweep of the fused AdamW (or Lion) kernel, per state format, on a GPU: prepared
launches (``memopt_kernels_triton.ops.prepare_step``) timed between CUDA events, median of
``--iters``, for each (rows of 32 elements, warps) pair, on a few-large and a many-small profile.

    python tools/bench/kernel_geometry.py [--formats fp32m,bf16m,q8m,ecc24q8,ecc24bf16]
        [--ahead default|on|off|both] [--rule adam|lion] [--geometries 8x4,16x4]
        [--maxnreg none,64] [--out geo.json]

Formats (AdamW, stochastic rounding on): ``fp32m`` fp32 parameters and moments, ``bf16m`` bf16
moments, ``q8m`` q8 moments, ``ecc24q8`` bf16 parameters with the ECC-24 master and q8 moments,
``ecc24bf16`` the same master with bf16 moments.
``--ahead`` overrides the kernels' loading one tile ahead (``ops._loads_ahead``: "on", "off",
"both" for each in turn; "default" keeps ops' choice per format).
What chose the default geometries of ``memopt_kernels_triton.ops.kernel_config``.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from apexw_kernel_probe import events_ms

from memopt_core import reference
from memopt_core.backends import GroupStep
from memopt_core.formats import StateSpec
from memopt_core.plan import GroupPlan, StateArena

FORMATS = {
    "fp32m": ("fp32", torch.float32, "fp32"),
    "bf16m": ("fp32", torch.float32, "bf16"),
    "q8m": ("fp32", torch.float32, "q8"),
    "ecc24q8": ("ecc24", torch.bfloat16, "q8"),
    "ecc24bf16": ("ecc24", torch.bfloat16, "bf16"),
}
GEOMETRIES = [(16, 8), (8, 4), (4, 4), (16, 4), (8, 8), (32, 8), (32, 4), (4, 2), (8, 2)]
PROFILES = [(8, 64 * 2**20), (4096, 32 * 2**10)]


def group_work(name: str, n: int, numel: int, rule: str = "adam") -> GroupStep:
    """A group of ``n`` CUDA tensors of ``numel`` elements in format ``name`` for ``rule``
    ("adam": AdamW, or "lion"), at step 10, with small random gradients."""
    master, dtype, moments = FORMATS[name]
    spec = StateSpec(master=master, moments=moments, stochastic_rounding=True)
    params = [torch.randn(numel, device="cuda").to(dtype) for _ in range(n)]
    grads = [(torch.randn(numel, device="cuda") * 1e-3).to(dtype) for _ in range(n)]
    plan = GroupPlan(params, spec)
    if rule == "adam":
        fields = {"exp_avg": spec.first, "exp_avg_sq": spec.second}
        s = reference.adam_scalars(
            lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=10, decoupled=True
        )
    else:
        fields = {"exp_avg": spec.first}
        s = reference.lion_scalars(
            lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01, maximize=False, initial_lr=None
        )
    arena = StateArena(plan, fields, spec.master_for(dtype))
    ids = list(range(n))
    return GroupStep(rule, spec, plan, ids, params, grads, arena, s, 10, 0, ids, False)


def main() -> None:
    from memopt_kernels_triton import ops

    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ahead", choices=["default", "on", "off", "both"], default="default")
    ap.add_argument("--rule", choices=["adam", "lion"], default="adam")
    ap.add_argument(
        "--geometries",
        default=",".join(f"{r}x{w}" for r, w in GEOMETRIES),
        help="rows x warps list (default: %(default)s)",
    )
    ap.add_argument("--maxnreg", default="none", help="register caps, e.g. none,64,96")
    args = ap.parse_args()
    geometries = [tuple(map(int, g.split("x"))) for g in args.geometries.split(",")]
    caps = [None if c == "none" else int(c) for c in args.maxnreg.split(",")]
    default_ahead = ops._loads_ahead
    aheads = {"default": [None], "on": [True], "off": [False], "both": [True, False]}[args.ahead]
    rows = []
    for ahead in aheads:
        # ops._loads_ahead(rule, block_size, master): a forced choice ignores all three
        ops._loads_ahead = default_ahead if ahead is None else (lambda *_, a=ahead: a)
        for name in args.formats.split(","):
            for n, numel in PROFILES:
                work = group_work(name, n, numel, args.rule)
                for (r, w), cap in itertools.product(geometries, caps):
                    cfg = ops.KernelConfig(rows=r, num_warps=w, maxnreg=cap)
                    p = ops.prepare_step(work, cfg)
                    ms = events_ms(
                        lambda p=p, s=work.scalars: p.launch(s, 10, 0, False), args.iters
                    )
                    rows.append(
                        {"rule": args.rule, "format": name, "tensors": n, "numel": numel,
                         "rows": r, "warps": w, "maxnreg": cap, "ahead": ahead, "ms": ms}
                    )  # fmt: skip
                    print(
                        f"{args.rule} {name:8s} {n:5d} x {numel:9d} rows={r:2d} warps={w} "
                        f"maxnreg={cap} ahead={ahead}: {ms:7.3f} ms",
                        flush=True,
                    )
                del work
                torch.cuda.empty_cache()
    ops._loads_ahead = default_ahead
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
