"""Sharded (FSDP2) parameters: 2 ranks over gloo on the CPU step their local shards and end with
the weights one process gets from the averaged gradients.

FSDP2 averages each gradient across the ranks (``g0 / 2 + g1 / 2``, exact halving and one
rounding, as :func:`memopt_core.testing.set_mean_gradients` computes it in one process), and each
rank draws the stochastic-rounding words of its elements' positions in the whole tensor
(``GroupStep.index_bases``). So every format is bit-exact on shards cut on 32-element block
boundaries, and the unblocked formats (fp32, bf16 moments, any master) on any cut; a blocked
(q8) moment block cut by the shard boundary is quantized per rank, within the format's bound.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fsdp2_models import CONFIGS, SHAPES, loss_of, make_model, make_optimizer

from memopt_core import MemOptimizer
from memopt_core.device_fixture import DIST_DEVICES
from memopt_core.errors import ConfigError
from memopt_core.sharding import block_aligned, index_base
from memopt_core.testing import Fsdp2Job, fsdp2_worker, set_mean_gradients, spawn_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)
STEPS = 5


JOBS = [(name, shape, True) for name in CONFIGS for shape in SHAPES]
JOBS.append(("adamw-ecc24-q8", "aligned", False))


def _job_name(name: str, shape: str, reshard: bool) -> str:
    return f"{name}-{shape}" + ("" if reshard else "-keep")


@pytest.fixture(scope="module", params=DIST_DEVICES)
def fsdp2_results(request, tmp_path_factory) -> tuple[str, Path]:
    """Every job of this module trained once by two ranks (one spawn: ranks start slowly), on
    the CPU over gloo or on 2 GPUs over NCCL: ``(device, output folder)``."""
    device = request.param
    out = tmp_path_factory.mktemp(f"fsdp2-{device}")
    jobs = [
        Fsdp2Job(
            _job_name(name, shape, reshard),
            functools.partial(make_model, shape, CONFIGS[name][0]),
            functools.partial(make_optimizer, name),
            functools.partial(loss_of, shape, CONFIGS[name][0]),
            STEPS,
            reshard,
        )
        for name, shape, reshard in JOBS
    ]
    args = (2, str(out / "init"), str(out), jobs, device)
    spawn_ranks(fsdp2_worker, args, 2, [out / f"{j.name}-rank{r}.pt" for j in jobs for r in (0, 1)])
    return device, out


def _results(results: tuple[str, Path], name: str, shape: str, reshard: bool = True) -> list[dict]:
    _, out = results
    job = _job_name(name, shape, reshard)
    return [torch.load(out / f"{job}-rank{r}.pt", weights_only=True) for r in (0, 1)]


def _reference(name: str, shape: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    dtype = CONFIGS[name][0]
    model = make_model(shape, dtype).to(device)
    opt = make_optimizer(name, model.parameters())
    for t in range(STEPS):
        set_mean_gradients(
            model, [functools.partial(loss_of, shape, dtype, model, t, r) for r in (0, 1)]
        )
        opt.step()
        opt.zero_grad()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _exact(name: str, shape: str) -> bool:
    return shape != "uneven" or CONFIGS[name][1]["moments"] not in ("q8", "fp8")


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fsdp2_two_ranks_equal_one_process(name, shape, fsdp2_results):
    want = _reference(name, shape, fsdp2_results[0])
    initial = make_model(shape, CONFIGS[name][0]).state_dict()
    assert not any(torch.equal(v, initial[k]) for k, v in want.items())  # the steps moved them
    for got in _results(fsdp2_results, name, shape):
        for k, v in want.items():
            if _exact(name, shape):
                assert torch.equal(_bits(got[k]), _bits(v)), k
            else:
                # q8 blocks cut by the shard boundary: quantized per rank; the weights stay
                # within a few bf16 ulps of one process (lr 1e-2, 5 steps)
                torch.testing.assert_close(got[k].float(), v.float(), rtol=0.05, atol=2e-3)


def test_fsdp2_without_resharding_after_forward(fsdp2_results):
    name, shape = "adamw-ecc24-q8", "aligned"
    want = _reference(name, shape, fsdp2_results[0])
    for got in _results(fsdp2_results, name, shape, reshard=False):
        for k, v in want.items():
            assert torch.equal(_bits(got[k]), _bits(v)), k


# --------------------------------------------------------------------- one-process DTensors
# (the `mesh` fixture: conftest.py)


def test_refused_placements_say_what_is_supported(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(1)]))
    with pytest.raises(ConfigError, match=r"placements \(Shard\(dim=1\),\).*sharded on dim 0"):
        MemOptimizer([w])


def test_a_plain_gradient_on_a_sharded_parameter_is_refused(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
    opt = MemOptimizer([w], lr=0.1)
    w.grad = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    opt.step()
    with pytest.raises(ConfigError, match="sharded like the parameter"):
        opt._check_grad(w, torch.ones(8, 4), opt._plans[0].entries[0].plan, 0)


def test_one_rank_mesh_equals_plain_tensors(mesh):
    """A DTensor on a one-rank mesh is the whole tensor: the same bits and state as plain."""
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    plain = [
        torch.randn(40, 24, generator=gen).bfloat16(),
        torch.randn(40, generator=gen).bfloat16(),
    ]
    grads = [[torch.randn(p.shape, generator=gen).bfloat16() for p in plain] for _ in range(4)]
    a = [torch.nn.Parameter(p.clone()) for p in plain]
    b = [torch.nn.Parameter(distribute_tensor(p.clone(), mesh, [Shard(0)])) for p in plain]
    assert all(index_base(p) == 0 and block_aligned(p) for p in b)
    oa = MemOptimizer(a, lr=1e-2, master="ecc24", moments="q8")
    ob = MemOptimizer(b, lr=1e-2, master="ecc24", moments="q8")
    for gs in grads:
        for p, q, g in zip(a, b, gs, strict=True):
            p.grad = g.clone()
            q.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        oa.step()
        ob.step()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(_bits(q.to_local()), _bits(p.detach()))
        for k, v in oa.state[p].items():
            assert torch.equal(ob.state[q][k], v), k


@pytest.mark.parametrize(
    "shape", [(40, 64), (40, 24), (70,)], ids=["rows-of-blocks", "odd-rows", "1-D"]
)
def test_state_dict_of_a_sharded_parameter_is_global_and_loads_back(mesh, shape):
    """DTensor states shaped as :mod:`memopt_core.sharding` says, and a load of them gives the
    same state (the same bits on the next step)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(
        distribute_tensor(torch.randn(shape, generator=gen).bfloat16(), mesh, [Shard(0)])
    )
    opt = MemOptimizer([w], lr=1e-2, master="ecc24", moments="q8")
    for _ in range(2):
        w.grad = distribute_tensor(torch.randn(shape, generator=gen).bfloat16(), mesh, [Shard(0)])
        opt.step()
    sd = opt.state_dict()
    st = sd["state"][0]
    plain = ("step", "param_shape", "decay_norm_step")
    assert all(isinstance(v, DTensor) for k, v in st.items() if k not in plain)
    assert not isinstance(st["decay_norm_step"], DTensor)
    assert st["decay_norm_step"].item() == 2
    assert st["param_shape"].tolist() == list(shape)  # the global shape, a plain tensor
    n = w.numel()
    r = n // shape[0]
    if len(shape) == 2 and r % 32 == 0:
        assert st["exp_avg"].shape == (shape[0], r)
        assert st["exp_avg_scale"].shape == (
            shape[0],
            r // 32,
        )
    else:
        assert st["exp_avg"].shape == shape
        assert st["exp_avg_scale"].shape == shape
    assert st["master_code"].shape == shape
    snapshot = {
        k: v.to_local().clone() if isinstance(v, DTensor) else v.clone()
        for k, v in st.items()
        if k != "param_shape"
    }
    fresh_w = torch.nn.Parameter(
        distribute_tensor(w.full_tensor().detach().clone(), mesh, [Shard(0)])
    )
    fresh = MemOptimizer([fresh_w], lr=1e-2, master="ecc24", moments="q8")
    fresh.init_state()
    loaded = fresh.state_dict()
    for k, v in loaded["state"][0].items():
        if k not in plain:
            v.to_local().copy_(snapshot[k])  # what dcp.load does in place
    loaded["state"][0]["decay_norm_step"].copy_(snapshot["decay_norm_step"])
    loaded["state"][0]["step"] = snapshot["step"]
    fresh.load_state_dict(loaded)
    for k, v in opt.state[w].items():
        assert torch.equal(fresh.state[fresh_w][k], v), k
    g = torch.randn(shape, generator=gen).bfloat16()
    for p, o in ((w, opt), (fresh_w, fresh)):
        p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        o.step()
    assert torch.equal(_bits(fresh_w.to_local()), _bits(w.to_local()))


