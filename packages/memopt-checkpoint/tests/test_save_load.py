"""save/load: bit-identical resume for every optimizer family, name keying, size, and errors
that change nothing."""

from __future__ import annotations

import copy
import random
import sys

import pytest
import torch

from memopt_checkpoint import export_fp32, fp32_model_state_dict, load, save
from memopt_core import MemOptimizer
from memopt_core.errors import CheckpointError, ConfigError, StateDictError


class Net(torch.nn.Module):
    def __init__(self, width: int = 40) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, width)
        self.mid = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 64, bias=False)
        self.head.weight = self.emb.weight  # tied: stored once

    def forward(self, ids):
        return self.head(self.norm(torch.tanh(self.mid(self.emb(ids)))))


def batch(t: int):
    return torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(t))


def train(model, opt, steps, start=0, sync=False):
    for t in range(start, start + steps):
        ids = batch(t)
        loss = torch.nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        loss.backward()
        if sync:
            opt.step_sync()
        else:
            opt.step()
            opt.zero_grad()


def _memopt_q8(model):
    return MemOptimizer(model.parameters(), rule="adamw", lr=1e-2, moments="q8", seed=3)


def _flash(name, **kw):
    def build(model):
        ecc = pytest.importorskip("memopt_ecc")
        return getattr(ecc, name)(model.parameters(), lr=1e-2, **kw)

    return build


def _bridge(model):
    offload = pytest.importorskip("memopt_offload")
    opt = offload.AdamBridge(model.parameters(), lr=1e-2, precision="compact")
    opt.attach_hooks(model)
    return opt


def _apexw(state):
    def build(model):
        apexw = pytest.importorskip("memopt_apexw")
        return apexw.ApexW(model.parameters(), lr=1e-2, state=state, mode_cache=None)

    return build


FAMILIES = {
    "memopt-q8-fp32": (_memopt_q8, torch.float32),
    "flash-adamw-ecc24": (_flash("FlashAdamW"), torch.bfloat16),
    "flash-adamw-ecc32": (_flash("FlashAdamW", master_weight_bits=32), torch.bfloat16),
    # decoded moments (exp_avg_sq as Adam's v, its q8 codes normalized by beta2**(k % 8)):
    # saved after 5 steps, resumed across the period's end at 8
    "flash-adamw-decoded": (
        _flash("FlashAdamW", betas=(0.9, 0.5), compress_state_dict=False),
        torch.bfloat16,
    ),
    "flash-lion": (_flash("FlashLion"), torch.bfloat16),
    "flash-sgd-momentum": (_flash("FlashSGD", momentum=0.9), torch.bfloat16),
    "adambridge-compact": (_bridge, torch.bfloat16),
    "apexw-bf16-fp32": (_apexw("bf16"), torch.float32),
    "apexw-q8-ecc24": (_apexw("q8"), torch.bfloat16),
}


def build(family, seed=0):
    make, dtype = FAMILIES[family]
    torch.manual_seed(seed)
    model = Net().to(dtype)
    return model, make(model)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_resume_is_bit_identical(family, tmp_path):
    sync = family.startswith("adambridge")
    straight, sopt = build(family)
    train(straight, sopt, 9, sync=sync)

    first, fopt = build(family)
    train(first, fopt, 5, sync=sync)
    save(tmp_path / "ck.mopt", model=first, optimizer=fopt, extra={"epoch": 3, "note": "x"})

    resumed, ropt = build(family, seed=123)  # another init: everything must come from the file
    extra = load(tmp_path / "ck.mopt", model=resumed, optimizer=ropt)
    assert extra == {"epoch": 3, "note": "x"}
    train(resumed, ropt, 4, start=5, sync=sync)
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p.detach().view(torch.int16 if p.dtype != torch.float32 else torch.int32),
                           q.detach().view(torch.int16 if q.dtype != torch.float32 else torch.int32)), name  # fmt: skip


def test_ecc24_checkpoint_size_per_parameter(tmp_path):
    ecc = pytest.importorskip("memopt_ecc")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).to(torch.bfloat16)
    opt = ecc.FlashAdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 512, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    opt.step()
    save(tmp_path / "ck.mopt", model=model, optimizer=opt)
    n = sum(p.numel() for p in model.parameters())
    per_param = (tmp_path / "ck.mopt").stat().st_size / n
    # bf16 weight 2 + ECC-24 code 1 + q8 m and v 2 x (1 + 1/32): 5.06 B; the issue's target 5.2
    print(f"ECC-24 FlashAdamW checkpoint: {per_param:.3f} B per parameter")
    assert 5.06 <= per_param <= 5.2, per_param


def test_tied_weights_are_stored_once(tmp_path):
    model, _ = build("memopt-q8-fp32")
    save(tmp_path / "ck.mopt", model=model)
    from memopt_checkpoint.container import CheckpointReader

    with CheckpointReader(tmp_path / "ck.mopt") as r:
        assert [k for k in r if "emb" in k or "head" in k] == ["model/emb.weight"]
        assert r.meta["model"]["aliases"] == {"head.weight": "emb.weight"}


def test_the_memopt_entry_is_stored_once(tmp_path):
    """state_dict() repeats its 'memopt' entry in every param group (for torch's
    get_state_dict): the file keeps the top-level one only, as before. A state dict whose top
    level lacks it (a state-dict post hook took it out) keeps the groups' copies, and load
    reads them."""
    from memopt_checkpoint.container import CheckpointReader

    model, opt = build("memopt-q8-fp32")
    train(model, opt, 2)
    save(tmp_path / "ck.mopt", model=model, optimizer=opt)
    with CheckpointReader(tmp_path / "ck.mopt") as r:
        info = r.meta["optimizer"]
        assert info["memopt"] == {
            "rule": "adamw",
            "seed": 3,
            "version": 2,
            "decay_norm_beta2": [0.999],  # JSON gives the floats back exactly
        }
        assert all("memopt" not in g for g in info["param_groups"])

    def drop_top_level(optimizer, sd):
        del sd["memopt"]

    handle = opt.register_state_dict_post_hook(drop_top_level)
    save(tmp_path / "groups.mopt", model=model, optimizer=opt)
    handle.remove()
    with CheckpointReader(tmp_path / "groups.mopt") as r:
        info = r.meta["optimizer"]
        assert info["memopt"] is None
        assert all(g["memopt"]["seed"] == 3 for g in info["param_groups"])
    twin = copy.deepcopy(model)
    other = MemOptimizer(twin.parameters(), rule="adamw", lr=1e-2, moments="q8", seed=8)
    load(tmp_path / "groups.mopt", model=twin, optimizer=other)
    assert other.seed == 3
    assert all("memopt" not in g for g in other.param_groups)


