"""Bad input: every error says what was wrong, where, and leaves no half-modified state."""

from __future__ import annotations

import copy
import importlib.metadata
import warnings
from fractions import Fraction

import pytest
import torch

from memopt_core import (
    BackendUnavailableError,
    ConfigError,
    MemoptError,
    MemOptimizer,
    StateDictError,
)


def P(*shape, dtype=torch.float32):
    return torch.nn.Parameter(torch.randn(*shape).to(dtype))


# ------------------------------------------------------------------------- hyperparameters
@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(rule="adagrad"), r"unknown rule 'adagrad'; choose one of \('sgd', 'sgdw', 'adam'"),
        (dict(lr=-1e-3), r"invalid learning rate -0.001 \(optimizer defaults\): it must be >= 0"),
        (dict(lr=float("nan")), r"learning rate \(lr\) \(optimizer defaults\) must be finite"),
        (dict(lr="fast"), r"learning rate \(lr\) \(optimizer defaults\) must be a real number"),
        (dict(eps=-1e-8), r"invalid eps -1e-08"),
        (dict(weight_decay=-0.1), r"invalid weight_decay -0.1"),
        (dict(betas=(1.0, 0.999)), r"invalid beta1 1.0 .*betas must lie in \[0, 1\)"),
        (dict(betas=(0.9, -0.1)), r"invalid beta2 -0.1"),
        (dict(betas=(0.9,)), r"betas \(optimizer defaults\) must be a pair"),
        (dict(rule="sgd", momentum=-0.5), r"invalid momentum -0.5"),
        (
            dict(rule="sgd", nesterov=True),
            r"nesterov=True .*needs momentum > 0 and dampening == 0.*momentum=0.0",
        ),
        (dict(rule="sgd", momentum=0.9, dampening=0.1, nesterov=True), r"dampening=0.1"),
        (dict(maximize=1), r"maximize \(optimizer defaults\) must be True or False, got 1"),
        (dict(master="ecc16"), r"unknown master format 'ecc16'.*'none', 'ecc24' or 'ecc32'"),
        (dict(moments="int4"), r"unknown moment format 'int4'.*\('fp32', 'bf16', 'fp8', 'q8'\)"),
        (dict(seed=-1), r"seed must be an int in \[0, 2\*\*64\)"),
        (dict(check_numerics="yes"), r"check_numerics must be True or False"),
        (dict(backend=3), r"backend must be None or a backend name"),
        (
            dict(decouple_lr=True, lr=0.0),
            r"decouple_lr=True .*needs a positive initial lr, got 0.0",
        ),
    ],
)
def test_bad_hyperparameters(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        MemOptimizer([P(3)], **kwargs)


def test_config_errors_are_value_errors_and_memopt_errors():
    with pytest.raises(ValueError, match="invalid learning rate") as info:
        MemOptimizer([P(3)], lr=-1)
    assert isinstance(info.value, MemoptError)


def test_bad_group_hyperparameters_name_the_group():
    with pytest.raises(ConfigError, match=r"invalid learning rate -1.0 \(param group 1\)"):
        MemOptimizer([{"params": [P(2)]}, {"params": [P(2)], "lr": -1.0}])


def test_bad_lr_set_later_is_caught_at_step_without_changes():
    p = P(4)
    opt = MemOptimizer([p])
    p.grad = torch.ones(4)
    before = p.detach().clone()
    opt.param_groups[0]["lr"] = -0.1
    with pytest.raises(ConfigError, match=r"invalid learning rate -0.1 \(param group 0\)"):
        opt.step()
    assert torch.equal(p.detach(), before)


# ----------------------------------------------------------------------------- parameters
def test_params_must_be_leaves():
    base = P(3)
    with pytest.raises(
        ConfigError, match=r"parameter #0 \(param group 0\) \(shape \(3,\).*is not a leaf"
    ):
        MemOptimizer([base * 2])


def test_real_numbers_of_other_types_are_hyperparameters():
    # numbers.Real as torch's optimizers take them: numpy scalars (a schedule may write one into
    # a group), fractions; the same step as with the floats
    values = [dict(lr=Fraction(1, 10), betas=(Fraction(9, 10), 0.99))]
    try:
        import numpy as np
    except ImportError:  # not a dependency: the fractions alone
        np = None
    if np is not None:
        values.append(dict(lr=np.float32(0.1), betas=(np.float64(0.9), np.float32(0.99))))
    for kw in values:
        a, b = P(5), P(5)
        b.data.copy_(a.data)
        opt_a = MemOptimizer([a], rule="adamw", **kw)
        opt_b = MemOptimizer(
            [b], rule="adamw", lr=float(kw["lr"]), betas=tuple(map(float, kw["betas"]))
        )
        for opt, p in ((opt_a, a), (opt_b, b)):
            p.grad = torch.ones(5)
            opt.step()
            opt.param_groups[0]["lr"] = kw["lr"]
            opt.step()
        assert torch.equal(a, b)


def test_generator_params_in_a_group():
    # a group's params as a generator (model.parameters()): every parameter lands in the group
    ps = [P(3), P(2, 2)]
    opt = MemOptimizer([{"params": (p for p in ps)}], lr=0.1)
    extra = P(4)
    opt.add_param_group({"params": (p for p in [extra])})
    assert [len(g["params"]) for g in opt.param_groups] == [2, 1]
    for p in [*ps, extra]:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in [*ps, extra]]
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, [*ps, extra], strict=True))


