"""The ``memopt`` entry (rule, seed, version) through torch's state-dict helpers.

``torch.distributed.checkpoint.state_dict``'s ``get_state_dict`` / ``set_state_dict`` (and their
``get_optimizer_state_dict`` / ``set_optimizer_state_dict``) keep only an optimizer state
dict's ``state`` and ``param_groups``, but every key of each group. ``state_dict()`` therefore
repeats the entry in every saved group, and ``load_state_dict`` reads it from there when the top
level lacks it: before, a load through those helpers kept the optimizer's own seed (training went
on with other stochastic-rounding bits) and took another rule's state. A single process with a
plain ``nn.Module`` needs no process group. DCP files: memopt-checkpoint's test_dcp.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from memopt_core import MemOptimizer, StateDictError

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("needs torch.distributed", allow_module_level=True)
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

#: stochastic rounding decides the ECC-24 master and q8 moments: the seed changes the bits
CONFIG = dict(lr=1e-2, master="ecc24", moments="q8", stochastic_rounding=True)
BACKENDS = ["torch", "cpu"]


def build(backend, *, seed, rule="adamw", init=0):
    torch.manual_seed(init)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 48), torch.nn.GELU(), torch.nn.Linear(48, 9)
    ).to(torch.bfloat16)
    ps = list(model.parameters())
    groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": 5e-3}]
    return model, MemOptimizer(groups, rule=rule, seed=seed, backend=backend, **CONFIG)


def train(model, opt, steps, start=0):
    for t in range(start, start + steps):
        x = torch.randn(6, 20, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def same_params(a, b):
    return all(
        torch.equal(p.view(torch.int16), q.view(torch.int16))
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def no_live_meta(opt):
    return all("memopt" not in g for g in opt.param_groups)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_through_torchs_helpers_into_another_seed_is_bit_identical(backend):
    if backend == "cpu":
        pytest.importorskip("memopt_kernels_cpu")
    straight, sopt = build(backend, seed=5)
    train(straight, sopt, 7)

    first, fopt = build(backend, seed=5)
    train(first, fopt, 4)
    msd, osd = copy.deepcopy(get_state_dict(first, fopt))

    resumed, ropt = build(backend, seed=42, init=1)  # another seed and other weights
    set_state_dict(resumed, ropt, model_state_dict=msd, optim_state_dict=osd)
    train(resumed, ropt, 3, start=4)
    # before: the load kept seed 42, and the continuation rounded with other bits
    assert same_params(straight, resumed)
    assert ropt.seed == 5
    assert no_live_meta(ropt)
    assert "memopt" not in osd  # what torch keeps: the groups, with the entry in each
    assert [g["memopt"] for g in osd["param_groups"]] == [
        {"rule": "adamw", "seed": 5, "version": 2, "decay_norm_beta2": [0.999, 0.999]}
    ] * 2
    # the control: a different seed does change the bits, so the test can tell
    other, oopt = build(backend, seed=42)
    train(other, oopt, 7)
    assert not same_params(straight, other)


def test_another_rules_state_through_torchs_helpers_is_refused():
    model, opt = build("torch", seed=5)
    train(model, opt, 2)
    osd = copy.deepcopy(get_optimizer_state_dict(model, opt))
    twin, adam = build("torch", seed=5, rule="adam")
    train(twin, adam, 1)
    before = copy.deepcopy(adam.state_dict())
    with pytest.raises(StateDictError, match=r"saved by a 'adamw' optimizer; this one runs 'adam'"):
        set_optimizer_state_dict(twin, adam, optim_state_dict=osd)
    after = adam.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i, entry in before["state"].items():
        assert all(torch.equal(v, after["state"][i][k]) for k, v in entry.items())


def _group_only(opt):
    """``opt.state_dict()`` as torch's helpers hand it over: no top-level entry."""
    sd = copy.deepcopy(opt.state_dict())
    del sd["memopt"]
    return sd


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda sd: sd["param_groups"][1]["memopt"].update(seed=6),
            r"param groups 0 and 1 of the state dict hold different 'memopt' entries",
        ),
        (
            lambda sd: sd["param_groups"][0]["memopt"].update(rule="lion"),
            r"param groups 0 and 1 of the state dict hold different 'memopt' entries",
        ),
        (
            lambda sd: sd["param_groups"][1].pop("memopt"),
            r"param group\(s\) \[0\] of the state dict hold a 'memopt' entry .* group\(s\) \[1\] "
            "none",
        ),
        (
            lambda sd: [g["memopt"].update(version=99) for g in sd["param_groups"]],
            r"the state dict has version 99; this memopt reads versions 1 to 2",
        ),
        (
            lambda sd: [g["memopt"].update(seed=-1) for g in sd["param_groups"]],
            r"the state dict's seed must be an int in \[0, 2\*\*64\), got -1",
        ),
        (
            lambda sd: [g.update(memopt="adamw") for g in sd["param_groups"]],
            r"the state dict's 'memopt' entry must be a dict",
        ),
    ],
    ids=["seeds-differ", "rules-differ", "one-group-lacks-it", "version", "seed", "not-a-dict"],
)
def test_group_entries_are_checked_and_must_agree(edit, match):
    model, opt = build("torch", seed=5)
    train(model, opt, 2)
    sd = _group_only(opt)
    edit(sd)
    _, fresh = build("torch", seed=8)
    with pytest.raises(StateDictError, match=match):
        fresh.load_state_dict(sd)
    assert fresh.seed == 8
    assert not fresh.state
    assert no_live_meta(fresh)