def test_names_not_positions(tmp_path):
    model, opt = build("memopt-q8-fp32")
    train(model, opt, 2)
    save(tmp_path / "ck.mopt", model=model, optimizer=opt)
    # the same parameters listed in another order and split into two groups
    twin = copy.deepcopy(model)
    params = dict(twin.named_parameters())
    groups = [
        {"params": [params["norm.bias"], params["mid.weight"]]},
        {"params": [params["emb.weight"], params["norm.weight"], params["mid.bias"]]},
    ]
    other = MemOptimizer(groups, rule="adamw", lr=1e-2, moments="q8", seed=3)
    with pytest.raises(StateDictError, match="param group"):
        load(tmp_path / "ck.mopt", model=twin, optimizer=other)
    reordered = MemOptimizer(
        [{"params": [params[n] for n in reversed(list(params))]}],
        rule="adamw", lr=1e-2, moments="q8", seed=3,
    )  # fmt: skip
    load(tmp_path / "ck.mopt", model=twin, optimizer=reordered)
    for name, p in params.items():
        src = opt.state[dict(model.named_parameters())[name]]
        for k, v in reordered.state[p].items():
            assert torch.equal(v, src[k]), (name, k)


def _snapshot(model, opt):
    return (
        {k: copy.deepcopy(v) for k, v in model.state_dict().items()},
        {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
    )


def _unchanged(model, opt, snap):
    msd, ost = snap
    for k, v in model.state_dict().items():
        assert torch.equal(v, msd[k]) if isinstance(v, torch.Tensor) else v == msd[k], k
    assert {id(p) for p in opt.state} == set(ost)
    for p, s in opt.state.items():
        assert all(torch.equal(v, ost[id(p)][k]) for k, v in s.items())


def test_mismatches_change_nothing(tmp_path):
    model, opt = build("memopt-q8-fp32")
    train(model, opt, 2)
    save(tmp_path / "ck.mopt", model=model, optimizer=opt)
    target, topt = build("memopt-q8-fp32", seed=5)
    train(target, topt, 1)
    snap = _snapshot(target, topt)

    wider = Net(width=48)
    with pytest.raises(StateDictError, match=r"model entry 'emb\.weight' .* shape"):
        load(tmp_path / "ck.mopt", model=wider)
    torch_opt = torch.optim.AdamW(target.parameters())
    # the hint named torch interop alone, which drops an ECC master's low bits
    with pytest.raises(
        StateDictError,
        match=r"state of a memopt_core\.optimizer\.MemOptimizer.*load it into a MemOptimizer",
    ):
        load(tmp_path / "ck.mopt", model=target, optimizer=torch_opt)
    bf16 = MemOptimizer(target.parameters(), rule="adamw", lr=1e-2, moments="bf16", seed=3)
    with pytest.raises(StateDictError, match="moments='q8'"):
        load(tmp_path / "ck.mopt", model=target, optimizer=bf16)
    _unchanged(target, topt, snap)

    class Extra(Net):
        def __init__(self):
            super().__init__()
            self.more = torch.nn.Linear(2, 2)

    with pytest.raises(StateDictError, match=r"missing \['more.weight', 'more.bias'\]"):
        load(tmp_path / "ck.mopt", model=Extra())
    # a flipped byte in an optimizer tensor: found before anything is written
    data = bytearray((tmp_path / "ck.mopt").read_bytes())
    data[200] ^= 0x40
    (tmp_path / "bad.mopt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        load(tmp_path / "bad.mopt", model=target, optimizer=topt)
    _unchanged(target, topt, snap)


class Versioned(Net):
    """A model whose set_extra_state refuses a saved version other than its own."""

    def __init__(self, version: int) -> None:
        super().__init__()
        self.version = version

    def get_extra_state(self):
        return {"version": self.version}

    def set_extra_state(self, state):
        if state["version"] != self.version:
            raise ValueError(f"saved by version {state['version']}, this is {self.version}")


def test_a_refusing_module_leaves_model_and_optimizer_as_they_were(tmp_path):
    """The model's own load code (set_extra_state here) refuses after every check passed: the
    optimizer was loaded and the model partly before the error (found by adversarial testing,
    2026-12-04); now the model's tensors are put back and the optimizer is not touched."""
    torch.manual_seed(0)
    model = Versioned(1)
    opt = _memopt_q8(model)
    train(model, opt, 2)
    save(tmp_path / "ck.mopt", model=model, optimizer=opt)
    torch.manual_seed(5)
    target = Versioned(2)
    topt = _memopt_q8(target)
    train(target, topt, 3)
    snap = _snapshot(target, topt)
    with pytest.raises(ValueError, match="saved by version 1, this is 2"):
        load(tmp_path / "ck.mopt", model=target, optimizer=topt)
    _unchanged(target, topt, snap)
    target.version = 1
    load(tmp_path / "ck.mopt", model=target, optimizer=topt)
    want = model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in target.state_dict().items() if "extra" not in k)


def test_keying_must_match(tmp_path):
    model, opt = build("memopt-q8-fp32")
    train(model, opt, 1)
    save(tmp_path / "by_name.mopt", model=model, optimizer=opt)
    save(tmp_path / "by_pos.mopt", optimizer=opt)
    with pytest.raises(ConfigError, match="by parameter name: pass model="):
        load(tmp_path / "by_name.mopt", optimizer=opt)
    with pytest.raises(StateDictError, match="holds no model"):
        load(tmp_path / "by_pos.mopt", model=model, optimizer=opt)
    _, topt = build("memopt-q8-fp32", seed=9)
    load(tmp_path / "by_pos.mopt", optimizer=topt)  # positions: the same construction order
    for p, q in zip(opt.param_groups[0]["params"], topt.param_groups[0]["params"], strict=True):
        assert all(torch.equal(v, topt.state[q][k]) for k, v in opt.state[p].items())


def test_bad_arguments(tmp_path):
    model, opt = build("memopt-q8-fp32")
    with pytest.raises(ConfigError, match="needs a model, an optimizer or both"):
        save(tmp_path / "x")
    with pytest.raises(ConfigError, match="not a parameter of the model"):
        save(tmp_path / "x", model=torch.nn.Linear(2, 2), optimizer=opt)
    with pytest.raises(ConfigError, match="JSON"):
        save(tmp_path / "x", model=model, extra={"bad": object()})
    for extra in ([("step", 3)], "abc"):  # bare AttributeErrors (a helper's hunt, 2026-12-07)
        with pytest.raises(ConfigError, match=r"extra must be a mapping .* got (list|str)"):
            save(tmp_path / "x", model=model, extra=extra)
    assert not (tmp_path / "x").exists()
    save(tmp_path / "x", model=model, optimizer=opt)
    before = [p.detach().clone() for p in model.parameters()]
    for kwargs, match in (
        (dict(model=model.state_dict()), "model must be a torch.nn.Module, got OrderedDict"),
        (dict(model=opt, optimizer=model), "model must be a torch.nn.Module, got MemOptimizer"),
        (dict(model=model, optimizer=opt.state_dict()), "optimizer must be a torch.optim.Opt"),
        (dict(model=model, strict="no"), "strict must be True or False, got 'no'"),
    ):
        with pytest.raises(ConfigError, match=match):
            load(tmp_path / "x", **kwargs)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


class WithExtraState(torch.nn.Linear):
    """A module whose ``state_dict()`` holds a non-tensor ``_extra_state``."""

    def __init__(self, extra):
        super().__init__(4, 4)
        self.extra = extra

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state


def test_non_tensor_model_entries(tmp_path):
    extra = {"version": 3, "names": ["a", "b"], "scale": 0.5, "note": None}
    model = torch.nn.Sequential(WithExtraState(extra))
    opt = MemOptimizer(model.parameters(), rule="adamw", lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    save(tmp_path / "ck.mopt", model=model, optimizer=opt)
    export_fp32(tmp_path / "fp32.pt", model)  # the torch path passes it through as well
    assert torch.load(tmp_path / "fp32.pt", weights_only=True)["0._extra_state"] == extra

    twin = torch.nn.Sequential(WithExtraState({"version": 1}))
    topt = MemOptimizer(twin.parameters(), rule="adamw", lr=1e-2)
    load(tmp_path / "ck.mopt", model=twin, optimizer=topt)
    assert twin[0].extra == extra
    assert torch.equal(twin[0].weight, model[0].weight)
    # a value only one side has as a tensor is refused before anything changes
    tensor_extra = torch.nn.Sequential(WithExtraState(torch.zeros(2)))
    with pytest.raises(
        StateDictError,
        match=r"model entry '0._extra_state' is a non-tensor value in the checkpoint, a tensor",
    ):
        load(tmp_path / "ck.mopt", model=tensor_extra)
    assert torch.equal(tensor_extra[0].extra, torch.zeros(2))
    # values JSON would not give back equal: ConfigError naming the key, no file
    for bad in ({"t": torch.ones(2)}, (1, 2), {1: "int key"}, float("nan"), object()):
        model[0].extra = bad
        with pytest.raises(ConfigError, match=r"model entry '0._extra_state' is a \w+ that JSON"):
            save(tmp_path / "bad.mopt", model=model)
    assert not (tmp_path / "bad.mopt").exists()


def test_fp32_export_is_a_plain_torch_file(tmp_path):
    ecc = pytest.importorskip("memopt_ecc")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)).to(torch.bfloat16)
    opt = ecc.FlashAdamW(model.parameters(), lr=1e-2, master_weight_bits=32)
    model(torch.randn(3, 16, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    export_fp32(tmp_path / "fp32.pt", model, opt)
    sd = torch.load(tmp_path / "fp32.pt", weights_only=True)
    want = fp32_model_state_dict(model, opt)
    assert sd.keys() == want.keys()
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert all(torch.equal(sd[k], want[k]) for k in sd)
    # ECC-32 is exactly fp32: the export differs from the bf16 weights below bf16 resolution
    w = sd["0.weight"]
    assert not torch.equal(w, model[0].weight.float())
    assert torch.equal(w.to(torch.bfloat16), model[0].weight.detach())


class TensorExtraState(torch.nn.Linear):
    """A module whose ``get_extra_state()`` returns a new tensor at every call."""

    def __init__(self):
        super().__init__(2, 2)
        self.seen = 0

    def get_extra_state(self):
        return torch.arange(self.seen + 1)  # its size changes with the value

    def set_extra_state(self, state):
        self.seen = int(state[-1])


def test_tensor_extra_state_reaches_set_extra_state(tmp_path):
    model = torch.nn.Sequential(TensorExtraState())
    model[0].seen = 42
    save(tmp_path / "ck.mopt", model=model)
    twin = torch.nn.Sequential(TensorExtraState())
    load(tmp_path / "ck.mopt", model=twin)
    assert twin[0].seen == 42  # a copy into the fresh tensor state_dict() returned would be lost
    assert torch.equal(twin[0].weight, model[0].weight)


class KeepsNone(torch.optim.SGD):
    """An optimizer with a None value and a tensor in its per-parameter state."""

    def step(self, closure=None):
        super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["prev_loss"] = None
                self.state[p]["count"] = torch.tensor(3)


def test_none_and_tensor_hyperparameters_and_state_round_trip(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    lr, betas = torch.tensor(0.01), (torch.tensor(0.9), torch.tensor(0.99))
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=betas)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    save(tmp_path / "adam.mopt", model=model, optimizer=opt)
    twin = torch.nn.Linear(4, 3)
    topt = torch.optim.Adam(twin.parameters(), lr=0.5)
    load(tmp_path / "adam.mopt", model=twin, optimizer=topt)
    g = topt.param_groups[0]
    # tensors stay tensors: Adam's float and tensor paths round differently
    assert isinstance(g["lr"], torch.Tensor)
    assert g["lr"].item() == lr.item()
    assert isinstance(g["betas"], tuple)
    assert all(isinstance(b, torch.Tensor) for b in g["betas"])
    assert g["betas"][1].item() == betas[1].item()
    for m, o in ((model, opt), (twin, topt)):
        m.zero_grad()
        m(torch.ones(2, 4)).sum().backward()
        o.step()
    assert torch.equal(model.weight, twin.weight)

    sgd = KeepsNone(model.parameters(), lr=0.1, momentum=0.9)
    model.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    sgd.step()
    save(tmp_path / "sgd.mopt", model=model, optimizer=sgd)
    other = KeepsNone(twin.parameters(), lr=0.1, momentum=0.9)
    load(tmp_path / "sgd.mopt", model=twin, optimizer=other)
    state = other.state[twin.weight]
    assert state["prev_loss"] is None
    assert torch.equal(state["count"], torch.tensor(3))
    assert torch.equal(state["momentum_buffer"], sgd.state[model.weight]["momentum_buffer"])


def test_position_keyed_torch_optimizer_state_checks_shapes(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    save(tmp_path / "ck.mopt", optimizer=opt)
    wider = torch.nn.Linear(4, 5)
    wopt = torch.optim.AdamW(wider.parameters())
    with pytest.raises(StateDictError, match=r"optimizer parameter '#0' has shape \(5, 4\)"):
        load(tmp_path / "ck.mopt", optimizer=wopt)
    assert not wopt.state


class TiedOtherOrder(torch.nn.Module):
    """Net's tied embedding and head, declared head first (so the tie's first name differs)."""

    def __init__(self, width: int = 40) -> None:
        super().__init__()
        self.head = torch.nn.Linear(width, 64, bias=False)
        self.emb = torch.nn.Embedding(64, width)
        self.mid = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.emb.weight = self.head.weight

    def forward(self, ids):
        return self.head(self.norm(torch.tanh(self.mid(self.emb(ids)))))


def test_tied_weights_declared_in_another_order_load_by_name(tmp_path):
    model, opt = build("memopt-q8-fp32")
    train(model, opt, 2)
    save(tmp_path / "ck.mopt", model=model, optimizer=opt)
    torch.manual_seed(5)
    twin = TiedOtherOrder()
    topt = _memopt_q8(twin)
    load(tmp_path / "ck.mopt", model=twin, optimizer=topt)
    assert torch.equal(twin.head.weight, model.emb.weight)
    mine = topt.state[twin.head.weight]
    for k, v in opt.state[model.emb.weight].items():
        assert torch.equal(mine[k], v), k


def test_fp32_export_takes_adambridge_masters_of_frozen_parameters():
    offload = pytest.importorskip("memopt_offload")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    opt = offload.AdamBridge(model.parameters(), lr=1e-2, precision="fp32")
    opt.attach_hooks(model)
    for _ in range(3):
        model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
        opt.step_sync()
    model[0].weight.requires_grad_(False)  # frozen for a later phase: its master is still held
    sd = fp32_model_state_dict(model, opt)
    master = opt.master_weight(model[0].weight)
    assert torch.equal(sd["0.weight"], master)
    assert not torch.equal(sd["0.weight"], model[0].weight.float())  # more than the bf16 weight
    opt.detach_hooks()


def test_tensor_subclasses_are_refused_with_the_way_out(tmp_path):
    class Sub(torch.Tensor):
        pass

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"tensor subclass.*torch\.distributed\.checkpoint"):
        save(tmp_path / "ck.mopt", model=model, extra={"x": torch.ones(3).as_subclass(Sub)})
    assert not (tmp_path / "ck.mopt").exists()


def test_schema_1_files_still_load(tmp_path, monkeypatch):
    """Schema 1 marked a state tensor with None and kept no shapes: such files load."""
    from memopt_checkpoint import api

    def schema_1_stored(v, key, tensors, where):
        if isinstance(v, torch.Tensor):
            tensors.append((key, v))
            return None
        return api._json_value(v, where)

    model, opt = build("flash-adamw-ecc24")
    train(model, opt, 3)
    with monkeypatch.context() as m:
        m.setattr(api, "CHECKPOINT_SCHEMA", 1)
        m.setattr(api, "_stored", schema_1_stored)
        save(tmp_path / "old.mopt", model=model, optimizer=opt)
    from memopt_checkpoint.container import CheckpointReader

    with CheckpointReader(tmp_path / "old.mopt") as r:
        assert r.meta["schema"] == 1
    twin, topt = build("flash-adamw-ecc24", seed=9)
    load(tmp_path / "old.mopt", model=twin, optimizer=topt)
    train(model, opt, 2, start=3)
    train(twin, topt, 2, start=3)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))


