"""A refused step leaves no trace. ``step()`` and ``step_parameters()`` refuse bad input with a
named error (a group's lr set to -1 or NaN, a non-finite weight decay, a sparse gradient or one
of another dtype or shape, a non-finite gradient with ``check_numerics``, a gradient a kernel
backend refuses, a tensor the optimizer does not hold); afterwards nothing the optimizer holds
has changed: no state for parameters at their first step (``state``, ``state_dict()``,
``state_bytes()``), no step count, no moments, no ``initial_lr`` recorded, no gradient unscaled
for a GradScaler. Fixing the input and stepping then gives the bits of a twin optimizer that never
saw the refused step. Each scenario refuses at the first step, at a replay of the cached step and
at a step where a parameter gets its first gradient (its plan extended); on the torch backend, the
cpu one where installed, and Triton's in its interpreter (a subprocess, as in
``test_cached_step``)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import pytest
import test_cached_step as t
import torch

from memopt_core import ConfigError, MemoptError, MemOptimizer, NumericsError
from memopt_core.testing import assert_same_optimizers, bits

#: name -> (test_cached_step's configuration, what changes in it)
CONFIGS = {
    "adamw-fp32": ("adam-fp32-l2", {"rule": "adamw"}),
    "adamw-ecc24-q8": ("adamw-ecc24-q8", {}),
    "adamw-fp8": ("adamw-ecc24-q8", {"moments": "fp8"}),
    "sgd-momentum": ("sgd-momentum", {}),
    "sgd-nesterov-fp8": ("sgd-nesterov", {}),
    "lion-ecc32-bf16": ("lion-ecc32-bf16", {}),
}
BAD = 4  # the parameter given the bad input (33 elements)
LATE = 3  # the parameter without a gradient until the last steps (100 elements)


def pair(cfg_name, backend, **kw):
    name, changes = CONFIGS[cfg_name]
    return t.pair(name, backend, **{**changes, **kw})


# ------------------------------------------------------------------------------ bad input
# each takes the optimizer and its parameters (gradients set) and returns what undoes it


def _group_value(key, value, gi=0):
    def bad(opt, params):
        group = opt.param_groups[gi]
        old = group[key]
        group[key] = value
        return lambda: group.__setitem__(key, old)

    return bad


def _sparse_grad(opt, params):
    p = params[BAD]
    g = p.grad
    p.grad = g.to_sparse()
    return lambda: setattr(p, "grad", g)


def _float64_grad(opt, params):
    p = params[BAD]
    g = p.grad
    p.grad_dtype = None  # lets torch take a gradient of another dtype
    p.grad = g.double()
    return lambda: setattr(p, "grad", g)


def _nan_grad(opt, params):
    g = params[BAD].grad
    old = g[5].clone()
    g[5] = math.nan
    return lambda: g.__setitem__(5, old)


def _grad_on_another_parameter(opt, params):
    p = params[BAD]
    g = p.grad
    p.grad = params[5].detach().view(-1)[: p.numel()].view(p.shape)  # a kernel writes there
    return lambda: setattr(p, "grad", g)


#: name -> (optimizer arguments, bad input, backends that refuse it: None for all)
CASES: dict[str, tuple[dict, Callable, tuple[str, ...] | None]] = {
    "lr -1": ({}, _group_value("lr", -1.0), None),
    "lr nan": ({}, _group_value("lr", math.nan), None),
    "weight_decay inf": ({}, _group_value("weight_decay", math.inf), None),
    "sparse gradient": ({}, _sparse_grad, None),
    "float64 gradient": ({}, _float64_grad, None),
    "nan gradient": ({"check_numerics": True}, _nan_grad, None),
    # the torch backend computes on copies and takes it (docs/architecture.md)
    "gradient on another parameter": ({}, _grad_on_another_parameter, ("cpu", "triton")),
}


def snapshot(opt, params, state_dict=True):
    """Everything a refused step must leave as it was (``state_dict``: with the keys of
    ``state_dict()["state"]``, which converts moments a changed beta2 leaves to the next step)."""
    return {
        "params": [bits(p).clone() for p in params],
        "grads": [
            None if p.grad is None or p.grad.layout != torch.strided else bits(p.grad).clone()
            for p in params
        ],
        "state": {
            i: {k: bits(v).clone() for k, v in opt.state[p].items()}
            for i, p in enumerate(params)
            if p in opt.state
        },
        "state_dict": sorted(opt.state_dict()["state"]) if state_dict else None,
        "state_bytes": opt.state_bytes(),
        "groups": [repr({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups],
    }


def assert_no_trace(before, after, where):
    assert before.keys() == after.keys()
    for key in before:
        x, y = before[key], after[key]
        if key == "state":
            assert x.keys() == y.keys(), (
                f"{where}: states of parameters {sorted(y)}, not {sorted(x)}"
            )
            for i in x:
                assert x[i].keys() == y[i].keys(), f"{where}: state keys of {i}"
                for k in x[i]:
                    assert torch.equal(x[i][k], y[i][k]), f"{where}: state {k!r} of {i} changed"
        elif key in ("params", "grads"):
            for i, (u, v) in enumerate(zip(x, y, strict=True)):
                same = (u is None and v is None) or (
                    u is not None and v is not None and torch.equal(u, v)
                )
                assert same, f"{where}: {key[:-1]} {i} changed"
        else:
            assert x == y, f"{where}: {key} {x} became {y}"


def refuse(opt, params, bad, call, where, error=MemoptError, state_dict=True):
    """Apply ``bad`` to the gradients set on ``params``, check that ``call`` refuses it and
    leaves no trace (:func:`snapshot`), undo it."""
    undo = bad(opt, params)
    before = snapshot(opt, params, state_dict)
    with pytest.raises(error):
        call(opt, params)
    assert_no_trace(before, snapshot(opt, params, state_dict), where)
    undo()


def _step(opt, params):
    opt.step()


def _step_parameters(opt, params):
    opt.step_parameters(params)


CALLS = {"step": _step, "step_parameters": _step_parameters}


# ------------------------------------------------------------------------------- scenarios
# plain functions of the backend name, so the Triton subprocess runs them too


def run_refusals(backend, cfg_name, case, call_name="step"):
    """The bad input refused at the first step, at a replay and at a parameter's first
    gradient, each followed by the fixed step, next to a twin that only takes the good ones."""
    kw, bad, refusing = CASES[case]
    assert refusing is None or backend in refusing
    a, b, opt, ref = pair(cfg_name, backend, **kw)
    call = CALLS[call_name]
    for step in range(1, 7):
        skip = (LATE,) if step < 5 else ()
        t.set_grads(a, step, skip=skip)  # in place: a replay follows them
        t.set_grads(b, step, in_place=False, skip=skip)
        if step in (1, 4, 5):  # the first step, a replay, a parameter's first gradient
            refuse(opt, a, bad, call, f"{cfg_name}, {case}, step {step}")
        call(opt, a)
        call(ref, b)
        assert_same_optimizers(a, b, opt, ref, f"{cfg_name}, {case}, step {step}")
    if call_name == "step":
        assert None in opt._cached_steps  # cached again after the refusals


def run_gradscaler_refused_after_its_checks(backend):
    """A GradScaler's step refused where the optimizer reads the scalars (decouple_lr switched
    on by hand at lr 0: there is no initial lr to record), after the hyperparameter and gradient
    checks: on a host backend the gradients were already unscaled in place, so the scaler's
    retry unscaled them twice, and the first step's state stayed. Retried with a good lr in the
    same iteration, the bits of a run that never saw the refused step."""

    def run(refuse_first):
        model = torch.nn.Linear(6, 4)
        with torch.no_grad():
            model.weight.copy_(torch.linspace(-1, 1, 24).view(4, 6))
            model.bias.copy_(torch.linspace(-0.5, 0.5, 4))
        params = list(model.parameters())
        opt = MemOptimizer(params, rule="adamw", lr=0.1, weight_decay=0.1, backend=backend)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
        x = torch.linspace(-2, 2, 18).view(3, 6)
        for it in range(3):
            opt.zero_grad()
            scaler.scale(model(x).square().mean()).backward()
            if it == 0:
                group = opt.param_groups[0]
                group["decouple_lr"] = True  # its initial lr is recorded at the next step
                if refuse_first:
                    group["lr"] = 0.0
                    before = snapshot(opt, params)
                    with pytest.raises(ConfigError, match="initial lr it would record now is 0"):
                        scaler.step(opt)
                    assert_no_trace(before, snapshot(opt, params), "GradScaler")
                    group["lr"] = 0.1
            scaler.step(opt)
            scaler.update()
        return params, opt

    a, opt = run(True)
    b, ref = run(False)
    assert_same_optimizers(a, b, opt, ref, "GradScaler")
    assert opt.param_groups[0]["initial_lr"] == 0.1


def run_initial_lr_recorded_by_a_refused_step(backend):
    """decouple_lr switched on by hand records the group's initial lr at the next step; a step
    refused after the scalars were read (a NaN gradient with check_numerics, on the ordinary
    path and on a replay) recorded it, and the retry after a scheduler's change of lr then
    decayed with the old one."""
    a, b, opt, ref = pair("adamw-fp32", backend, check_numerics=True)
    for step in range(1, 6):
        t.set_grads(a, step)
        t.set_grads(b, step, in_place=False)
        if step in (1, 4):
            for o in (opt, ref):
                o.param_groups[0]["decouple_lr"] = True
                o.param_groups[0].pop("initial_lr", None)
            refuse(opt, a, _nan_grad, _step, f"step {step}", NumericsError)
            for o in (opt, ref):
                o.param_groups[0]["lr"] *= 0.5  # a scheduler's step in between
        opt.step()
        ref.step()
        assert_same_optimizers(a, b, opt, ref, f"step {step}")


def run_moments_converted_by_a_refused_step(backend):
    """A changed beta2 converts a group's q8/fp8 second moments before its next step; a step
    refused by another group converted them (and a retry with the old beta2 converted them
    back, rounded twice)."""

    def make(params):
        groups = [{"params": params[:3]}, {"params": params[3:]}]
        return MemOptimizer(groups, rule="adamw", lr=1e-2, moments="q8", backend=backend)

    a = t.make_params(torch.float32)
    b = t.twin(a)
    opt, ref = make(a), make(b)
    for step in range(1, 6):
        t.set_grads(a, step)
        t.set_grads(b, step, in_place=False)
        if step in (3, 4):  # refused by an ordinary step (a sparse gradient), by a replay
            opt.param_groups[0]["betas"] = (0.9, 0.99)
            bad = _sparse_grad if step == 3 else _group_value("lr", math.nan, gi=1)
            refuse(opt, a, bad, _step, f"beta2, then group 1, step {step}", state_dict=False)
            opt.param_groups[0]["betas"] = (0.9, 0.999)  # changed back with the fix
        opt.step()
        ref.step()
        assert_same_optimizers(a, b, opt, ref, f"step {step}")


def run_rebuild_refused(backend):
    """A parameter appended to a group's list by hand rebuilds the group (and on Triton the
    other groups of its family arena) at the next step: refused there, the old plans, states and
    arenas stay, and the new parameter gets no state."""

    def make(params):
        groups = [{"params": params[:2]}, {"params": params[2:4]}]
        return MemOptimizer(groups, rule="adamw", lr=1e-2, moments="q8", backend=backend)

    a = t.make_params(torch.float32)
    b = t.twin(a)
    opt, ref = make(a[:5]), make(b[:5])
    for step in range(1, 6):
        t.set_grads(a, step, skip=(4, 5) if step < 3 else (5,))
        t.set_grads(b, step, in_place=False, skip=(4, 5) if step < 3 else (5,))
        if step == 3:
            opt.param_groups[0]["params"].append(a[4])
            ref.param_groups[0]["params"].append(b[4])
            state = dict(opt.state[a[0]])
            refuse(opt, a, _sparse_grad, _step, "rebuild")
            assert all(opt.state[a[0]][k] is v for k, v in state.items())  # the same views
        opt.step()
        ref.step()
        assert_same_optimizers(a, b, opt, ref, f"step {step}")


def _counts_edited(opt, params):
    """Counts edited in place: that of group 0's first parameter to 100, that of group 1's
    first (``params[3]``) to no count (2.5), which the step refuses."""
    saved = [(opt.state[p]["step"], opt.state[p]["step"].clone()) for p in (params[0], params[3])]
    saved[0][0].fill_(100.0)
    saved[1][0].fill_(2.5)

    def undo():
        for count, was in saved:
            count.copy_(was)

    return undo


def run_count_edit_refused(backend):
    """A step count edited in place converts the q8 second moments stored for it (``v / N``,
    ``N`` of the count) before its group steps. A step refused by another group's edit (a count
    of 2.5) converted them first, and the retry with the edit taken back converted them back,
    rounded twice. Now they convert once the checks passed (or in a rebuild's copies, dropped
    with it): the bits of a twin that never saw the refused step, whether group 0 just steps,
    gains a parameter at its first gradient (its plan extended) or one appended to its list (a
    rebuild)."""
    for change in ("none", "first gradient", "appended"):
        a = [p for i, p in enumerate(t.make_params(torch.float32)) if i != 2]  # no empty one
        b = t.twin(a)

        def make(ps, change=change):
            first = ps[:3] if change == "first gradient" else ps[:2]
            groups = [{"params": first}, {"params": ps[3:]}]
            return MemOptimizer(groups, rule="adamw", lr=1e-2, moments="q8", backend=backend)

        opt, ref = make(a), make(b)
        for step in range(1, 7):
            skip = (2,) if step < 4 else ()  # parameter 2's first gradient at step 4
            t.set_grads(a, step, skip=skip)
            t.set_grads(b, step, in_place=False, skip=skip)
            if step == 4:
                if change == "appended":
                    opt.param_groups[0]["params"].append(a[2])
                    ref.param_groups[0]["params"].append(b[2])
                where = f"{change}, step {step}"
                refuse(opt, a, _counts_edited, _step, where, ConfigError, state_dict=False)
            opt.step()
            ref.step()
            assert_same_optimizers(a, b, opt, ref, f"{change}, step {step}")
        assert float(opt.state[a[0]]["step"]) == 6


SCENARIOS = [
    run_gradscaler_refused_after_its_checks,
    run_initial_lr_recorded_by_a_refused_step,
    run_moments_converted_by_a_refused_step,
    run_rebuild_refused,
    run_count_edit_refused,
]


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize(
    ("backend", "case"),
    [
        (backend, case)
        for case, (_, _, refusing) in CASES.items()
        for backend in t.backend_names()
        if refusing is None or backend in refusing
    ],
)
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_a_refused_step_leaves_no_trace(backend, cfg_name, case):
    run_refusals(backend, cfg_name, case)


@pytest.mark.parametrize("backend", t.backend_names())
@pytest.mark.parametrize("case", ["lr nan", "float64 gradient", "nan gradient"])
def test_a_refused_step_parameters_leaves_no_trace(backend, case):
    run_refusals(backend, "adamw-ecc24-q8", case, "step_parameters")


@pytest.mark.parametrize("backend", t.backend_names())
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__.removeprefix("run_"))
def test_scenario(backend, scenario):
    scenario(backend)


@pytest.mark.parametrize("backend", t.backend_names())
def test_a_rebuild_from_written_states_frees_each_old_arena(backend, monkeypatch):
    """States written into ``optimizer.state`` from outside (copies, as ZeroRedundancyOptimizer's
    load writes them) rebuild every group at the next step from them. The old arenas are read
    by nothing: each is freed as its group is rebuilt (the step kept them all until its checks
    passed: one more copy of the whole state at the peak). A step refused after every group was
    rebuilt (a sparse gradient) leaves no trace, ``state_bytes()`` included (the old plans come back with new zeroed
    arenas), and fixed, steps as a twin that never saw it."""
    a = t.make_params(torch.float32)
    b = t.twin(a)
    groups = len(a)

    def make(ps):
        return MemOptimizer(
            [{"params": [p]} for p in ps], rule="adamw", lr=1e-2, moments="q8", backend=backend
        )

    opt, ref = make(a), make(b)
    for step in (1, 2):
        t.set_grads(a, step)
        t.set_grads(b, step, in_place=False)
        opt.step()
        ref.step()
    for o, ps in ((opt, a), (ref, b)):
        for p in ps:
            o.state[p] = {k: v.clone() for k, v in o.state[p].items()}
    old = [
        [weakref.ref(x) for e in opt._plans[gi].entries for x in e.arena.tensors()]
        for gi in range(groups)
    ]
    alive = []  # at each new arena: the groups whose old arena is still alive
    real = opt._new_arena

    def new_arena(plan, codecs, master):
        alive.append([gi for gi, refs in enumerate(old) if any(r() is not None for r in refs)])
        return real(plan, codecs, master)

    monkeypatch.setattr(opt, "_new_arena", new_arena)
    t.set_grads(a, 3)
    t.set_grads(b, 3, in_place=False)
    refuse(opt, a, _sparse_grad, _step, "rebuild from written states")
    # the rebuilt groups, then the old plans reopened (in reverse) by the refusal
    assert alive == [list(range(gi + 1, groups)) for gi in range(groups)] + [[]] * groups
    for step in (3, 4):
        if step == 4:
            t.set_grads(a, step)
            t.set_grads(b, step, in_place=False)
        opt.step()
        ref.step()
        assert_same_optimizers(a, b, opt, ref, f"step {step}")


@pytest.mark.parametrize("backend", t.backend_names())
def test_step_parameters_refuses_bad_grads_and_foreign_tensors_without_state(backend):
    """``step_parameters`` builds every trainable parameter's state at its first call: one
    refused for a gradient of another shape, or for a tensor the optimizer does not hold, built
    it all."""
    a, b, opt, ref = pair("adamw-ecc24-q8", backend)
    t.set_grads(a, 1)
    t.set_grads(b, 1, in_place=False)
    grads = {a[BAD]: torch.zeros(7, dtype=a[BAD].dtype)}
    for call in (
        lambda o, ps: o.step_parameters(ps, grads=grads),
        lambda o, ps: o.step_parameters([*ps, torch.zeros(3)]),
    ):
        before = snapshot(opt, a)
        with pytest.raises(ConfigError):
            call(opt, a)
        assert_no_trace(before, snapshot(opt, a), "step_parameters")
    assert len(opt.state) == 0
    opt.step_parameters(a)
    ref.step_parameters(b)
    assert_same_optimizers(a, b, opt, ref)


@pytest.mark.parametrize("backend", t.backend_names())
def test_init_state_refused_for_a_later_group_builds_nothing(backend):
    """A state of the wrong shape written by hand into a parameter of the second group refuses
    init_state() after the first group was built: that one is taken back too."""
    p, q = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(6))
    opt = MemOptimizer([{"params": [p]}, {"params": [q]}], backend=backend)
    opt.state[q]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ConfigError, match="state 'exp_avg' of parameter #0 of param group 1"):
        opt.init_state()
    assert p not in opt.state
    assert opt.state_bytes() == 0
    opt.state[q]["exp_avg"] = torch.zeros(6)  # fixed: taken as written
    opt.init_state()
    assert opt.state[p]["step"].item() == 0
    assert torch.equal(opt.state[q]["exp_avg"], torch.zeros(6))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_capturable_refused_by_a_host_backend_builds_no_state(backend):
    if backend not in t.backend_names():
        pytest.skip("the cpu backend is not installed")
    p = torch.nn.Parameter(torch.ones(5))
    opt = MemOptimizer([p], backend=backend, capturable=True)
    p.grad = torch.ones(5)
    with pytest.raises(ConfigError, match="capturable=True needs a backend"):
        opt.step()
    assert len(opt.state) == 0
    assert opt.state_bytes() == 0


_TRITON_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import test_refused_steps as t
for case in t.CASES:
    t.run_refusals("triton", "adamw-ecc24-q8", case)
for name in t.CONFIGS:
    t.run_refusals("triton", name, "lr nan")
t.run_refusals("triton", "sgd-momentum", "nan gradient", "step_parameters")
for scenario in t.SCENARIOS:
    scenario("triton")
print("same bits")
"""


def test_triton_in_the_interpreter(tmp_path):
    """The Triton backend (its family arenas, merged groups and device steps for a GradScaler)
    in its interpreter."""
    t.interpret_triton(tmp_path, _TRITON_SCRIPT)
