"""torch.distributed.checkpoint (DCP) with memopt state dicts of unsharded models.

memopt optimizers' ``state_dict()`` holds plain tensors (views of the state arenas; AdamBridge's
host masters), so DCP saves them as they are and ``dcp.load`` writes the saved values straight
into a fresh optimizer's arenas (host memory for AdamBridge: no trip through a GPU). Resume is
bit-identical. FSDP2-sharded parameters and resharding are in test_dcp_sharded.py. DCP pickles
its save plans through numpy, so these tests need it.
"""

from __future__ import annotations

import copy

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
pytest.importorskip("numpy", reason="torch.distributed.checkpoint pickles its plans with numpy")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)
import torch.distributed.checkpoint as dcp  # noqa: E402

from memopt_checkpoint import check_dcp_load  # noqa: E402
from memopt_core import MemOptimizer  # noqa: E402
from memopt_core.errors import ConfigError, StateDictError  # noqa: E402


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
    """Steps ``start`` .. ``start + steps - 1`` of a Sequential whose first layer is Linear, on
    a batch drawn from the step's number (in the model's dtype)."""
    first = model[0]
    for t in range(start, start + steps):
        x = torch.randn(6, first.in_features, generator=torch.Generator().manual_seed(t))
        model(x.to(first.weight.dtype)).float().pow(2).mean().backward()
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
        with pytest.raises(ConfigError, match=r"no optimizer state yet: call .*init_state\(\)"):
            check_dcp_load(ropt, tmp_path / "ck")
        ropt.init_state()  # DCP loads into existing tensors: create the state to load into
    check_dcp_load(ropt, tmp_path / "ck")
    target = {"model": resumed.state_dict(), "optim": ropt.state_dict()}
    dcp.load(target, checkpoint_id=tmp_path / "ck")
    resumed.load_state_dict(target["model"])
    ropt.load_state_dict(target["optim"])
    train(resumed, ropt, 3, start=4)
    for (n, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)), n


