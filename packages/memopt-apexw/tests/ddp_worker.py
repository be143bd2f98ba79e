"""The worker process of test_ddp_gloo.py (importable by name, so multiprocessing's spawn finds it).

Each rank trains the same model under DistributedDataParallel over gloo on its own half of every
batch with ApexW and saves its final weights; the test compares them with a one-process reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from memopt_apexw import ApexW
from memopt_core.testing import init_rank, leave_group

#: name -> (model dtype, ApexW kwargs)
CONFIGS = {
    "fp32-bf16state": (torch.float32, {"state": "bf16"}),
    "bf16-ecc24-q8": (torch.bfloat16, {"state": "q8"}),
}


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 7)).to(
        dtype
    )


def make_optimizer(name: str, params) -> ApexW:
    return ApexW(params, lr=1e-2, weight_decay=0.01, mode_cache=None, **CONFIGS[name][1])


def shard(step: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s half of step ``step``'s batch."""
    g = torch.Generator().manual_seed(100 + step)
    full = torch.randn(8, 24, generator=g).to(dtype)
    return full[4 * rank : 4 * rank + 4]


def loss_of(model, x) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def train(
    rank: int,
    world: int,
    init_file: str,
    name: str,
    steps: int,
    out: str,
    bucket_view: bool,
    set_to_none: bool,
    device: str = "cpu",
) -> None:
    """One rank: gloo on the CPU, or NCCL with GPU ``rank`` (``device="cuda"``)."""
    cuda = device == "cuda"
    init_rank(rank, world, init_file, device)
    try:
        dtype = CONFIGS[name][0]
        model = make_model(dtype).to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if cuda else None, gradient_as_bucket_view=bucket_view
        )
        opt = make_optimizer(name, ddp.parameters())
        for t in range(steps):
            loss_of(ddp, shard(t, rank, dtype).to(device)).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, f"{out}/rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other rank may never reach it
        raise
    leave_group()