def test_duplicate_params():
    p = P(3)
    with pytest.raises(ConfigError, match="appears twice in the group"):
        MemOptimizer([p, p])
    with pytest.raises(ConfigError, match="already in another param group"):
        MemOptimizer([{"params": [p]}, {"params": [p]}])
    opt = MemOptimizer([p])
    with pytest.raises(ConfigError, match="already in another param group"):
        opt.add_param_group({"params": [p]})
    assert len(opt.param_groups) == 1


def test_a_param_appended_by_hand_to_a_second_group_is_refused_without_changes():
    """torch lets a group's params list be edited in place; a parameter another group holds
    would be updated by both groups' launches at one step count."""
    a, b = P(4), P(3)
    opt = MemOptimizer([{"params": [a]}, {"params": [b]}], lr=0.1)
    a.grad, b.grad = torch.ones(4), torch.ones(3)
    opt.step()
    opt.param_groups[1]["params"].append(a)
    before = [a.detach().clone(), b.detach().clone()]
    with pytest.raises(ConfigError, match=r"#0 of param group 0 and .* of param group 1 share"):
        opt.step()
    assert torch.equal(a.detach(), before[0])
    assert torch.equal(b.detach(), before[1])
    assert opt.state[a]["step"].item() == 1
    opt.param_groups[1]["params"].pop()
    opt.step()  # the edit undone: the same optimizer steps again
    assert opt.state[a]["step"].item() == 2


@pytest.mark.parametrize(
    ("dtype", "pattern"),
    [
        (
            torch.float64,
            r"shape \(2, 3\), torch.float64.*memopt optimizes float32, bfloat16 and float16",
        ),
        (torch.int32, r"shape \(2, 3\), torch.int32"),
        (torch.complex64, r"shape \(2, 3\), torch.complex64"),
    ],
)
def test_unsupported_param_dtypes(dtype, pattern):
    t = torch.zeros(2, 3, dtype=dtype)
    with pytest.raises(ConfigError, match=pattern):
        MemOptimizer([P(4), t])


def test_named_parameters_appear_in_messages():
    with pytest.raises(ConfigError, match=r"parameter 'head.bias' \(param group 0\)"):
        MemOptimizer([("w", P(2)), ("head.bias", torch.zeros(2, dtype=torch.float64))])


def test_master_format_must_fit_the_dtype():
    with pytest.raises(
        ConfigError, match=r"parameter #0 .*shape \(5,\), torch.float16.*'ecc24'.*bfloat16"
    ):
        MemOptimizer([P(5, dtype=torch.float16)], master="ecc24")


def test_params_container_errors():
    with pytest.raises(ConfigError, match="got a single tensor"):
        MemOptimizer(P(3))
    with pytest.raises(ConfigError, match="empty parameter list"):
        MemOptimizer([])
    with pytest.raises(ConfigError, match="is a set"):
        MemOptimizer([{"params": {P(3)}}])
    with pytest.raises(ConfigError, match="is a str, not a tensor"):
        MemOptimizer([P(3), "weight"])


# ------------------------------------------------------------------------------- gradients
def test_sparse_gradients_are_refused_without_changes():
    a, b = P(4), P(5, 3)
    opt = MemOptimizer([a, b])
    a.grad = torch.ones(4)
    b.grad = torch.eye(5, 3).to_sparse()
    before = a.detach().clone()
    with pytest.raises(
        ConfigError,
        match=r"parameter #1 of param group 0 \(shape \(5, 3\).*sparse_coo gradient.*dense",
    ):
        opt.step()
    assert torch.equal(a.detach(), before)
    assert a not in opt.state  # the refused first step built no state (it left zeros, step 0)


def test_negated_views_are_refused_without_changes():
    """A tensor with torch's negative bit holds the opposite values in memory, which the
    kernels would read or write (the cpu backend did, silently)."""
    with pytest.raises(ConfigError, match=r"#0 .*is a negated view .*pass its \.resolve_neg\(\)"):
        MemOptimizer([torch.nn.Parameter(torch._neg_view(torch.ones(4)))])
    a, b = P(4), P(1)
    opt = MemOptimizer([a, b], lr=0.1)
    a.grad = torch.ones(4)
    b.grad = torch.tensor([1 + 3j]).conj().imag  # a contiguous negated view, through public API
    assert b.grad.is_neg()
    assert b.grad.is_contiguous()
    before = a.detach().clone()
    with pytest.raises(
        ConfigError, match=r"the gradient of parameter #1 .* is a negated view.*\.resolve_neg"
    ):
        opt.step()
    assert torch.equal(a.detach(), before)
    b.grad = b.grad.resolve_neg()
    opt.step()
    assert opt.state[b]["step"].item() == 1
    # a replay that follows moved gradients checks them too
    b.grad = torch._neg_view(torch.ones(1))
    with pytest.raises(ConfigError, match=r"the gradient of parameter #1 .* is a negated view"):
        opt.step()
    assert opt.state[b]["step"].item() == 1