def _seeded(seed, rule="adamw", momentum=None):
    """A bf16 model and a MemOptimizer whose stochastic rounding (ECC-24 master, q8 moments)
    depends on ``seed``; two param groups. The model's weights do not depend on it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 48), torch.nn.GELU(), torch.nn.Linear(48, 9)
    ).to(torch.bfloat16)
    ps = list(model.parameters())
    groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": 5e-3}]
    kw = {} if momentum is None else {"momentum": momentum}
    return model, MemOptimizer(
        groups, rule=rule, lr=1e-2, master="ecc24", moments="q8", seed=seed, **kw
    )


@pytest.mark.usefixtures("process_group")
def test_torchs_state_dict_helpers_resume_into_another_seed_through_dcp(tmp_path):
    """torch's get_state_dict / set_state_dict keep only an optimizer's 'state' and
    'param_groups' (keyed by parameter name). memopt's 'memopt' entry (rule, seed, version)
    travels in every saved param group: check_dcp_load reads it there (before: "no 'memopt'
    entry"), and the load takes the saved seed, so an optimizer built with another one
    resumes bit for bit (before: it kept its own seed and rounded with other bits)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    straight, sopt = _seeded(5)
    train(straight, sopt, 7)
    first, fopt = _seeded(5)
    train(first, fopt, 4)
    msd, osd = get_state_dict(first, fopt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ck")

    resumed, ropt = _seeded(42)
    msd, osd = get_state_dict(resumed, ropt)  # creates the state by a step at lr 0
    check_dcp_load(ropt, tmp_path / "ck")
    target = {"model": msd, "optim": osd}
    dcp.load(target, checkpoint_id=tmp_path / "ck")
    set_state_dict(
        resumed, ropt, model_state_dict=target["model"], optim_state_dict=target["optim"]
    )
    assert ropt.seed == 5
    assert all("memopt" not in g for g in ropt.param_groups)
    train(resumed, ropt, 3, start=4)
    for (n, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)), n


@pytest.mark.usefixtures("process_group")
def test_check_dcp_load_checks_the_entry_a_get_state_dict_checkpoint_holds(tmp_path):
    """Another rule, a version or seed load_state_dict would refuse, param groups whose entries
    differ, another compress_state_dict: refused before dcp.load writes anything, for
    checkpoints saved through torch's get_state_dict as for those of opt.state_dict()."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _seeded(5)
    train(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ck")

    # adamw's state into adam (the same state layout: dcp.load would fill it in)
    twin, adam = _seeded(5, rule="adam")
    msd, osd = get_state_dict(twin, adam)
    with pytest.raises(StateDictError, match=r"state of a 'adamw' optimizer; this one runs 'adam'"):
        check_dcp_load(adam, tmp_path / "ck")
    target = {"model": msd, "optim": osd}
    dcp.load(target, checkpoint_id=tmp_path / "ck")  # what check_dcp_load stands before
    with pytest.raises(StateDictError, match=r"saved by a 'adamw' optimizer; this one runs 'adam'"):
        set_state_dict(
            twin, adam, model_state_dict=target["model"], optim_state_dict=target["optim"]
        )
    assert all("memopt" not in g for g in adam.param_groups)

    def saved_with(edit, name):
        _, osd = get_state_dict(model, opt)
        osd = {
            **osd,
            "param_groups": [dict(g, memopt=dict(g["memopt"])) for g in osd["param_groups"]],
        }
        edit(osd["param_groups"])
        dcp.save({"optim": osd}, checkpoint_id=tmp_path / name)
        return tmp_path / name

    _, fresh = _seeded(8)
    fresh.init_state()
    cases = [
        (
            lambda gs: gs[1]["memopt"].update(seed=6),
            r"param groups 0 and 1 of the checkpoint hold different 'memopt' entries",
        ),
        (
            lambda gs: gs[1].pop("memopt"),
            r"param group\(s\) \[0\] of the checkpoint hold a 'memopt' entry .* group\(s\) \[1\]",
        ),
        (
            lambda gs: [g["memopt"].update(version=99) for g in gs],
            r"the checkpoint has version 99; this memopt reads versions 1 to 2",
        ),
        (
            lambda gs: [g["memopt"].update(seed=2**64) for g in gs],
            r"the checkpoint's seed must be an int in \[0, 2\*\*64\)",
        ),
    ]
    for i, (edit, match) in enumerate(cases):
        with pytest.raises(StateDictError, match=match):
            check_dcp_load(fresh, saved_with(edit, f"bad{i}"))
    check_dcp_load(fresh, saved_with(lambda gs: None, "good"))
    # the top level of opt.state_dict() is checked the same way (its version was not)
    sd = opt.state_dict()
    sd["memopt"] = dict(sd["memopt"], version=99)
    dcp.save({"optim": sd}, checkpoint_id=tmp_path / "v99")
    with pytest.raises(StateDictError, match=r"the checkpoint has version 99"):
        check_dcp_load(fresh, tmp_path / "v99")

    # FlashOptimizer's compress_state_dict, saved in the groups too
    ecc = pytest.importorskip("memopt_ecc")
    flash_model, flash = build("flash-lion")
    flash.compress_state_dict = False
    train(flash_model, flash, 1)
    _, osd = get_state_dict(flash_model, flash)
    dcp.save({"optim": osd}, checkpoint_id=tmp_path / "flash")
    compressed = ecc.FlashLion(flash_model.parameters(), lr=1e-3)
    compressed.init_state()
    with pytest.raises(StateDictError, match=r"saved with compress_state_dict=False"):
        check_dcp_load(compressed, tmp_path / "flash")
    compressed.compress_state_dict = False
    check_dcp_load(compressed, tmp_path / "flash")


@pytest.mark.usefixtures("process_group")
def test_check_dcp_load_reads_a_get_state_dict_checkpoints_state_by_name(tmp_path):
    """torch's get_state_dict keys the state by parameter name ("0.weight": dots inside), in
    the optimizer's order: check_dcp_load compares each parameter's saved state keys by it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _sgd(0.9)
    train(model, opt, 2)
    _, osd = get_state_dict(model, opt)
    dcp.save({"optim": osd}, checkpoint_id=tmp_path / "momentum")
    _, same = _sgd(0.9)
    same.init_state()
    check_dcp_load(same, tmp_path / "momentum")
    _, none = _sgd(0.0)
    none.init_state()
    with pytest.raises(
        StateDictError,
        match=r"holds \['momentum_buffer'\] for parameter index 0 .*saved as '0.weight'.*lacks",
    ):
        check_dcp_load(none, tmp_path / "momentum")
    _, frozen = _sgd(0.9, frozen_first=True)
    frozen.init_state()
    with pytest.raises(ConfigError, match=r"parameter index 0 .*saved as '0.weight'.*none here"):
        check_dcp_load(frozen, tmp_path / "momentum")


@pytest.mark.usefixtures("process_group")
def test_a_dcp_checkpoint_without_group_entries(tmp_path):
    """opt.state_dict() saved by a memopt that kept its 'memopt' entry at the top level only:
    check_dcp_load reads it there, dcp.load of the new state_dict() (entries in every group)
    reports the group entries missing before loading anything, and a target without them
    loads, with the saved seed."""
    model, opt = _seeded(5)
    train(model, opt, 3)
    old = opt.state_dict()
    for g in old["param_groups"]:
        del g["memopt"]
    dcp.save({"model": model.state_dict(), "optim": old}, checkpoint_id=tmp_path / "old")
    train(model, opt, 2, start=3)

    twin, topt = _seeded(42)
    topt.init_state()
    check_dcp_load(topt, tmp_path / "old")
    target = {"model": twin.state_dict(), "optim": topt.state_dict()}
    live = {id(p): s["exp_avg"].clone() for p, s in topt.state.items()}
    with pytest.raises(
        dcp.api.CheckpointException,
        match=r"Missing key in checkpoint state_dict: optim\.param_groups\.0\.memopt\.",
    ):
        dcp.load(target, checkpoint_id=tmp_path / "old")
    assert all(torch.equal(s["exp_avg"], live[id(p)]) for p, s in topt.state.items())
    for g in target["optim"]["param_groups"]:
        del g["memopt"]
    dcp.load(target, checkpoint_id=tmp_path / "old")
    twin.load_state_dict(target["model"])
    topt.load_state_dict(target["optim"])
    assert topt.seed == 5
    train(twin, topt, 2, start=3)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))


@pytest.mark.usefixtures("process_group")
def test_check_dcp_load_refuses_other_formats_before_dcp_writes(tmp_path):
    model, opt = build("memopt-ecc24-q8")
    train(model, opt, 2)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=tmp_path)

    def target(split=False, **kw):
        twin, _ = build("memopt-ecc24-q8", seed=1)
        ps = list(twin.parameters())
        groups = [{"params": ps[:2]}, {"params": ps[2:]}] if split else ps
        config = dict(rule="adamw", lr=1e-2, master="ecc24", moments="q8", seed=5) | kw
        topt = MemOptimizer(groups, **config)
        topt.init_state()
        train(twin, topt, 1)
        return topt

    # ECC-24 codes into ECC-32 arenas: dcp.load would cast them in (the sizes match)
    ecc32 = target(master="ecc32")
    live = {id(p): s["master_code"].clone() for p, s in ecc32.state.items()}
    with pytest.raises(
        StateDictError,
        match=r"param group 0 of the checkpoint holds master='ecc24' states; this optimizer "
        r"uses master='ecc32': dcp.load would cast them",
    ):
        check_dcp_load(ecc32, tmp_path)
    assert all(torch.equal(s["master_code"], live[id(p)]) for p, s in ecc32.state.items())
    with pytest.raises(StateDictError, match=r"holds moments='q8' states; .* moments='fp8'"):
        check_dcp_load(target(moments="fp8"), tmp_path)
    with pytest.raises(StateDictError, match=r"state of a 'adamw' optimizer; this one runs 'lion'"):
        check_dcp_load(target(rule="lion"), tmp_path)
    with pytest.raises(StateDictError, match=r"no memopt optimizer state under 'optimizer'"):
        check_dcp_load(target(), tmp_path, key="optimizer")
    with pytest.raises(StateDictError, match=r"the checkpoint has 1 param group\(s\), this .* 2"):
        check_dcp_load(target(split=True), tmp_path)
    ecc = pytest.importorskip("memopt_ecc")
    flash_model, flash = build("flash-lion")
    flash.compress_state_dict = False
    train(flash_model, flash, 1)
    dcp.save({"optim": flash.state_dict()}, checkpoint_id=tmp_path / "flash")
    compressed = ecc.FlashLion(flash_model.parameters(), lr=1e-3)
    compressed.init_state()
    with pytest.raises(StateDictError, match=r"saved with compress_state_dict=False"):
        check_dcp_load(compressed, tmp_path / "flash")
    compressed.compress_state_dict = False
    check_dcp_load(compressed, tmp_path / "flash")


