"""ApexW under FSDP2 (``fully_shard``): 2 ranks (gloo on the CPU; NCCL on 2 GPUs where the host
has them) end with the weights one
process gets from the averaged gradients, bit for bit (every shard starts on a q8 block; each
rank draws the stochastic-rounding words of its elements' positions in the whole tensor).

Sharded parameters take the general step, not the cached one: FSDP2 hands over new gradient
buffers every step, so a cached step would never replay (and ``capturable=True`` is refused).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from fsdp2_apexw import CONFIGS, loss_of, make_model, make_optimizer

from memopt_apexw import ApexW
from memopt_core.device_fixture import DIST_DEVICES
from memopt_core.errors import ConfigError
from memopt_core.testing import Fsdp2Job, fsdp2_worker, set_mean_gradients, spawn_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)
STEPS = 6


@pytest.fixture(scope="module", params=DIST_DEVICES)
def results(request, tmp_path_factory):
    """Every config trained by 2 ranks in one spawn: gloo on the CPU, or NCCL on 2 GPUs."""
    device = request.param
    out = tmp_path_factory.mktemp(f"fsdp2-{device}")
    jobs = [
        Fsdp2Job(
            name,
            functools.partial(make_model, dtype),
            functools.partial(make_optimizer, name),
            functools.partial(loss_of, dtype),
            STEPS,
        )
        for name, (dtype, _) in CONFIGS.items()
    ]
    args = (2, str(out / "init"), str(out), jobs, device)
    spawn_ranks(fsdp2_worker, args, 2, [out / f"{j.name}-rank{r}.pt" for j in jobs for r in (0, 1)])
    return device, out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fsdp2_two_ranks_equal_one_process(name, results):
    device, out = results
    dtype = CONFIGS[name][0]
    model = make_model(dtype).to(device)
    opt = make_optimizer(name, model.parameters())
    for t in range(STEPS):
        set_mean_gradients(model, [functools.partial(loss_of, dtype, model, t, r) for r in (0, 1)])
        opt.step()
        opt.zero_grad()
    initial = dict(make_model(dtype).named_parameters())
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for rank in (0, 1):
        got = torch.load(out / f"{name}-rank{rank}.pt", weights_only=True)
        for k, v in model.named_parameters():
            v = v.detach().cpu()
            assert not torch.equal(v, initial[k])
            assert torch.equal(got[k].view(bits), v.view(bits)), (rank, k)


def test_capturable_with_sharded_parameters_is_refused(tmp_path):
    """On a one-rank mesh: the cached step is never built for DTensors, and a capture asked
    for is refused (it could never be valid)."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = make_model(torch.float32)
        fully_shard(model)
        opt = ApexW(model.parameters(), lr=1e-2, mode="torch", mode_cache=None)
        for t in range(2):
            loss_of(torch.float32, model, t, 0).backward()
            opt.step()
            opt.zero_grad()
        assert not opt._cached_steps  # the general path every step
        opt.capturable = True  # what capturable=True would ask for (CUDA only at construction)
        loss_of(torch.float32, model, 2, 0).backward()
        with pytest.raises(ConfigError, match="sharded"):
            opt.step()
    finally:
        dist.destroy_process_group()
