"""fp32 weights out of bf16 + ECC codes and back: exact for ECC-32, nearest for ECC-24."""

from __future__ import annotations

import copy

import pytest
import torch
from ecc_testutil import same_bits
from torch import nn

from memopt_core import StateDictError
from memopt_core.formats import master_codec
from memopt_ecc import (
    FlashAdamW,
    cast_model,
    fp32_master,
    get_fp32_model_state_dict,
    set_fp32_model_state_dict,
)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 10, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, idx):
        return self.out(self.bn(self.lin(self.embed(idx))))


def trained(device, mwb=24, steps=3, seed=0):
    torch.manual_seed(seed)
    model = cast_model(Model().to(device))
    opt = FlashAdamW(model.parameters(), lr=1e-2, master_weight_bits=mwb)
    for t in range(steps):
        idx = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(t)).to(device)
        model(idx).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def random_fp32_dict(model, seed=1):
    """Values that are not bf16 numbers (full 24-bit mantissas)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            out[k] = (torch.randn(v.shape, generator=gen) * 3).to(v.device)
        else:
            out[k] = v.clone()
    out["out.weight"] = out["embed.weight"]  # tied: the same values under both names
    return out


@pytest.mark.parametrize("mwb", [24, 32, None])
def test_get_decodes_parameters_and_widens_the_rest(mwb, device):
    model, opt = trained(device, mwb)
    sd = get_fp32_model_state_dict(model, opt)
    assert list(sd) == list(model.state_dict())
    for k, v in sd.items():
        assert v.device.type == device.type
        if k == "bn.num_batches_tracked":
            assert v.dtype == torch.int64
            continue
        assert v.dtype == torch.float32
    for name, p in model.named_parameters():
        code = opt.state[p].get("master_code")
        if mwb is None or p.dtype == torch.float32:
            assert code is None
            assert torch.equal(sd[name], p.detach().float())
        else:
            want = master_codec({24: "ecc24", 32: "ecc32"}[mwb], p.dtype).decode(p.detach(), code)
            assert same_bits(sd[name], want)
            assert not torch.equal(sd[name], p.detach().float())  # the code carries bits
    assert same_bits(sd["out.weight"], sd["embed.weight"])
    # the method form is the same function
    method = opt.get_fp32_model_state_dict(model)
    assert all(same_bits(method[k], sd[k]) for k in sd)
    # loads into an fp32 copy of the model
    fp32_model = Model().to(device)
    fp32_model.load_state_dict(sd)
    assert same_bits(fp32_model.lin.weight, sd["lin.weight"])


def test_ecc32_round_trips_bit_exactly(device):
    model, opt = trained(device, mwb=32)
    values = random_fp32_dict(model)
    set_fp32_model_state_dict(model, opt, values)
    got = get_fp32_model_state_dict(model, opt)
    for k, v in values.items():
        assert same_bits(got[k], v.to(got[k].dtype)), k
    # the bf16 parameter is the nearest bf16 of the master (ties away, docs/formats.md)
    assert torch.equal(model.lin.weight.detach(), values["lin.weight"].bfloat16())


def test_ecc32_trains_exactly_like_fp32_after_set(device):
    """bf16 + ECC-32 is an exact fp32 master: loaded weights and fed the same gradients, it follows
    an fp32 model's training bit for bit."""
    model, opt = trained(device, mwb=32, steps=0)
    values = random_fp32_dict(model)
    set_fp32_model_state_dict(model, opt, values)
    ref = Model().to(device)
    cast_model(ref, dtype=torch.float32)
    ref.load_state_dict(values)
    ref_opt = FlashAdamW(ref.parameters(), lr=1e-2)  # fp32 parameters: fp32 master
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            g = torch.randn(p.shape, generator=gen).to(device=device, dtype=p.dtype)
            p.grad, q.grad = g, g.float()  # the same values
        opt.step()
        ref_opt.step()
    got = get_fp32_model_state_dict(model, opt)
    for name, q in ref.named_parameters():
        assert same_bits(got[name], q.detach()), name


def test_ecc24_rounds_to_nearest_and_set_get_is_stable(device):
    model, opt = trained(device, mwb=24)
    values = random_fp32_dict(model)
    set_fp32_model_state_dict(model, opt, values)
    got = get_fp32_model_state_dict(model, opt)
    codec = master_codec("ecc24", torch.bfloat16)
    for name, p in model.named_parameters():
        want = (
            values[name] if p.dtype == torch.float32 else codec.decode(*codec.encode(values[name]))
        )
        assert same_bits(got[name], want), name
    before = {
        id(p): (p.detach().clone(), opt.state[p]["master_code"].clone())
        for p in model.parameters()
        if "master_code" in opt.state[p]
    }
    set_fp32_model_state_dict(model, opt, got)  # set(get()) changes nothing
    for p in model.parameters():
        if id(p) in before:
            assert torch.equal(p.detach(), before[id(p)][0])
            assert torch.equal(opt.state[p]["master_code"], before[id(p)][1])