def _mlp(order):
    """An MLP's up (64, 16) and down (16, 64) weights: fp32 with q8 moments, states of the same
    sizes; ``order`` lists them to the optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64, bias=False), torch.nn.GELU(), torch.nn.Linear(64, 16, bias=False)
    )
    up, down = model[0].weight, model[2].weight
    params = [up, down] if order == "saved" else [down, up]
    return model, MemOptimizer(params, rule="adamw", lr=1e-2, moments="q8", seed=5)


@pytest.mark.usefixtures("process_group")
def test_dcp_carries_param_shape_and_reordered_parameters_are_refused(tmp_path):
    model, opt = _mlp("saved")
    train(model, opt, 2)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp_path / "ck")

    # the same order: dcp.load fills param_shape in place from the checkpoint
    _, same = _mlp("saved")
    same.init_state()
    check_dcp_load(same, tmp_path / "ck")
    target = {"optim": same.state_dict()}
    for entry in target["optim"]["state"].values():
        entry["param_shape"].fill_(-1)
    dcp.load(target, checkpoint_id=tmp_path / "ck")
    assert [e["param_shape"].tolist() for e in target["optim"]["state"].values()] == [
        [64, 16],
        [16, 64],
    ]
    same.load_state_dict(target["optim"])
    for p, q in zip(opt.param_groups[0]["params"], same.param_groups[0]["params"], strict=True):
        assert all(torch.equal(v, same.state[q][k]) for k, v in opt.state[p].items())

    # the other order: every state tensor fits, only param_shape tells
    _, swapped = _mlp("swapped")
    swapped.init_state()
    live = [{k: v.clone() for k, v in swapped.state[p].items()} for p in swapped.state]
    with pytest.raises(
        StateDictError,
        match=r"state of parameter index 0 was saved for a parameter of shape \(64, 16\); this "
        r"optimizer's parameter 0 has shape \(16, 64\): the state belongs to another parameter",
    ):
        check_dcp_load(swapped, tmp_path / "ck")
    for p, before in zip(swapped.state, live, strict=True):
        assert all(torch.equal(swapped.state[p][k], v) for k, v in before.items())
    # without the check, dcp.load writes and load_state_dict refuses (loudly, not silently)
    target = {"optim": swapped.state_dict()}
    dcp.load(target, checkpoint_id=tmp_path / "ck")
    with pytest.raises(StateDictError, match=r"shape \(64, 16\); this parameter's shape is \(16"):
        swapped.load_state_dict(target["optim"])


@pytest.mark.usefixtures("process_group")
def test_dcp_checkpoint_without_param_shape(tmp_path):
    """A checkpoint of a memopt that did not record shapes: check_dcp_load cannot check them,
    dcp.load of a state_dict() that has them reports them missing before loading anything, and
    a target without them loads."""
    _, opt = _mlp("saved")
    opt.init_state()
    sd = opt.state_dict()
    for entry in sd["state"].values():
        del entry["param_shape"]
    dcp.save({"optim": sd}, checkpoint_id=tmp_path / "old")
    _, fresh = _mlp("saved")
    fresh.init_state()
    check_dcp_load(fresh, tmp_path / "old")
    target = {"optim": fresh.state_dict()}
    with pytest.raises(
        dcp.api.CheckpointException,
        match=r"Missing key in checkpoint state_dict: optim\.state\.0\.param_shape",
    ):
        dcp.load(target, checkpoint_id=tmp_path / "old")
    for entry in target["optim"]["state"].values():
        del entry["param_shape"]
    dcp.load(target, checkpoint_id=tmp_path / "old")
    fresh.load_state_dict(target["optim"])


@pytest.mark.usefixtures("process_group")
def test_dcp_checkpoint_without_the_count_record(tmp_path):
    """A checkpoint of a memopt before the ``decay_norm_step`` record: dcp.load with partial
    loads would leave the live record (a view of the optimizer's own counters, 0 here) beside
    the saved counts, and load_state_dict would convert the moments from it. check_dcp_load
    says to drop the key, and so dropped the checkpoint loads bit for bit."""
    model, opt = _mlp("saved")
    train(model, opt, 3)
    sd = copy.deepcopy(opt.state_dict())
    for entry in sd["state"].values():
        del entry["decay_norm_step"]
    dcp.save({"optim": sd}, checkpoint_id=tmp_path / "old")
    _, fresh = _mlp("saved")
    fresh.init_state()
    with pytest.raises(
        StateDictError,
        match=r"holds no 'decay_norm_step' for parameter index 0 .*an older memopt saved it.*"
        r"entry\.pop\('decay_norm_step', None\)",
    ):
        check_dcp_load(fresh, tmp_path / "old")
    target = {"optim": fresh.state_dict()}
    for entry in target["optim"]["state"].values():
        entry.pop("decay_norm_step", None)
    dcp.load(target, checkpoint_id=tmp_path / "old")
    fresh.load_state_dict(target["optim"])
    for p, q in zip(opt.param_groups[0]["params"], fresh.param_groups[0]["params"], strict=True):
        assert opt.state[p].keys() == fresh.state[q].keys()
        assert all(torch.equal(v, fresh.state[q][k]) for k, v in opt.state[p].items())


@pytest.mark.usefixtures("process_group")
def test_check_dcp_load_refuses_a_parameter_frozen_after_training(tmp_path):
    """The checkpoint holds the state (ECC master code too) of a parameter frozen after
    training, init_state() makes none for it, and dcp.load would drop it silently."""
    ecc = pytest.importorskip("memopt_ecc")

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
        model = model.to(torch.bfloat16)
        return model, ecc.FlashAdamW(model.parameters(), lr=1e-2, master_weight_bits=32)

    def step(model, opt, t):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    model, opt = build(0)
    for t in range(3):
        step(model, opt, t)
    model[0].weight.requires_grad_(False)  # fine-tune only the rest from now on
    step(model, opt, 3)
    want = ecc.get_fp32_model_state_dict(model, opt)
    dcp.save(
        {"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=tmp_path / "ck"
    )

    twin, topt = build(5)
    twin[0].weight.requires_grad_(False)
    topt.init_state()
    with pytest.raises(
        ConfigError,
        match=r"state for parameter index 0 \(parameter #0 of param group 0 \(shape \(16, 16\).*"
        r"which has none here .*unfreeze it, call optimizer.init_state\(\), freeze it again",
    ):
        check_dcp_load(topt, tmp_path / "ck")
    # the way out the message gives: then everything loads
    twin[0].weight.requires_grad_(True)
    topt.init_state()
    twin[0].weight.requires_grad_(False)
    check_dcp_load(topt, tmp_path / "ck")
    sd = {"model": twin.state_dict(), "optim": topt.state_dict()}
    dcp.load(sd, checkpoint_id=tmp_path / "ck")
    twin.load_state_dict(sd["model"])
    topt.load_state_dict(sd["optim"])
    got = ecc.get_fp32_model_state_dict(twin, topt)
    assert all(torch.equal(got[k], want[k]) for k in want)

    # state for more parameters than the optimizer has (one group each): refused as well
    head = torch.nn.Linear(16, 4).to(torch.bfloat16)
    hopt = ecc.FlashAdamW(head.parameters(), lr=1e-2, master_weight_bits=32)
    hopt.init_state()
    with pytest.raises(
        StateDictError, match="state for parameter index 2; this optimizer has 2 parameters"
    ):
        check_dcp_load(hopt, tmp_path / "ck")


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("bad", [-1.0, 2.5, float("nan")])
def test_check_dcp_load_refuses_a_corrupt_step_count(tmp_path, bad):
    """dcp.load writes the saved counts into the live ones, and only load_state_dict refused a
    negative, fractional or NaN one: the live counts were overwritten by then (audit round 4)."""
    _, opt = _mlp("saved")
    opt.init_state()
    sd = opt.state_dict()
    sd["state"][1]["step"] = torch.tensor(bad)
    dcp.save({"optim": sd}, checkpoint_id=tmp_path / "ck")
    _, fresh = _mlp("saved")
    fresh.init_state()
    with pytest.raises(StateDictError, match=r"'step' of parameter index 1 in the checkpoint"):
        check_dcp_load(fresh, tmp_path / "ck")
    assert all(float(fresh.state[p]["step"]) == 0 for p in fresh.state)


def _sgd(momentum, frozen_first=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    if frozen_first:
        model[0].weight.requires_grad_(False)
    return model, MemOptimizer(model.parameters(), rule="sgd", lr=0.1, momentum=momentum)


@pytest.mark.usefixtures("process_group")
def test_check_dcp_load_compares_the_state_keys_of_each_parameter(tmp_path):
    """SGD with momentum saves momentum buffers. A target built with momentum=0 has none:
    dcp.load dropped the saved ones silently and load_state_dict restarted the momentum from a
    zero buffer (found by adversarial testing, 2026-12-04). The reverse made dcp.load fail with
    torch's bare "Missing key". Both are refused before anything is read into the target."""
    model, opt = _sgd(0.9)
    train(model, opt, 2)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp_path / "momentum")
    _, none = _sgd(0.0)
    none.init_state()
    with pytest.raises(
        StateDictError,
        match=r"holds \['momentum_buffer'\] for parameter index 0 .*lacks .*dcp.load would drop "
        r"them silently",
    ):
        check_dcp_load(none, tmp_path / "momentum")
    _, same = _sgd(0.9)
    same.init_state()
    check_dcp_load(same, tmp_path / "momentum")

    model, opt = _sgd(0.0)
    train(model, opt, 2)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp_path / "plain")
    _, heavy = _sgd(0.9)
    heavy.init_state()
    with pytest.raises(
        StateDictError,
        match=r"holds no \['momentum_buffer'\] for parameter index 0 .*would fail on the missing",
    ):
        check_dcp_load(heavy, tmp_path / "plain")


