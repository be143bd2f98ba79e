"""Rank processes of test_dcp_sharded.py (importable by name, so spawned ranks find them).

A run trains an FSDP2-sharded model with one memopt optimizer for some steps, optionally after
loading a torch.distributed.checkpoint, optionally saving one at the end, and writes its full
weights. Batches are split evenly over the ranks, so a 1-rank run sees the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from memopt_core.testing import init_rank, leave_group

#: name -> (parameter dtype, optimizer builder name, kwargs)
CONFIGS = {
    "memopt-ecc24-q8": (torch.bfloat16, "memopt", dict(master="ecc24", moments="q8")),
    "memopt-fp32-bf16": (torch.float32, "memopt", dict(master="fp32", moments="bf16")),
    "flash-adamw": (torch.bfloat16, "flash", {}),
    "apexw-q8": (torch.bfloat16, "apexw", {}),
}
#: "aligned": every shard cut falls between q8 blocks on 1 and 2 ranks; "uneven": a bias is cut
#: mid-block on 2 ranks
SHAPES = {"aligned": (32, 64, 128), "uneven": (24, 40, 7)}
BATCH = 8


def make_model(shape: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    a, b, c = SHAPES[shape]
    return torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.GELU(), torch.nn.Linear(b, c)).to(
        dtype
    )


def make_optimizer(name: str, params):
    _, kind, kw = CONFIGS[name]
    if kind == "memopt":
        from memopt_core import MemOptimizer

        return MemOptimizer(params, rule="adamw", lr=1e-2, weight_decay=0.01, seed=3, **kw)
    if kind == "flash":
        from memopt_ecc import FlashAdamW

        return FlashAdamW(params, lr=1e-2, weight_decay=0.01, **kw)
    from memopt_apexw import ApexW

    return ApexW(params, lr=1e-2, weight_decay=0.01, state="q8", mode_cache=None, **kw)


def batch(shape: str, dtype: torch.dtype, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, SHAPES[shape][0], generator=g).to(dtype)


def loss_of(model, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def run(
    rank: int,
    world: int,
    init_file: str,
    out: str,
    cases: list[tuple[str, str]],
    start: int,
    steps: int,
    load: bool,
    save: bool,
    device: str = "cpu",
) -> None:
    """Train every ``(name, shape)`` case on ``world`` ranks from step ``start`` for ``steps``
    steps, first loading ``{out}/../ckpt-{name}-{shape}`` when ``load``, saving there at the
    end when ``save``; write the full weights to ``{out}/{name}-{shape}-rank{rank}.pt``. One
    process group for all cases: starting ranks is the slow part. ``device="cuda"``: NCCL, one
    GPU per rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    init_rank(rank, world, init_file, device)
    try:
        for name, shape in cases:
            ckpt = f"{out}/../ckpt-{name}-{shape}"
            dtype = CONFIGS[name][0]
            model = make_model(shape, dtype).to(device)
            for m in model:
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m)
            fully_shard(model)
            opt = make_optimizer(name, model.parameters())
            if load:
                opt.init_state()  # tensors for dcp.load to fill
                sd = {"model": model.state_dict(), "optim": opt.state_dict()}
                dcp.load(sd, checkpoint_id=ckpt)
                model.load_state_dict(sd["model"])
                opt.load_state_dict(sd["optim"])
            per = BATCH // world
            for t in range(start, start + steps):
                x = batch(shape, dtype, t)[per * rank : per * (rank + 1)].to(device)
                loss_of(model, x).backward()
                opt.step()
                opt.zero_grad()
            if save:
                dcp.save(
                    {"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt
                )
            full = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
            torch.save(full, f"{out}/{name}-{shape}-rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()