def test_set_before_the_first_step_creates_the_codes(device):
    torch.manual_seed(0)
    model = cast_model(Model().to(device))
    opt = FlashAdamW(model.parameters(), master_weight_bits=32)
    values = random_fp32_dict(model)
    opt.set_fp32_model_state_dict(model, values)
    assert all(
        "master_code" in opt.state[p] for p in model.parameters() if p.dtype == torch.bfloat16
    )
    got = opt.get_fp32_model_state_dict(model)
    assert same_bits(got["lin.weight"], values["lin.weight"])
    assert all(int(s["step"]) == 0 for s in opt.state.values())


def test_set_before_the_first_step_creates_state_as_a_step_would(device):
    """Trainable parameters get state (step 0, codes); a frozen one only its rounded value; the
    first step afterwards equals one from a fresh optimizer fed the same fp32 weights."""
    torch.manual_seed(0)
    model = cast_model(Model().to(device))
    model.lin.bias.requires_grad_(False)
    opt = FlashAdamW(model.parameters(), lr=1e-2, master_weight_bits=32)
    values = random_fp32_dict(model)
    opt.set_fp32_model_state_dict(model, values)
    assert model.lin.bias not in opt.state
    assert same_bits(model.lin.bias.detach(), values["lin.bias"].bfloat16())
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(int(opt.state[p]["step"]) == 0 for p in trainable)
    # the same weights reached by a plain init_state() + set: identical state, identical step
    twin = copy.deepcopy(model)
    twin_opt = FlashAdamW(twin.parameters(), lr=1e-2, master_weight_bits=32)
    twin_opt.init_state()
    set_fp32_model_state_dict(twin, twin_opt, values)
    idx = torch.arange(8, device=device) % 10
    for m, o in ((model, opt), (twin, twin_opt)):
        m(idx).float().pow(2).mean().backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert same_bits(p, q)
        for k in opt.state.get(p, {}):
            assert same_bits(opt.state[p][k], twin_opt.state[q][k])


def test_set_validates_before_changing_anything():
    model, opt = trained("cpu", mwb=32)
    snapshot = copy.deepcopy((model.state_dict(), opt.state_dict()))
    good = random_fp32_dict(model)
    cases = {
        "missing keys": {k: v for k, v in good.items() if k != "lin.bias"},
        "unexpected keys": {**good, "extra.weight": torch.zeros(1)},
        "is torch.bfloat16": {**good, "lin.weight": good["lin.weight"].bfloat16()},
        "has shape": {**good, "lin.weight": torch.zeros(3, 3)},
        "tied parameter but differ": {**good, "out.weight": good["out.weight"] + 1},
        # passed the checks and failed in the copies, after earlier entries were written
        "on meta; values must be dense": {**good, "lin.bias": good["lin.bias"].to("meta")},
        "sparse_coo tensor": {**good, "lin.bias": good["lin.bias"].to_sparse()},
        # a float value for an integer buffer was truncated silently
        "loads from torch.int64": {**good, "bn.num_batches_tracked": torch.tensor(7.9)},
        "loads from a floating dtype": {
            **good,
            "bn.running_mean": torch.ones(6, dtype=torch.int64),
        },
    }
    for match, sd in cases.items():
        with pytest.raises(StateDictError, match=match):
            set_fp32_model_state_dict(model, opt, sd)
    assert all(same_bits(v, snapshot[0][k]) for k, v in model.state_dict().items())
    # strict=False loads the keys it has
    set_fp32_model_state_dict(model, opt, {"lin.weight": good["lin.weight"]}, strict=False)
    assert same_bits(fp32_master(opt, model.lin.weight), good["lin.weight"])
    assert same_bits(model.lin.bias, snapshot[0]["lin.bias"])
    with pytest.raises(TypeError, match="memopt optimizer"):
        get_fp32_model_state_dict(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="strict must be True or False"):
        set_fp32_model_state_dict(model, opt, good, strict="no")  # was taken as True


def test_set_of_get_keeps_integer_parameters_and_float64_tensors():
    """An integer Parameter (an index table): get returned it as it is and set refused it
    ("parameters load from float32 values"). A float64 buffer or frozen parameter: get
    narrowed it to float32, so set(get()) rounded it."""
    model = nn.Linear(4, 4).to(torch.bfloat16)
    model.idx = nn.Parameter(torch.arange(4), requires_grad=False)
    model.register_buffer("freq", torch.tensor([1 + 2**-40, 3.0], dtype=torch.float64))
    model.table = nn.Parameter(torch.tensor([1 + 2**-40], dtype=torch.float64), requires_grad=False)
    opt = FlashAdamW([model.weight, model.bias], lr=1e-2)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    before = copy.deepcopy(model.state_dict())
    sd = get_fp32_model_state_dict(model, opt)
    assert sd["idx"].dtype == torch.int64
    assert sd["freq"].dtype == sd["table"].dtype == torch.float64
    set_fp32_model_state_dict(model, opt, sd)
    assert all(same_bits(v, before[k]) for k, v in model.state_dict().items())