def _unused_head():
    """An MLP and a head that the forward never uses (requires_grad, never a gradient)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    head = torch.nn.Linear(16, 3)
    return model, MemOptimizer([*model.parameters(), *head.parameters()], rule="adamw", lr=1e-2)


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("case", ["frozen", "unused"])
def test_a_parameter_without_state_when_saved(tmp_path, case):
    """The checkpoint has no state for a parameter that has state in the target: one frozen
    when saved and trainable now (gradual unfreezing), or an unused head (no gradient yet: as
    under torch, a step creates only the state of parameters with one), which init_state()
    gives state in the target. check_dcp_load names it (dcp.load failed with a bare "Missing
    key"), and the way out its message gives resumes as the uninterrupted run."""
    build, why, missing = {
        "frozen": (lambda: _sgd(0.9, frozen_first=True), "frozen when it was saved", [0]),
        "unused": (_unused_head, "without a gradient until then", [4, 5]),
    }[case]
    model, opt = build()
    train(model, opt, 2)
    assert sorted(i for i, p in enumerate(opt.param_groups[0]["params"]) if p not in opt.state) == (
        missing
    )
    dcp.save(
        {"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=tmp_path / "ck"
    )
    model[0].weight.requires_grad_(True)
    train(model, opt, 2, start=2)

    twin, topt = _sgd(0.9) if case == "frozen" else _unused_head()
    topt.init_state()
    with pytest.raises(
        ConfigError,
        match=rf"holds no optimizer state for parameter index {missing[0]} .*{why}.*"
        rf"del sd\['optim'\]\['state'\]\[{missing[0]}\]",
    ):
        check_dcp_load(topt, tmp_path / "ck")
    sd = {"model": twin.state_dict(), "optim": topt.state_dict()}
    for index in missing:
        del sd["optim"]["state"][index]
    dcp.load(sd, checkpoint_id=tmp_path / "ck")
    twin.load_state_dict(sd["model"])
    topt.load_state_dict(sd["optim"])
    train(twin, topt, 2, start=2)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def _grouped(order, seed=5, moments=("q8", "bf16"), shard=False):
    """Weights (decayed) and biases (not) of an MLP whose up (64, 16) and down (16, 64) weights
    have q8 states of the same sizes, in two groups with ``moments`` (the formats differ, so
    each group must be compared with its own saved one). ``order`` "reversed"
    lists the groups, and the parameters in each, the other way round; "mixed" puts each
    layer's weight and bias in one group. ``shard``: FSDP2 (``fully_shard``) over the layers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    if shard:
        from torch.distributed.fsdp import fully_shard

        for m in (model[0], model[2], model):
            fully_shard(m)
    up, down = model[0], model[2]
    if order == "mixed":
        pairs = [[up.weight, up.bias], [down.weight, down.bias]]
    else:
        pairs = [[up.weight, down.weight], [up.bias, down.bias]]
    groups = [
        {"params": pairs[0], "weight_decay": 0.1, "lr": 1e-2, "moments": moments[0]},
        {"params": pairs[1], "weight_decay": 0.0, "lr": 3e-3, "moments": moments[1]},
    ]
    if order == "reversed":
        groups = [dict(g, params=g["params"][::-1]) for g in groups[::-1]]
    return model, MemOptimizer(groups, rule="adamw", seed=seed)


@pytest.mark.usefixtures("process_group")
def test_check_dcp_load_with_the_model_maps_a_get_state_dict_checkpoint_by_name(tmp_path):
    """Given the model, check_dcp_load reads the live parameters' names as torch's helpers
    write them: an optimizer whose groups and parameters are listed in another order than
    when saved passes (set_state_dict maps by name, and the states land on their own
    parameters), where the check by position refuses it; groups that hold other parameters
    and a model that is not the optimizer's are refused by name."""
    model, opt = _grouped("saved")
    train(model, opt, 3)
    _saved_by_name(model, opt, tmp_path / "ck")

    twin, topt = _grouped("reversed", seed=9)
    topt.init_state()
    # by position the first live group (the biases, bf16) is compared with the saved weights'
    with pytest.raises(StateDictError, match=r"group 0 of the checkpoint holds moments='q8'"):
        check_dcp_load(topt, tmp_path / "ck")
    check_dcp_load(topt, tmp_path / "ck", model=twin)
    _load_by_name(twin, topt, tmp_path / "ck")
    assert topt.seed == 5
    _same_states(model, opt, twin, topt)
    assert [(g["lr"], g["weight_decay"]) for g in topt.param_groups] == [(3e-3, 0.0), (1e-2, 0.1)]

    # the groups hold other parameters than when saved: no saved group has their names
    mixed_model, mixed = _grouped("mixed")
    mixed.init_state()
    with pytest.raises(
        StateDictError,
        match=r"param group 0 of this optimizer holds parameters of param groups \[0, 1\] of "
        r"the checkpoint: its parameters were grouped otherwise",
    ):
        check_dcp_load(mixed, tmp_path / "ck", model=mixed_model)
    # a model the optimizer's parameters are not in
    with pytest.raises(ConfigError, match=r"is not a parameter of the model given"):
        check_dcp_load(topt, tmp_path / "ck", model=model)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got dict"):
        check_dcp_load(topt, tmp_path / "ck", model={})
    # a format that differs is named by the saved group and the live one it maps to
    fp8_model, fp8 = _grouped("reversed", moments=("q8", "fp8"))  # the biases' differs
    fp8.init_state()
    with pytest.raises(
        StateDictError,
        match=r"param group 1 of the checkpoint \(this optimizer's group 0\) holds moments='bf16'",
    ):
        check_dcp_load(fp8, tmp_path / "ck", model=fp8_model)
    # a checkpoint keyed by index (opt.state_dict()) has no names: the model changes nothing
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp_path / "by_index")
    same_model, same = _grouped("saved")
    same.init_state()
    check_dcp_load(same, tmp_path / "by_index", model=same_model)


@pytest.mark.usefixtures("process_group")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_check_dcp_load_names_parameters_as_torchs_helpers_do(tmp_path):
    """The names come from torch's get_optimizer_state_dict, not named_parameters(): through
    torch.compile's wrapper ('_orig_mod.' in named_parameters, not in the checkpoint) and on
    FSDP2-sharded parameters (one rank) a reordered optimizer passes, and set_state_dict then
    puts each saved state on its own parameter."""
    model, opt = _grouped("saved")
    opt.init_state()
    _saved_by_name(model, opt, tmp_path / "plain")
    twin, topt = _grouped("reversed")
    topt.init_state()
    compiled = torch.compile(twin)  # a wrapper only: nothing runs, so nothing compiles
    assert next(iter(dict(compiled.named_parameters()))).startswith("_orig_mod.")
    check_dcp_load(topt, tmp_path / "plain", model=compiled)

    pytest.importorskip("torch.distributed.fsdp")
    model, opt = _grouped("saved", shard=True)
    train(model, opt, 2)
    _saved_by_name(model, opt, tmp_path / "fsdp")
    twin, topt = _grouped("reversed", seed=9, shard=True)
    topt.init_state()
    with pytest.raises(StateDictError, match=r"group 0 of the checkpoint holds moments='q8'"):
        check_dcp_load(topt, tmp_path / "fsdp")
    check_dcp_load(topt, tmp_path / "fsdp", model=twin)
    _load_by_name(twin, topt, tmp_path / "fsdp")
    _same_states(model, opt, twin, topt)


def _bridge_mlp(precision="bf16", frozen_bias=False, sizes=(20, 48), **kw):
    offload = pytest.importorskip("memopt_offload")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(*sizes), torch.nn.GELU(), torch.nn.Linear(sizes[1], 9)
    ).to(torch.bfloat16)
    model[0].bias.requires_grad_(not frozen_bias)
    return model, offload.AdamBridge(model.parameters(), lr=1e-2, precision=precision, **kw)


