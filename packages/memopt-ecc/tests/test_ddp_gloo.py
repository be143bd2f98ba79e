"""The Flash* family under DistributedDataParallel: 2 processes over gloo on the CPU, and over
NCCL on 2 GPUs where the host has them.

DDP divides each gradient by the world size and sums it across ranks (both exact or rounded the
same way in a one-process replay: halving is exact, and the sum of two bf16 values rounds once),
so every rank's weights and optimizer state (master codes, moment codes and scales) must equal,
bit for bit, a single process that steps on ``g_rank0 / 2 + g_rank1 / 2``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_worker import OPTIMIZERS, loss_of, make_model, make_optimizer, saved, shard, train
from ecc_testutil import same_bits

from memopt_core.device_fixture import DIST_DEVICES
from memopt_core.testing import set_mean_gradients, spawn_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)
STEPS = 6


def reference(name: str, device: str) -> dict:
    """:func:`ddp_worker.saved` of one process stepping on the averaged gradients."""
    model = make_model().to(device)
    opt = make_optimizer(name, model.parameters())
    for t in range(STEPS):
        set_mean_gradients(
            model, [lambda r=r, t=t: loss_of(model, shard(t, r).to(device)) for r in (0, 1)]
        )
        opt.step()
        opt.zero_grad()
    return saved(model, opt)


@pytest.fixture(scope="module", params=DIST_DEVICES)
def trained(request, tmp_path_factory):
    """Every optimizer of OPTIMIZERS trained by 2 ranks in one spawn: gloo on the CPU, or NCCL
    on 2 GPUs."""
    device = request.param
    out = tmp_path_factory.mktemp(f"ddp-{device}")
    names = list(OPTIMIZERS)
    spawn_ranks(
        train,
        (2, str(out / "init"), names, STEPS, str(out), device),
        2,
        [out / f"{name}-rank{r}.pt" for name in names for r in (0, 1)],
    )
    return device, out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_ddp_two_ranks_equal_one_process(name, trained):
    """Each rank's weights and every tensor of its optimizer's state dict (compressed: the master
    codes and the moments' codes and scales) equal one process's bit for bit."""
    device, out = trained
    want = reference(name, device)
    for rank in (0, 1):
        got = torch.load(out / f"{name}-rank{rank}.pt", weights_only=True)
        for k, v in want["model"].items():
            assert torch.equal(got["model"][k].view(torch.int16), v.view(torch.int16)), (rank, k)
        assert sorted(got["state"]) == sorted(want["state"]), rank
        for i, entry in want["state"].items():
            assert sorted(got["state"][i]) == sorted(entry), (rank, i)
            for k, v in entry.items():
                assert same_bits(got["state"][i][k], v), (rank, i, k)
    assert not all(  # the steps moved the weights
        torch.equal(v, w)
        for v, w in zip(want["model"].values(), make_model().state_dict().values(), strict=True)
    )
    for entry in want["state"].values():  # the dicts hold the codes and the moments compared
        assert "master_code" in entry
        assert any(k.startswith(("exp_avg", "momentum_buffer")) for k in entry), sorted(entry)


def test_release_refuses_unsharded_parameters_of_several_processes(tmp_path):
    """DDP averages gradients after the per-parameter hooks ran: release on its .module, on a
    model wrapped later, or under replicate() updated each replica with its local gradient
    (the replicas drifted apart silently). Refused unless allow_unsynchronized=True."""
    from ddp_worker import release_refusals

    outs = [tmp_path / f"release{r}.txt" for r in (0, 1)]
    spawn_ranks(release_refusals, (2, str(tmp_path / "init"), str(tmp_path)), 2, outs)
    for out in outs:
        lines = out.read_text().splitlines()
        for how in ("inner", "before", "replicate"):
            said = f"{how}: TypeError enable_gradient_release() with 2 processes"
            assert any(line.startswith(said) for line in lines), lines
        assert "allowed: accepted" in lines
