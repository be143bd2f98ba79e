"""Worker of test_ddp_gloo.py: AdamBridge under DDP (gloo on the CPU, or NCCL on 2 GPUs), one
per process, plain step()."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from offload_testutil import batch, loss_of, make_model

from memopt_core.testing import init_rank, leave_group
from memopt_kernels_cpu import set_num_threads
from memopt_offload import AdamBridge


def shard(step: int, rank: int, device: str = "cpu") -> torch.Tensor:
    return batch(step, device, n=8)[4 * rank : 4 * rank + 4]


def train(
    rank: int, world: int, init_file: str, precision: str, steps: int, out: str, device: str = "cpu"
) -> None:
    """One rank: gloo on the CPU, or NCCL with GPU ``rank``. Each rank has its own AdamBridge
    (its own pinned host buffers) and its share of the host's cores for the CPU kernels."""
    init_rank(rank, world, init_file, device)
    try:
        set_num_threads(max(1, (os.cpu_count() or 2) // world))
        model = make_model(device)
        cuda = device == "cuda"
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
        opt = AdamBridge(model.parameters(), lr=2e-3, precision=precision)
        for t in range(steps):
            loss_of(ddp, shard(t, rank, device)).backward()
            opt.step()
            opt.zero_grad()
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, f"{out}/rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other rank may never reach it
        raise
    leave_group()


def hooks_on_inner_module(rank: int, world: int, init_file: str, out: str) -> None:
    """One rank: attach_hooks on DDP's inner module; writes what it raised to
    ``{out}/hooks{rank}.txt``."""
    init_rank(rank, world, init_file, "cpu")
    try:
        model = make_model("cpu")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = AdamBridge(ddp.parameters(), precision="fp32")
        try:
            opt.attach_hooks(ddp.module)
            said = "accepted"
        except TypeError as e:
            said = f"TypeError {e}"
    finally:
        leave_group()
    with open(f"{out}/hooks{rank}.txt", "w") as f:
        f.write(said)