class FusedQK(torch.nn.Module):
    """q and k projections kept as one fused weight and saved as two entries, built fresh by
    its own ``_save_to_state_dict`` (so not views of the parameter)."""

    def __init__(self):
        super().__init__()
        self.qk = torch.nn.Parameter(torch.randn(8, 4))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        q, k = self.qk.chunk(2)
        destination[prefix + "q"] = q if keep_vars else q.detach().clone()
        destination[prefix + "k"] = k if keep_vars else k.detach().clone()

    def _load_from_state_dict(self, sd, prefix, local_metadata, strict, missing, unexpected, errs):
        with torch.no_grad():
            self.qk.copy_(torch.cat([sd.pop(prefix + "q"), sd.pop(prefix + "k")]))


class SavesFp32(torch.nn.Linear):
    """A bf16 layer whose state-dict post hook saves the weight cast to fp32."""

    def __init__(self):
        super().__init__(4, 4)
        self.to(torch.bfloat16)
        self.register_state_dict_post_hook(self._widen)

    @staticmethod
    def _widen(module, sd, prefix, local_metadata):
        sd[prefix + "weight"] = sd[prefix + "weight"].float()


class CachesTranspose(torch.nn.Linear):
    """Keeps a derived buffer up to date with load hooks; records what they saw."""

    def __init__(self):
        super().__init__(4, 4)
        self.register_buffer("wt", self.weight.detach().t().clone(), persistent=False)
        self.seen = []
        self._register_load_state_dict_pre_hook(self._pre, with_module=True)
        self.register_load_state_dict_post_hook(self._post)

    @staticmethod
    def _pre(module, sd, prefix, *args):
        module.seen.append(sorted(k for k in sd if k.startswith(prefix)))

    @staticmethod
    def _post(module, incompatible):
        module.wt = module.weight.detach().t().clone()


