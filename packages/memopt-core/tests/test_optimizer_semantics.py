"""MemOptimizer behaves like a torch optimizer: state dicts and bit-identical resume, schedulers,
closures, param groups, parameters without gradients, odd shapes and layouts, copies, partial
steps, numerics checks."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch

from memopt_core import ConfigError, MemOptimizer, NumericsError

CONFIGS = {
    "fp32": dict(rule="adamw", dtype=torch.float32, master="none", moments="fp32"),
    "ecc24-q8": dict(rule="adamw", dtype=torch.bfloat16, master="ecc24", moments="q8"),
    "ecc32-bf16-lion": dict(rule="lion", dtype=torch.bfloat16, master="ecc32", moments="bf16"),
    "none-fp8-sgd": dict(
        rule="sgd", dtype=torch.bfloat16, master="none", moments="fp8", momentum=0.9
    ),
}
SHAPES = [(7, 9), (), (0, 3), (100,), (33,)]


def make_params(dtype=torch.float32, device="cpu", seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        for s in shapes
    ]


def grads_for(params, step, seed=100):
    gen = torch.Generator().manual_seed(seed + step)
    return [torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype) for p in params]


def set_grads(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.clone()


def train(opt, params, steps, start=0, seed=100):
    for t in range(start, start + steps):
        set_grads(params, grads_for(params, t, seed))
        opt.step()


def make_opt(params, cfg, **kw):
    cfg = {k: v for k, v in cfg.items() if k != "dtype"}
    cfg.update(kw)
    return MemOptimizer(params, lr=1e-2, weight_decay=0.01, **cfg)


def clone_all(params):
    return [p.detach().clone() for p in params]


def equal_all(a, b):
    return all(torch.equal(x.detach(), y.detach()) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------- state dicts
@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_is_bit_identical(name, device):
    cfg = CONFIGS[name]
    straight = make_params(cfg["dtype"], device)
    opt = make_opt(straight, cfg, seed=7)
    train(opt, straight, 3)
    buf = io.BytesIO()
    torch.save({"params": clone_all(straight), "opt": opt.state_dict()}, buf)
    train(opt, straight, 3, start=3)

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = [p.clone().requires_grad_() for p in saved["params"]]
    opt2 = make_opt(resumed, cfg, seed=99)  # the seed comes back from the state dict
    opt2.load_state_dict(saved["opt"])
    assert opt2.seed == 7
    train(opt2, resumed, 3, start=3)
    assert equal_all(straight, resumed)
    for p, q in zip(straight, resumed, strict=True):
        assert set(opt.state[p]) == set(opt2.state[q])
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[q][k]), k


def test_state_dict_format_and_dtypes_survive_loading():
    params = make_params(torch.bfloat16, shapes=[(4, 8), (5,)])
    opt = MemOptimizer(params, master="ecc24", moments="q8")
    train(opt, params, 2)
    sd = opt.state_dict()
    assert sd["memopt"] == {
        "rule": "adamw",
        "seed": 0,
        "version": 2,
        "decay_norm_beta2": [0.999],
    }
    assert sd["param_groups"][0]["params"] == [0, 1]
    assert sd["param_groups"][0]["moments"] == "q8"
    st = sd["state"][0]
    assert set(st) == {
        "step",
        "exp_avg",
        "exp_avg_scale",
        "exp_avg_sq",
        "exp_avg_sq_scale",
        "master_code",
        "param_shape",
        "decay_norm_step",
    }
    # the count the q8 second moment is stored for: the optimizer's live record
    assert st["decay_norm_step"].item() == 2
    assert "decay_norm_step" not in opt.state[params[0]]
    assert st["param_shape"].dtype == torch.int64
    assert st["param_shape"].tolist() == [4, 8]
    assert sd["state"][1]["param_shape"].tolist() == [5]
    assert "param_shape" not in opt.state[params[0]]  # only the state dict's entries hold it
    assert st["step"].dtype == torch.float32
    assert st["step"].shape == ()
    assert st["step"].item() == 2
    assert st["master_code"].dtype == torch.uint8
    assert st["master_code"].shape == (4, 8)
    assert st["exp_avg"].dim() == 1
    assert st["exp_avg"].numel() % 32 == 0
    # loading keeps the stored dtypes (torch's base class would cast floats to bfloat16)
    params2 = [p.detach().clone().requires_grad_() for p in params]
    opt2 = MemOptimizer(params2, master="ecc24", moments="q8")
    opt2.load_state_dict(copy.deepcopy(sd))
    assert set(opt2.state[params2[0]]) == set(opt.state[params[0]])  # no param_shape
    for k, v in opt.state[params[0]].items():
        assert opt2.state[params2[0]][k].dtype == v.dtype
        assert torch.equal(opt2.state[params2[0]][k], v)


def test_fp32_states_look_like_torch():
    p = torch.randn(3, 4, requires_grad=True)
    opt = MemOptimizer([p], moments="fp32")
    p.grad = torch.ones(3, 4)
    opt.step()
    st = opt.state[p]
    assert st["exp_avg"].shape == (3, 4)
    assert st["exp_avg"].dtype == torch.float32
    assert st["exp_avg_sq"].shape == (3, 4)
    assert st["step"].device.type == "cpu"


def test_load_state_dict_restores_hyperparameters():
    params = make_params()
    opt = MemOptimizer(params, lr=0.1)
    train(opt, params, 1)
    sd = copy.deepcopy(opt.state_dict())
    opt.param_groups[0]["lr"] = 0.5
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.1
    assert opt.param_groups[0]["params"] == params


def test_state_dict_before_any_step_and_roundtrip_in_place():
    params = make_params()
    opt = MemOptimizer(params)
    assert opt.state_dict()["state"] == {}
    opt.load_state_dict(opt.state_dict())
    train(opt, params, 2)
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    opt.load_state_dict(opt.state_dict())  # loading its own live views
    for k, v in before.items():
        assert torch.equal(opt.state[params[0]][k], v)


# ------------------------------------------------------------------------ schedulers, closure
def test_step_lr_scheduler_changes_the_update():
    def run(schedule):
        p = torch.nn.Parameter(torch.ones(8))
        opt = MemOptimizer([p], rule="sgd", lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if schedule else None
        for _ in range(3):
            p.grad = torch.ones(8)
            opt.step()
            if sched:
                sched.step()
        return p.detach()

    f32 = torch.float32
    expected = torch.tensor(1.0, dtype=f32)
    for lr in (0.1, 0.05, 0.025):
        expected = expected - torch.tensor(lr, dtype=f32) * 1.0
    assert torch.equal(run(True), expected.expand(8))
    assert not torch.equal(run(False), run(True))


def test_decouple_lr_uses_lr_over_initial_lr():
    p = torch.nn.Parameter(torch.full((4,), 2.0))
    opt = MemOptimizer([p], rule="adamw", lr=1e-2, weight_decay=0.1, decouple_lr=True)
    assert opt.param_groups[0]["initial_lr"] == 1e-2
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    expected = torch.full((4,), 2.0)
    for factor in (1.0, 0.5, 0.25):
        p.grad = torch.zeros(4)  # zero gradient: only the decay moves the weight
        opt.step()
        sched.step()
        expected = expected * torch.tensor(1 - factor * 0.1, dtype=torch.float32)
    assert torch.equal(p.detach(), expected)


def test_decouple_lr_with_a_tensor_lr_follows_the_schedule():
    """Schedulers set a tensor lr in place: initial_lr must be a copy, not the same tensor."""
    out = []
    for lr in (1e-2, torch.tensor(1e-2)):
        p = torch.nn.Parameter(torch.full((4,), 2.0))
        opt = MemOptimizer([p], rule="adamw", lr=lr, weight_decay=0.5, decouple_lr=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
        for _ in range(3):
            p.grad = torch.zeros(4)
            opt.step()
            sched.step()
        assert opt.param_groups[0]["initial_lr"] is not opt.param_groups[0]["lr"]
        out.append(p.detach().clone())
    assert torch.equal(out[0], out[1])  # 2 * 0.5 * 0.95 * 0.995, not 2 * 0.5**3


def test_decouple_lr_switched_on_at_lr_zero_is_a_config_error():
    p = torch.nn.Parameter(torch.ones(4))
    opt = MemOptimizer([p], rule="adamw", lr=0.0, weight_decay=0.1)
    p.grad = torch.ones(4)
    opt.step()
    opt.param_groups[0]["decouple_lr"] = True  # no initial_lr recorded: it would be 0
    with pytest.raises(ConfigError, match=r"initial lr it would record now is 0\.0"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(4))


def test_a_parameter_whose_elements_share_memory_is_refused_before_any_update():
    a = torch.nn.Parameter(torch.ones(8))
    b = torch.nn.Parameter(torch.zeros(1).expand(8))  # stride 0: one memory location
    with pytest.raises(ConfigError, match="share memory"):
        MemOptimizer([a, b], rule="adamw", lr=0.1)
    b = torch.nn.Parameter(torch.zeros(8))
    opt = MemOptimizer([a, b], rule="adamw", lr=0.1)
    b.data = torch.zeros(1).expand(8)  # swapped in later: refused at the step
    a.grad, b.grad = torch.ones(8), torch.ones(8)
    with pytest.raises(ConfigError, match="share memory"):
        opt.step()
    assert torch.equal(a.detach(), torch.ones(8))  # nothing moved


def test_closure_is_evaluated_with_grad_enabled():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = MemOptimizer([p], rule="sgd", lr=0.1)
    calls = []

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        calls.append(1)
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert calls == [1]
    assert loss.item() == 5.0
    assert torch.equal(
        p.detach(), torch.tensor([1.0, -2.0]) - torch.tensor(0.1) * torch.tensor([2.0, -4.0])
    )


# ---------------------------------------------------------------------------- param groups
def test_param_groups_with_their_own_hyperparameters_and_formats():
    a = make_params(torch.float32, seed=1)
    b = make_params(torch.bfloat16, seed=2)
    opt = MemOptimizer(
        [
            {"params": a, "moments": "q8", "lr": 1e-2},
            {"params": b, "master": "ecc24", "moments": "bf16", "lr": 1e-3, "betas": (0.8, 0.9)},
        ],
        stochastic_rounding=False,
    )
    a1 = [p.detach().clone().requires_grad_() for p in a]
    b1 = [p.detach().clone().requires_grad_() for p in b]
    oa = MemOptimizer(a1, moments="q8", lr=1e-2, stochastic_rounding=False)
    ob = MemOptimizer(
        b1, master="ecc24", moments="bf16", lr=1e-3, betas=(0.8, 0.9), stochastic_rounding=False
    )
    for t in range(3):
        ga, gb = grads_for(a, t), grads_for(b, t, seed=500)
        set_grads(a, ga), set_grads(b, gb), set_grads(a1, ga), set_grads(b1, gb)
        opt.step(), oa.step(), ob.step()
    assert equal_all(a, a1)
    assert equal_all(b, b1)
    assert "exp_avg_scale" in opt.state[a[0]]
    assert "master_code" not in opt.state[a[0]]
    assert opt.state[b[0]]["exp_avg"].dtype == torch.bfloat16
    assert opt.state[b[0]]["master_code"].dtype == torch.uint8


def test_mixed_dtypes_in_one_group():
    a = make_params(torch.float32, seed=1)
    b = make_params(torch.bfloat16, seed=2)
    opt = MemOptimizer(a + b, master="ecc32", moments="q8")
    train(opt, a + b, 2)
    assert "master_code" in opt.state[b[0]]
    assert "master_code" not in opt.state[a[0]]
    assert opt.state[b[3]]["step"].item() == 2


def test_add_param_group_after_steps():
    a = make_params(seed=1)
    b = make_params(seed=2)
    opt = MemOptimizer(a, lr=1e-2, stochastic_rounding=False)
    a_ref = [p.detach().clone().requires_grad_() for p in a]
    ref_a = MemOptimizer(a_ref, lr=1e-2, stochastic_rounding=False)
    train(opt, a, 2)
    train(ref_a, a_ref, 2)
    opt.add_param_group({"params": b, "lr": 1e-3, "moments": "bf16"})
    b_ref = [p.detach().clone().requires_grad_() for p in b]
    ref_b = MemOptimizer(b_ref, lr=1e-3, moments="bf16", stochastic_rounding=False)
    for t in (2, 3):
        ga, gb = grads_for(a, t), grads_for(b, t, seed=500)
        set_grads(a, ga), set_grads(b, gb), set_grads(a_ref, ga), set_grads(b_ref, gb)
        opt.step(), ref_a.step(), ref_b.step()
    assert equal_all(a, a_ref)
    assert equal_all(b, b_ref)
    assert opt.state[a[0]]["step"].item() == 4
    assert opt.state[b[0]]["step"].item() == 2
    assert opt.param_groups[1]["lr"] == 1e-3
    assert opt.param_groups[1]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_autograds_zero_gradient_steps_as_zeros(name, device):
    """A parameter used only through torch.sgn gets autograd's zero tensor as its gradient, at
    address 0 with no memory: the Triton kernels read address 0 (an illegal access on the
    GPU), the cpu backend refused it. It steps as dense zeros do, across cached replays."""
    cfg = CONFIGS[name]
    runs = []
    for zero_tensor in (True, False):
        a, b = make_params(cfg["dtype"], device, seed=3, shapes=[(7, 9), (33,)])
        opt = make_opt([a, b], cfg)
        for t, kind in enumerate("zzdddzdz"):  # dense zeros in the middle: cached, replayed
            a.grad = grads_for([a], t)[0]
            b.grad = None
            if kind == "z" and zero_tensor:
                torch.sgn(b).sum().backward()
                assert b.grad._is_zerotensor()
            else:
                b.grad = torch.zeros_like(b)
            opt.step()
        assert opt.state[b]["step"].item() == 8
        runs.append((clone_all([a, b]), opt.state_dict()["state"]))
    (got, got_state), (want, want_state) = runs
    assert equal_all(got, want)
    assert set(got_state) == set(want_state) == {0, 1}
    for i in want_state:
        for k in want_state[i]:
            assert torch.equal(got_state[i][k], want_state[i][k]), (i, k)


def test_params_appended_to_a_group_in_place():
    """torch.optim lets a group's params list grow in place: the new one starts at step 1."""
    a, b = make_params(seed=1)[:2]
    b_ref = b.detach().clone().requires_grad_()
    opt = MemOptimizer([a], lr=1e-2, stochastic_rounding=False)
    ref = MemOptimizer([b_ref], lr=1e-2, stochastic_rounding=False)
    train(opt, [a], 2)
    opt.param_groups[0]["params"].append(b)
    g = grads_for([a, b], 5)
    set_grads([a, b], g)
    set_grads([b_ref], g[1:])
    opt.step()
    ref.step()
    assert opt.state[a]["step"].item() == 3
    assert opt.state[b]["step"].item() == 1
    assert equal_all([b], [b_ref])


