"""Worker of test_ddp_gloo.py: AdamBridge under DDP on the CPU, one per process, plain step()."""

from __future__ import annotations

import torch
import torch.distributed as dist
from offload_testutil import batch, loss_of, make_model

from memopt_offload import AdamBridge


def shard(step: int, rank: int) -> torch.Tensor:
    return batch(step, "cpu", n=8)[4 * rank : 4 * rank + 4]


def train(rank: int, world: int, init_file: str, precision: str, steps: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = make_model("cpu")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = AdamBridge(model.parameters(), lr=2e-3, precision=precision)
        for t in range(steps):
            loss_of(ddp, shard(t, rank)).backward()
            opt.step()
            opt.zero_grad()
        torch.save(model.state_dict(), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