@pytest.mark.parametrize("cls", [FusedQK, SavesFp32])
def test_load_restores_state_dicts_that_modules_build(cls, tmp_path):
    """``load`` goes through ``model.load_state_dict``: a copy into the entries ``state_dict()``
    built fresh would fill temporaries and leave the model as it was."""
    torch.manual_seed(0)
    src = cls()
    torch.manual_seed(1)
    dst = cls()
    before = [p.detach().clone() for p in dst.parameters()]
    save(tmp_path / "ck.mopt", model=src)
    load(tmp_path / "ck.mopt", model=dst)
    for p, q, old in zip(src.parameters(), dst.parameters(), before, strict=True):
        assert torch.equal(p, q)
        assert not torch.equal(q, old)
    want = src.state_dict()
    got = dst.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_load_runs_load_hooks_and_fills_lazy_modules(tmp_path):
    torch.manual_seed(0)
    src = torch.nn.Sequential(CachesTranspose(), torch.nn.LazyLinear(3))
    src(torch.ones(1, 4))
    torch.manual_seed(1)
    dst = torch.nn.Sequential(CachesTranspose(), torch.nn.LazyLinear(3))
    save(tmp_path / "ck.mopt", model=src)
    load(tmp_path / "ck.mopt", model=dst)
    assert dst[0].seen == [["0.bias", "0.weight"]]
    assert torch.equal(dst[0].weight, src[0].weight)
    assert torch.equal(dst[0].wt, src[0].weight.t())  # the post hook ran after the copy
    assert torch.equal(dst[1].weight, src[1].weight)  # the lazy layer took its shape
    assert torch.equal(dst[1].bias, src[1].bias)


