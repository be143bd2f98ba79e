"""The cached step is replayed only while it is valid: whatever changes between steps (new
gradient tensors, a parameter's storage, gradients appearing or vanishing, param groups, loaded
state, learning-rate schedules, hyperparameters), ApexW still gives the reference's bits."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from apexw_testutil import (
    assert_same,
    fused_backend_for,
    make_params,
    reference_for,
    set_grads,
    step_both,
    triton_interpreter_ready,
    twin,
)

from memopt_apexw import ApexW


@pytest.fixture(params=["fused", "torch"])
def mode(request, device):
    if request.param == "fused" and fused_backend_for(device) is None:
        pytest.skip(f"no fused backend for {device} installed")
    return request.param


@pytest.fixture(params=["fused", "torch", "triton-interpreter"])
def addr_mode(request, device):
    """Like ``mode``, plus Triton's prepared launches (which keep raw addresses) on CPU."""
    if request.param == "triton-interpreter":
        if device.type != "cpu" or not triton_interpreter_ready():
            pytest.skip("Triton's interpreter on CPU tensors (needs triton, numpy)")
        return request.param
    if request.param == "fused" and fused_backend_for(device) is None:
        pytest.skip(f"no fused backend for {device} installed")
    return request.param


def pair(device, mode, dtype=torch.float32, **kw):
    a = make_params(device, dtype)
    b = twin(a)
    extra = {"backend": "triton"} if mode == "triton-interpreter" else {}
    mode = "fused" if mode == "triton-interpreter" else mode
    return a, b, ApexW(a, mode=mode, **extra, **kw), reference_for(b, **kw)


def test_replays_after_the_first_step(device, mode):
    a, b, opt, ref = pair(device, mode)
    step_both(a, b, opt, ref, 1)
    assert mode in opt._cached_steps
    cached = opt._cached_steps[mode]
    for step in range(2, 6):
        step_both(a, b, opt, ref, step)
        assert opt._cached_steps[mode] is cached  # replayed, not rebuilt
    assert_same(a, b, opt, ref)


def test_new_gradient_tensors(device, addr_mode):
    a, b, opt, ref = pair(device, addr_mode)
    for step in range(1, 8):
        step_both(a, b, opt, ref, step, in_place=step % 3 != 0)  # every third step: fresh tensors
        assert_same(a, b, opt, ref, f"step {step}")


def test_set_to_none_and_partial_gradients(device, addr_mode):
    a, b, opt, ref = pair(device, addr_mode)
    step_both(a, b, opt, ref, 1)
    for step in range(2, 9):
        opt.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        set_grads(a, step)
        set_grads(b, step)
        if step % 2:  # some parameters get no gradient at odd steps
            for x, y in zip(a[::2], b[::2], strict=True):
                x.grad = None
                y.grad = None
        opt.step()
        ref.step()
        assert_same(a, b, opt, ref, f"step {step}")


def test_parameter_storage_swapped(device, addr_mode):
    a, b, opt, ref = pair(device, addr_mode)
    step_both(a, b, opt, ref, 1)
    step_both(a, b, opt, ref, 2)
    for x, y in zip(a, b, strict=True):  # same Parameter objects, new storage (like .to())
        x.data = x.data.clone()
        y.data = y.data.clone()
    for step in range(3, 6):
        step_both(a, b, opt, ref, step)
    assert_same(a, b, opt, ref)


def test_lr_schedule_and_hyperparameter_changes(device, mode):
    a, b, opt, ref = pair(device, mode)
    sa = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=40)
    sb = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=1e-2, total_steps=40)
    for step in range(1, 31):
        if step == 12:
            for g in (opt.param_groups[0], ref.param_groups[0]):
                g["weight_decay"] = 0.0
                g["betas"] = (0.8, 0.99)
        if step == 20:
            for g in (opt.param_groups[0], ref.param_groups[0]):
                g["weight_decay"] = 0.1
                g["eps"] = 1e-6
        step_both(a, b, opt, ref, step)
        sa.step()
        sb.step()
    assert_same(a, b, opt, ref)