def test_fp32_master_without_state_is_the_parameter():
    p = nn.Parameter(torch.randn(5).bfloat16())
    opt = FlashAdamW([p])
    assert same_bits(fp32_master(opt, p), p.detach().float())
    q = nn.Parameter(torch.randn(5))
    assert same_bits(fp32_master(opt, q), q.detach())  # not held: itself


def test_fp32_master_of_a_detached_alias_is_its_parameters_and_a_part_is_refused():
    """``p.detach()`` / ``p.data`` is not the object the optimizer holds; it was taken for a
    parameter without state and widened, silently not the master weight."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(4, 5).bfloat16())
    opt = FlashAdamW([p], lr=1e-3)
    for _ in range(3):
        p.grad = torch.randn(4, 5).bfloat16()
        opt.step()
    master = fp32_master(opt, p)
    assert not torch.equal(master, p.detach().float())  # the code holds bits of its own
    assert same_bits(fp32_master(opt, p.detach()), master)
    assert same_bits(fp32_master(opt, p.data), master)
    with pytest.raises(ValueError, match=r"part of parameter #0 of param group 0 \(shape \(4, 5\)"):
        fp32_master(opt, p[1])


def test_fp32_state_dict_is_fp32_for_buffers_and_frozen_parameters():
    """Buffers and parameters the optimizer does not hold are widened too (mutation testing:
    dropping their ``.float()`` went unnoticed)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(torch.bfloat16)
    model[2].weight.requires_grad_(False)  # frozen: not in the optimizer
    opt = FlashAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.randn(8, 4, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    sd = get_fp32_model_state_dict(model, opt)
    floating = {k: v.dtype for k, v in sd.items() if v.is_floating_point()}
    assert set(floating) >= {"0.weight", "1.running_mean", "1.running_var", "2.weight"}
    assert set(floating.values()) == {torch.float32}
    assert torch.equal(sd["2.weight"], model[2].weight.float())
    assert torch.equal(sd["1.running_var"], model[1].running_var.float())


def test_the_fp32_copy_docs_ecc_md_names_computes_as_a_fresh_fp32_model():
    """docs/ecc.md: an fp32 copy of a cast model, made with ``cast_model(copy, float32)``, holds
    no bf16 output casts (a ``.float()`` copy keeps the recast layers' hooks)."""

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
        )

    model = cast_model(net(), full_precision_recast_layers=["1"])
    opt = FlashAdamW(model.parameters(), master_weight_bits=32)
    x = torch.randn(8, 16)
    loss = model(x.bfloat16()).float().square().mean()
    loss.backward()
    opt.step()
    sd = get_fp32_model_state_dict(model, opt)
    fresh = net()
    fresh.load_state_dict(sd)
    copied = cast_model(copy.deepcopy(model), dtype=torch.float32)
    copied.load_state_dict(sd)
    assert torch.equal(copied(x), fresh(x))
    stale = copy.deepcopy(model).float()  # what the docs warn against: it still casts to bf16
    stale.load_state_dict(sd)
    assert stale[1](x).dtype == torch.bfloat16


def test_a_model_cast_in_place_after_training_is_refused_by_name():
    """Widened in place after training (``cast_model(model, dtype=torch.float32)``), a
    parameter's ECC code no longer belongs to it: the export failed with "master format 'fp32'
    has no code", and the widening had dropped the code's low bits. It says what happened and
    what to do."""
    model, opt = trained("cpu")
    before = get_fp32_model_state_dict(model, opt)
    cast_model(model, dtype=torch.float32)
    with pytest.raises(StateDictError, match=r"created for torch\.bfloat16.*before casting"):
        get_fp32_model_state_dict(model, opt)
    with pytest.raises(StateDictError, match=r"created for torch\.bfloat16"):
        fp32_master(opt, model.lin.weight)
    # the dict taken before the cast carries the weights over
    fresh = cast_model(copy.deepcopy(model), dtype=torch.float32)
    fresh.load_state_dict(before)
    assert torch.equal(fresh.lin.weight, before["lin.weight"])


def test_one_buffer_under_two_names_takes_one_value():
    """A buffer registered under two names is one tensor: differing values for it are refused
    (the last one was written), equal ones load, NaNs compare by their bits."""
    model = nn.Module()
    shared = torch.zeros(3)
    model.register_buffer("a", shared)
    model.sub = nn.Module()
    model.sub.register_buffer("a", shared)
    model.lin = nn.Linear(2, 2)
    opt = FlashAdamW(model.parameters())
    sd = get_fp32_model_state_dict(model, opt)
    sd["a"], sd["sub.a"] = torch.ones(3), torch.full((3,), 2.0)
    weight = model.lin.weight.detach().clone()
    with pytest.raises(StateDictError, match=r"'a' and 'sub.a' name one tensor but differ"):
        set_fp32_model_state_dict(model, opt, sd)
    assert torch.equal(shared, torch.zeros(3))
    assert torch.equal(model.lin.weight, weight)
    sd["a"] = sd["sub.a"] = torch.tensor([float("nan"), 1.0, 2.0])
    set_fp32_model_state_dict(model, opt, sd)
    assert torch.equal(shared[1:], torch.tensor([1.0, 2.0]))
    assert shared[0].isnan()
