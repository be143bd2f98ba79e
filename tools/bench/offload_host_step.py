"""AdamBridge's host update alone, per precision, beside a copy and torch's fused CPU AdamW.

What the CPU does for each parameter of an offloaded step, without a GPU: the C++ kernels over
host tensors laid out as ``memopt_offload.AdamBridge`` lays them out (``PRECISIONS``: an fp32
master that also writes the bf16 staging copy, or an ECC-24 master whose bf16 weight is the
upload itself), from a bf16 gradient, with stochastic rounding. Rows:

- ``copy``: ``torch`` ``copy_`` of an fp32 buffer, read + write counted (the memory's speed);
- ``torch``: ``torch.optim.AdamW(fused=True)`` on fp32 parameters and gradients (28 B/param);
- ``deepspeed``: DeepSpeed's ``DeepSpeedCPUAdam`` (ZeRO-Offload's host optimizer, AdamW mode) on
  the same fp32 tensors (28 B/param), when ``deepspeed`` is installed (its C++ op is built with
  ninja at the first construction, outside the timed steps);
- one row per AdamBridge precision (``fp32``, ``bf16``, ``fp8``, ``bf16-ecc24``, ``compact``).

Each row runs ``--iters`` timed steps after 2 untimed ones over 2**``--log2n`` parameters and
reports the median: ns per parameter, and GB/s for the bytes the kernel reads and writes
(``offload_e2e.BYTE_MODEL``'s kernel column; the DMA legs of a real step come on top). By default
every row runs in its own process, in the order given, so one row's pages and threads do not
meet the next's; ``--rounds N`` repeats the rows in reverse order every other round.

    python tools/bench/offload_host_step.py --threads 16 --log2n 26 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import offload_e2e
import torch
from offload_e2e import positive_int

from memopt_offload import PRECISIONS

PEERS = ("copy", "torch", "deepspeed")


def row_step(name: str, n: int) -> tuple[Callable[[], object], int, torch.Tensor]:
    """The step of row ``name`` over ``n`` parameters, the bytes it moves per parameter and the
    tensor it writes."""
    if name == "copy":
        a, b = torch.randn(n), torch.empty(n)
        return (lambda: b.copy_(a)), 8, b
    if name == "torch":
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n) * 1e-3
        return torch.optim.AdamW([p], lr=1e-3, fused=True).step, 28, p
    if name == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n) * 1e-3
        return DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True).step, 28, p
    from memopt_core import MemOptimizer

    moments, master = PRECISIONS[name]
    ecc = master == "ecc24"
    # as AdamBridge: an ECC-24 master is the bf16 weight + code; else an fp32 master + staging
    p = torch.nn.Parameter(torch.randn(n).to(torch.bfloat16 if ecc else torch.float32))
    grad = (torch.randn(n) * 1e-3).bfloat16()
    opt = MemOptimizer(
        [p], rule="adamw", lr=1e-3, weight_decay=0.01, moments=moments,
        master=master if ecc else "none", stochastic_rounding=True, backend="cpu",
    )  # fmt: skip
    staging = {} if ecc else {p: torch.empty(n, dtype=torch.bfloat16)}
    step = lambda: opt.step_parameters([p], grads={p: grad}, staging=staging)  # noqa: E731
    return step, offload_e2e.BYTE_MODEL[name].kernel, p


def time_row(name: str, n: int, iters: int) -> dict:
    step, nbytes, _ = row_step(name, n)
    with torch.no_grad():
        for _ in range(2):
            step()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {
        "name": name, "ms": med * 1e3, "ns_per_param": med / n * 1e9,
        "bytes_per_param": nbytes, "gbs": nbytes * n / med / 1e9,
    }  # fmt: skip


def set_threads(threads: int | None) -> None:
    if threads:
        import memopt_kernels_cpu

        torch.set_num_threads(threads)  # DeepSpeed's op runs in torch's OpenMP runtime
        memopt_kernels_cpu.set_num_threads(threads)


def run_isolated(name: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name]
    cmd += ["--log2n", str(args.log2n), "--iters", str(args.iters)]
    cmd += ["--threads", str(args.threads)] if args.threads else []
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode:
        return {"name": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(rows: list[dict], threads: int, n: int) -> str:
    ref = [r["ns_per_param"] for r in rows if r["name"] == "torch" and "error" not in r]
    torch_ns = statistics.median(ref) if ref else None
    out = [
        f"2**{n.bit_length() - 1} parameters, {threads} threads; ns/param and GB/s are medians",
        "",
        "| row | round | ns/param | ms | kernel B/param | GB/s | vs torch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['name']} | {r['round']} | failed: {r['error']} | | | | |")
            continue
        vs = f"{r['ns_per_param'] / torch_ns:.2f}" if torch_ns else "-"
        out.append(
            f"| {r['name']} | {r['round']} | {r['ns_per_param']:.3f} | {r['ms']:.2f} | "
            f"{r['bytes_per_param']} | {r['gbs']:.1f} | {vs} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="copy,torch,fp32,bf16,fp8,bf16-ecc24,compact")
    ap.add_argument("--log2n", type=positive_int, default=26, help="parameters: 2**LOG2N (26)")
    ap.add_argument("--iters", type=positive_int, default=9, help="timed steps per row (9)")
    ap.add_argument("--threads", type=int, default=0, help="torch's and the kernels' (0: all)")
    ap.add_argument(
        "--rounds", type=positive_int, default=1, help="repeat the rows, reversed every other"
    )
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--json", type=Path, help="write every row here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    known = PEERS + tuple(PRECISIONS)
    names = [s for s in args.rows.split(",") if s]
    unknown = [s for s in [*names, args.child] if s and s not in known]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {', '.join(known)}")
    if not names:
        ap.error("--rows names no row")
    if args.threads < 0:
        ap.error("--threads must be at least 0 (0: all)")
    n = 1 << args.log2n
    set_threads(args.threads)
    if args.child:
        print(json.dumps(time_row(args.child, n, args.iters)))
        return 0
    rows = []
    for k, order in enumerate(offload_e2e.round_order(names, args.rounds)):
        for name in order:
            r = run_isolated(name, args) if args.isolate else time_row(name, n, args.iters)
            r["round"] = k + 1
            rows.append(r)
            print(f"{name:>12} (round {k + 1}): {r.get('ns_per_param', float('nan')):.3f} ns/param")
    threads = args.threads or torch.get_num_threads()
    print(report(rows, threads, n))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": threads, "n": n, "rows": rows}, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