def test_param_groups_added_later_keep_their_own_step(device, mode):
    a, b, opt, ref = pair(device, mode)
    extra_a = make_params(device, seed=7, shapes=[(17,), (2, 9)])
    extra_b = twin(extra_a)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step)
    opt.add_param_group({"params": extra_a, "lr": 5e-3, "weight_decay": 0.2})
    ref.add_param_group({"params": extra_b, "lr": 5e-3, "weight_decay": 0.2})
    for step in range(4, 10):
        set_grads(extra_a, step)
        set_grads(extra_b, step)
        step_both(a, b, opt, ref, step)
    assert_same(a + extra_a, b + extra_b, opt, ref)
    assert float(opt.state[extra_a[0]]["step"]) == 6.0
    assert float(opt.state[a[1]]["step"]) == 9.0


def test_state_dict_resume_is_bit_identical(device, mode):
    a = make_params(device)
    straight = ApexW(a, mode=mode)
    for step in range(1, 13):
        set_grads(a, step)
        straight.step()
    b = make_params(device)
    first = ApexW(b, mode=mode)
    for step in range(1, 7):
        set_grads(b, step)
        first.step()
    saved = first.state_dict()
    c = twin(b)
    resumed = ApexW(c, mode=mode)
    resumed.load_state_dict(saved)
    for step in range(7, 13):
        set_grads(c, step)
        resumed.step()
    assert_same(a, c, straight, resumed)


def test_torchs_state_dict_helpers_resume_bit_identically_into_another_seed(device, mode):
    """torch's get/set_optimizer_state_dict keep only 'state' and 'param_groups': the memopt
    entry (rule, seed, version) travels in every saved group (ApexW inherits it from
    MemOptimizer). Before, the load kept the resumed optimizer's seed: bf16 moments and the
    ECC-24 master round stochastically, so the continuation took other bits."""
    pytest.importorskip("torch.distributed")
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def build(seed):
        model = torch.nn.ParameterList(
            torch.nn.Parameter(p.detach()) for p in make_params(device, torch.bfloat16)
        )
        ps = list(model)
        groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": 5e-4}]
        return model, ps, ApexW(groups, lr=1e-3, state="bf16", mode=mode, seed=seed)

    _, a, straight = build(3)
    for step in range(1, 9):
        set_grads(a, step)
        straight.step()
    model, b, first = build(3)
    for step in range(1, 5):
        set_grads(b, step)
        first.step()
    osd = copy.deepcopy(get_optimizer_state_dict(model, first))
    resumed_model, c, resumed = build(12)
    with torch.no_grad():
        for p, q in zip(c, b, strict=True):
            p.copy_(q)
    set_optimizer_state_dict(resumed_model, resumed, optim_state_dict=osd)
    for step in range(5, 9):
        set_grads(c, step)
        resumed.step()
    assert_same(a, c, straight, resumed)
    assert resumed.seed == 3
    assert all("memopt" not in g for g in resumed.param_groups)
    assert [g["memopt"]["seed"] for g in osd["param_groups"]] == [3, 3]


def test_load_state_dict_mid_run_rebuilds(device, mode):
    a, b, opt, ref = pair(device, mode)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step)
    snapshot = ref.state_dict()
    opt.load_state_dict(snapshot)  # same values, new tensors: the cache must not replay old views
    for step in range(4, 8):
        step_both(a, b, opt, ref, step)
    assert_same(a, b, opt, ref)


def test_step_parameters_between_steps(device, mode):
    a, b, opt, ref = pair(device, mode)
    step_both(a, b, opt, ref, 1)
    set_grads(a, 2)
    set_grads(b, 2)
    opt.step_parameters(a[:3])
    ref.step_parameters(b[:3])
    for step in range(3, 7):  # parameters now at two step counts, then one again
        step_both(a, b, opt, ref, step)
    assert_same(a, b, opt, ref)


def test_check_numerics_still_checks_when_replaying(device, mode):
    from memopt_core import NumericsError

    a = make_params(device)
    opt = ApexW(a, mode=mode, check_numerics=True)
    for step in range(1, 4):
        set_grads(a, step)
        opt.step()
    before = [p.detach().clone() for p in a]
    a[3].grad[0, 0] = float("nan")
    with pytest.raises(NumericsError, match="non-finite"):
        opt.step()
    assert all(torch.equal(x, y) for x, y in zip(a, before, strict=True))


def test_holds_no_gradient_between_steps(device, addr_mode):
    # a cached step that kept gradients alive would hold a whole model's worth of freed
    # gradients through the next backward
    a, b, opt, ref = pair(device, addr_mode)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step, in_place=False)
    refs = [weakref.ref(p.grad) for p in a]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
