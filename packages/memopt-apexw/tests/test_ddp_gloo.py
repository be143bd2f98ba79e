"""ApexW under DistributedDataParallel: 2 processes over gloo on the CPU, with DDP's gradients as
separate tensors or as views of its buckets, zeroed in place or set to None: the cached step must
follow every way DDP hands gradients over.

DDP divides each gradient by the world size and sums it across ranks (exact halving, one rounding
for the sum of two), so every rank's weights must equal, bit for bit, a single process that steps
on ``g_rank0 / 2 + g_rank1 / 2``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_worker import CONFIGS, loss_of, make_model, make_optimizer, shard, train

from memopt_core.device_fixture import DIST_DEVICES
from memopt_core.testing import set_mean_gradients, spawn_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)
STEPS = 6


def reference(name: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    dtype = CONFIGS[name][0]
    model = make_model(dtype).to(device)
    opt = make_optimizer(name, model.parameters())
    for t in range(STEPS):
        set_mean_gradients(
            model, [lambda r=r, t=t: loss_of(model, shard(t, r, dtype).to(device)) for r in (0, 1)]
        )
        opt.step()
        opt.zero_grad()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("bucket_view", [False, True], ids=["grad_tensors", "bucket_views"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ddp_two_ranks_equal_one_process(name, bucket_view, set_to_none, tmp_path):
    spawn_ranks(
        train,
        (2, str(tmp_path / "init"), name, STEPS, str(tmp_path), bucket_view, set_to_none),
        2,
        [tmp_path / f"rank{r}.pt" for r in (0, 1)],
    )
    want = reference(name)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for k, v in want.items():
            assert torch.equal(_bits(got[k]), _bits(v)), (rank, k)
    initial = make_model(CONFIGS[name][0]).state_dict()
    assert not all(torch.equal(v, initial[k]) for k, v in want.items())  # the steps moved them


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("device", [p for p in DIST_DEVICES if p != "cpu"])
def test_ddp_on_two_gpus_equals_one_gpu(name, device, tmp_path):
    """NCCL on 2 GPUs (ApexW's fused Triton step, cached after the first step) against one
    GPU stepping on the averaged gradients."""
    spawn_ranks(
        train,
        (2, str(tmp_path / "init"), name, STEPS, str(tmp_path), False, True, device),
        2,
        [tmp_path / f"rank{r}.pt" for r in (0, 1)],
    )
    want = reference(name, device)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for k, v in want.items():
            assert torch.equal(_bits(got[k]), _bits(v)), (rank, k)