def test_tensors_without_memory_are_refused_without_changes():
    """A storage resized to 0 bytes has address 0: the Triton kernels read it (an illegal
    access on the GPU), torch's ops raised their own error."""
    a, b = P(4), P(5)
    opt = MemOptimizer([a, b], lr=0.1)
    a.grad, b.grad = torch.ones(4), torch.ones(5)
    opt.step()  # cached: the replay's check sees the gradient's new address
    b.grad = torch.ones(5)
    b.grad.untyped_storage().resize_(0)
    before = a.detach().clone()
    with pytest.raises(ConfigError, match=r"#1 .*its gradient has no memory \(its storage"):
        opt.step()
    b.grad = torch.ones(5)
    b.untyped_storage().resize_(0)
    with pytest.raises(ConfigError, match=r"#1 .*: it has no memory"):
        opt.step()
    assert torch.equal(a.detach(), before)
    assert opt.state[a]["step"].item() == 1


def test_meta_parameters_are_refused_as_such():
    # a meta tensor has address 0 too, but the cause (and the fix) is not a freed storage
    p = torch.zeros(4, device="meta", requires_grad=True)
    p.grad = torch.ones(4, device="meta")
    with pytest.raises(ConfigError, match=r"#0 .*: it is on the meta device.*to_empty"):
        MemOptimizer([p], lr=0.1).step()


def test_gradient_dtype_must_be_param_dtype_or_fp32():
    p = P(4, dtype=torch.bfloat16)
    p.grad_dtype = None
    opt = MemOptimizer([p])
    p.grad = torch.ones(4, dtype=torch.float64)
    with pytest.raises(
        ConfigError,
        match=r"torch.float64 gradient; memopt takes gradients in the parameter's dtype or float32",
    ):
        opt.step()


@pytest.mark.parametrize("how", ["the same dict", "a copy sharing its params"])
def test_a_group_appended_by_hand_to_param_groups_is_refused(how):
    """A group appended to ``param_groups`` by hand (not through add_param_group) whose
    parameters another group holds: its plan is new, and the check of a params list edited
    by hand did not run for it, so both groups' launches updated the parameter at one count
    (one more step moved it twice as far, its count read one step)."""
    a, b = P(4), P(3)
    opt = MemOptimizer([{"params": [a]}, {"params": [b]}], lr=0.1)
    a.grad, b.grad = torch.ones(4), torch.ones(3)
    opt.step()
    g0 = opt.param_groups[0]
    opt.param_groups.append(g0 if how == "the same dict" else dict(g0))
    before = a.detach().clone()
    with pytest.raises(
        ConfigError, match=r"#0 of param group 0 and parameter #0 of param group 2 share"
    ):
        opt.step()
    assert torch.equal(a.detach(), before)
    assert opt.state[a]["step"].item() == 1


def test_step_parameters_refuses_grads_and_staging_that_are_no_tensors():
    """A gradient that is no tensor failed deep in the step (AttributeError
    '_is_zerotensor'), a staging key that is no tensor in the message's label."""
    w = P(64)
    opt = MemOptimizer([w])
    with pytest.raises(ConfigError, match=r"grads\[parameter #0 of param group 0 .*\] must be a "):
        opt.step_parameters([w], grads={w: [1.0] * 64})
    w.grad = torch.ones(64)
    with pytest.raises(ConfigError, match=r"staging is keyed by the parameters .* got a key 'w'"):
        opt.step_parameters([w], staging={"w": torch.zeros(64, dtype=torch.bfloat16)})
    assert opt.state == {}


def test_step_parameters_names_a_gradient_that_is_no_tensor_beside_staging():
    """The staging check read every gradient before the gradients were checked: an
    AttributeError (review of stop 68's diff)."""
    w = P(64)
    opt = MemOptimizer([w])
    for bad in (None, 1.0):
        with pytest.raises(ConfigError, match=r"grads\[parameter #0 .*\] must be a tensor"):
            opt.step_parameters(
                [w], grads={w: bad}, staging={w: torch.empty(64, dtype=torch.bfloat16)}
            )
    assert opt.state == {}


def test_a_pair_of_tensors_is_no_named_parameter():
    """torch reads a 2-tuple as (name, parameter): (a, b) of two tensors held b alone, and a
    was never trained (a helper's review, 2026-12-07)."""
    a, b = P(4), P(4)
    with pytest.raises(ConfigError, match=r"parameter #0 \(param group 0\) is a pair, read as"):
        MemOptimizer([(a, b)])
    opt = MemOptimizer([("a", a), ("b", b)])  # named parameters, as named_parameters() gives
    assert opt.param_groups[0]["param_names"] == ["a", "b"]


