"""Host time of FlashAdamW / ApexW steps with the Qwen shapes (/ 8) in G param groups on the
GPU: perf_counter around opt.step() (the host part; the GPU drained before each), then a
cProfile of 20 steps. Run from the repository root: python <this file> 25 | no-decay-1d.
(Reformatted for the linter after the runs; the logic is the one that ran.)"""

import cProfile
import pstats
import statistics
import sys
import time

sys.path.insert(0, "tools/bench")
import torch
from step_bench import make_params, param_groups, qwen25_05b_shapes, scaled

from memopt_apexw import ApexW
from memopt_ecc import FlashAdamW

G = sys.argv[1]
ROWS = [
    ("FlashAdamW", torch.bfloat16, lambda g: FlashAdamW(g, lr=1e-3, weight_decay=0.01)),
    (
        "ApexW bf16",
        torch.float32,
        lambda g: ApexW(g, lr=1e-3, weight_decay=0.01, state="bf16", mode="fused"),
    ),
]
for name, dtype, make in ROWS:
    ps = make_params(scaled(qwen25_05b_shapes(), 8), dtype, torch.device("cuda"), 0)
    opt = make(param_groups(ps, G))
    for _ in range(6):
        opt.step()
    torch.cuda.synchronize()
    host = []
    for _ in range(30):
        torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        host.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    median, least = statistics.median(host) * 1e6, min(host) * 1e6
    print(f"{name} {G} groups: host part {median:.0f} us (min {least:.0f})", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        opt.step()
        torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    del opt, ps
    torch.cuda.empty_cache()
