"""State dicts that do not fit the optimizer's sharding, refused before anything changes.

- ``set_fp32_model_state_dict`` checks every DTensor entry (mesh, placements, local shard shape)
  and refuses a DTensor for a plain parameter before it writes anything: the copies failed
  inside torch, after the entries before the bad one were written.
- ``load_state_dict`` refuses the DTensor states of a sharded optimizer for plain parameters
  (they passed the checks by their global shape, then failed in the copies and stayed in the
  state: every later step failed), and a state of another world size names the meshes.
- ``ZeroRedundancyOptimizer``'s load copies the saved groups' keys into the live groups and
  writes ``optimizer.state`` itself: a checkpoint of another format switched the optimizer to
  it silently; its next step now refuses it.

The files of another rank and of another world size come from one spawn of 2 gloo ranks; the
rest runs in one process over a one-rank gloo group (the ``mesh`` fixture: conftest.py).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fsdp2_models import loss_of, make_model, make_optimizer

from memopt_core import MemOptimizer
from memopt_core.errors import StateDictError
from memopt_core.fp32_state import get_fp32_model_state_dict, set_fp32_model_state_dict
from memopt_core.testing import init_rank, leave_group, spawn_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

#: bf16 weights with ECC-24 codes and bf16 moments; "uneven": Linear(24, 40), Linear(40, 7), so
#: over 2 ranks the first layer's shards are equal (20 rows each) and the second's are not (4, 3)
CONFIG, SHAPE, DTYPE = "adamw-ecc24-bf16", "uneven", torch.bfloat16


def _model(mesh=None, shard: bool = True) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = make_model(SHAPE, DTYPE)
    if shard:
        for m in (model[0], model[2]):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _trained(mesh=None, shard: bool = True, rank: int = 0, moments: str | None = None):
    model = _model(mesh, shard)
    if moments is None:
        opt = make_optimizer(CONFIG, model.parameters())
    else:
        opt = MemOptimizer(model.parameters(), lr=1e-2, master="ecc24", moments=moments)
    loss_of(SHAPE, DTYPE, model, 0, rank).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _local(t: torch.Tensor) -> torch.Tensor:
    from memopt_core.sharding import local_shard

    return local_shard(t.detach()).clone()


def _snapshot(model: torch.nn.Module, opt: MemOptimizer) -> list:
    out: list = [_local(p) for p in model.parameters()]
    for p in model.parameters():
        out += [_local(v) for _, v in sorted(opt.state.get(p, {}).items())]
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(_bytes(x), _bytes(y)) for x, y in zip(a, b, strict=True)
    )


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    """Train one step on 2 ranks, save the fp32 weights and the optimizer's state_dict() per
    rank (torch.save), then load the other rank's fp32 file, then (after one more step) the
    rank's own. ``{out}/rank{rank}.json``: what the first load raised, whether the weights and
    states stayed as they were, and whether the own file gave back its weights."""
    init_rank(rank, world, init_file)
    try:
        model, opt = _trained(rank=rank)
        torch.save(get_fp32_model_state_dict(model, opt), Path(out, f"fp32-rank{rank}.pt"))
        torch.save(opt.state_dict(), Path(out, f"optim-rank{rank}.pt"))
        dist.barrier()
        other = torch.load(Path(out, f"fp32-rank{1 - rank}.pt"), weights_only=False)
        before = _snapshot(model, opt)
        try:
            set_fp32_model_state_dict(model, opt, other)
            error = "loaded"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        res = {"error": error, "unchanged": _same(before, _snapshot(model, opt))}
        loss_of(SHAPE, DTYPE, model, 1, rank).backward()
        opt.step()
        own = torch.load(Path(out, f"fp32-rank{rank}.pt"), weights_only=False)
        set_fp32_model_state_dict(model, opt, own)
        back = get_fp32_model_state_dict(model, opt)
        res["own file"] = all(torch.equal(back[k].to_local(), v.to_local()) for k, v in own.items())
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()


@pytest.fixture(scope="module")
def two_rank_files(tmp_path_factory) -> Path:
    """The folder of the 2-rank run: per rank its files and what loading the other's raised."""
    out = tmp_path_factory.mktemp("sd-refusals")
    files = [out / f"rank{r}.json" for r in (0, 1)]
    spawn_ranks(_worker, (2, str(out / "init"), str(out)), 2, files)
    return out


