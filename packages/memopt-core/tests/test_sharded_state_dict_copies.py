"""``torch.save`` and ``copy.deepcopy`` of the state dict of an optimizer over sharded (FSDP2)
parameters, and a load of either back.

A sharded parameter's states are DTensors (:func:`memopt_core.sharding.global_state`) over the
optimizer's state arenas. Made over views of an arena (a storage offset > 0), torch 2.13 could
neither save nor deep-copy them ("invalid python storage"); they are now made over aliases of
their own bytes, still without a copy. Saved then loaded, or deep-copied then loaded, on both
ranks, the state continues bit for bit as the optimizer it came from.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fsdp2_models import CONFIGS, make_optimizer

from memopt_core import MemOptimizer
from memopt_core.device_fixture import DIST_DEVICES
from memopt_core.testing import init_rank, spawn_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

#: case -> fsdp2_models config (MemOptimizer) or memopt-ecc's optimizer name
CASES = {
    "MemOptimizer-q8": "adamw-ecc24-q8",
    "MemOptimizer-bf16": "adamw-bf16-sr",
    "FlashAdamW-compressed": "FlashAdamW",
}
DETOURS = ("torch.save", "deepcopy")
SAVED_AT, STEPS = 3, 6


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).view(torch.uint8)


def _make_model(dtype: torch.dtype) -> torch.nn.Module:
    """Rows of whole q8 blocks (48x32), odd rows (7x48: 48 is no multiple of 32; 4 rows and 3
    over 2 ranks) and 1-D biases: every layout of :func:`memopt_core.sharding.global_state`,
    most of them views at an offset in their arena."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 7))
    return model.to(dtype)


def _make_optimizer(case: str, params) -> torch.optim.Optimizer:
    if CASES[case] in CONFIGS:
        return make_optimizer(CASES[case], params)
    import memopt_ecc

    return memopt_ecc.FlashAdamW(params, lr=1e-2, weight_decay=0.01)


def _dtype(case: str) -> torch.dtype:
    return CONFIGS[CASES[case]][0] if CASES[case] in CONFIGS else torch.bfloat16


def _sharded(case: str, device: str) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _make_model(_dtype(case)).to(device)
    for m in list(model.modules())[1:]:
        if any(True for _ in m.parameters(recurse=False)):
            fully_shard(m)
    return fully_shard(model)


def _train(model, opt, steps: range, rank: int) -> None:
    dev = next(model.parameters()).device
    for t in steps:
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 + t))
        x = x[4 * rank : 4 * rank + 4].to(dev, next(model.parameters()).dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _local_bits(model, opt) -> list:
    """This rank's shards of the weights and its optimizer states: tensors as bytes."""
    out: list = [_bits(p.to_local()) for p in model.parameters()]
    for p in model.parameters():
        for k, v in sorted(opt.state[p].items()):
            out += [k, _bits(v) if isinstance(v, torch.Tensor) else repr(v)]
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


def _worker(rank: int, world: int, init_file: str, out: str, device: str) -> None:
    """Per case: train SAVED_AT steps; take state_dict() to a file (torch.save) and a deepcopy;
    train on to STEPS (the saved state's arenas move on); then, per detour, a fresh sharded model
    with the weights of step SAVED_AT and a fresh optimizer loading the file (torch.load) or
    the copy (or, the control, loading nothing) train the same steps.
    ``{out}/rank{rank}.json``: case/detour -> "same bits", or
    what differed or was raised. Both ranks raise alike, so their collectives stay paired."""
    init_rank(rank, world, init_file, device)
    res: dict[str, str] = {}
    try:
        for case in CASES:
            model = _sharded(case, device)
            opt = _make_optimizer(case, model.parameters())
            _train(model, opt, range(SAVED_AT), rank)
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            sd = opt.state_dict()
            path = Path(out, f"{case}-rank{rank}.pt")
            taken = {}
            for detour in DETOURS:
                try:
                    if detour == "torch.save":
                        torch.save(sd, path)
                        taken[detour] = path
                    else:
                        taken[detour] = copy.deepcopy(sd)
                except Exception as e:
                    res[f"{case}/{detour}"] = f"{type(e).__name__}: {e}"
            taken["no load"] = None  # the control: a fresh state must not give the same bits
            _train(model, opt, range(SAVED_AT, STEPS), rank)
            want = _local_bits(model, opt)
            for detour, saved in taken.items():
                try:
                    if detour == "torch.save":
                        saved = torch.load(saved)
                    fresh = _sharded(case, device)
                    fresh.load_state_dict(weights)
                    fopt = _make_optimizer(case, fresh.parameters())
                    if saved is not None:
                        fopt.load_state_dict(saved)
                    _train(fresh, fopt, range(SAVED_AT, STEPS), rank)
                    got = _local_bits(fresh, fopt)
                    same = _same(got, want)
                    res[f"{case}/{detour}"] = "same bits" if same else "different bits"
                except Exception as e:
                    res[f"{case}/{detour}"] = f"{type(e).__name__}: {e}"
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=DIST_DEVICES)
def results(request, tmp_path_factory) -> list[dict[str, str]]:
    """Every case's results, by rank, from one spawn of 2 ranks."""
    device = request.param
    if device == "cpu":
        pytest.importorskip("memopt_ecc")  # FlashAdamW-compressed (the rank imports it)
    out = tmp_path_factory.mktemp(f"sd-copies-{device}")
    files = [out / f"rank{r}.json" for r in (0, 1)]
    spawn_ranks(_worker, (2, str(out / "init"), str(out), device), 2, files)
    return [json.loads(f.read_text()) for f in files]