def test_step_parameters_refuses_grads_of_parameters_not_stepped():
    """A gradient in ``grads`` for a parameter left out of ``params`` was dropped without a
    word: the caller meant it to be used."""
    a, b = P(64), P(32)
    opt = MemOptimizer([a, b])
    a.grad = torch.ones(64)
    with pytest.raises(
        ConfigError, match=r"grads names parameter #1 of param group 0 .* not among the param"
    ):
        opt.step_parameters([a], grads={b: torch.ones(32)})
    with pytest.raises(ConfigError, match=r"grads is keyed by the parameters .* got a key 'b'"):
        opt.step_parameters([a], grads={"b": torch.ones(32)})
    assert opt.state == {}
    opt.step_parameters([a], grads={a: torch.ones(64)})  # its own gradient: steps
    assert opt.state[a]["step"].item() == 1


def test_step_parameters_with_a_foreign_tensor():
    opt = MemOptimizer([P(3)])
    with pytest.raises(
        ConfigError, match=r"step_parameters got a tensor \(shape \(2,\).*does not hold"
    ):
        opt.step_parameters([torch.zeros(2)])


def test_format_cannot_change_after_state_exists():
    p = P(40)
    opt = MemOptimizer([p], moments="fp32")
    p.grad = torch.ones(40)
    opt.step()
    opt.param_groups[0]["moments"] = "q8"
    before = p.detach().clone()
    with pytest.raises(
        ConfigError,
        match=r"param group 0 changed its state format from .*moments='fp32' to .*moments='q8'",
    ):
        opt.step()
    assert torch.equal(p.detach(), before)
    opt.param_groups[0]["moments"] = "fp32"
    opt.step()  # restoring the format works


def test_cast_parameter_with_state_is_refused_without_changes():
    # a rebuild under the new dtype would drop the ECC code and go on from the rounded weight
    p = P(64, dtype=torch.bfloat16)
    opt = MemOptimizer([p], master="ecc32", moments="q8")
    for _ in range(3):
        p.grad = torch.randn(64).bfloat16()
        opt.step()
    state = {k: v.clone() for k, v in opt.state[p].items()}
    p.data = p.data.float()  # model.float() after training started
    p.grad = torch.zeros(64)
    with pytest.raises(
        ConfigError,
        match=r"#0 of param group 0 .*changed since its state was created \(it was "
        r"torch.bfloat16 of shape \(64,\) on cpu\).*no parameter or state was modified",
    ):
        opt.step()
    with pytest.raises(ConfigError, match="changed since its state was created"):
        opt.step_parameters([p])
    assert sorted(opt.state[p]) == sorted(state)  # the ECC code is still there
    assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())
    p.data = p.data.bfloat16()  # casting back works
    p.grad = torch.zeros(64).bfloat16()
    opt.step()
    assert int(opt.state[p]["step"]) == 4


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_parameter_cast_before_its_first_step_is_named(dtype):
    """``model.double()`` after the optimizer was built, before any state: the step named no
    parameter and explained ECC's bfloat16 split for a float64 tensor (adversarial round 4);
    it gives add_param_group's dtype rule, naming the parameter."""
    a, b = P(4), P(8)
    opt = MemOptimizer([{"params": [a]}, {"params": [b]}], master="ecc24")
    before = a.detach().clone()
    b.data = b.data.to(dtype)
    a.grad, b.grad = torch.ones(4), torch.ones(8, dtype=dtype)
    with pytest.raises(
        ConfigError,
        match=rf"parameter #0 of param group 1 \(shape \(8,\), {dtype}, on cpu\) has dtype "
        rf"{dtype} since it was added to the optimizer .*float32, bfloat16 and float16",
    ):
        opt.step()
    assert torch.equal(a.detach(), before)  # nothing was updated
    b.data, b.grad = b.data.real.float(), torch.ones(8)
    opt.step()  # cast back, it steps


def test_forced_backend_that_is_missing(monkeypatch, fresh_backends):
    # no kernel package registered, whatever this environment has installed
    real = importlib.metadata.entry_points
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda **kw: [] if kw == {"group": "memopt.kernels"} else real(**kw),
    )
    monkeypatch.setenv("MEMOPT_BACKEND", "triton")
    with pytest.raises(
        BackendUnavailableError, match=r"'triton' is not installed.*memopt-kernels-triton"
    ):
        MemOptimizer([P(3)])
    with pytest.raises(BackendUnavailableError, match=r"'cpu' is not installed"):
        MemOptimizer([P(3)], backend="cpu")


# ----------------------------------------------------------------------------- state dicts
def _trained(master="ecc24", moments="q8", dtype=torch.bfloat16, rule="adamw"):
    params = [P(6, 7, dtype=dtype), P(40, dtype=dtype)]
    opt = MemOptimizer(params, rule=rule, master=master, moments=moments)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape).to(dtype)
        opt.step()
    return params, opt


def _fresh(params, **kw):
    kw = {"master": "ecc24", "moments": "q8", **kw}
    return MemOptimizer([p.detach().clone().requires_grad_() for p in params], **kw)


def _snapshot(opt):
    return {
        "groups": copy.deepcopy(
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        ),
        "state": {
            i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())
        },
        "seed": opt.seed,
    }