@pytest.mark.parametrize("rule", ["sgd", "sgdw"])
def test_cycling_schedulers_cycle_sgd_momentum(rule):
    """OneCycleLR cycles betas[0] when the optimizer's defaults hold betas, else momentum."""
    momenta = []
    for cls, kw in ((torch.optim.SGD, {}), (MemOptimizer, {"rule": rule})):
        p = torch.nn.Parameter(torch.zeros(4))
        opt = cls([p], lr=0.1, momentum=0.9, **kw)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
        seen = []
        for _ in range(4):
            p.grad = torch.ones(4)
            opt.step()
            sched.step()
            seen.append(opt.param_groups[0]["momentum"])
        momenta.append(seen)
    assert momenta[0] == momenta[1]
    assert momenta[0][0] != 0.9
    adam = MemOptimizer([torch.nn.Parameter(torch.zeros(4))], rule="adamw", lr=0.1)
    assert "betas" in adam.defaults  # Adam and Lion cycle beta1


def test_params_without_grads_are_skipped_and_keep_their_step():
    params = make_params()
    opt = MemOptimizer(params)
    train(opt, params, 1)
    before = clone_all(params)
    grads = grads_for(params, 5)
    grads[0] = None
    set_grads(params, grads)
    opt.step()
    assert torch.equal(params[0].detach(), before[0])
    assert opt.state[params[0]]["step"].item() == 1
    assert opt.state[params[3]]["step"].item() == 2
    # the next step updates both, each with its own bias correction (separate sub-batches)
    set_grads(params, grads_for(params, 6))
    opt.step()
    assert opt.state[params[0]]["step"].item() == 2
    assert opt.state[params[3]]["step"].item() == 3