@pytest.mark.usefixtures("process_group")
def test_check_dcp_load_checks_an_adam_bridge_checkpoint(tmp_path):
    """AdamBridge (host state from its construction on, no param_shape: its master has the
    parameter's shape): another precision (bf16 into fp32 moments: dcp.load casts them in),
    a parameter frozen when the bridge was built (dcp.load drops its saved state, where
    load_state_dict of the same dict refuses it), a master of another shape and another
    optimizer's checkpoint are refused before dcp.load writes anything; the clipping state is
    checked as load_state_dict checks it."""
    model, opt = _bridge_mlp(max_grad_norm=1.0)
    train(model, opt, 2)
    saved = opt.state_dict()
    dcp.save({"optim": saved}, checkpoint_id=tmp_path / "ck")
    _, same = _bridge_mlp(max_grad_norm=1.0)
    check_dcp_load(same, tmp_path / "ck")

    _, fp32 = _bridge_mlp("fp32")
    with pytest.raises(StateDictError, match=r"holds precision='bf16' state; .* precision='fp32'"):
        check_dcp_load(fp32, tmp_path / "ck")
    _, frozen = _bridge_mlp(frozen_bias=True)
    with pytest.raises(StateDictError, match=r"holds state for parameter index 1, which is frozen"):
        frozen.load_state_dict(saved)
    with pytest.raises(
        ConfigError,
        match=r"parameter index 1 \(parameter of shape \(48,\)\), which has none here \(frozen "
        r"when the AdamBridge was built",
    ):
        check_dcp_load(frozen, tmp_path / "ck")
    _, transposed = _bridge_mlp(sizes=(48, 20))
    with pytest.raises(
        StateDictError,
        match=r"master weight of parameter index 0 has shape \(48, 20\); this optimizer's "
        r"parameter 0 has shape \(20, 48\)",
    ):
        check_dcp_load(transposed, tmp_path / "ck")
    _, memopt_opt = build("memopt-ecc24-q8")
    memopt_opt.init_state()
    with pytest.raises(StateDictError, match=r"holds AdamBridge's state; this optimizer is a Mem"):
        check_dcp_load(memopt_opt, tmp_path / "ck")
    dcp.save({"optim": memopt_opt.state_dict()}, checkpoint_id=tmp_path / "memopt")
    with pytest.raises(StateDictError, match=r"the checkpoint was not saved by AdamBridge"):
        check_dcp_load(same, tmp_path / "memopt")
    bad = opt.state_dict()
    bad["memopt"] = dict(bad["memopt"], clip_coef=2.0)
    dcp.save({"optim": bad}, checkpoint_id=tmp_path / "clip")
    with pytest.raises(StateDictError, match=r"memopt\['clip_coef'\] must be None or a number in"):
        check_dcp_load(same, tmp_path / "clip")
    with pytest.raises(TypeError, match=r"memopt optimizer or memopt_offload.AdamBridge, got SGD"):
        check_dcp_load(torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "ck")