def _same(a, b):
    if (
        a["groups"] != b["groups"]
        or a["seed"] != b["seed"]
        or a["state"].keys() != b["state"].keys()
    ):
        return False
    return all(
        a["state"][i].keys() == b["state"][i].keys()
        and all(torch.equal(v, b["state"][i][k]) for k, v in a["state"][i].items())
        for i in a["state"]
    )


def _mutations():
    def drop(sd):
        del sd["state"][0]["exp_avg_scale"]

    def extra(sd):  # a memopt state name this format does not store (the caller's keys load)
        sd["state"][1]["momentum_buffer"] = torch.zeros(3)

    def shape(sd):
        sd["state"][1]["master_code"] = torch.zeros(41, dtype=torch.uint8)

    def dtype(sd):
        sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].float()

    def fmt(sd):
        sd["param_groups"][0]["moments"] = "bf16"

    def rule(sd):
        sd["memopt"]["rule"] = "lion"

    def groups(sd):
        sd["param_groups"].append(dict(sd["param_groups"][0]))

    def size(sd):
        sd["param_groups"][0]["params"] = [0]

    def step(sd):
        sd["state"][0]["step"] = torch.tensor(-1.0)

    def step_f32_overflow(sd):  # finite as a double, inf as the float32 count it becomes
        sd["state"][0]["step"] = 1e300

    def step_huge_int(sd):  # beyond float's range: OverflowError before
        sd["state"][0]["step"] = 2**2000

    def meta_state(sd):  # NotImplementedError at the copy before
        sd["state"][0]["exp_avg"] = torch.empty_like(sd["state"][0]["exp_avg"], device="meta")

    def params_not_a_list(sd):  # a bare TypeError in the conversions before
        sd["param_groups"][0]["params"] = None

    def future_version(sd):  # was never read: any version loaded
        sd["memopt"]["version"] = 99

    def orphan(sd):
        sd["state"][5] = sd["state"][0]

    def norm_list(sd):  # one normalizing beta2 per param group
        sd["memopt"]["decay_norm_beta2"] = [0.999, 0.999]

    def norm_beta2(sd):
        sd["memopt"]["decay_norm_beta2"] = [1.5]

    def torch_dict(sd):
        del sd["param_groups"][0]["master"]

    def bad_lr(sd):
        sd["param_groups"][0]["lr"] = -3.0

    def no_state(sd):
        del sd["state"]

    return [
        (
            drop,
            r"state of parameter index 0 \(shape \(6, 7\), torch.bfloat16.*lacks \['exp_avg_scale'\]",
        ),
        (extra, r"parameter index 1 .*unexpected entries \['momentum_buffer'\]"),
        (
            shape,
            r"state 'master_code' of parameter index 1 .*torch.uint8 of shape \(41,\).*stores torch.uint8 of shape \(40,\)",
        ),
        (
            dtype,
            r"state 'exp_avg' of parameter index 0 .*is torch.float32 of shape \(64,\).*stores torch.float8_e4m3fn",
        ),
        (
            fmt,
            r"param group 0 of the state dict holds moments='bf16' states; this optimizer uses moments='q8'.*to_torch_state_dict and load_torch_state_dict",
        ),
        (rule, r"saved by a 'lion' optimizer; this one runs 'adamw'"),
        (groups, r"the state dict has 2 param group\(s\), this optimizer has 1"),
        (size, r"param group 0 of the state dict has 1 parameters, this optimizer's has 2"),
        (step, r"'step' of parameter index 0 .*whole number >= 0 that float32 holds, got -1.0"),
        (step_f32_overflow, r"'step' of parameter index 0 .*that float32 holds, got 1e\+300"),
        (step_huge_int, r"'step' of parameter index 0 .*that float32 holds"),
        (orphan, r"state for parameter index 5, which none of its param groups lists"),
        (meta_state, r"state 'exp_avg' of parameter index 0 .*on the meta device"),
        (params_not_a_list, r"param group 0 of the state dict: 'params' must be a list"),
        (future_version, r"the state dict has version 99; this memopt reads versions 1 to 2"),
        (torch_dict, r"lacks \['master'\]: it was not saved by a memopt optimizer"),
        (norm_list, r"'decay_norm_beta2' must list one beta2 \(or None\) per param group \(1\)"),
        (
            norm_beta2,
            r"'decay_norm_beta2' of param group 0 must be None or a beta2 in \[0, 1\), got 1.5",
        ),
        (bad_lr, r"invalid learning rate -3.0 \(param group 0 of the state dict\)"),
        (no_state, r"lacks 'state'"),
    ]


@pytest.mark.parametrize(
    ("mutate", "pattern"), _mutations(), ids=lambda x: getattr(x, "__name__", "")
)
def test_bad_state_dicts_are_refused_before_any_change(mutate, pattern):
    params, opt = _trained()
    target = _fresh(params)
    for p in (q for g in target.param_groups for q in g["params"]):
        p.grad = torch.randn(p.shape).to(p.dtype)
    target.step()
    before = _snapshot(target)
    sd = copy.deepcopy(opt.state_dict())
    mutate(sd)
    with pytest.raises(StateDictError, match=pattern):
        target.load_state_dict(sd)
    assert _same(before, _snapshot(target))