def test_load_into_a_meta_model_is_refused_by_name(tmp_path):
    """The backup of the model's values raised torch's "Cannot copy out of meta tensor"."""
    save(tmp_path / "ck.mopt", model=torch.nn.Linear(4, 3))
    with torch.device("meta"):
        dst = torch.nn.Linear(4, 3)
    with pytest.raises(ConfigError, match=r"'weight' \(2 tensor\(s\) in all\) is on the meta"):
        load(tmp_path / "ck.mopt", model=dst)
    dst.to_empty(device="cpu")
    load(tmp_path / "ck.mopt", model=dst)  # materialized, it loads


def test_load_into_a_module_with_its_own_state_dict_format_changes_nothing_on_mismatch(tmp_path):
    src = FusedQK()
    save(tmp_path / "ck.mopt", model=src)
    wider = FusedQK()
    wider.qk = torch.nn.Parameter(torch.zeros(8, 6))
    with pytest.raises(
        StateDictError, match=r"model entry 'q' is torch\.float32 of shape \(4, 4\)"
    ):
        load(tmp_path / "ck.mopt", model=wider)
    assert torch.equal(wider.qk, torch.zeros(8, 6))


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"sched": {"mode_worse": float("inf")}}, r"extra\['sched'\]\['mode_worse'\] is inf"),
        ({"x": [1.0, float("nan")]}, r"extra\['x'\]\[1\] is nan"),
        ({"py_rng": random.getstate()}, r"extra\['py_rng'\] is a tuple, .* back as a list"),
        ({"shape": [1, (3, 4)]}, r"extra\['shape'\]\[1\] is a tuple"),
        ({"t": {"a": torch.tensor(1.5)}}, r"extra\['t'\]\['a'\] is a tensor inside a container"),
        ({"by_id": {1: "x"}}, r"extra\['by_id'\] has the key 1: .* load back as a str"),
        ({3: "x"}, r"extra's keys must be str, got 3"),
        ({"bad": object()}, r"extra\['bad'\] \(object\) is not JSON-serializable"),
    ],
)
def test_extra_that_would_not_come_back_as_it_was_is_refused_naming_it(extra, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        save(tmp_path / "ck.mopt", model=torch.nn.Linear(2, 2), extra=extra)
    assert not (tmp_path / "ck.mopt").exists()


def test_lr_schedulers_go_through_extra(tmp_path):
    """The README's recipe: a scheduler's state in ``extra``; ReduceLROnPlateau's without its
    ``mode_worse`` (inf), which its ``load_state_dict`` recomputes."""
    from torch.optim import lr_scheduler

    def run(resume_from=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 3)
        opt = MemOptimizer(model.parameters(), rule="adamw", lr=0.05)
        step = lr_scheduler.StepLR(opt, 2, 0.5)
        plateau = lr_scheduler.ReduceLROnPlateau(opt, patience=0)
        start = 0
        if resume_from is not None:
            extra = load(resume_from, model=model, optimizer=opt)
            step.load_state_dict(extra["step"])
            plateau.load_state_dict(extra["plateau"])
            start = extra["t"]
        for t in range(start, 6):
            opt.zero_grad()
            model(torch.ones(2, 3) * (t % 3)).pow(2).sum().backward()
            opt.step()
            step.step()
            plateau.step(1.0 / (t + 1) if t < 3 else 1.0)
            if t == 2 and resume_from is None:
                plain = {k: v for k, v in plateau.state_dict().items() if k != "mode_worse"}
                extra = {"step": step.state_dict(), "plateau": plain, "t": 3}
                save(tmp_path / "ck.mopt", model=model, optimizer=opt, extra=extra)
        return model, step.state_dict(), plateau.state_dict()

    model, step_sd, plateau_sd = run()
    resumed, rstep_sd, rplateau_sd = run(tmp_path / "ck.mopt")
    assert rstep_sd == step_sd
    assert rplateau_sd == plateau_sd
    assert plateau_sd["mode_worse"] == float("inf")
    assert torch.equal(resumed.weight, model.weight)


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"schema": "2"}, r"'schema' is '2', not an int"),
        ({"schema": 0}, r"'schema' is 0, not an int >= 1"),
        ({"schema": 2, "model": {}}, r"its 'model' entry is not"),
        ({"schema": 2, "model": {"keys": ["weight"], "aliases": {"bias": "b"}}}, "'model' entry"),
        (
            {"schema": 2, "model": {"keys": ["weight", "bias"]}},
            r"refers to tensors it does not hold: \['model/weight', 'model/bias'\]",
        ),
        ({"schema": 2, "optimizer": {"class": "x"}}, r"its 'optimizer' entry lacks"),
        ({"schema": 2, "extra": [], "extra_tensors": []}, r"its 'extra' is not a dict"),
        ({"schema": 2, "extra_tensors": ["rng"]}, r"does not hold: \['extra/rng'\]"),
    ],
)
def test_a_container_with_a_foreign_meta_is_a_checkpoint_error(meta, match, tmp_path):
    from memopt_checkpoint.container import write_checkpoint

    write_checkpoint(tmp_path / "x.mopt", {}, meta=meta)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError, match=r"x\.mopt is not a memopt_checkpoint\.save file"):
        load(tmp_path / "x.mopt", model=model if "model" in meta else None, optimizer=opt)
    with pytest.raises(CheckpointError, match=match):
        load(tmp_path / "x.mopt", model=model, optimizer=opt)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_group_listing_a_parameter_twice_is_named(tmp_path):
    """A checkpoint edited (its checksums recomputed) to list a name twice in a param group:
    the message said the group "lacks [] and has []" (a helper's hunt, 2026-12-07)."""
    from memopt_checkpoint.container import CheckpointReader, write_checkpoint

    model, opt = build("memopt-q8-fp32")
    save(tmp_path / "ok.mopt", model=model, optimizer=opt)
    with CheckpointReader(tmp_path / "ok.mopt") as r:
        meta = copy.deepcopy(r.meta)
        tensors = {k: r.load(k) for k in r}
    names = meta["optimizer"]["param_groups"][0]["params"]
    names.append(names[0])
    write_checkpoint(tmp_path / "dup.mopt", tensors, meta=meta)
    with pytest.raises(
        StateDictError, match="param group 0 of the checkpoint lists a parameter tw"
    ):
        load(tmp_path / "dup.mopt", model=model, optimizer=opt)