def test_frozen_params_get_no_state():
    params = make_params()
    frozen = torch.randn(50)  # requires_grad=False
    opt = MemOptimizer([*params, frozen], moments="fp32")
    train(opt, params, 2)
    assert frozen not in opt.state
    assert opt.state_bytes() == sum(p.numel() for p in params) * 8
    frozen.requires_grad_()  # unfreezing: it joins at its first gradient
    frozen.grad = torch.ones(50)
    before = frozen.detach().clone()
    opt.step()
    assert opt.state[frozen]["step"].item() == 1
    assert not torch.equal(frozen.detach(), before)
    assert opt.state[params[0]]["step"].item() == 3  # their (old) grads are still there: stepped
    assert opt.state_bytes() == (sum(p.numel() for p in params) + 50) * 8


def test_zero_size_and_scalar_params(device):
    p0 = torch.zeros((0, 4), device=device, requires_grad=True)
    s = torch.tensor(1.5, device=device, requires_grad=True)
    opt = MemOptimizer([p0, s], master="ecc24", moments="q8", lr=0.1)
    for _ in range(2):
        p0.grad = torch.zeros((0, 4), device=device)
        s.grad = torch.tensor(1.0, device=device)
        opt.step()
    assert s.item() < 1.5
    assert p0.shape == (0, 4)
    assert opt.state[s]["exp_avg"].shape == (32,)
    assert opt.state[p0]["exp_avg"].shape == (0,)
    assert opt.state[s]["step"].item() == 2


