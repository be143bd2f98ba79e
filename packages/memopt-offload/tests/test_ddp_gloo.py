"""AdamBridge with DDP: one optimizer per process (2 gloo processes on the CPU; NCCL on 2 GPUs where
the host has them, each process with its own host buffers and half the cores), step() after
backward, equal bit for bit to one process stepping on ``g_rank0 / 2 + g_rank1 / 2``; the
pipelined hooks are refused under DDP with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_bridge_worker import shard, train
from offload_testutil import Reference, loss_of, make_model

from memopt_core.device_fixture import DIST_DEVICES
from memopt_core.testing import set_mean_gradients, spawn_ranks
from memopt_offload import AdamBridge

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)
STEPS = 5


@pytest.mark.parametrize("device", DIST_DEVICES)
@pytest.mark.parametrize("precision", ["fp32", "compact"])
def test_ddp_step_equals_one_process(precision, device, tmp_path):
    args = (2, str(tmp_path / "init"), precision, STEPS, str(tmp_path), device)
    spawn_ranks(train, args, 2, [tmp_path / f"rank{r}.pt" for r in (0, 1)])
    model = make_model(device)
    ref = Reference(model, precision, lr=2e-3)
    for t in range(STEPS):
        set_mean_gradients(
            model, [lambda r=r, t=t: loss_of(model, shard(t, r, device)) for r in (0, 1)]
        )
        ref.step()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for k, v in model.state_dict().items():
            v = v.cpu()
            assert torch.equal(got[k].view(torch.int16), v.view(torch.int16)), (rank, k)


def test_hooks_refuse_ddp(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'i'}", rank=0, world_size=1)
    try:
        model = make_model("cpu")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = AdamBridge(model.parameters())
        with pytest.raises(TypeError, match=r"AdamBridge\.attach_hooks\(\) cannot work with Dis"):
            opt.attach_hooks(ddp)
        assert not opt.hooks_attached
    finally:
        dist.destroy_process_group()


def test_hooks_refuse_the_inner_module_of_ddp(tmp_path):
    """Given DDP's .module, the hooks were accepted and the first backward raised a misleading
    'arrived twice' (DDP averages after the hooks ran): refused like gradient release."""
    from ddp_bridge_worker import hooks_on_inner_module

    outs = [tmp_path / f"hooks{r}.txt" for r in (0, 1)]
    spawn_ranks(hooks_on_inner_module, (2, str(tmp_path / "init"), str(tmp_path)), 2, outs)
    for out in outs:
        assert out.read_text().startswith(
            "TypeError AdamBridge.attach_hooks() with 2 processes: parameter"
        )