def _edited(tmp_path, edit):
    """A real save's meta passed through ``edit`` and written back with its tensors (checksums
    right: an edit, not damage); returns the path and a model and optimizer to load into."""
    from memopt_checkpoint.container import CheckpointReader, write_checkpoint

    model, opt = build("memopt-q8-fp32")
    train(model, opt, 2)
    save(tmp_path / "ok.mopt", model=model, optimizer=opt, extra={"t": torch.arange(3)})
    with CheckpointReader(tmp_path / "ok.mopt") as r:
        meta = copy.deepcopy(r.meta)
        tensors = {k: r.load(k) for k in r}
    edit(meta)
    write_checkpoint(tmp_path / "edited.mopt", tensors, meta=meta)
    return tmp_path / "edited.mopt", *build("memopt-q8-fp32", seed=7)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        # an alias of a list: a bare TypeError (unhashable)
        (lambda m: m["model"]["aliases"].update({"head.weight": []}), "'model' entry is not"),
        (lambda m: m["model"]["aliases"].update({"head.weight": {}}), "'model' entry is not"),
        # a stored name made an alias of another of its shape and dtype: loaded silently with
        # the other's values
        (
            lambda m: m["model"]["aliases"].update({"mid.bias": "norm.weight"}),
            r"names \['mid.bias'\] both as a stored tensor, an alias or a value",
        ),
        (
            lambda m: m["model"]["values"].update({"head.weight": 1}),
            r"names \['head.weight'\] both",
        ),
    ],
)
def test_an_edited_model_entry_is_a_checkpoint_error(tmp_path, edit, match):
    """A bad-input hunt (2026-12-08): the file's checksums are right, its meta is not what
    save writes."""
    path, model, opt = _edited(tmp_path, edit)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError, match=match):
        load(path, model=model, optimizer=opt)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def _share_first_exp_avg(meta):
    state = meta["optimizer"]["state"]
    first = next(iter(state.values()))["exp_avg"]
    for entry in state.values():
        entry["exp_avg"] = first


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m.update(extra_tensors=["t"] * 1000), r"\['extra/t', 'extra/t', "),
        (_share_first_exp_avg, r"\['optim/emb.weight/exp_avg', "),
        (lambda m: m["model"]["keys"].append("mid.bias"), r"\['model/mid.bias'\]"),
    ],
)
def test_a_tensor_referred_to_twice_is_refused_before_it_is_read(
    tmp_path, monkeypatch, edit, match
):
    """save refers to each stored tensor once. Each mention was read anew: a meta listing one
    extra tensor 1,000 times read it 1,000 times (of a 1 GB tensor, 1 TB from a file of 1 GB;
    a bad-input hunt, 2026-12-08). Refused before anything is read."""
    from memopt_checkpoint.container import CheckpointReader

    path, model, opt = _edited(tmp_path, edit)
    reads = []
    real_load = CheckpointReader.load

    def counted(self, key, device="cpu"):
        reads.append(key)
        return real_load(self, key, device)

    monkeypatch.setattr(CheckpointReader, "load", counted)
    with pytest.raises(CheckpointError, match=f"refers to tensors more than once: {match}"):
        load(path, model=model, optimizer=opt)
    assert reads == []