def test_an_fp32_dict_of_another_rank_is_refused_before_anything_changes(two_rank_files):
    """Rank 0's file on rank 1 and the reverse: the first layer's shards have the same shape
    (they were written before the second layer's copy failed), the second layer's do not."""
    for rank, (mine, theirs) in enumerate((((4, 40), (3, 40)), ((3, 40), (4, 40)))):
        res = json.loads((two_rank_files / f"rank{rank}.json").read_text())
        assert res["error"].startswith(
            f"StateDictError: entry '2.weight' holds a local shard of shape {theirs}; this "
            f"process's shard of the parameter has shape {mine}"
        ), (rank, res["error"])
        assert "torch.distributed.checkpoint" in res["error"]
        assert res["unchanged"], rank
        assert res["own file"], rank  # torch.save per rank: the same sharding loads


def test_dicts_of_another_world_size_name_the_meshes(two_rank_files, mesh):
    """Rank 0's files of the 2-rank run loaded by one process: the fp32 weights and the
    optimizer state are refused naming both mesh shapes (the placements are the same), with
    nothing changed."""
    model = _model(mesh)
    opt = make_optimizer(CONFIG, model.parameters())
    before = _snapshot(model, opt)
    fp32 = torch.load(two_rank_files / "fp32-rank0.pt", weights_only=False)
    with pytest.raises(
        StateDictError,
        match=r"entry '0\.weight' was saved on a device mesh of shape \(2,\); this parameter's "
        r"mesh has shape \(1,\) .*torch\.distributed\.checkpoint",
    ):
        set_fp32_model_state_dict(model, opt, fp32)
    assert _same(before, _snapshot(model, opt))
    assert len(opt.state) == 0  # not even created
    sd = torch.load(two_rank_files / "optim-rank0.pt", weights_only=False)
    with pytest.raises(
        StateDictError,
        match=r"state '\w+' of parameter index 0 \(param group 0\) was saved on a device mesh of "
        r"shape \(2,\); this parameter's mesh has shape \(1,\) .*torch\.distributed\.checkpoint",
    ):
        opt.load_state_dict(sd)
    assert len(opt.state) == 0


def test_an_fp32_dict_of_a_sharded_model_into_a_plain_one_is_refused_unchanged(mesh):
    """The DTensor entries of a sharded model (one rank: shards of the whole shapes) into a
    plain model: refused before the plain first entry is written."""
    sharded, sopt = _trained(mesh)
    sd = get_fp32_model_state_dict(sharded, sopt)
    plain, popt = _trained(shard=False)
    sd["0.weight"] = torch.full((40, 24), 0.5)  # plain, fits: would be written first
    before = _snapshot(plain, popt)
    with pytest.raises(
        StateDictError,
        match=r"entry '0\.bias' is a DTensor .*this model's parameter is not sharded: pass the "
        r"whole tensor \(value\.full_tensor\(\).*torch\.distributed\.checkpoint",
    ):
        set_fp32_model_state_dict(plain, popt, sd)
    assert _same(before, _snapshot(plain, popt))


def test_an_fp32_dict_on_another_mesh_of_the_same_shape_is_refused(mesh):
    from torch.distributed.device_mesh import init_device_mesh

    named = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    model, opt = _trained(mesh)
    other, oopt = _trained(named)
    before = _snapshot(model, opt)
    with pytest.raises(StateDictError, match=r"entry '0\.weight' was saved on another device mesh"):
        set_fp32_model_state_dict(model, opt, get_fp32_model_state_dict(other, oopt))
    assert _same(before, _snapshot(model, opt))
    with pytest.raises(
        StateDictError,
        match=r"state '\w+' of parameter index 0 \(param group 0\) was saved on another device "
        r"mesh .*torch\.distributed\.checkpoint",
    ):
        opt.load_state_dict(oopt.state_dict())
    assert _same(before, _snapshot(model, opt))


