"""The worker process of test_ddp_gloo.py (importable by name, so multiprocessing's spawn finds it).

Each rank trains the same bf16 model under DistributedDataParallel over gloo on its own half of
every batch and saves its final weights and optimizer state; the test compares them with a
one-process reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import memopt_ecc
from memopt_core.testing import init_rank, leave_group

OPTIMIZERS = {
    "FlashAdamW": dict(lr=1e-2, weight_decay=0.01),
    "FlashAdam": dict(lr=1e-2, weight_decay=0.01),
    "FlashLion": dict(lr=1e-3, weight_decay=0.01),
    "FlashSGDW": dict(lr=1e-2, momentum=0.9, weight_decay=0.01),
    "FlashSGD": dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 7)).to(
        torch.bfloat16
    )


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    return getattr(memopt_ecc, name)(params, **OPTIMIZERS[name])


def shard(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s half of step ``step``'s batch."""
    g = torch.Generator().manual_seed(100 + step)
    full = torch.randn(8, 24, generator=g).to(torch.bfloat16)
    return full[4 * rank : 4 * rank + 4]


def loss_of(model, x) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def saved(model, opt) -> dict:
    """What a rank saves: the model's weights and the optimizer's state dict's ``state`` (master
    codes, moment codes and scales, steps), on the CPU."""
    state = {
        i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        for i, entry in opt.state_dict()["state"].items()
    }
    return {"model": {k: v.cpu() for k, v in model.state_dict().items()}, "state": state}


def train(
    rank: int,
    world: int,
    init_file: str,
    names: list[str],
    steps: int,
    out: str,
    device: str = "cpu",
) -> None:
    """One rank: gloo on the CPU, or NCCL with GPU ``rank`` (``device="cuda"``). Trains a model
    with each optimizer of ``names`` in turn (one process group: the ranks start once) and saves
    :func:`saved` to ``{out}/{name}-rank{rank}.pt``."""
    cuda = device == "cuda"
    init_rank(rank, world, init_file, device)
    try:
        for name in names:
            model = make_model().to(device)
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[rank] if cuda else None
            )
            opt = make_optimizer(name, ddp.parameters())
            for t in range(steps):
                loss_of(ddp, shard(t, rank).to(device)).backward()
                opt.step()
                opt.zero_grad()
            torch.save(saved(model, opt), f"{out}/{name}-rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other rank may never reach it
        raise
    leave_group()


def release_refusals(rank: int, world: int, init_file: str, out: str) -> None:
    """One rank: enable_gradient_release on DDP's inner module, before wrapping in DDP, and
    under composable replicate(); writes what each raised to ``{out}/release{rank}.txt``."""
    import torch.distributed as dist
    from torch.distributed._composable.replicate import replicate

    from memopt_ecc import FlashAdamW, enable_gradient_release

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    said = []
    try:
        for how in ("inner", "before", "replicate", "allowed"):
            model = make_model()
            opt = FlashAdamW(model.parameters(), lr=1e-2)
            target = model
            if how == "inner":
                target = torch.nn.parallel.DistributedDataParallel(model).module
            elif how == "replicate":
                replicate(model)
            try:
                handle = enable_gradient_release(target, opt, allow_unsynchronized=how == "allowed")
                handle.remove()
                said.append(f"{how}: accepted")
            except TypeError as e:
                said.append(f"{how}: TypeError {str(e)[:60]}")
    finally:
        dist.destroy_process_group()
    with open(f"{out}/release{rank}.txt", "w") as f:
        f.write("\n".join(said))