@pytest.mark.parametrize("cfg", ["fp32", "ecc24-q8"])
def test_non_contiguous_params(cfg, device):
    c = CONFIGS[cfg]
    base = torch.randn(12, 10, device=device).to(c["dtype"])
    p = base.t().requires_grad_()  # a transposed leaf: non-contiguous
    q = p.detach().contiguous().requires_grad_()
    assert not p.is_contiguous()
    op, oq = make_opt([p], c), make_opt([q], c)
    for t in range(3):
        g = grads_for([q], t)[0]
        p.grad, q.grad = g.clone(), g.clone()
        op.step(), oq.step()
    assert torch.equal(p.detach(), q.detach())
    assert not p.is_contiguous()
    assert p.stride() == (1, 10)


# ------------------------------------------------------------------------- copies and pickle
@pytest.mark.parametrize("name", ["fp32", "ecc24-q8"])
def test_deepcopy_and_pickle(name):
    cfg = CONFIGS[name]
    params = make_params(cfg["dtype"])
    opt = make_opt(params, cfg)
    train(opt, params, 2)
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        cparams = [p for g in clone.param_groups for p in g["params"]]
        assert all(cp is not p for cp, p in zip(cparams, params, strict=True))
        assert equal_all(cparams, params)
        train(clone, cparams, 2, start=2)
    train(opt, params, 2, start=2)
    assert equal_all(cparams, params)  # the copy continued exactly like the original
    for k, v in opt.state[params[0]].items():
        assert torch.equal(clone.state[cparams[0]][k], v)
    # pickling stores compact states, not one whole arena per view
    assert len(pickle.dumps(opt)) < 4 * opt.state_bytes() + 20000
    extra = torch.nn.Parameter(torch.zeros(3, dtype=cfg["dtype"]))
    clone.add_param_group({"params": [extra]})  # a copy takes groups as the original does
    assert clone.param_groups[-1]["params"] == [extra]