def _three_layer(params_of=None, seed=5, groups=None):
    """An fp32 MLP with q8 moments; ``params_of(model)`` lists the optimizer's parameters,
    ``groups(model)`` its param groups."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    if groups is not None:
        ps = groups(model)
    else:
        ps = list(params_of(model) if params_of is not None else model.parameters())
    return model, MemOptimizer(ps, rule="adamw", lr=1e-2, moments="q8", seed=seed)


def _saved_by_name(model, opt, path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load_by_name(model, opt, path, drop=(), **options):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    for name in drop:  # parameters whose state the checkpoint lacks: started fresh
        del sd["optim"]["state"][name]
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(
        model,
        opt,
        model_state_dict=sd["model"],
        optim_state_dict=sd["optim"],
        options=StateDictOptions(**options),
    )


def _whole(t):
    """A state tensor, gathered where it is a DTensor (FSDP2; step counts are plain)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _same_states(a, aopt, b, bopt):
    """Each parameter of ``b`` has the state of ``a``'s parameter of the same name."""
    names = dict(a.named_parameters())
    for name, q in b.named_parameters():
        p = names[name]
        assert (p in aopt.state) == (q in bopt.state), name
        assert aopt.state.get(p, {}).keys() == bopt.state.get(q, {}).keys(), name
        for k, v in aopt.state.get(p, {}).items():
            assert torch.equal(_whole(bopt.state[q][k]), _whole(v)), (name, k)


