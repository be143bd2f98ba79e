"""End to end under FSDP2: the Qwen2.5-0.5B shape sharded over the GPUs of one host.

Each row spawns one process per GPU (NCCL), shards the model with ``fully_shard`` (every decoder
layer, then the root), trains ``--warmup`` untimed then ``--steps`` timed steps of
transformers' causal-LM loss on random tokens (``--batch`` x ``--seq`` per rank), and reports
the median step time (forward + backward + optimizer step, CUDA events on each rank, the slowest
rank's median) and each rank's peak allocated memory. Rows:

- ``torch-adamw``: fp32 parameters, FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, ``torch.optim.AdamW(fused=True)`` (torch's own FSDP2 recipe);
- ``flash-adamw``: ``memopt_ecc.cast_model`` to bf16, FSDP2 without a mixed-precision policy,
  ``FlashAdamW`` (ECC-24 master + q8 moments, fused Triton step on each rank's shards);
- ``flash-adamw-release``: the same with ``enable_gradient_release`` (updates inside backward);
- ``apexw-bf16``: ``memopt_apexw.ApexW(state="bf16")`` on the fp32 parameters of row one.

Usage (one host, 2 GPUs): ``python tools/bench/fsdp2_qwen.py --world 2 --json out.json``.
``--device cpu --tiny`` runs the same code over gloo on the CPU (a smoke test, no timings worth
reporting).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import offload_e2e
import qwen2_shape
import torch
import torch.distributed as dist

from memopt_core.testing import init_rank, leave_group, spawn_ranks

ROWS = ("torch-adamw", "flash-adamw", "flash-adamw-release", "apexw-bf16")
GIB = 2**30


def _shard(model: torch.nn.Module, row: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if row in ("torch-adamw", "apexw-bf16")
        else MixedPrecisionPolicy()
    )
    layers = [m for m in model.modules() if type(m).__name__ == "Qwen2DecoderLayer"]
    for layer in layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)


def _optimizer(model: torch.nn.Module, row: str, lr: float):
    params = list(model.parameters())
    if row == "torch-adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True), None
    if row == "apexw-bf16":
        from memopt_apexw import ApexW

        return ApexW(params, lr=lr, weight_decay=0.01, state="bf16", mode="fused"), None
    import memopt_ecc

    opt = memopt_ecc.FlashAdamW(params, lr=lr, weight_decay=0.01)
    handle = memopt_ecc.enable_gradient_release(model, opt) if row.endswith("release") else None
    return opt, handle


def worker(rank: int, world: int, init_file: str, row: str, args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    init_rank(rank, world, init_file, args.device)
    try:
        torch.manual_seed(0)
        shape = (
            qwen2_shape.Qwen2Shape(64, 128, 2, 4, 2, 1000) if args.tiny else qwen2_shape.QWEN25_05B
        )
        choice = offload_e2e.choose_model(args.model)
        dtype = torch.float32 if row in ("torch-adamw", "apexw-bf16") else torch.bfloat16
        model = offload_e2e.build_model(choice, shape, dev, torch.float32)
        if dtype == torch.bfloat16:
            import memopt_ecc

            model = memopt_ecc.cast_model(model, dtype=torch.bfloat16)
        _shard(model, row)
        opt, _handle = _optimizer(model, row, args.lr)
        batches = offload_e2e.make_batches(
            args.warmup + args.steps, args.batch, args.seq, shape.vocab_size, 1000 + rank, dev
        )
        times, losses = [], []
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for i, (ids, labels) in enumerate(batches):
            if cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
            t0 = time.perf_counter()
            loss = offload_e2e.loss_of(model, ids, labels)
            loss.backward()
            if _handle is None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            if cuda:
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
            else:
                ms = (time.perf_counter() - t0) * 1e3
            if i >= args.warmup:
                times.append(ms)
            losses.append(float(loss.detach()))
        peak = torch.cuda.max_memory_allocated() / GIB if cuda else float("nan")
        out = {
            "row": row,
            "rank": rank,
            "median_ms": statistics.median(times),
            "times_ms": times,
            "peak_gib": peak,
            "losses": losses,
            "model": choice.note,
            "params": sum(p.numel() for p in model.parameters()),
        }
        Path(args.tmp, f"{row}-rank{rank}.json").write_text(json.dumps(out))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", choices=("auto", "transformers", "plain"), default="auto")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank (%(default)s)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        ap.error(f"unknown rows {bad}; choose from {ROWS}")
    if args.world < 1 or args.steps < 1 or args.warmup < 0 or min(args.batch, args.seq) < 1:
        ap.error("--world, --steps, --batch and --seq must be at least 1, --warmup at least 0")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        ap.error(f"--world {args.world} needs that many GPUs; {torch.cuda.device_count()} here")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        for row in rows:
            init = Path(tmp, f"init-{row}")
            files = [Path(tmp, f"{row}-rank{r}.json") for r in range(args.world)]
            try:
                # gloo now and then aborts a rank at teardown, after its work: spawn_ranks accepts
                # that when every rank wrote its results (CI saw it in this script, 2026-12-07)
                spawn_ranks(worker, (args.world, str(init), row, args), args.world, files)
            except Exception as exc:  # a failed row is reported, the others still run
                results.append({"row": row, "error": f"{type(exc).__name__}: {exc}"[:2000]})
                print(f"{row}: FAILED {exc}", file=sys.stderr)
                continue
            ranks = [json.loads(f.read_text()) for f in files]
            results.append(
                {
                    "row": row,
                    "median_ms": max(r["median_ms"] for r in ranks),
                    "peak_gib": [r["peak_gib"] for r in ranks],
                    "final_loss": [r["losses"][-1] for r in ranks],
                    "ranks": ranks,
                }
            )
    meta = {
        "world": args.world,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch_per_rank": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
    }
    print("| row | step ms (median, slowest rank) | peak GiB per rank | final loss per rank |")
    print("|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['row']} | failed: {r['error'][:120]} | | |")
        else:
            peaks = " / ".join(f"{p:.2f}" for p in r["peak_gib"])
            loss = " / ".join(f"{v:.4f}" for v in r["final_loss"])
            print(f"| {r['row']} | {r['median_ms']:.1f} | {peaks} | {loss} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
