"""The optimizer step under a ``torch.amp.GradScaler``: ``scaler.step(opt); scaler.update()``.

Each timed iteration is ``scaler.scale(x)`` (a one-element tensor standing for the loss),
``scaler.step(opt)`` and ``scaler.update()``. GradScaler's use is fp16 autocast over fp32 weights, so the parameters and gradients here are
fp32 (random gradients, fixed). The scale stays 1.0 (``init_scale=1``, no growth), so unscaling
leaves the gradients as they are while every kernel and synchronisation of the loop still runs.

Rows (``--rows``):

- ``adamw``: torch's AdamW ``fused=True``; the scaler hands it its scale and found-inf flag
  (``_step_supports_amp_scaling``), the fused kernel unscales and skips.
- ``flash-adamw``: memopt_ecc.FlashAdamW (fp32 weights: no ECC code, q8 moments); since
  2026-12-02 the scaler hands it the flags too, and the Triton kernel unscales and skips.
- ``flash-adamw-scaler-loop``: the same optimizer under the scaler's own loop, what it got
  before (``unscale_``: a pass that reads and writes every gradient, then a host read of the
  flag, a synchronisation, then ``step()``).
- ``flash-adamw-capturable``: ``capturable=True`` (step counts on the device from the start).
- ``apexw``, ``apexw-scaler-loop``: memopt_apexw.ApexW (``mode="fused"``, bf16 moments) given
  the flags (since 2026-12-03), and under the scaler's own loop (what it got before).

Timed (CUDA events): the median of ``--iters`` iterations each started on an idle GPU, and
``--pipelined`` iterations back to back (as a training loop runs them). Writes
``amp_step_bench.md`` under ``--out``.

    python tools/bench/amp_step_bench.py --profiles 8x64M,qwen2.5-0.5b --out out/amp
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_bench import PROFILES, Timer, free_memory, machine, make_params


class _ScalerLoop:
    """Mixed into a memopt optimizer class: GradScaler then runs its own loop."""

    _step_supports_amp_scaling = False


def _build(row: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if row == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    from memopt_ecc import FlashAdamW

    if row == "flash-adamw":
        return FlashAdamW(params, lr=1e-3, weight_decay=0.01)
    if row == "flash-adamw-capturable":
        return FlashAdamW(params, lr=1e-3, weight_decay=0.01, capturable=True)
    if row == "flash-adamw-scaler-loop":
        cls = type("FlashAdamWScalerLoop", (_ScalerLoop, FlashAdamW), {})
        return cls(params, lr=1e-3, weight_decay=0.01)
    if row in ("apexw", "apexw-scaler-loop"):
        from memopt_apexw import ApexW

        cls = ApexW if row == "apexw" else type("ApexWScalerLoop", (_ScalerLoop, ApexW), {})
        return cls(params, lr=1e-3, weight_decay=0.01, mode="fused")
    raise SystemExit(f"unknown row {row!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", default="8x64M,qwen2.5-0.5b")
    ap.add_argument(
        "--rows", default="adamw,flash-adamw,flash-adamw-scaler-loop,flash-adamw-capturable"
    )
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pipelined", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every row, alternated")
    ap.add_argument("--out", default="out/amp")
    args = ap.parse_args()
    unknown = set(args.profiles.split(",")) - set(PROFILES)
    if unknown:
        ap.error(f"unknown profiles {sorted(unknown)}; choose from {sorted(PROFILES)}")
    if min(args.iters, args.rounds, args.pipelined) < 1 or args.warmup < 0:
        ap.error("--iters, --rounds and --pipelined must be at least 1, --warmup at least 0")
    if not torch.cuda.is_available():
        raise SystemExit("amp_step_bench times CUDA steps: no CUDA device here")
    device = torch.device("cuda")
    timer = Timer(device)
    lines = [
        "# The step under a GradScaler",
        "",
        f"Command: `python {' '.join(sys.argv)}`",
        f"Machine: {machine(device)}; torch {torch.__version__}",
        "",
        "| profile | round | row | per step, idle GPU (ms) | back to back (ms/step) | "
        "/ adamw back to back |",
        "|---|---|---|---|---|---|",
    ]
    for profile in args.profiles.split(","):
        shapes = PROFILES[profile]
        for rnd in range(1, args.rounds + 1):
            rows = args.rows.split(",")
            if rnd % 2 == 0:
                rows.reverse()  # alternate the order: drift shows as a round difference
            base = None
            results = []
            for row in rows:
                params = make_params(shapes, torch.float32, device, seed=0)
                opt = _build(row, params)
                scaler = torch.amp.GradScaler("cuda", init_scale=1.0, growth_interval=10**9)

                one = torch.ones((), device=device)

                def it(opt=opt, scaler=scaler, one=one) -> None:
                    scaler.scale(one)  # what scaling the loss does: the scaler's iteration starts
                    scaler.step(opt)
                    scaler.update()

                for _ in range(args.warmup):
                    it()
                times = [timer(it) for _ in range(args.iters)]
                back = timer.pipelined(it, args.pipelined)
                if row == "adamw":
                    base = back
                # the median: times[len // 2] took the upper of the middle two of an even count
                results.append((row, statistics.median(times), back))
                del opt, params, scaler
                free_memory(device)
            for row, ms, back in results:
                ratio = f"{back / base:.3f}" if base else "-"
                lines.append(f"| {profile} | {rnd} | {row} | {ms:.3f} | {back:.3f} | {ratio} |")
                print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "amp_step_bench.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