@pytest.mark.parametrize("moments", ["bf16", "q8"])
def test_a_sharded_optimizer_state_into_a_plain_optimizer_is_refused(mesh, moments):
    """A one-rank sharded optimizer's states have the plain parameters' shapes: they passed the
    checks, then failed in the copies and stayed in the state (every later step failed)."""
    _, sopt = _trained(mesh, moments=moments)
    plain, popt = _trained(shard=False, moments=moments)
    before = _snapshot(plain, popt)
    with pytest.raises(
        StateDictError,
        match=r"state '\w+' of parameter index 0 \(param group 0\) is a DTensor: the dict was "
        r"saved by a sharded optimizer .*torch\.distributed\.checkpoint",
    ):
        popt.load_state_dict(sopt.state_dict())
    assert _same(before, _snapshot(plain, popt))
    loss_of(SHAPE, DTYPE, plain, 1, 0).backward()
    popt.step()  # still steps
    assert not _same(before, _snapshot(plain, popt))


def _zero(model: torch.nn.Module, moments: str):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=MemOptimizer, lr=1e-2, master="ecc24", moments=moments
    )


# torch.distributed.optim uses torch.jit at import
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.interface` is deprecated:DeprecationWarning")
def test_a_zero_redundancy_load_of_another_format_is_refused_at_the_step(mesh):
    """ZeroRedundancyOptimizer writes the q8 states and the saved groups' moments='q8' into an
    optimizer built with bf16 moments: the step refuses them, before it changes a weight. A
    checkpoint of the optimizer's own format loads and steps."""
    model = _model(shard=False)
    zero = _zero(model, "q8")
    loss_of(SHAPE, DTYPE, model, 0, 0).backward()
    zero.step()
    zero.consolidate_state_dict(to=0)
    saved = copy.deepcopy(zero.state_dict())

    other = _model(shard=False)
    wrong = _zero(other, "bf16")
    wrong.load_state_dict(copy.deepcopy(saved))
    weights = [_local(p) for p in other.parameters()]
    loss_of(SHAPE, DTYPE, other, 1, 0).backward()
    with pytest.raises(
        StateDictError,
        match=r"param group 0 holds states written from outside the optimizer and now says "
        r"master='ecc24', moments='q8', but it was built with master='ecc24', moments='bf16' "
        r"\(torch's ZeroRedundancyOptimizer\.load_state_dict",
    ):
        wrong.step()
    assert _same(weights, [_local(p) for p in other.parameters()])

    same = _model(shard=False)
    right = _zero(same, "q8")
    right.load_state_dict(copy.deepcopy(saved))
    loss_of(SHAPE, DTYPE, same, 1, 0).backward()
    right.step()
    assert right.optim.state[same[0].weight]["step"].item() == 2


def test_a_format_edit_before_the_first_step_is_still_taken():
    """Without states written from outside, a group's format may change before its first step
    (the step builds the states in it), and a state dict in the edited format loads."""
    p = torch.nn.Parameter(torch.randn(40).bfloat16())
    opt = MemOptimizer([p], lr=1e-2, master="ecc24", moments="fp32")
    opt.param_groups[0]["moments"] = "q8"
    p.grad = torch.ones(40, dtype=torch.bfloat16)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float8_e4m3fn
    q = torch.nn.Parameter(p.detach().clone())
    twin = MemOptimizer([q], lr=1e-2, master="ecc24", moments="fp32")
    twin.param_groups[0]["moments"] = "q8"
    twin.load_state_dict(opt.state_dict())
    for o, t in ((opt, p), (twin, q)):
        t.grad = torch.ones(40, dtype=torch.bfloat16)
        o.step()
    assert torch.equal(q.detach(), p.detach())