def test_state_dict_of_another_format_into_fp32_moments():
    params, opt = _trained(moments="bf16")
    target = _fresh(params, moments="fp32")
    with pytest.raises(
        StateDictError, match="holds moments='bf16' states; this optimizer uses moments='fp32'"
    ):
        target.load_state_dict(opt.state_dict())


def test_not_a_mapping():
    with pytest.raises(StateDictError, match="expected a state dict"):
        MemOptimizer([P(2)]).load_state_dict([1, 2])


# ------------------------------------------------------------ input matrix (audit 2026-12-01)
def test_parameters_sharing_memory_are_refused():
    """Each parameter is updated from its own old value: where two share memory, the torch
    backend kept one update of two silently (the kernels raised at step)."""
    base = torch.zeros(8)
    a, b = torch.nn.Parameter(base[:6]), torch.nn.Parameter(base[4:])
    with pytest.raises(ConfigError, match=r"parameter #0 of param group 0 and parameter #1 of"):
        MemOptimizer([a, b], backend="torch")
    with pytest.raises(ConfigError, match=r"#0 of param group 0 and parameter #0 of param group 1"):
        MemOptimizer([{"params": [a]}, {"params": [b]}], backend="torch")
    opt = MemOptimizer([a], backend="torch")
    with pytest.raises(ConfigError, match="share memory"):
        opt.add_param_group({"params": [b]})
    assert len(opt.param_groups) == 1
    wide = torch.nn.Parameter(torch.zeros(1, 8).expand(4, 8))
    with pytest.raises(ConfigError, match="expanded tensor"):
        MemOptimizer([wide], backend="torch")
    # disjoint views of one storage are fine
    MemOptimizer([torch.nn.Parameter(base[:4]), torch.nn.Parameter(base[4:])], backend="torch")


def test_construction_checks_memory_once_for_all_groups(monkeypatch):
    """Checked per group against the groups before it, construction was quadratic in the
    number of groups (33 s for 2000 one-parameter groups); a group added later is still checked
    against those held."""
    import memopt_core.optimizer as optimizer_module

    calls = []
    real = optimizer_module.check_parameters_apart
    monkeypatch.setattr(
        optimizer_module,
        "check_parameters_apart",
        lambda new, held: calls.append((len(new), len(held))) or real(new, held),
    )
    opt = MemOptimizer([{"params": [P(3)]} for _ in range(50)], backend="torch")
    assert calls == [(50, 0)]
    opt.add_param_group({"params": [P(3)]})
    assert calls[1:] == [(1, 50)]


def test_inference_mode_is_refused_before_any_write():
    p = P(40)
    opt = MemOptimizer([p], moments="bf16", backend="torch")
    p.grad = torch.randn(40)
    with torch.inference_mode():
        for call in (opt.step, opt.init_state, lambda: opt.step_parameters([p])):
            with pytest.raises(ConfigError, match=r"inside torch.inference_mode\(\)"):
                call()
    assert not opt.state
    opt.step()  # outside it: a normal first step
    assert opt.state[p]["step"].item() == 1
    with torch.inference_mode():
        q = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    with pytest.raises(ConfigError, match=r"created under torch\.inference_mode"):
        MemOptimizer([q])


def test_lazy_parameters_are_refused_by_name():
    lazy = torch.nn.LazyLinear(4)
    with pytest.raises(ConfigError, match=r"not initialized yet .*run one forward pass"):
        MemOptimizer(lazy.parameters())


@pytest.mark.parametrize(
    ("rule", "key", "value", "pattern"),
    [
        ("adamw", "amsgrad", True, "amsgrad=True: memopt has no AMSGrad"),
        ("adam", "decoupled_weight_decay", True, "decoupled_weight_decay=True, but rule 'adam'"),
        (
            "adamw",
            "decoupled_weight_decay",
            False,
            "decoupled_weight_decay=False, but rule 'adamw'",
        ),
        ("sgd", "differentiable", True, "differentiable=True: memopt's steps are not"),
    ],
)
def test_torch_keys_that_change_the_rule_are_refused(rule, key, value, pattern):
    """torch.optim group keys memopt does not implement were ignored silently."""
    p = P(8)
    with pytest.raises(ConfigError, match=r"\(param group 0\) sets " + pattern):
        MemOptimizer([{"params": [p], key: value}], rule=rule)
    opt = MemOptimizer([{"params": [p], key: not value}], rule=rule)  # the matching value
    opt.param_groups[0][key] = value  # edited later: refused at the step, nothing written
    p.grad = torch.ones(8)
    before = p.detach().clone()
    with pytest.raises(ConfigError, match=pattern):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_betas_edited_to_none():
    p = P(8)
    p.grad = torch.ones(8)
    opt = MemOptimizer([p], rule="adamw")
    opt.param_groups[0]["betas"] = None
    with pytest.raises(ConfigError, match=r"betas \(param group 0\) is None"):
        opt.step()
    sgd = MemOptimizer([p], rule="sgd", momentum=0.9)  # SGD's betas are unused: None is fine
    sgd.param_groups[0]["betas"] = None
    sgd.step()
    assert sgd.state[p]["step"].item() == 1