def test_blocks_that_mix_saved_scales_are_requantized(mesh):
    """A 1-D parameter's q8 state with per-element scales that differ inside a block (saved by
    ranks cut mid-block) loads as the round-to-nearest encoding of the saved values."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from memopt_core.formats import moment_codec
    from memopt_core.sharding import local_state

    codec = moment_codec("q8_signed")
    values = torch.randn(64, generator=torch.Generator().manual_seed(2))
    values[:20] *= 1e-3  # rank 0 of a 2-way cut at 20 saw small values, rank 1 large ones
    a, b = (
        codec.encode(values[:32].clone().index_fill_(0, torch.arange(20, 32), 0)),
        codec.encode(torch.cat([values[20:], torch.zeros(20)])),
    )
    codes = torch.cat([a[""][:20], b[""][:44]])
    scales = torch.cat([a["scale"][:1].expand(20), b["scale"].repeat_interleave(32)[:44]])
    saved = torch.cat([codec.decode(a)[:20], codec.decode(b)[:44]])
    w = torch.nn.Parameter(distribute_tensor(torch.zeros(64), mesh, [Shard(0)]))
    entry = {
        "exp_avg": DTensor.from_local(codes, mesh, [Shard(0)], run_check=False),
        "exp_avg_scale": DTensor.from_local(scales, mesh, [Shard(0)], run_check=False),
    }
    out = local_state(w, entry, {"exp_avg": codec}, "test")
    want = codec.encode(saved)
    assert torch.equal(out["exp_avg"].view(torch.uint8), want[""].view(torch.uint8))
    assert torch.equal(out["exp_avg_scale"], want["scale"])
    assert not torch.equal(scales[:32], scales[:1].expand(32))  # the block did mix scales


def test_hsdp_placements_on_a_two_dimensional_mesh(tmp_path):
    """(Replicate, Shard(0)) on a 1 x 1 mesh, as HSDP places parameters: accepted, stepped as
    the plain tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1))
        gen = torch.Generator().manual_seed(3)
        x, g = torch.randn(40, 24, generator=gen), torch.randn(40, 24, generator=gen)
        place = [Replicate(), Shard(0)]
        a = torch.nn.Parameter(x.clone())
        b = torch.nn.Parameter(distribute_tensor(x.clone(), mesh, place))
        oa = MemOptimizer([a], lr=1e-2, moments="bf16")
        ob = MemOptimizer([b], lr=1e-2, moments="bf16")
        for _ in range(3):
            a.grad = g.clone()
            b.grad = distribute_tensor(g.clone(), mesh, place)
            oa.step()
            ob.step()
        assert torch.equal(_bits(b.to_local()), _bits(a.detach()))
    finally:
        dist.destroy_process_group()
