"""The state conversions outside the step, on the kernels' codecs and on core's reference codecs.

``memopt_core.conversions`` runs a kernel package's standalone codecs (Triton on CUDA tensors,
the C++ kernels on CPU tensors) where one is installed, else the reference codecs in slices of
``ENCODE_SLICE`` elements. This benchmark times each conversion both ways, in one process, on
``memopt_ecc.FlashAdamW`` (ECC-24 master, q8 moments, bf16 parameters) over one of
``step_bench``'s profiles, after one optimizer step:

- ``fp32-masters``: ``memopt_ecc.get_fp32_model_state_dict`` (decode every ECC master);
- ``state-dict``: ``state_dict()`` of a ``compress_state_dict=False`` optimizer (decode every
  moment);
- ``load-state-dict``: ``load_state_dict`` of that dict (encode every moment);
- ``set-fp32-masters``: ``memopt_ecc.set_fp32_model_state_dict`` (encode every master);
- ``to-torch`` / ``from-torch``: ``memopt_checkpoint.to_torch_state_dict`` and
  ``load_torch_state_dict`` (decode / encode every moment, and the masters of fresh state).

Per row and codec path: the median of ``--iters`` timed calls after one untimed call (CUDA:
synchronized before and after each call), and on CUDA the peak memory a call allocates beyond
what it started with (its result included). The reference path is taken by making
``codec_kernels`` answer None, which is what an install without kernel packages sees. Both paths
give the same bits (the packages' tests check it); the run checks one row's results are equal.

    python tools/bench/conversion_bench.py --device cuda --profile qwen2.5-0.5b --out out/conv
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import step_bench
import torch

from memopt_core import conversions
from memopt_core.testing import bits

ROWS = (
    "fp32-masters",
    "state-dict",
    "load-state-dict",
    "set-fp32-masters",
    "to-torch",
    "from-torch",
)
PATHS = ("kernels", "reference")


def build(shapes: list[tuple[int, ...]], device: torch.device) -> tuple[torch.nn.Module, Any]:
    """A module holding bf16 parameters of ``shapes`` and a FlashAdamW (state dicts decoded)
    that has taken one step on fixed random gradients."""
    from memopt_ecc import FlashAdamW

    params = step_bench.make_params(shapes, torch.bfloat16, device, seed=0)
    model = torch.nn.ParameterList(params)
    opt = FlashAdamW(params, lr=1e-3, weight_decay=0.01, compress_state_dict=False)
    opt.step()
    return model, opt


def row_call(name: str, model: torch.nn.Module, opt: Any) -> Callable[[], object]:
    """The conversion of row ``name``: a call that returns what the conversion produces."""
    from memopt_checkpoint import load_torch_state_dict, to_torch_state_dict
    from memopt_ecc import get_fp32_model_state_dict, set_fp32_model_state_dict

    if name == "fp32-masters":
        return lambda: get_fp32_model_state_dict(model, opt)
    if name == "state-dict":
        return opt.state_dict
    if name == "load-state-dict":
        sd = opt.state_dict()
        return lambda: opt.load_state_dict(sd)
    if name == "set-fp32-masters":
        sd = get_fp32_model_state_dict(model, opt)
        return lambda: set_fp32_model_state_dict(model, opt, sd)
    if name == "to-torch":
        return lambda: to_torch_state_dict(opt)
    if name == "from-torch":
        sd = to_torch_state_dict(opt)
        return lambda: load_torch_state_dict(opt, sd)
    raise ValueError(f"unknown row {name!r}; rows: {', '.join(ROWS)}")


def use_path(path: str, device: torch.device) -> Callable[[], None]:
    """Make conversions take ``path`` (``kernels`` or ``reference``); returns the undo."""
    real = conversions.codec_kernels
    if path == "reference":
        conversions.codec_kernels = lambda _device: None
    elif real(device) is None:
        raise SystemExit(f"no kernel package offers codecs on {device}: install one")

    def undo() -> None:
        conversions.codec_kernels = real

    return undo


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> tuple[float, float | None]:
    """(median ms over ``iters`` calls after one untimed call, CUDA peak GiB one call allocates
    beyond what it started with, or None on a CPU)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        sync()
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
        del out
    return statistics.median(times), peak


def first_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a conversion's result (a state dict), for comparing the two paths."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in first_tensors(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in first_tensors(v)]
    return []


def same_results(model: torch.nn.Module, opt: Any, device: torch.device) -> bool:
    """Whether both paths give bit-identical fp32 masters and decoded state."""
    out = {}
    for path in PATHS:
        undo = use_path(path, device)
        try:
            out[path] = first_tensors(row_call("fp32-masters", model, opt)()) + first_tensors(
                opt.state_dict()["state"]
            )
        finally:
            undo()
    a, b = out["kernels"], out["reference"]
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
        for x, y in zip(a, b, strict=True)
        if x.is_floating_point()
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", default="qwen2.5-0.5b", choices=sorted(step_bench.PROFILES))
    ap.add_argument("--scale", type=int, default=None, help="divide first dims (CPU default 16)")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="folder for conversion_bench.json")
    args = ap.parse_args(argv)
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if args.iters < 1 or (args.scale is not None and args.scale < 1):  # --scale 0 meant 16
        ap.error("--iters and --scale must be at least 1")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device: {e}")
    scale = args.scale if args.scale is not None else (16 if device.type == "cpu" else 1)
    shapes = step_bench.scaled(step_bench.PROFILES[args.profile], scale)
    n = sum(torch.Size(s).numel() for s in shapes)
    model, opt = build(shapes, device)
    rows = []
    for name in args.rows.split(","):
        for path in PATHS:
            undo = use_path(path, device)
            try:
                ms, peak = timed(row_call(name, model, opt), device, args.iters)
            finally:
                undo()
            rows.append({"row": name, "path": path, "ms": ms, "peak_gib": peak})
    equal = same_results(model, opt, device)
    header = {
        "device": step_bench.machine(device),
        "profile": args.profile,
        "scale": scale,
        "tensors": len(shapes),
        "params": n,
        "torch": torch.__version__,
        "results_equal": equal,
    }
    print(" ".join(f"{k}={v}" for k, v in header.items()))
    print(
        "| conversion | kernels ms | reference ms | reference / kernels | peak GiB kernels | peak GiB reference |"
    )
    print("|---|---|---|---|---|---|")
    by = {(r["row"], r["path"]): r for r in rows}
    for name in args.rows.split(","):
        k, r = by[(name, "kernels")], by[(name, "reference")]
        pk = "" if k["peak_gib"] is None else f"{k['peak_gib']:.3f}"
        pr = "" if r["peak_gib"] is None else f"{r['peak_gib']:.3f}"
        print(f"| {name} | {k['ms']:.1f} | {r['ms']:.1f} | {r['ms'] / k['ms']:.2f} | {pk} | {pr} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "conversion_bench.json").write_text(
            json.dumps({**header, "rows": rows}, indent=1)
        )
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
