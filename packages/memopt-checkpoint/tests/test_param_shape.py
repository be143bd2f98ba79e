"""save/load and the optimizer states' ``param_shape``: an MLP's up (64, 16) and down (16, 64)
weights with fp32 parameters and q8 moments have states of the same sizes, so only the recorded
shape tells them apart. By name they load where they belong, whatever the optimizer's order; by
position into reordered parameters they are refused with nothing changed."""

from __future__ import annotations

import pytest
import torch

from memopt_checkpoint import load, save
from memopt_checkpoint.container import CheckpointReader
from memopt_core import MemOptimizer
from memopt_core.errors import StateDictError


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64, bias=False), torch.nn.GELU(), torch.nn.Linear(64, 16, bias=False)
    )


def _optimizer(model, order="saved"):
    up, down = model[0].weight, model[2].weight
    params = [up, down] if order == "saved" else [down, up]
    return MemOptimizer(params, rule="adamw", lr=1e-2, moments="q8", seed=3)


def _train(model, opt, steps):
    for t in range(steps):
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(t))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _states(opt):
    return {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def _same(opt, states):
    return {id(p) for p in opt.state} == set(states) and all(
        s.keys() == states[id(p)].keys()
        and all(torch.equal(v, states[id(p)][k]) for k, v in s.items())
        for p, s in opt.state.items()
    )


def test_by_name_loads_each_state_where_it_belongs(tmp_path):
    model = _mlp()
    opt = _optimizer(model)
    _train(model, opt, 2)
    save(tmp_path / "ck.mopt", model=model, optimizer=opt)
    with CheckpointReader(tmp_path / "ck.mopt") as reader:
        assert reader.load("optim/0.weight/param_shape").tolist() == [64, 16]
        assert reader.load("optim/2.weight/param_shape").tolist() == [16, 64]

    twin = _mlp(seed=1)
    reordered = _optimizer(twin, order="swapped")  # names, not positions, find the states
    load(tmp_path / "ck.mopt", model=twin, optimizer=reordered)
    for name in ("0.weight", "2.weight"):
        src = opt.state[dict(model.named_parameters())[name]]
        dst = reordered.state[dict(twin.named_parameters())[name]]
        assert dst.keys() == src.keys()  # param_shape stays in the state dict only
        assert all(torch.equal(dst[k], v) for k, v in src.items()), name


def test_by_position_into_reordered_parameters_is_refused(tmp_path):
    model = _mlp()
    opt = _optimizer(model)
    _train(model, opt, 2)
    save(tmp_path / "ck.mopt", optimizer=opt)  # keyed by position

    same = _optimizer(_mlp(seed=1))
    load(tmp_path / "ck.mopt", optimizer=same)
    for p, q in zip(opt.param_groups[0]["params"], same.param_groups[0]["params"], strict=True):
        assert all(torch.equal(same.state[q][k], v) for k, v in opt.state[p].items())

    target_model = _mlp(seed=2)
    swapped = _optimizer(target_model, order="swapped")
    _train(target_model, swapped, 1)
    before = _states(swapped)
    with pytest.raises(
        StateDictError,
        match=r"optimizer parameter '#0' has shape \(16, 64\); the checkpoint's state under that "
        r"position was saved for a parameter of shape \(64, 16\): it belongs to another parameter",
    ):
        load(tmp_path / "ck.mopt", optimizer=swapped)
    assert _same(swapped, before)


def test_file_without_param_shape_still_loads(tmp_path, monkeypatch):
    """A file saved before the shapes were recorded loads (unchecked), by name and position."""
    model = _mlp()
    opt = _optimizer(model)
    _train(model, opt, 2)
    state_dict = opt.state_dict

    def old_state_dict():
        sd = state_dict()
        sd["state"] = {
            i: {k: v for k, v in e.items() if k != "param_shape"} for i, e in sd["state"].items()
        }
        return sd

    monkeypatch.setattr(opt, "state_dict", old_state_dict)
    save(tmp_path / "name.mopt", model=model, optimizer=opt)
    save(tmp_path / "pos.mopt", optimizer=opt)
    with CheckpointReader(tmp_path / "pos.mopt") as reader:
        assert not [k for k in reader if k.endswith("param_shape")]
    twin = _mlp(seed=1)
    by_name = _optimizer(twin, order="swapped")
    load(tmp_path / "name.mopt", model=twin, optimizer=by_name)
    by_pos = _optimizer(_mlp(seed=1))
    load(tmp_path / "pos.mopt", optimizer=by_pos)
    for o in (by_name, by_pos):
        assert sorted(o.state[p]["step"].item() for p in o.state) == [2.0, 2.0]
