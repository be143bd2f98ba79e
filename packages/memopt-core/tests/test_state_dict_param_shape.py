"""``param_shape``: a state dict entry records its parameter's shape, and ``load_state_dict``
refuses the state of another parameter.

Blocked moments (q8, fp8) are flat and padded to whole blocks, and an fp32 parameter (or a bf16
one with ``master="none"``) keeps no code shaped like it, so the tensors of such a state fit any
parameter with the same padded number of elements: an MLP's up_proj (4096, 1024) and down_proj
(1024, 4096), or a (60,) and a (64,). Without the record, a model whose parameters were
reordered between save and load took one parameter's moments for the other's, silently (torch's
AdamW, whose moments are shaped like the parameter, refuses it)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from memopt_core import MemOptimizer, StateDictError

#: formats whose state does not show its parameter's shape: (param dtype, master, moments)
SHAPELESS = {
    "fp32-q8": (torch.float32, "ecc24", "q8"),  # an fp32 parameter is its own master
    "fp32-fp8": (torch.float32, "ecc24", "fp8"),
    "bf16-none-q8": (torch.bfloat16, "none", "q8"),
}


def _params(shapes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def _train(opt, params, steps, start=0):
    for t in range(start, start + steps):
        gen = torch.Generator().manual_seed(100 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
        opt.zero_grad()


def _state_copy(opt):
    return [
        {k: v.clone() for k, v in opt.state[p].items()}
        for g in opt.param_groups
        for p in g["params"]
    ]


def _same_state(opt, copies):
    params = [p for g in opt.param_groups for p in g["params"]]
    return all(
        opt.state[p].keys() == c.keys()
        and all(torch.equal(opt.state[p][k], v) for k, v in c.items())
        for p, c in zip(params, copies, strict=True)
    )


@pytest.mark.parametrize("config", list(SHAPELESS))
def test_state_of_a_reordered_parameter_of_equal_size_is_refused(config):
    """up_proj (64, 16) and down_proj (16, 64): their states have the same tensors' sizes; a
    model that lists them in the other order gets a StateDictError, and nothing changes."""
    dtype, master, moments = SHAPELESS[config]
    params = _params([(64, 16), (16, 64)], dtype)
    opt = MemOptimizer(params, lr=1e-2, master=master, moments=moments)
    _train(opt, params, 2)
    sd = opt.state_dict()
    assert [sd["state"][i]["param_shape"].tolist() for i in (0, 1)] == [[64, 16], [16, 64]]
    # the moments alone cannot tell: every tensor of one state has the other's size and dtype
    for k, v in sd["state"][0].items():
        if k != "param_shape":
            assert (v.dtype, v.shape) == (sd["state"][1][k].dtype, sd["state"][1][k].shape), k

    swapped = _params([(16, 64), (64, 16)], dtype, seed=1)
    target = MemOptimizer(swapped, lr=1e-2, master=master, moments=moments)
    _train(target, swapped, 1)
    before = _state_copy(target)
    with pytest.raises(
        StateDictError,
        match=r"the state of parameter index 0 \(shape \(16, 64\), .*param group 0\) was saved "
        r"for a parameter of shape \(64, 16\); this parameter's shape is \(16, 64\): the state "
        r"belongs to another parameter",
    ):
        target.load_state_dict(sd)
    assert _same_state(target, before)
    # the same dict loads into the model in the saved order
    same = _params([(64, 16), (16, 64)], dtype, seed=1)
    twin = MemOptimizer(same, lr=1e-2, master=master, moments=moments)
    twin.load_state_dict(sd)
    for p, q in zip(params, same, strict=True):
        assert opt.state[p].keys() == twin.state[q].keys()
        assert all(torch.equal(twin.state[q][k], v) for k, v in opt.state[p].items())


def test_state_of_a_parameter_of_the_same_padded_size_is_refused():
    """(60,) pads to 64 elements, as (64,) is: the q8 states have the same sizes."""
    a = _params([(60,)], torch.float32)
    opt = MemOptimizer(a, lr=1e-2, moments="q8")
    _train(opt, a, 2)
    sd = opt.state_dict()
    b = _params([(64,)], torch.float32)
    other = MemOptimizer(b, lr=1e-2, moments="q8")
    other.init_state()
    assert all(
        v.shape == other.state[b[0]][k].shape for k, v in opt.state[a[0]].items()
    )  # no tensor tells
    with pytest.raises(
        StateDictError,
        match=r"parameter index 0 \(shape \(64,\).* saved for a parameter of shape \(60,\); this "
        r"parameter's shape is \(64,\)",
    ):
        other.load_state_dict(sd)
    # and a (64,) state into a (8, 8) parameter: the same elements, another shape
    square = MemOptimizer(_params([(8, 8)], torch.float32), lr=1e-2, moments="q8")
    with pytest.raises(StateDictError, match=r"shape \(64,\); this parameter's shape is \(8, 8\)"):
        square.load_state_dict(other.state_dict())


def test_state_dict_records_shapes_without_touching_the_live_state():
    params = _params([(5, 3), (7,), ()], torch.float32)
    opt = MemOptimizer(params, lr=1e-2, moments="q8")
    _train(opt, params, 1)
    sd = opt.state_dict()
    for i, p in enumerate(params):
        shape = sd["state"][i]["param_shape"]
        assert shape.dtype == torch.int64
        assert shape.device.type == "cpu"
        assert shape.tolist() == list(p.shape)
        assert "param_shape" not in opt.state[p]
        assert sd["state"][i] is not opt.state[p]
        # the states themselves are still the live arena views, as in torch
        assert sd["state"][i]["exp_avg"].data_ptr() == opt.state[p]["exp_avg"].data_ptr()
    assert opt.state_dict()["state"][0]["param_shape"] is not sd["state"][0]["param_shape"]
    opt.load_state_dict(sd)
    assert all("param_shape" not in opt.state[p] for p in params)


def test_old_state_dicts_without_param_shape_still_load_and_resume_bit_identically():
    shapes = [(64, 16), (16, 64), (60,)]
    straight = _params(shapes, torch.float32)
    sopt = MemOptimizer(straight, lr=1e-2, moments="q8", seed=3)
    _train(sopt, straight, 5)

    first = _params(shapes, torch.float32)
    fopt = MemOptimizer(first, lr=1e-2, moments="q8", seed=3)
    _train(fopt, first, 3)
    sd = copy.deepcopy(fopt.state_dict())
    for entry in sd["state"].values():
        del entry["param_shape"]  # what memopt wrote before it recorded shapes
    resumed = [p.detach().clone().requires_grad_() for p in first]
    ropt = MemOptimizer(resumed, lr=1e-2, moments="q8", seed=3)
    ropt.load_state_dict(sd)
    _train(ropt, resumed, 2, start=3)
    for p, q in zip(straight, resumed, strict=True):
        assert torch.equal(p.view(torch.int32), q.view(torch.int32))


@pytest.mark.parametrize(
    "as_saved",
    [
        lambda t: t,
        lambda t: tuple(t.tolist()),
        lambda t: t.tolist(),  # a JSON round trip
        lambda t: t.to(torch.int32),
    ],
    ids=["tensor", "tuple", "list", "int32"],
)
def test_param_shape_loads_as_tensor_tuple_or_list(as_saved):
    params = _params([(64, 16), (16, 64)], torch.float32)
    opt = MemOptimizer(params, lr=1e-2, moments="q8")
    _train(opt, params, 1)
    sd = copy.deepcopy(opt.state_dict())
    for entry in sd["state"].values():
        entry["param_shape"] = as_saved(entry["param_shape"])
    twin = MemOptimizer([p.detach().clone().requires_grad_() for p in params], moments="q8")
    twin.load_state_dict(sd)
    swapped = MemOptimizer(
        [p.detach().clone().requires_grad_() for p in params[::-1]], moments="q8"
    )
    with pytest.raises(
        StateDictError, match=r"shape \(64, 16\); this parameter's shape is \(16, 64\)"
    ):
        swapped.load_state_dict(sd)


@pytest.mark.parametrize(
    "bad", [torch.tensor([4.0, 8.0]), torch.tensor([[4, 8]]), "4x8", [4, -8], [4, True], None]
)
def test_malformed_param_shape_is_refused(bad):
    params = _params([(4, 8)], torch.float32)
    opt = MemOptimizer(params, lr=1e-2, moments="q8")
    _train(opt, params, 1)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["param_shape"] = bad
    before = _state_copy(opt)
    with pytest.raises(
        StateDictError, match=r"'param_shape' of parameter index 0 .*must be the parameter's shape"
    ):
        opt.load_state_dict(sd)
    assert _same_state(opt, before)


def test_torch_save_round_trip_keeps_the_check():
    """``torch.load(weights_only=True)`` gives the record back; swapped still refused."""
    params = _params([(64, 16), (16, 64)], torch.float32)
    opt = MemOptimizer(params, lr=1e-2, moments="fp8")
    _train(opt, params, 2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded["state"][1]["param_shape"].tolist() == [16, 64]
    swapped = MemOptimizer(
        [p.detach().clone().requires_grad_() for p in params[::-1]], moments="fp8"
    )
    with pytest.raises(StateDictError, match=r"belongs to another parameter"):
        swapped.load_state_dict(loaded)


def test_reordered_param_groups_are_refused():
    """Two groups swapped: the same numbers of parameters, states of the same sizes."""
    up, down = _params([(64, 16), (16, 64)], torch.float32)
    opt = MemOptimizer([{"params": [up]}, {"params": [down], "lr": 1e-3}], lr=1e-2, moments="q8")
    _train(opt, [up, down], 1)
    sd = opt.state_dict()
    target = MemOptimizer(
        [
            {"params": [down.detach().clone().requires_grad_()]},
            {"params": [up.detach().clone().requires_grad_()]},
        ],
        lr=1e-2,
        moments="q8",
    )
    with pytest.raises(
        StateDictError, match=r"parameter index 0 \(shape \(16, 64\).*param group 0\) was saved"
    ):
        target.load_state_dict(sd)