@pytest.mark.parametrize("where", ["group", "state", "memopt"])
def test_an_optimizer_entry_nested_too_deeply_is_a_checkpoint_error(tmp_path, where):
    """400 levels of lists in a param group, a state entry or the memopt entry: load's checks
    recursed 2 frames a level, a bare RecursionError (a bad-input hunt, 2026-12-08)."""
    deep: list = []
    inner = deep
    for _ in range(400):
        inner.append([])
        inner = inner[0]

    def edit(meta):
        info = meta["optimizer"]
        target = {
            "group": info["param_groups"][0],
            "state": next(iter(info["state"].values())),
            "memopt": info["memopt"],
        }[where]
        target["deep"] = deep

    path, model, opt = _edited(tmp_path, edit)
    with pytest.raises(CheckpointError, match="'optimizer' entry is nested more than 64 levels"):
        load(path, model=model, optimizer=opt)


@pytest.mark.parametrize("wrapper", ["DataParallel", "DistributedDataParallel"])
def test_fp32_state_dict_of_a_wrapped_model_has_the_same_keys_for_every_optimizer(
    wrapper, tmp_path
):
    """The bare model's keys (no ``module.``), as memopt_core.fp32_state.get_fp32_model_state_dict has."""
    ecc = pytest.importorskip("memopt_ecc")
    dist = torch.distributed
    if wrapper == "DistributedDataParallel":
        if not dist.is_available() or not dist.is_gloo_available():
            pytest.skip("needs torch.distributed with gloo")
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1
        )
    try:
        inner = torch.nn.Linear(4, 4).to(torch.bfloat16)
        model = getattr(torch.nn.parallel, wrapper)(inner)
        assert list(model.state_dict()) == ["module.weight", "module.bias"]
        for opt in (
            None,
            torch.optim.AdamW(model.parameters()),
            MemOptimizer(model.parameters(), rule="adamw", lr=1e-2),
            ecc.FlashAdamW(model.parameters(), lr=1e-3),
        ):
            sd = fp32_model_state_dict(model, opt)
            assert list(sd) == ["weight", "bias"]
            assert torch.equal(sd["weight"], inner.weight.float())
        export_fp32(tmp_path / "fp32.pt", model)
        inner.load_state_dict(torch.load(tmp_path / "fp32.pt", weights_only=True))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("optimizer", [None, "torch"])
def test_fp32_state_dict_without_a_memopt_optimizer_is_fp32(optimizer):
    """Without a memopt optimizer every floating entry is widened from the model (mutation
    testing: this path was never dtype-checked)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).bfloat16()
    opt = None if optimizer is None else torch.optim.SGD(model.parameters(), lr=0.1)
    sd = fp32_model_state_dict(model, opt)
    floating = {k: v for k, v in sd.items() if v.is_floating_point()}
    assert set(floating) == {"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                             "1.running_var"}  # fmt: skip
    for k, v in floating.items():
        assert v.dtype == torch.float32, k
        assert torch.equal(v, model.state_dict()[k].float()), k


def test_fp32_export_refuses_what_is_no_optimizer_of_the_model(tmp_path):
    """``opt.state_dict()`` for ``opt``, a string, or another model's optimizer: the export
    widened the bf16 weights and left out the ECC masters it exists to keep (a helper's hunt,
    2026-12-07)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).bfloat16()
    opt = MemOptimizer(model.parameters(), master="ecc24", lr=1e-3)
    other = MemOptimizer(torch.nn.Linear(8, 8).bfloat16().parameters(), master="ecc24")
    for bad, error, message in (
        (opt.state_dict(), TypeError, "optimizer itself .* got dict"),
        ("opt", TypeError, "got str"),
        (other, ConfigError, "holds none of the model's parameters"),
    ):
        with pytest.raises(error, match=message):
            fp32_model_state_dict(model, bad)
        with pytest.raises(error, match=message):
            export_fp32(tmp_path / "w.pt", model, bad)
    assert not (tmp_path / "w.pt").exists()
    half = MemOptimizer([model.weight], master="ecc24")  # a part of the model: its masters
    assert set(fp32_model_state_dict(model, half)) == {"weight", "bias"}


def test_fp32_export_of_ecc_masters_needs_no_memopt_ecc(tmp_path, monkeypatch):
    """memopt-checkpoint depends on memopt-core only; without memopt-ecc the export refused every
    MemOptimizer (adversarial testing, 2026-12-04). The decode now lives in memopt-core."""
    from memopt_core.fp32_state import fp32_master

    monkeypatch.setitem(sys.modules, "memopt_ecc", None)  # as if not installed
    model, opt = build("memopt-q8-fp32")
    torch.manual_seed(1)
    bf16 = Net().to(torch.bfloat16)
    ecc = MemOptimizer(bf16.parameters(), rule="adamw", lr=1e-2, master="ecc24", moments="q8")
    for m, o in ((model, opt), (bf16, ecc)):
        train(m, o, 2)
        export_fp32(tmp_path / "w.pt", m, o)
        got = torch.load(tmp_path / "w.pt", weights_only=True)
        params = dict(m.named_parameters(remove_duplicate=False))
        for k, v in got.items():
            assert v.dtype == torch.float32
            if k in params:
                assert torch.equal(v, fp32_master(o, params[k]).cpu()), k
    assert not torch.equal(got["mid.weight"], bf16.mid.weight.float())  # the code counted