def test_step_parameters_updates_only_those():
    params = make_params()
    full = [p.detach().clone().requires_grad_() for p in params]
    opt, ref = MemOptimizer(params), MemOptimizer(full)
    grads = grads_for(params, 0)
    set_grads(params, grads)
    set_grads(full, grads)
    before = clone_all(params)
    opt.step_parameters([params[3], params[0]])
    assert torch.equal(params[1].detach(), before[1])
    assert torch.equal(params[4].detach(), before[4])
    assert opt.state[params[4]]["step"].item() == 0
    opt.step_parameters(params[4])
    opt.step_parameters([params[1], params[2]])
    ref.step()
    assert equal_all(params, full)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_step_parameters_with_explicit_grads_and_staging(grad_dtype):
    # memopt-offload's call: fp32 host masters, bf16 gradients passed by mapping (torch cannot
    # store them as .grad), bf16 copies of the new weights into staging buffers
    params = make_params()
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt, ropt = MemOptimizer(params, moments="bf16"), MemOptimizer(ref, moments="bf16")
    for step in range(3):
        grads = [g.to(grad_dtype) for g in grads_for(params, step)]
        set_grads(ref, [g.float() for g in grads])  # widening is exact: the same update
        staging = {p: torch.full((p.numel(),), 3.0, dtype=torch.bfloat16) for p in params[:3]}
        opt.step_parameters(params, grads=dict(zip(params, grads, strict=True)), staging=staging)
        ropt.step()
        assert equal_all(params, ref)
        assert all(p.grad is None for p in params)
        for p, st in staging.items():
            assert torch.equal(st, p.detach().reshape(-1).to(torch.bfloat16))


