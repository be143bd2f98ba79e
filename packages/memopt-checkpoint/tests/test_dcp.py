"""torch.distributed.checkpoint (DCP) with memopt state dicts of unsharded models.

memopt optimizers' ``state_dict()`` holds plain tensors (views of the state arenas; AdamBridge's
host masters), so DCP saves them as they are and ``dcp.load`` writes the saved values straight
into a fresh optimizer's arenas (host memory for AdamBridge: no trip through a GPU). Resume is
bit-identical. FSDP2-sharded parameters and resharding are in test_dcp_sharded.py. DCP pickles
its save plans through numpy, so these tests need it.
"""

from __future__ import annotations

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
pytest.importorskip("numpy", reason="torch.distributed.checkpoint pickles its plans with numpy")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)
import torch.distributed.checkpoint as dcp  # noqa: E402

from memopt_core import MemOptimizer  # noqa: E402


def _memopt(model):
    return MemOptimizer(
        model.parameters(), rule="adamw", lr=1e-2, master="ecc24", moments="q8", seed=5
    )


def _flash(model):
    ecc = pytest.importorskip("memopt_ecc")
    return ecc.FlashLion(model.parameters(), lr=1e-3)


def _bridge(model):
    offload = pytest.importorskip("memopt_offload")
    return offload.AdamBridge(model.parameters(), lr=1e-2, precision="bf16")


def _apexw(model):
    apexw = pytest.importorskip("memopt_apexw")
    return apexw.ApexW(model.parameters(), lr=1e-2, state="q8", mode_cache=None)


BUILDERS = {
    "memopt-ecc24-q8": _memopt,
    "flash-lion": _flash,
    "adambridge-bf16": _bridge,
    "apexw-ecc24-q8": _apexw,
}


def build(name, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 48), torch.nn.GELU(), torch.nn.Linear(48, 9)
    ).to(torch.bfloat16)
    return model, BUILDERS[name](model)


def train(model, opt, steps, start=0):
    for t in range(start, start + steps):
        x = torch.randn(6, 20, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("name", list(BUILDERS))
def test_dcp_resume_is_bit_identical(name, tmp_path):
    straight, sopt = build(name)
    train(straight, sopt, 7)

    first, fopt = build(name)
    train(first, fopt, 4)
    dcp.save(
        {"model": first.state_dict(), "optim": fopt.state_dict()}, checkpoint_id=tmp_path / "ck"
    )

    resumed, ropt = build(name, seed=42)
    if hasattr(ropt, "init_state"):  # AdamBridge holds its host state from construction on
        ropt.init_state()  # DCP loads into existing tensors: create the state to load into
    target = {"model": resumed.state_dict(), "optim": ropt.state_dict()}
    dcp.load(target, checkpoint_id=tmp_path / "ck")
    resumed.load_state_dict(target["model"])
    ropt.load_state_dict(target["optim"])
    train(resumed, ropt, 3, start=4)
    for (n, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)), n