def test_state_dict_repeats_the_entry_in_its_groups_and_live_groups_never_hold_it():
    model, opt = build("torch", seed=5)
    train(model, opt, 2)
    sd = opt.state_dict()
    assert sd["memopt"] == {
        "rule": "adamw",
        "seed": 5,
        "version": 2,
        "decay_norm_beta2": [0.999, 0.999],
    }
    assert all(g["memopt"] == sd["memopt"] for g in sd["param_groups"])
    assert all(g["memopt"] is not sd["memopt"] for g in sd["param_groups"])  # copies
    assert no_live_meta(opt)
    # the top level wins where both are there (the groups of a dict an older memopt rewrote
    # may hold stale copies)
    both = copy.deepcopy(sd)
    for g in both["param_groups"]:
        g["memopt"]["seed"] = 77
    _, fresh = build("torch", seed=8)
    fresh.load_state_dict(both)
    assert fresh.seed == 5
    assert no_live_meta(fresh)
    # a key put into a live group by hand (ZeroRedundancyOptimizer copies saved group keys into
    # its optimizer's groups): state_dict() writes the optimizer's own, a load removes it
    fresh.param_groups[0]["memopt"] = {"rule": "lion", "seed": 1}
    assert fresh.state_dict()["param_groups"][0]["memopt"]["seed"] == 5
    fresh.load_state_dict(_group_only(opt))
    assert fresh.seed == 5
    assert no_live_meta(fresh)


def test_dicts_without_group_entries_load_as_before():
    model, opt = build("torch", seed=5)
    train(model, opt, 2)
    old = copy.deepcopy(opt.state_dict())  # the layout of an older memopt: top level only
    for g in old["param_groups"]:
        del g["memopt"]
    _, fresh = build("torch", seed=8)
    fresh.load_state_dict(old)
    assert fresh.seed == 5
    assert no_live_meta(fresh)
    # an older memopt's dict through torch's helpers: no entry anywhere, the optimizer's seed
    del old["memopt"]
    _, fresh = build("torch", seed=8)
    fresh.load_state_dict(old)
    assert fresh.seed == 8
    assert no_live_meta(fresh)


# torch.distributed.optim uses torch.jit at import
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.interface` is deprecated:DeprecationWarning")
def test_zero_redundancy_optimizer_resumes_bit_identically_with_the_saved_seed(tmp_path):
    """torch's ZeroRedundancyOptimizer builds its state dict from its own param groups and the
    per-parameter states, and loads the states by writing ``optimizer.state`` directly: the
    memopt entry does not travel through it (documented in memopt-checkpoint's README). Built
    with the saved seed, a resume continues bit for bit; with another, it keeps its own."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def build_zero(seed, init=0):
        torch.manual_seed(init)
        model = torch.nn.Sequential(
            torch.nn.Linear(20, 48), torch.nn.GELU(), torch.nn.Linear(48, 9)
        ).to(torch.bfloat16)
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=MemOptimizer, seed=seed, backend="torch", **CONFIG
        )
        return model, opt

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        straight, sopt = build_zero(5)
        train(straight, sopt, 6)
        first, fopt = build_zero(5)
        train(first, fopt, 3)
        fopt.consolidate_state_dict(to=0)
        osd = copy.deepcopy(fopt.state_dict())
        assert "memopt" not in osd
        assert all("memopt" not in g for g in osd["param_groups"])
        for seed, same in ((5, True), (42, False)):
            resumed, ropt = build_zero(seed, init=1)
            resumed.load_state_dict(first.state_dict())
            ropt.load_state_dict(copy.deepcopy(osd))
            train(resumed, ropt, 3, start=3)
            assert ropt.optim.seed == seed
            assert same_params(straight, resumed) is same
    finally:
        dist.destroy_process_group()