def test_step_parameters_staging_errors():
    params = make_params()
    opt = MemOptimizer(params)
    set_grads(params, grads_for(params, 0))
    with pytest.raises(ValueError, match="staging must be a"):
        opt.step_parameters(params, staging=[torch.zeros(63, dtype=torch.bfloat16)])
    with pytest.raises(
        ValueError, match=r"staging of parameter #0 .* contiguous bfloat16 tensor of 63"
    ):
        opt.step_parameters(params, staging={params[0]: torch.zeros(63)})
    with pytest.raises(ValueError, match="not among the parameters being stepped"):
        opt.step_parameters(params[1:], staging={params[0]: torch.zeros(63, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="grads must be a"):
        opt.step_parameters(params, grads=[torch.zeros(63)])
    half = make_params(torch.float16)
    hopt = MemOptimizer(half)
    set_grads(half, grads_for(half, 0))
    with pytest.raises(ValueError, match="bf16 copies are for float32 and bfloat16"):
        hopt.step_parameters(half, staging={half[0]: torch.zeros(63, dtype=torch.bfloat16)})
    assert not opt.state  # validation ran before any state was created


def test_check_numerics_raises_before_touching_anything():
    params = make_params(torch.bfloat16)
    named = [(f"layer{i}.weight", p) for i, p in enumerate(params)]
    opt = MemOptimizer(named, master="ecc24", moments="q8", check_numerics=True)
    train(opt, params, 1)
    before_p = clone_all(params)
    before_s = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    grads = grads_for(params, 9)
    grads[3][7] = float("nan")
    grads[0][1, 2] = float("inf")
    set_grads(params, grads)
    with pytest.raises(NumericsError, match=r"2 parameter\(s\).*'layer0.weight'.*'layer3.weight'"):
        opt.step()
    assert equal_all(params, before_p)
    for i, p in enumerate(params):
        for k, v in before_s[i].items():
            assert torch.equal(opt.state[p][k], v), (i, k)
    set_grads(params, grads_for(params, 10))
    opt.step()  # finite again: steps normally
    assert opt.state[params[0]]["step"].item() == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", range(4))
def test_check_numerics_names_the_one_bad_gradient_among_small_and_large(bad, where):
    """The check reduces small gradients of a dtype together and large ones alone (min-max
    reductions): one bad element, anywhere (here the last), in any of them is found and named,
    and gradients at the largest finite values pass."""
    shapes = [(3,), (1 << 16,), (5, 7), ((1 << 16) + 1,)]
    dtypes = [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]
    params = [torch.zeros(s, dtype=d).requires_grad_() for s, d in zip(shapes, dtypes, strict=True)]
    opt = MemOptimizer([(f"p{i}", p) for i, p in enumerate(params)], check_numerics=True)
    for p in params:
        p.grad = torch.full_like(p, torch.finfo(p.dtype).max)
        p.grad.view(-1)[0] = torch.finfo(p.dtype).min
    opt.step()  # finite extremes: no error
    params[where].grad.view(-1)[-1] = bad
    with pytest.raises(NumericsError, match=rf"in 1 parameter\(s\): parameter 'p{where}' "):
        opt.step()


def test_without_check_numerics_nan_flows_into_the_parameter():
    p = torch.nn.Parameter(torch.ones(4))
    opt = MemOptimizer([p])
    p.grad = torch.tensor([float("nan"), 0.0, 0.0, 0.0])
    opt.step()
    assert torch.isnan(p.detach()[0])
    assert torch.isfinite(p.detach()[1:]).all()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    params = make_params()
    opt = MemOptimizer(params)
    set_grads(params, grads_for(params, 0))
    opt.zero_grad(set_to_none=set_to_none)
    for p in params:
        assert (p.grad is None) if set_to_none else torch.equal(p.grad, torch.zeros_like(p))


def test_default_betas_follow_the_rule():
    p = [torch.nn.Parameter(torch.ones(2))]
    assert MemOptimizer(p, rule="lion").defaults["betas"] == (0.9, 0.99)
    assert MemOptimizer(p, rule="adamw").defaults["betas"] == (0.9, 0.999)
    assert MemOptimizer(p, rule="lion", betas=(0.95, 0.98)).defaults["betas"] == (0.95, 0.98)
    assert "betas" not in MemOptimizer(p, rule="sgd").defaults  # see the cycling schedulers
    opt = MemOptimizer([{"params": p, "betas": None}], rule="lion")
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)


def test_momentum_switched_on_later_creates_the_buffer():
    p = torch.nn.Parameter(torch.ones(5))
    opt = MemOptimizer([p], rule="sgd", lr=0.1)
    p.grad = torch.ones(5)
    opt.step()
    assert set(opt.state[p]) == {"step"}
    opt.param_groups[0]["momentum"] = 0.9
    opt.step()
    assert "momentum_buffer" in opt.state[p]
    # the new buffer starts at zero: 0.9 * 0 + (1 - 0) * g (as torch, whose buffer starts at g)
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.ones(5))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("moments", ["fp32", "q8"])
def test_a_state_saved_before_momentums_first_step_loads(backend, moments):
    """Momentum switched on after a step: the buffer exists only after the next step, so a
    state dict saved in between has none, and loading it (into the same optimizer or a new
    one, as a resume does) was refused as lacking it. It loads, and the run goes on with the
    bits of the run that was never saved."""
    if backend == "cpu":
        pytest.importorskip("memopt_kernels_cpu")
    runs = []
    for roundtrip in (False, True):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(40)), torch.nn.Parameter(torch.randn(3, 5))]

        def make(ps=ps):
            return MemOptimizer(
                ps, rule="sgd", lr=0.1, dampening=0.1, moments=moments, backend=backend
            )

        opt = make()
        gen = torch.Generator().manual_seed(1)
        for t in range(6):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            if t == 1:
                opt.param_groups[0]["momentum"] = 0.9
                if roundtrip:
                    opt.load_state_dict(opt.state_dict())  # the same optimizer
                    saved = copy.deepcopy(opt.state_dict())
                    opt = make()
                    opt.load_state_dict(saved)  # a new one
        runs.append(ps)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a.detach(), b.detach())