@pytest.mark.usefixtures("process_group")
def test_check_dcp_load_by_name_and_frozen_parameters(tmp_path):
    """torch's set_state_dict hands no state to a frozen parameter (memopt's load then drops
    it) and refuses a trainable one's missing state unless strict=False: check_dcp_load says
    so for name-keyed checkpoints, and what it advises loads. Frozen parameters without state
    listed in the optimizer at save only, or at load only, are no regrouping."""
    model, opt = _three_layer()
    train(model, opt, 2)
    _saved_by_name(model, opt, tmp_path / "all")

    # frozen now, with state: set_state_dict would drop it
    twin, topt = _three_layer(seed=9)
    topt.init_state()
    twin[0].weight.requires_grad_(False)
    with pytest.raises(
        ConfigError,
        match=r"saved as '0.weight' is frozen \(requires_grad=False\) but has optimizer state: "
        r"torch's set_state_dict hands no state",
    ):
        check_dcp_load(topt, tmp_path / "all", model=twin)
    twin[0].weight.requires_grad_(True)  # as advised, until set_state_dict has run
    check_dcp_load(topt, tmp_path / "all", model=twin)
    _load_by_name(twin, topt, tmp_path / "all")
    _same_states(model, opt, twin, topt)

    # a parameter of the checkpoint that this optimizer does not hold: its state would drop
    _, fewer = _three_layer(lambda m: [p for n, p in m.named_parameters() if n != "2.bias"])
    fewer.init_state()
    with pytest.raises(ConfigError, match=r"state for '2.bias', which is not a parameter of"):
        check_dcp_load(fewer, tmp_path / "all", model=_)

    # frozen when saved (no state), trainable now: delete its entry, load with strict=False
    frozen, fopt = _three_layer()
    frozen[0].weight.requires_grad_(False)
    train(frozen, fopt, 2)
    _saved_by_name(frozen, fopt, tmp_path / "frozen")
    twin, topt = _three_layer(seed=9)
    topt.init_state()
    with pytest.raises(
        ConfigError,
        match=r"del sd\['optim'\]\['state'\]\['0.weight'\]\), and "
        r"pass options=StateDictOptions\(strict=False\)",
    ):
        check_dcp_load(topt, tmp_path / "frozen", model=twin)
    _load_by_name(twin, topt, tmp_path / "frozen", drop=["0.weight"], strict=False)
    # without state after the load, as under torch: its next step with a gradient creates it
    assert twin[0].weight not in topt.state
    for name, q in twin.named_parameters():
        if name != "0.weight":
            p = dict(frozen.named_parameters())[name]
            assert all(torch.equal(topt.state[q][k], v) for k, v in fopt.state[p].items())

    # frozen parameters listed at save only, or at load only: no state, the same groups
    trainable = lambda m: [p for n, p in m.named_parameters() if n != "0.weight"]  # noqa: E731
    for i, (saved_with, loaded_with) in enumerate(((None, trainable), (trainable, None))):
        first, fopt = _three_layer(saved_with)
        first[0].weight.requires_grad_(False)
        train(first, fopt, 2)
        _saved_by_name(first, fopt, tmp_path / f"listed{i}")
        twin, topt = _three_layer(loaded_with, seed=9)
        twin[0].weight.requires_grad_(False)
        topt.init_state()
        check_dcp_load(topt, tmp_path / f"listed{i}", model=twin)
        _load_by_name(twin, topt, tmp_path / f"listed{i}")
        _same_states(first, fopt, twin, topt)