def test_state_dict_entries_save_does_not_store_are_refused(tmp_path):
    """A state-dict post hook's top-level entry was dropped silently, and the matching load
    hook failed later with a bare KeyError (adversarial testing, 2026-12-04)."""
    model, opt = build("memopt-q8-fp32")
    train(model, opt, 1)
    handle = opt.register_state_dict_post_hook(lambda o, sd: sd.update(ema_decay=0.99))
    with pytest.raises(ConfigError, match=r"top-level entries \['ema_decay'\] .*extra="):
        save(tmp_path / "ck.mopt", model=model, optimizer=opt)
    assert not (tmp_path / "ck.mopt").exists()
    handle.remove()
    save(tmp_path / "ck.mopt", model=model, optimizer=opt, extra={"ema_decay": 0.99})
    assert load(tmp_path / "ck.mopt", model=model, optimizer=opt) == {"ema_decay": 0.99}


def test_tuple_hyperparameters_load_back_as_tuples(tmp_path):
    """JSON keeps no tuples: Rprop's etas and step_sizes came back as lists (only betas was
    converted; adversarial testing, 2026-12-04)."""
    model = Net()
    opt = torch.optim.Rprop(model.parameters(), etas=(0.4, 1.3))
    train(model, opt, 1)
    save(tmp_path / "ck.mopt", model=model, optimizer=opt)
    twin = torch.optim.Rprop(model.parameters())
    load(tmp_path / "ck.mopt", model=model, optimizer=twin)
    assert twin.param_groups[0]["etas"] == (0.4, 1.3)
    assert twin.param_groups[0]["step_sizes"] == opt.param_groups[0]["step_sizes"]
    assert isinstance(twin.param_groups[0]["step_sizes"], tuple)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_adambridge_inf_or_nan_grad_norm_round_trips(bad, tmp_path):
    """A clipping AdamBridge keeps ``last_grad_norm`` inf or NaN after a step whose gradients
    overflowed; save refused it ("JSON has no inf/nan"), so no checkpoint could be written
    (adversarial testing, 2026-12-06). The meta marks it and load gives it back."""
    offload = pytest.importorskip("memopt_offload")
    from memopt_checkpoint.container import read_meta

    def make(seed):
        torch.manual_seed(seed)
        model = Net().to(torch.bfloat16)
        return model, offload.AdamBridge(
            model.parameters(), lr=1e-2, precision="bf16", max_grad_norm=1.0
        )

    model, opt = make(0)
    train(model, opt, 1)
    ids = batch(1)
    model(ids).float().sum().backward()
    model.mid.bias.grad[0] = bad
    opt.step()
    opt.zero_grad()
    assert str(opt.last_grad_norm) == str(bad)
    save(tmp_path / "ck.mopt", model=model, optimizer=opt)
    marked = read_meta(tmp_path / "ck.mopt")["optimizer"]["memopt"]["last_grad_norm"]
    assert marked == {"$float": str(bad)}
    twin, topt = make(9)
    load(tmp_path / "ck.mopt", model=twin, optimizer=topt)
    assert str(topt.last_grad_norm) == str(bad)  # NaN stays NaN (NaN != NaN)
    train(model, opt, 2, start=2)
    train(twin, topt, 2, start=2)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))


def test_non_finite_floats_in_optimizer_state_and_their_marker(tmp_path):
    """Any optimizer's inf / -inf / NaN (in groups, state, nested) round-trips; a value that
    would read as the marker is refused on save, an edited marker on load."""
    from memopt_checkpoint.container import read_meta, write_checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.param_groups[0]["bounds"] = (float("-inf"), [1.5, float("inf")], {"x": float("nan")})
    save(tmp_path / "ck.mopt", optimizer=opt)
    twin = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    load(tmp_path / "ck.mopt", optimizer=twin)
    lo, hi, nested = twin.param_groups[0]["bounds"]
    assert (lo, hi) == (float("-inf"), [1.5, float("inf")])
    assert list(nested) == ["x"]
    assert nested["x"] != nested["x"]  # NaN

    meta = read_meta(tmp_path / "ck.mopt")
    meta["optimizer"]["param_groups"][0]["bounds"][0] = {"$float": "1.5"}
    write_checkpoint(tmp_path / "edited.mopt", {}, meta=meta)
    with pytest.raises(CheckpointError, match=r"\{'\$float': \.\.\.\} in its 'optimizer' entry"):
        load(tmp_path / "edited.mopt", optimizer=twin)

    for marker_like in ({"$float": "inf"}, [{"$float": 1, "y": 2}]):
        opt.param_groups[0]["bounds"] = marker_like
        with pytest.raises(ConfigError, match=r"key '\$float', which marks inf and nan"):
            save(tmp_path / "bad.mopt", optimizer=opt)
    assert not (tmp_path / "bad.mopt").exists()


@pytest.mark.parametrize("optimizer", [None, "torch", "memopt", "bridge"])
def test_fp32_state_dict_keeps_float64_entries(optimizer):
    """float64 entries stay float64 (fp32 would round them) whatever the optimizer; only
    narrower floating ones are widened. Without a memopt optimizer they were rounded to fp32
    (adversarial testing, 2026-12-06)."""
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    model.register_buffer("scale", torch.tensor([1 / 3], dtype=torch.float64))
    if optimizer == "torch":
        opt = torch.optim.AdamW(model.parameters())
    elif optimizer == "memopt":
        opt = MemOptimizer(model.parameters(), rule="adamw")
    elif optimizer == "bridge":
        offload = pytest.importorskip("memopt_offload")
        opt = offload.AdamBridge(model.parameters(), lr=1e-2, precision="bf16")
    else:
        opt = None
    sd = fp32_model_state_dict(model, opt)
    assert sd["scale"].dtype == torch.float64
    assert sd["scale"].item() == 1 / 3
    assert sd["weight"].dtype == torch.float32
    assert torch.equal(sd["weight"], model.weight.float())