def test_state_bytes_counts_arenas():
    p32 = torch.nn.Parameter(torch.randn(1000))
    assert MemOptimizer([p32]).state_bytes() == 0  # no state before the first step
    opt = MemOptimizer([p32], moments="fp32")
    p32.grad = torch.ones(1000)
    opt.step()
    assert opt.state_bytes() == 8000
    pb = torch.nn.Parameter(torch.randn(1000, dtype=torch.bfloat16))
    opt = MemOptimizer([pb], master="ecc24", moments="q8")
    pb.grad = torch.ones(1000, dtype=torch.bfloat16)
    opt.step()
    padded = 1024  # 1000 rounded up to the 32-element block
    assert opt.state_bytes() == 2 * (padded + padded // 32) + padded
    sgd = MemOptimizer([p32], rule="sgd")
    sgd.step()
    assert sgd.state_bytes() == 0  # plain SGD keeps no state


def test_param_cast_after_state_exists_is_refused():
    # model.to(bfloat16) after some steps: a re-plan would go on from the rounded weight (and
    # drop an ECC code the other way round), so the step refuses it; casting back continues
    p = torch.nn.Parameter(torch.randn(4))
    opt = MemOptimizer([p], moments="fp32")
    p.grad = torch.ones(4)
    opt.step()
    m = opt.state[p]["exp_avg"].clone()
    weight = p.detach().clone()
    p.data = p.data.to(torch.bfloat16)
    p.grad = None
    p.grad_dtype = None
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"changed since its state was created \(it was "):
        opt.step()
    assert opt.state[p]["step"].item() == 1
    assert torch.equal(opt.state[p]["exp_avg"], m)
    p.data = weight
    p.grad = None
    p.grad_dtype = None
    p.grad = torch.ones(4)
    opt.step()
    assert opt.state[p]["step"].item() == 2
    assert torch.equal(opt.state[p]["exp_avg"], m + 0.1 * (1 - m))  # continued from m


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's imports (torch.jit)
def test_a_compiled_step_gives_the_eager_bits():
    """torch.compile around opt.step() runs it eagerly: inductor had compiled the torch
    backend's rounding words (rng's wrapping int64 arithmetic) into other, partly negative
    values, so stochastic rounding differed from step 2 on (2304 of 4096 parameters, q8)."""
    out = []
    for compiled in (False, True):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4096))
        opt = MemOptimizer([p], rule="adamw", lr=1e-2, moments="q8", backend="torch")
        step = torch.compile(opt.step) if compiled else opt.step
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            p.grad = torch.randn(4096, generator=gen)
            step()
        out.append(p.detach().clone())
    assert torch.equal(out[0].view(torch.int32), out[1].view(torch.int32))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # dynamo's imports