@pytest.mark.usefixtures("process_group")
def test_check_dcp_load_refuses_an_empty_group_torch_maps_wrongly(tmp_path):
    """torch's set_state_dict maps a param group without parameters to the checkpoint's last
    group (a torch bug): a name-keyed checkpoint whose empty group is not last is refused
    before dcp.load, and moving that group to the end, as the message says, loads it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def empty_first(m):
        return [
            {"params": [], "lr": 7e-3},
            {"params": [m[0].weight, m[2].weight], "weight_decay": 0.1},
            {"params": [m[0].bias, m[2].bias], "lr": 3e-3},
        ]

    model, opt = _three_layer(groups=empty_first)
    train(model, opt, 2)
    _saved_by_name(model, opt, tmp_path / "ck")
    twin, topt = _three_layer(groups=empty_first, seed=9)
    topt.init_state()
    with pytest.raises(
        StateDictError, match=r"param group 0 of the checkpoint has no parameters and is not"
    ):
        check_dcp_load(topt, tmp_path / "ck", model=twin)
    msd, osd = get_state_dict(twin, topt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=tmp_path / "ck")
    groups = sd["optim"]["param_groups"]
    groups.append(groups.pop(0))
    set_state_dict(twin, topt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert [g["lr"] for g in topt.param_groups] == [7e-3, 1e-2, 3e-3]
    _same_states(model, opt, twin, topt)
    # saved with the empty group last, it loads as it is
    model, opt = _three_layer(groups=lambda m: empty_first(m)[1:] + empty_first(m)[:1])
    train(model, opt, 1)
    _saved_by_name(model, opt, tmp_path / "last")
    check_dcp_load(topt, tmp_path / "last", model=twin)


@pytest.mark.usefixtures("process_group")
def test_a_checkpoint_of_another_memopt_class_into_a_flash_optimizer(tmp_path):
    """A MemOptimizer (ECC-24 + q8) checkpoint loaded into FlashAdamW of the same formats:
    check_dcp_load passed, then dcp.load failed inside torch on the 'compressed' key that
    FlashAdamW's state dict has and the checkpoint lacks. Now the check says so and how; done
    that way, training continues as the saving optimizer's would (the same rule and formats)."""
    ecc = pytest.importorskip("memopt_ecc")
    straight, sopt = build("memopt-ecc24-q8")
    train(straight, sopt, 6)
    first, fopt = build("memopt-ecc24-q8")
    train(first, fopt, 3)
    dcp.save(
        {"optim": fopt.state_dict(), "model": first.state_dict()}, checkpoint_id=tmp_path / "ck"
    )

    torch.manual_seed(1)
    resumed = build("memopt-ecc24-q8")[0]
    ropt = ecc.FlashAdamW(resumed.parameters(), lr=1e-2, weight_decay=0.0, seed=5)
    ropt.init_state()
    with pytest.raises(StateDictError, match=r"no memopt\['compressed'\] .*\.pop\('compressed'\)"):
        check_dcp_load(ropt, tmp_path / "ck")
    target = {"optim": ropt.state_dict(), "model": resumed.state_dict()}
    target["optim"]["memopt"].pop("compressed")
    for g in target["optim"]["param_groups"]:
        g["memopt"].pop("compressed")
    dcp.load(target, checkpoint_id=tmp_path / "ck")
    resumed.load_state_dict(target["model"])
    ropt.load_state_dict(target["optim"])
    train(resumed, ropt, 3, start=3)
    for (n, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)), n


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("compress", [True, False], ids=["codes", "decoded"])
def test_a_version_1_checkpoint_loads_its_second_moments_as_v(compress, tmp_path):
    """A checkpoint of a memopt before decay-normalized second moments (state-dict version 1:
    no 'decay_norm_beta2', the 8-bit exp_avg_sq is v itself, as codes or decoded). dcp.load
    failed on the key the live state dict has: check_dcp_load says to drop it, and done that
    way the load gives v back (the next step normalizes it)."""
    ecc = pytest.importorskip("memopt_ecc")
    from memopt_checkpoint import to_torch_state_dict
    from memopt_core import conversions
    from memopt_core.formats import moment_codec
    from memopt_core.plan import state_key

    def flash(model):
        return ecc.FlashAdamW(
            model.parameters(), lr=1e-2, betas=(0.9, 0.5), compress_state_dict=compress, seed=5
        )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.Linear(48, 9))
    model = model.to(torch.bfloat16)
    opt = flash(model)
    train(model, opt, 5)  # N = 0.5**5
    codec = moment_codec("q8_sqrt")
    sd = opt.state_dict()
    raw = []  # v on the raw grid: what a version-1 memopt held
    for i, v in to_torch_state_dict(opt)["state"].items():
        v = v["exp_avg_sq"]
        flat = torch.zeros(-(-v.numel() // 32) * 32)
        flat[: v.numel()] = v.reshape(-1)
        codes = conversions.encode_moment(codec, flat)
        raw.append(conversions.decode_moment(codec, codes)[: v.numel()].reshape(v.shape))
        if compress:
            for sfx, c in codes.items():
                sd["state"][i][state_key("exp_avg_sq", sfx)] = c
        else:
            sd["state"][i]["exp_avg_sq"] = raw[-1].clone()
    for meta in [sd["memopt"]] + [g["memopt"] for g in sd["param_groups"]]:
        del meta["decay_norm_beta2"]
        meta["version"] = 1
    dcp.save({"optim": sd}, checkpoint_id=tmp_path / "v1")

    resumed = torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.Linear(48, 9))
    resumed = resumed.to(torch.bfloat16)
    resumed.load_state_dict(model.state_dict())
    ropt = flash(resumed)
    ropt.init_state()
    with pytest.raises(StateDictError, match=r"no 'decay_norm_beta2' .*pop\('decay_norm_beta2'\)"):
        check_dcp_load(ropt, tmp_path / "v1")
    target = {"optim": ropt.state_dict()}
    for meta in [target["optim"]["memopt"]] + [
        g["memopt"] for g in target["optim"]["param_groups"]
    ]:
        meta.pop("decay_norm_beta2")
    dcp.load(target, checkpoint_id=tmp_path / "v1")
    ropt.load_state_dict(target["optim"])
    assert ropt.decay_norm(0, 5) == 1.0
    # the stored moments are v itself (to_torch_state_dict would normalize them first, as the
    # next step does, with a stochastic rounding)
    params = [p for g in ropt.param_groups for p in g["params"]]
    for i, v in enumerate(raw):
        st = ropt.state[params[i]]
        u = conversions.decode_moment(
            codec, {sfx: st[state_key("exp_avg_sq", sfx)] for sfx in codec.fields}
        )
        assert torch.equal(u[: v.numel()].reshape(v.shape), v), i
    train(resumed, ropt, 1, start=5)  # normalized by the step
    assert ropt.decay_norm(0, 6) == 0.5**6


@pytest.mark.usefixtures("process_group")
def test_check_dcp_load_of_a_missing_folder_or_a_file(tmp_path):
    """Both failed inside torch's dcp.load with a CheckpointException, which is no Exception."""
    _, opt = build("memopt-ecc24-q8")
    opt.init_state()
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        check_dcp_load(opt, tmp_path / "nothing")
    # read only for checkpoints keyed by name: for the others it passed silently
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got dict"):
        check_dcp_load(opt, tmp_path / "nothing", model={"not": "a module"})
    (tmp_path / "ck.mopt").write_bytes(b"x")
    with pytest.raises(StateDictError, match=r"is a file; .* memopt_checkpoint\.load"):
        check_dcp_load(opt, tmp_path / "ck.mopt")
    # a folder that is no DCP checkpoint, and one whose .metadata is cut short (a helper's
    # hunt, 2026-12-07: both the CheckpointException)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StateDictError, match=r"could not read a checkpoint at .*empty"):
        check_dcp_load(opt, tmp_path / "empty")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / ".metadata").write_bytes(b"\x80\x04junk")
    with pytest.raises(StateDictError, match=r"could not read a checkpoint at .*cut"):
        check_dcp_load(opt, tmp_path / "cut")
    # a checkpoint saved without collectives holds per-rank metadata only: it is read
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp_path / "local", use_collectives=False)
    assert ".metadata" not in {f.name for f in (tmp_path / "local").iterdir()}
    check_dcp_load(opt, tmp_path / "local")


@pytest.mark.usefixtures("process_group")
def test_an_adam_bridge_checkpoint_of_version_1_says_which_key_to_drop(tmp_path):
    """AdamBridge with q8 moments (precision="compact") saves its host optimizer's normalizing
    beta2s; a checkpoint from before lacks them, and dcp.load would fail on the missing key.
    check_dcp_load names it; dropped as it says, the load reads the moments as v."""
    model, opt = _bridge_mlp("compact")
    train(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["memopt"]["decay_norm_beta2"] == [0.999]
    for meta in [saved["memopt"]] + [g["memopt"] for g in saved["param_groups"]]:
        del meta["decay_norm_beta2"]
        meta["version"] = 1
    dcp.save({"optim": saved}, checkpoint_id=tmp_path / "v1")
    _, fresh = _bridge_mlp("compact")
    with pytest.raises(StateDictError, match=r"has no 'decay_norm_beta2' .*\.pop\("):
        check_dcp_load(fresh, tmp_path / "v1")
    target = fresh.state_dict()
    for meta in [target["memopt"]] + [g["memopt"] for g in target["param_groups"]]:
        meta.pop("decay_norm_beta2")
    dcp.load({"optim": target}, checkpoint_id=tmp_path / "v1")
    fresh.load_state_dict(target)
    assert fresh._host.decay_norm(0, 2) == 1.0  # v itself until the next step
    # a checkpoint of this version passes
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp_path / "v2")
    _, other = _bridge_mlp("compact")
    check_dcp_load(other, tmp_path / "v2")