@pytest.mark.parametrize("detour", DETOURS)
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_state_dict_saved_or_copied_continues_bit_for_bit(case, detour, results):
    for rank, res in enumerate(results):
        assert res[f"{case}/{detour}"] == "same bits", f"rank {rank}"


@pytest.mark.parametrize("case", list(CASES))
def test_the_continuation_depends_on_the_loaded_state(case, results):
    """The control: without the load, a fresh optimizer continues to other bits."""
    for rank, res in enumerate(results):
        assert res[f"{case}/no load"] == "different bits", f"rank {rank}"


# --------------------------------------------------------------------- one-process DTensors
# (the `mesh` fixture: conftest.py)


def test_sharded_state_dict_is_live_without_a_copy_and_saves_each_state_once(mesh):
    """The DTensor states alias the optimizer's state (no copy per state_dict(), live as torch's
    are); a deepcopy is a snapshot; torch.save writes each state's bytes, not its whole arena
    once per state; torch.load gives them back."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(1)
    shapes = [(40, 64), (40, 24), (70,)]
    ws = [
        torch.nn.Parameter(
            distribute_tensor(torch.randn(s, generator=gen).bfloat16(), mesh, [Shard(0)])
        )
        for s in shapes
    ]
    opt = MemOptimizer(ws, lr=1e-2, master="ecc24", moments="q8")
    for w in ws:
        w.grad = distribute_tensor(torch.randn(w.shape, generator=gen).bfloat16(), mesh, [Shard(0)])
    opt.step()
    sd = opt.state_dict()
    offsets = []
    for i, w in enumerate(ws):
        for k, v in sd["state"][i].items():
            if isinstance(v, DTensor):
                local, held = v.to_local(), opt.state[w][k]
                offsets.append(held.storage_offset())
                if local.numel() == held.numel() and local.dtype == held.dtype:
                    assert local.data_ptr() == held.data_ptr(), (i, k)  # an alias, no copy
    assert any(offsets), "no state at an offset in its arena: the test lost its point"

    snapshot = copy.deepcopy(sd)
    buf = io.BytesIO()
    torch.save(sd, buf)
    total = sum(
        v.to_local().numel() * v.element_size()
        for st in sd["state"].values()
        for v in st.values()
        if isinstance(v, DTensor)
    )
    assert buf.tell() < total + 64 * 1024  # each state once (plus pickle and zip headers)
    buf.seek(0)
    loaded = torch.load(buf)
    before = {
        (i, k): v.to_local().clone()
        for i, st in sd["state"].items()
        for k, v in st.items()
        if isinstance(v, DTensor)
    }
    for w in ws:
        w.grad = distribute_tensor(torch.randn(w.shape, generator=gen).bfloat16(), mesh, [Shard(0)])
    opt.step()
    moved = 0
    for (i, k), v in before.items():
        assert torch.equal(snapshot["state"][i][k].to_local(), v), (i, k)
        assert torch.equal(loaded["state"][i][k].to_local(), v), (i, k)
        moved += not torch.equal(sd["state"][i][k].to_local(), v)  # live: the step moved it
    assert moved
