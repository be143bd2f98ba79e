"""MemOptimizer's advanced lifecycle API: ``init_state()`` (state before the first step), the
gradient-release switch (``begin_gradient_release`` / ``end_gradient_release`` /
``gradient_release_active``: ``step()`` and ``zero_grad()`` warn and do nothing), and torch's step
hooks firing exactly once per ``step()`` call, also in subclasses calling ``super().step()``."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from memopt_core import ConfigError, MemOptimizer
from memopt_core.testing import assert_same_optimizers, bits

CONFIGS = {
    "fp32-adamw": dict(rule="adamw", dtype=torch.float32, master="none", moments="fp32"),
    "ecc24-q8-adamw": dict(rule="adamw", dtype=torch.bfloat16, master="ecc24", moments="q8"),
    "ecc32-bf16-lion": dict(rule="lion", dtype=torch.bfloat16, master="ecc32", moments="bf16"),
    "none-fp8-sgd": dict(
        rule="sgd", dtype=torch.bfloat16, master="none", moments="fp8", momentum=0.9
    ),
    "fp32-sgd-no-momentum": dict(rule="sgdw", dtype=torch.float32, master="none", moments="q8"),
}
SHAPES = [(7, 9), (), (0, 3), (100,), (33,)]


def make_params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]


def make_opt(params, cfg, **kw):
    cfg = {k: v for k, v in cfg.items() if k != "dtype"}
    cfg.update(kw)
    return MemOptimizer(params, lr=1e-2, weight_decay=0.01, **cfg)


def set_grads(params, step, skip=()):
    gen = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
        p.grad = None if i in skip else g


# ---------------------------------------------------------------------------- init_state
@pytest.mark.parametrize("name", list(CONFIGS))
def test_init_state_creates_state_for_parameters_without_gradients(name):
    cfg = CONFIGS[name]
    params = make_params(cfg["dtype"])
    frozen = torch.randn(5).to(cfg["dtype"])  # requires_grad=False, no gradient: no state
    before = [bits(p).clone() for p in params]
    opt = make_opt([*params, frozen], cfg)
    assert opt.state_bytes() == 0
    assert len(opt.state) == 0
    assert opt.init_state() is None
    for p, b in zip(params, before, strict=True):
        assert p.grad is None  # no gradients were made
        assert torch.equal(bits(p), b)  # parameters untouched
        st = opt.state[p]
        assert int(st["step"]) == 0
        for k, v in st.items():
            if k in ("step", "master_code"):
                continue
            assert not v.float().any(), f"state {k!r} is not zero"
        if cfg["dtype"] == torch.bfloat16 and cfg["master"] != "none":
            assert "master_code" in st
    assert frozen not in opt.state
    if name != "fp32-sgd-no-momentum":
        assert opt.state_bytes() > 0
    # idempotent: the same state objects, the same arenas
    views = {id(p): dict(opt.state[p]) for p in params}
    nbytes = opt.state_bytes()
    opt.init_state()
    assert opt.state_bytes() == nbytes
    for p in params:
        for k, v in opt.state[p].items():
            assert v is views[id(p)][k]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_step_after_init_state_equals_one_without_it(name):
    cfg = CONFIGS[name]
    pa, pb = make_params(cfg["dtype"]), make_params(cfg["dtype"])
    opt_a, opt_b = make_opt(pa, cfg), make_opt(pb, cfg)
    opt_a.init_state()
    for t in range(4):
        skip = {0} if t == 0 else {3} if t == 2 else set()  # some parameters lack a gradient
        set_grads(pa, t, skip)
        set_grads(pb, t, skip)
        opt_a.step()
        opt_b.step()
        if t == 1:
            opt_a.init_state()  # after steps: changes nothing
        if t == 0:
            # a step creates state only for parameters with a gradient; init_state for all
            assert pb[0] not in opt_b.state
            assert int(opt_a.state[pa[0]]["step"]) == 0
            assert all(torch.equal(bits(p), bits(q)) for p, q in zip(pa, pb, strict=True))
            continue
        assert_same_optimizers(pa, pb, opt_a, opt_b)
    assert opt_a.state_bytes() == opt_b.state_bytes()
    assert int(opt_a.state[pa[0]]["step"]) == 3


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_parameter_without_a_gradient_gets_no_state_until_it_has_one(name, backend, device):
    # torch's optimizers create state only for parameters that got a gradient: an unused head
    # or an expert no token reached costs nothing until it trains (here: a (64, 64) and a (9,)
    # one beside the used parameters, last of two param groups, which the Triton backend steps
    # as one family arena; over steps that the cached step replays)
    cfg = CONFIGS[name]
    n = len(SHAPES)

    def model(late=True):
        gen = torch.Generator().manual_seed(7)
        extra = [torch.randn(s, generator=gen).to(cfg["dtype"]) for s in ((64, 64), (9,))]
        ps = [*make_params(cfg["dtype"]), *(extra if late else [])]
        return [p.detach().to(device).requires_grad_() for p in ps]

    def groups(ps):
        return [{"params": ps[:3]}, {"params": ps[3:], "lr": 5e-3}]

    params, ref_params, alone_params = model(), model(), model(late=False)
    opt, ref, alone = (
        make_opt(groups(ps), cfg, backend=backend) for ps in (params, ref_params, alone_params)
    )
    ref.init_state()  # the state of every trainable parameter from the start
    for t in range(8):
        for ps in (params, ref_params, alone_params):
            set_grads(ps, t, skip={n, n + 1})
        opt.step()
        ref.step()
        alone.step()
    assert all(p not in opt.state for p in params[n:])
    assert len(opt.state) == n
    assert opt.state_bytes() == alone.state_bytes()
    assert sorted(opt.state_dict()["state"]) == list(range(n))
    assert_same_optimizers(params[:n], alone_params, opt, alone)
    # their first gradients (the (64, 64) one at step 8, the other at 9): first steps from
    # fresh state, the bits of an optimizer that held their state all along. Every state
    # tensor stays the one it was (live, as torch's): no rebuild, which would hold the group's
    # state twice while it copies it
    held = [dict(opt.state[p]) for p in params[:n]]
    for t in (8, 9, 10):
        before = [p.detach().clone() for p in params[n:]]
        for ps in (params, ref_params):
            set_grads(ps, t, skip={n + 1} if t == 8 else ())
        opt.step()
        ref.step()
        if t < 10:
            assert int(opt.state[params[n + t - 8]]["step"]) == 1
            assert not torch.equal(bits(params[n + t - 8]), bits(before[t - 8]))
            for p, was in zip(params, held, strict=False):
                assert all(opt.state[p][k] is v for k, v in was.items())
            held.append(dict(opt.state[params[n + t - 8]]))
    assert_same_optimizers(params, ref_params, opt, ref)
    assert opt.state_bytes() == ref.state_bytes()
    assert opt.state_bytes() > alone.state_bytes() or name == "fp32-sgd-no-momentum"


def test_a_tensor_put_in_place_of_one_without_state_is_checked():
    # a parameter without state yet, replaced in its list by a tensor with a gradient: the
    # list was edited (not a first gradient), so the group is rebuilt and its parameters
    # checked as add_param_group checks them (this one shares the first one's memory)
    a, b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    opt = MemOptimizer([a, b], rule="adamw", lr=1e-2)
    a.grad = torch.ones(8)
    opt.step()
    q = torch.nn.Parameter(a.data)
    opt.param_groups[0]["params"][1] = q
    a.grad, q.grad = torch.ones(8), torch.ones(8)
    with pytest.raises(ConfigError, match="parameter #0 of param group 0 and parameter #1 of "):
        opt.step()


def test_init_state_picks_up_parameters_added_or_unfrozen_later():
    a = torch.randn(4, requires_grad=True)
    frozen = torch.randn(3)
    opt = MemOptimizer([a, frozen], rule="adamw")
    opt.init_state()
    assert frozen not in opt.state
    a_state = opt.state[a]["exp_avg"]
    b = torch.randn(6, requires_grad=True)
    opt.add_param_group({"params": [b], "lr": 0.1})
    opt.init_state()
    assert int(opt.state[b]["step"]) == 0
    assert opt.state[a]["exp_avg"] is a_state  # its group did not change: kept as it was
    a.grad = torch.ones_like(a)
    opt.step()
    a_state = opt.state[a]["exp_avg"].clone()
    frozen.requires_grad_()
    opt.init_state()  # group 0 is rebuilt around the unfrozen parameter; a's values stay
    assert int(opt.state[frozen]["step"]) == 0
    assert torch.equal(opt.state[a]["exp_avg"], a_state)
    assert int(opt.state[a]["step"]) == 1


def test_init_state_then_state_dict_round_trip():
    params = make_params(torch.bfloat16)
    opt = make_opt(params, CONFIGS["ecc24-q8-adamw"])
    opt.init_state()
    sd = copy.deepcopy(opt.state_dict())
    assert len(sd["state"]) == len(params)
    other = make_opt(make_params(torch.bfloat16), CONFIGS["ecc24-q8-adamw"])
    other.load_state_dict(sd)
    assert other.state_bytes() == opt.state_bytes()


# -------------------------------------------------------------------- gradient release
def _released(opt):
    owner = object()
    opt.begin_gradient_release(owner)
    return owner


def test_release_switch_turns_step_and_zero_grad_into_warning_no_ops():
    params = make_params()
    opt = make_opt(params, CONFIGS["fp32-adamw"])
    assert not opt.gradient_release_active
    owner = _released(opt)
    assert opt.gradient_release_active
    set_grads(params, 0)
    before = [bits(p).clone() for p in params]
    called = []

    def closure():
        called.append(1)
        return torch.tensor(1.0)

    with pytest.warns(UserWarning, match="does nothing") as rec:
        assert opt.step(closure) is None
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "MemOptimizer.step() does nothing while enable_gradient_release() is active" in msg
    assert "handle.remove()" in msg  # what to do
    # what it means for a framework's loop, which calls step() itself
    assert "gradient accumulation" in msg
    assert "clip_grad_norm_ finds no gradient" in msg
    assert rec[0].filename == __file__  # points at the caller, through torch's hook wrapper
    assert not called  # the closure is not evaluated
    with pytest.warns(UserWarning, match=r"MemOptimizer\.zero_grad\(\) does nothing") as rec:
        opt.zero_grad()
    assert rec[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per activation
        opt.step()
        opt.zero_grad()
    assert all(p.grad is not None for p in params)  # zero_grad kept them
    assert all(torch.equal(bits(p), b) for p, b in zip(params, before, strict=True))
    assert opt.state_bytes() == 0
    # the hooks' own entry keeps working
    opt.step_parameters([params[0]])
    assert int(opt.state[params[0]]["step"]) == 1
    assert not torch.equal(bits(params[0]), before[0])
    # a second activation is refused; another owner cannot end this one
    with pytest.raises(ConfigError, match="already active"):
        opt.begin_gradient_release(object())
    opt.end_gradient_release(object())
    assert opt.gradient_release_active
    opt.end_gradient_release(owner)
    assert not opt.gradient_release_active
    opt.end_gradient_release(owner)  # idempotent
    opt.step()
    assert int(opt.state[params[1]]["step"]) == 1
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    # a new activation warns again
    owner = _released(opt)
    with pytest.warns(UserWarning, match="does nothing"):
        opt.step()
    opt.end_gradient_release(owner)
    with pytest.raises(ConfigError, match="owner"):
        opt.begin_gradient_release(None)


def test_add_param_group_is_refused_while_released():
    # the release hooks cover the parameters held when release began: a new group's parameters
    # would never be updated
    params = make_params()
    opt = make_opt(params[:1], CONFIGS["fp32-adamw"])
    owner = _released(opt)
    with pytest.raises(
        ConfigError,
        match=r"add_param_group while gradient release is active.*"
        r"handle.remove\(\) first",
    ):
        opt.add_param_group({"params": params[1:]})
    assert len(opt.param_groups) == 1
    opt.end_gradient_release(owner)
    opt.add_param_group({"params": params[1:]})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_released_optimizer_is_not_released(how):
    params = make_params()
    opt = make_opt(params, CONFIGS["fp32-adamw"])
    _released(opt)
    clone = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert opt.gradient_release_active
    assert not clone.gradient_release_active
    for p in clone.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clone.step()


# ------------------------------------------------------------- param_groups edited by hand
@pytest.mark.parametrize("edit", ["reverse", "pop_first", "pop_then_add"])
@pytest.mark.parametrize("partial", [False, True])
def test_param_groups_edited_by_hand_after_steps(edit, partial):
    """torch's optimizers follow ``param_groups`` edited in place. Plans were kept per group
    index: after a reorder, step_parameters() (gradient release's step) skipped a whole group
    silently, and removing a group other than the last made step() raise an IndexError. Here
    the edited optimizer must go on exactly as one whose groups were not edited (fp32 state:
    no rounding words, which follow a tensor's position)."""
    cfg = CONFIGS["fp32-adamw"]
    pa, pb = make_params(), make_params()
    opt_a = make_opt([{"params": pa[:2], "lr": 0.1}, {"params": pa[2:]}], cfg)
    opt_b = make_opt([{"params": pb[:2], "lr": 0.1}, {"params": pb[2:]}], cfg)
    for t in range(2):
        set_grads(pa, t), set_grads(pb, t)
        opt_a.step(), opt_b.step()
    kept = slice(0, 5)
    if edit == "reverse":
        opt_a.param_groups.reverse()
    else:
        opt_a.param_groups.pop(0)
        kept = slice(2, 5)
        if edit == "pop_then_add":
            extra = [torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)]
            opt_a.add_param_group({"params": [extra[0]]})
            opt_b.add_param_group({"params": [extra[1]]})
            pa, pb = [*pa, extra[0]], [*pb, extra[1]]
            kept = slice(2, 6)
    for t in range(2, 4):
        set_grads(pa, t), set_grads(pb, t)
        if partial:
            opt_a.step_parameters(pa[kept]), opt_b.step_parameters(pb[kept])
        else:
            opt_a.step(), opt_b.step()
    assert_same_optimizers(pa[kept], pb[kept], opt_a, opt_b, f"{edit}, partial={partial}")


# --------------------------------------------------------------------------- step hooks
class Counter:
    def __init__(self, opt):
        self.counts = {"pre": 0, "post": 0, "global_pre": 0, "global_post": 0}
        self.handles = [
            opt.register_step_pre_hook(self._bump("pre")),
            opt.register_step_post_hook(self._bump("post")),
            register_optimizer_step_pre_hook(self._bump("global_pre")),
            register_optimizer_step_post_hook(self._bump("global_post")),
        ]

    def _bump(self, key):
        def hook(*args):
            self.counts[key] += 1

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()

    def once(self):
        return self.counts == {"pre": 1, "post": 1, "global_pre": 1, "global_post": 1}


def _subclasses():
    # defined per test, so torch's per-class wrapping of step starts fresh each time
    class Sub(MemOptimizer):
        def step(self, closure=None):
            self.calls = getattr(self, "calls", 0) + 1
            return super().step(closure)

    class SubSub(Sub):
        def step(self, closure=None):
            return super().step(closure)

    class Inherits(Sub):  # no override: Sub's step
        pass

    return {"MemOptimizer": MemOptimizer, "Sub": Sub, "SubSub": SubSub, "Inherits": Inherits}


@pytest.mark.parametrize("order", ["base-first", "sub-first"])
def test_step_hooks_fire_once_per_step_call(order):
    classes = _subclasses()
    names = list(classes) if order == "base-first" else list(reversed(classes))
    opts = {}
    for name in names:  # building an instance wraps its class's step (torch)
        p = torch.ones(3, requires_grad=True)
        opts[name] = (classes[name]([p], rule="adamw", lr=0.1), p)
    for name in names:
        opt, p = opts[name]
        for t in range(2):
            p.grad = torch.full_like(p, 0.5)
            counter = Counter(opt)
            try:
                loss = opt.step(lambda: torch.tensor(3.0))
            finally:
                counter.remove()
            assert counter.once(), f"{name}, step {t}: {counter.counts}"
            assert float(loss) == 3.0  # the closure's loss comes back through the wrappers
        assert int(opt.state[p]["step"]) == 2  # the update itself ran once per call


def test_step_hooks_fire_once_in_release_mode_and_under_an_lr_scheduler():
    Sub = _subclasses()["Sub"]
    MemOptimizer([torch.ones(1, requires_grad=True)])  # the base's step is wrapped too
    p = torch.ones(3, requires_grad=True)
    opt = Sub([p], rule="adamw", lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # wraps opt.step
    p.grad = torch.ones_like(p)
    counter = Counter(opt)
    opt.step()
    sched.step()
    assert counter.once(), counter.counts
    owner = _released(opt)
    counter.counts = dict.fromkeys(counter.counts, 0)
    with pytest.warns(UserWarning, match=r"Sub\.step\(\) does nothing"):
        opt.step()
    assert counter.once(), counter.counts  # the hooks wrap the call, which did nothing
    opt.end_gradient_release(owner)
    counter.remove()
    assert int(opt.state[p]["step"]) == 1


def test_profiler_sees_one_step_range():
    classes = _subclasses()
    MemOptimizer([torch.ones(1, requires_grad=True)])
    p = torch.ones(3, requires_grad=True)
    opt = classes["SubSub"]([p], rule="adamw", lr=0.1)
    p.grad = torch.ones_like(p)
    with torch.autograd.profiler.profile() as prof:
        opt.step()
    names = [e.name for e in prof.function_events if e.name.startswith("Optimizer.step#")]
    assert names == ["Optimizer.step#SubSub.step"]


def test_a_pre_hook_may_replace_the_arguments():
    Sub = _subclasses()["Sub"]
    MemOptimizer([torch.ones(1, requires_grad=True)])
    p = torch.ones(3, requires_grad=True)
    opt = Sub([p], rule="sgd", lr=0.1)

    def pre(optimizer, args, kwargs):
        return args, {"closure": lambda: torch.tensor(7.0)}

    h = opt.register_step_pre_hook(pre)
    p.grad = torch.ones_like(p)
    assert float(opt.step()) == 7.0
    h.remove()


def test_state_dict_post_hooks_see_and_replace_the_finished_dict():
    p = torch.nn.Parameter(torch.randn(8, 4))
    opt = MemOptimizer([p], rule="adamw", moments="q8")
    p.grad = torch.randn(8, 4)
    opt.step()
    seen = []
    opt.register_state_dict_post_hook(
        lambda o, sd: seen.append((sorted(sd), sorted(sd["state"][0])))
    )
    sd = opt.state_dict()
    assert seen == [(["memopt", "param_groups", "state"], sorted(sd["state"][0]))]
    assert "param_shape" in seen[0][1]
    opt.register_state_dict_post_hook(
        lambda o, sd: {"state": {}, "param_groups": sd["param_groups"]}
    )
    assert sorted(opt.state_dict()) == ["param_groups", "state"]  # the hook's dict, as returned