def test_a_fullgraph_compile_of_the_step_says_why_it_cannot():
    """The step runs eagerly, a graph break that fullgraph=True refuses: dynamo's message was
    "Attempted to call function marked as skipped ... Please file an issue to PyTorch"."""
    import torch._dynamo

    p = torch.nn.Parameter(torch.randn(8))
    opt = MemOptimizer([p], rule="adamw", lr=1e-2, backend="torch")

    @torch.compile(fullgraph=True, backend="eager")
    def step(lr):
        opt.param_groups[0]["lr"] = lr
        opt.step()

    torch._dynamo.reset()
    p.grad = torch.ones(8)
    with pytest.raises(Exception, match=r"memopt runs optimizer steps eagerly \(a graph break\)"):
        step(1e-3)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # dynamo's imports
def test_a_compiled_training_step_gives_the_eager_bits(device):
    """A compiled training step (forward, backward and opt.step() in one torch.compile): the
    step graph-breaks into the eager step, with the eager bits. On the H200 (torch 2.11)
    dynamo failed an internal assertion tracing the step wrapper's own bookkeeping."""
    out = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)
        ).to(device)
        opt = MemOptimizer(model.parameters(), rule="adamw", lr=1e-2, moments="q8")

        def train_step(x, model=model, opt=opt):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        step = torch.compile(train_step, backend="eager") if compiled else train_step
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            step(torch.randn(8, 16, generator=gen).to(device))
        out.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*out, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("sr", [True, False])
def test_reaching_the_float32_step_limit_warns_once_with_stochastic_rounding(sr):
    """float32 step counts (torch's too) stop at 2**24; stochastic rounding, whose words come
    from the count, would then repeat them at every step and could stall: said once."""
    p = torch.nn.Parameter(torch.randn(64))
    opt = MemOptimizer([p], rule="adamw", moments="bf16", stochastic_rounding=sr, backend="torch")
    p.grad = torch.randn(64)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["step"] = torch.tensor(2.0**24 - 2)
    opt.load_state_dict(sd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # counts 2**24 - 1, 2**24, then stuck at 2**24
            opt.step()
    limit = [w for w in caught if "reached 2**24" in str(w.message)]
    assert len(limit) == (1 if sr else 0)
    assert opt.state[p]["step"].item() == 2**24


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_callers_state_entries_are_kept_as_torch_keeps_them(backend):
    """timm's Lookahead keeps ``lookahead_slow_buff`` in ``optimizer.state[p]``. Such entries
    vanished when memopt rebuilt a group's state (at the first step, after a state tensor was
    written, when momentum was switched on), and the optimizer's own state dict, which held
    them, was refused on load ("unexpected entries")."""
    if backend == "cpu":
        pytest.importorskip("memopt_kernels_cpu")
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(40).bfloat16()) for _ in range(2)]
    opt = MemOptimizer(ps, rule="sgd", lr=0.1, master="ecc24", moments="q8", backend=backend)
    opt.state[ps[0]]["slow"] = torch.ones(40)  # before the first step
    for t in range(4):
        if t == 2:
            opt.param_groups[0]["momentum"] = 0.9  # a rebuild with a momentum buffer
        for p in ps:
            p.grad = torch.randn(40).bfloat16()
        opt.step()
        if t == 0:
            opt.state[ps[1]]["counter"] = 3  # after a step
    assert torch.equal(opt.state[ps[0]]["slow"], torch.ones(40))
    assert opt.state[ps[1]]["counter"] == 3
    sd = copy.deepcopy(opt.state_dict())
    assert sd["state"][0]["slow"].dtype == torch.float32  # saved as it is
    twin = MemOptimizer(
        [torch.nn.Parameter(p.detach().clone()) for p in ps],
        rule="sgd", lr=0.1, master="ecc24", moments="q8", backend=backend,
    )  # fmt: skip
    twin.load_state_dict(sd)
    q0, q1 = twin.param_groups[0]["params"]
    assert twin.state[q0]["slow"].dtype == torch.bfloat16  # cast like the parameter, as torch does
    assert torch.equal(twin.state[q0]["slow"], torch.ones(40, dtype=torch.bfloat16))
    assert twin.state[q1]["counter"] == 3
    assert "momentum_buffer" in twin.state[q0]