def test_an_interrupt_as_the_kernel_returns_still_counts_the_step(monkeypatch):
    """Python delivers a Ctrl-C that arrives during a C++ kernel once the call returns: the
    work has run, so its step counts must advance (a retry repeated the step number)."""
    from memopt_core.torch_backend import TorchBackend

    def make():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64))
        return p, MemOptimizer([p], rule="adamw", moments="bf16", backend="torch")

    grads = [torch.randn(64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    p, opt = make()
    for g in grads:
        p.grad = g.clone()
        opt.step()
    clean = p.detach().clone()

    p, opt = make()
    p.grad = grads[0].clone()
    opt.step()
    real = TorchBackend.step

    def interrupted(self, work):
        real(self, work)
        raise KeyboardInterrupt

    for g in grads[1:]:
        p.grad = g.clone()
        with monkeypatch.context() as m:  # both the cached replay and an ordinary step
            m.setattr(TorchBackend, "step", interrupted)
            with pytest.raises(KeyboardInterrupt):
                opt.step()
    assert opt.state[p]["step"].item() == 3
    assert torch.equal(p.detach(), clean)


@pytest.mark.parametrize(
    ("kwargs", "dtype", "what"),
    [
        (dict(moments="q8"), torch.float32, "q8_signed exp_avg, q8_sqrt exp_avg_sq"),
        (dict(moments="bf16", rule="lion"), torch.float32, "bf16 exp_avg"),
        (dict(moments="fp32", master="ecc24"), torch.bfloat16, "weights with master 'ecc24'"),
        (dict(moments="fp32", master="none"), torch.float16, "weights with master 'none'"),
    ],
)
def test_round_to_nearest_that_stalls_warns_once(kwargs, dtype, what):
    """An audit ran 2000 AdamW steps with stochastic_rounding=False: q8 and fp8 moments moved
    the weights 1.7x and 2.3x as far as fp64's, silently. The default rounds stochastically."""
    from memopt_core import RoundToNearestWarning

    p, q = P(8, dtype=dtype), P(8, dtype=dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = MemOptimizer([p], stochastic_rounding=False, **kwargs)
        opt.add_param_group({"params": [q]})  # once per optimizer
    said = [w for w in caught if w.category is RoundToNearestWarning]
    assert len(said) == 1
    assert what in str(said[0].message)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(moments="fp32"),  # fp32 moments and master: nothing rounds
        dict(moments="q8", rule="sgd"),  # SGD without momentum keeps no moment
        dict(moments="q8", stochastic_rounding=True),
    ],
)
def test_round_to_nearest_that_cannot_stall_is_quiet(kwargs):
    kwargs.setdefault("stochastic_rounding", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MemOptimizer([P(8)], **kwargs)


def test_a_block_scale_byte_of_255_is_refused_at_load():
    """No format writes scale byte 255 (E8M0 scales are 0..254); the torch backend read it as
    2**128 and Triton as inf (NaN parameters), so a state holding it is refused by name."""
    p = P(64)
    p.grad = torch.randn(64)
    opt = MemOptimizer([p], moments="q8", backend="torch")
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg_scale"][0] = 255
    before = opt.state[p]["exp_avg_scale"].clone()
    with pytest.raises(StateDictError, match=r"'exp_avg_scale' .* block scale byte 255"):
        opt.load_state_dict(sd)
    assert torch.equal(opt.state[p]["exp_avg_scale"], before)


@pytest.mark.parametrize("moments", ["fp32", "bf16", "fp8"])
def test_a_negative_second_moment_is_refused_at_load(moments):
    """An average of squares is never negative; torch loads one and its next step takes the
    square root (NaN weights). -0.0 (what sqrt keeps) and a state of zeros load."""
    p = P(64)
    p.grad = torch.randn(64)
    opt = MemOptimizer([p], moments=moments)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    sd = copy.deepcopy(opt.state_dict())
    v = sd["state"][0]["exp_avg_sq"]
    bits = v.view(torch.uint8) if v.element_size() == 1 else None
    if bits is not None:  # float8 e5m2: the sign bit of a nonzero code (torch assigns no float8)
        i = int(bits.nonzero()[0])
        bits[i] |= 0x80
    else:
        v[3] = -1e-8
    with pytest.raises(StateDictError, match=r"'exp_avg_sq' of parameter index 0 .* negative"):
        opt.load_state_dict(sd)
    for k, t in before.items():
        assert torch.equal(opt.state[p][k], t), k
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg_sq"].view(torch.uint8 if bits is not None else v.dtype).zero_()
    if bits is None:
        sd["state"][0]["exp_avg_sq"][5] = -0.0
    opt.load_state_dict(sd)  # zeros and -0.0 are second moments
    p.grad = torch.randn(64)
    opt.step()
    assert torch.isfinite(p.detach()).all()


def test_check_param_groups_raises_what_the_step_would():
    a, b = P(8), P(8)
    opt = MemOptimizer([{"params": [a]}, {"params": [b]}])
    opt.check_param_groups()  # valid groups: nothing
    opt.param_groups[1]["betas"] = (0.9, 1.5)
    with pytest.raises(ConfigError, match=r"\(param group 1\)") as checked:
        opt.check_param_groups()
    a.grad, b.grad = torch.ones(8), torch.ones(8)
    with pytest.raises(ConfigError) as stepped:
        opt.step()
    assert str(checked.value) == str(stepped.value)


STAGING_OVERLAPS = {
    # what the staging buffer of parameter a is: each copy overwrote it after the update (the
    # torch backend); the cpu backend refused the call's own tensors, not a parameter held and
    # not stepped
    "a itself": lambda a, b, ga, gb: a.data,
    "b, stepped": lambda a, b, ga, gb: b.data,
    "b, held and not stepped": lambda a, b, ga, gb: b.data,
    "a's gradient": lambda a, b, ga, gb: ga,
    "b's gradient": lambda a, b, ga, gb: gb,
    "half of b": lambda a, b, ga, gb: b.data.view(torch.bfloat16)[32:96],
}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("case", list(STAGING_OVERLAPS))
def test_staging_that_shares_memory_is_refused_before_any_write(backend, case):
    if backend == "cpu":
        pytest.importorskip("memopt_kernels_cpu")
    a, b = P(64), P(64)
    opt = MemOptimizer([a, b], lr=1e-2, backend=backend)
    ga, gb = torch.randn(64), torch.randn(64)
    params = [a] if case in ("a itself", "a's gradient", "b, held and not stepped") else [a, b]
    grads = {p: g for p, g in ((a, ga), (b, gb)) if any(p is q for q in params)}
    st = STAGING_OVERLAPS[case](a, b, ga, gb)
    st = st if st.dtype == torch.bfloat16 else st.view(torch.bfloat16)[:64]
    before = [t.detach().clone() for t in (a, b, ga, gb)]
    with pytest.raises(ConfigError, match=r"staging of parameter #0 of param group 0 .* share"):
        opt.step_parameters(params, grads=grads, staging={a: st})
    for t, old in zip((a, b, ga, gb), before, strict=True):
        assert torch.equal(t.detach(), old)
    assert opt.state == {}


def test_staging_checks_held_parameters_on_their_current_addresses():
    """The held parameters' byte ranges are cached: a parameter added later, or moved, is seen."""
    a, b = P(64), P(64)
    opt = MemOptimizer([a], lr=1e-2)
    a.grad = torch.randn(64)
    opt.step_parameters([a], staging={a: torch.empty(64, dtype=torch.bfloat16)})
    opt.add_param_group({"params": [b]})
    with pytest.raises(ConfigError, match="share"):
        opt.step_parameters([a], staging={a: b.data.view(torch.bfloat16)[:64]})
    old = b.data
    b.data = torch.randn(64)  # the cached range of b is stale: old is no parameter now
    opt.step_parameters([a], staging={a: old.view(torch.bfloat16)[:64]})
    assert torch.equal(old.view(torch.bfloat16)[:64], a.detach().to(torch.bfloat16))
    with pytest.raises(ConfigError, match="share"):
        opt.step_parameters([a], staging={a: b.data.view(torch.bfloat16)[64:]})


@pytest.mark.parametrize("key", ["lr", "betas", "eps", "weight_decay", "moments", "maximize"])
def test_a_group_key_deleted_by_hand_is_named(key):
    """A bare KeyError in the step before (a helper's hunt, 2026-12-07)."""
    p = P(8)
    opt = MemOptimizer([p])
    del opt.param_groups[0][key]
    p.grad = torch.ones(8)
    before = p.detach().clone()
    with pytest.raises(ConfigError, match=rf"param group 0 has no '{key}': give it a value"):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("flag", ["amsgrad", "differentiable", "decoupled_weight_decay"])
def test_torch_flags_in_a_group_must_be_bools(flag):
    """ "no" was read as true: amsgrad="no" refused as amsgrad=True, decoupled_weight_decay="no"
    taken as decoupling."""
    p = P(8)
    opt = MemOptimizer([p], rule="adamw")
    opt.param_groups[0][flag] = "no"
    p.grad = torch.ones(8)
    with pytest.raises(ConfigError, match=rf"{flag} \(param group 0\) must be True or False"):
        opt.step()


@pytest.mark.parametrize("params", [None, 5, "w", {"w": 1}])
def test_a_group_whose_params_are_no_list_is_named(params):
    opt = MemOptimizer([P(8)])
    with pytest.raises(ConfigError, match=r"params \(param group 1\) must be a list of param"):
        opt.add_param_group({"params": params})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("moments", [["q8"], {"q8": 1}])
def test_a_saved_moments_value_that_is_no_str_is_named(moments):
    """A list or dict (unhashable) was a bare TypeError in the decay-normalization lookup."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = MemOptimizer([p], rule="adamw", lr=1e-3, moments="q8")
    p.grad = torch.randn_like(p)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["moments"] = moments
    with pytest.raises(StateDictError, match=r"param group 0 of the state dict holds moments="):
        opt.load_state_dict(sd)
