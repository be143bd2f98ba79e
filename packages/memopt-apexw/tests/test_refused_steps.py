"""A refused ApexW step leaves no trace, in every mode, as memopt-core's (its
``test_refused_steps``): after a step refused for bad input (a group's lr set to NaN, a float64
gradient, a gradient sharing memory with a parameter the fused kernels write, no kernel backend
for ``mode="fused"``) the optimizer holds what it held before: no state for parameters at their
first step (``state``, ``state_bytes()``), the same bits for the others. Fixed and stepped again,
it gives the bits of a twin that never saw the refused step. Each input is refused at the first
step, at a step of the cached step's replays and where a parameter gets its first gradient; in
the fused mode (memopt-kernels-cpu, and Triton's interpreter), the torch mode and the auto mode
(whose trial alternates the two).

ApexW checked that a fused backend runs every group on plans and states it built before core's
checks ran, outside core's atomic section: a step refused by that check or by a later one kept
the states of the parameters at their first step (the mode="auto" trial built them too)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from apexw_testutil import (
    fused_backend_for,
    make_params,
    set_grads,
    triton_interpreter_ready,
    twin,
)

from memopt_apexw import ApexW
from memopt_core import backends
from memopt_core.errors import BackendUnavailableError, ConfigError, MemoptError
from memopt_core.testing import assert_same_optimizers, bits

SHAPES = [(64,), (33,), (129,), (16, 16)]
BAD = 1  # the parameter given the bad input
LATE = 2  # the parameter without a gradient before step FIRST_GRAD
SOURCE = 3  # the parameter an aliasing gradient is a view of
FIRST_GRAD = 4
STEPS = 5
#: when the bad input comes: the step, and the parameter it is given to
WHEN = {"first step": (1, BAD), "replay": (3, BAD), "first gradient": (FIRST_GRAD, LATE)}

needs_cpu_kernels = pytest.mark.skipif(
    fused_backend_for(torch.device("cpu")) is None, reason="needs memopt-kernels-cpu"
)
needs_interpreter = pytest.mark.skipif(
    not triton_interpreter_ready(),
    reason="needs memopt-kernels-triton, triton and numpy with TRITON_INTERPRET=1",
)
#: name -> ApexW's mode and backend arguments, and what the mode needs here
MODES = {
    "fused-cpu": ({"mode": "fused"}, needs_cpu_kernels),
    "fused-triton": ({"mode": "fused", "backend": "triton"}, needs_interpreter),
    "torch": ({"mode": "torch"}, ()),
    "auto": ({"mode": "auto"}, needs_cpu_kernels),
}
CONFIGS = {"fp32-bf16": (torch.float32, "bf16"), "bf16-ecc24-q8": (torch.bfloat16, "q8")}


# ------------------------------------------------------------------------------ bad input
# each takes the optimizer, its parameters (gradients set) and the parameter to give the bad
# input, and returns what undoes it


def _lr_nan(opt, params, p):
    group = opt.param_groups[0]
    old = group["lr"]
    group["lr"] = math.nan
    return lambda: group.__setitem__("lr", old)


def _float64_grad(opt, params, p):
    g = p.grad
    p.grad_dtype = None  # lets torch take a gradient of another dtype
    p.grad = g.double()
    return lambda: setattr(p, "grad", g)


def _aliasing_grad(opt, params, p):
    """A gradient that is a view of another parameter, which the fused kernels write while they
    read it (refused naming both; the torch step computes on copies and takes it)."""
    g = p.grad
    p.grad = params[SOURCE].detach().view(-1)[: p.numel()].view(p.shape)
    return lambda: setattr(p, "grad", g)


def _no_kernel_backend(opt, params, p):
    """memopt-kernels-cpu unusable (as without it): ``mode="fused"`` refuses the step."""
    old = backends._registry
    reg = backends.available_backends()
    reg["cpu"] = backends.BackendStatus("cpu", False, "simulated: unusable here", "tests")
    backends._registry = reg
    return lambda: setattr(backends, "_registry", old)


#: name -> (the bad input, the error, the modes that refuse it, the steps where they do)
CASES: dict[str, tuple[Callable[..., Any], type[MemoptError], set[str], set[str]]] = {
    "lr nan": (_lr_nan, ConfigError, set(MODES), set(WHEN)),
    "float64 gradient": (_float64_grad, ConfigError, set(MODES), set(WHEN)),
    # the auto mode's trial steps of the torch mode take it; the kernels check the memory of
    # one launch, and a parameter's first gradient gets a launch of its own (core's
    # _extend_group), which runs after the one writing SOURCE
    "aliasing gradient": (
        _aliasing_grad,
        ConfigError,
        {"fused-cpu", "fused-triton"},
        {"first step", "replay"},
    ),
    # a cached step replays the launches it resolved (checked when they were)
    "no kernel backend": (
        _no_kernel_backend,
        BackendUnavailableError,
        {"fused-cpu"},
        {"first step", "first gradient"},
    ),
}


def _held(opt, params) -> tuple[int, list[dict[str, torch.Tensor]]]:
    """``state_bytes()``, and the bits of each parameter ("") and of each of its states."""
    held = [
        {"": bits(p).clone(), **{k: bits(v).clone() for k, v in opt.state.get(p, {}).items()}}
        for p in params
    ]
    return opt.state_bytes(), held


def _grads(params, step: int) -> None:
    """Step ``step``'s gradients, in place (the cached step replays while they keep their
    buffers); none for LATE before FIRST_GRAD."""
    set_grads([p for i, p in enumerate(params) if i != LATE or step >= FIRST_GRAD], step)


REFUSED = [
    pytest.param(mode, case, when, marks=MODES[mode][1], id=f"{mode}-{case}-{when}")
    for mode in MODES
    for case, (_, _, modes, whens) in CASES.items()
    for when in WHEN
    if mode in modes and when in whens
]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize(("mode", "case", "when"), REFUSED)
def test_a_refused_step_leaves_no_trace(mode, case, when, config):
    bad, error, _, _ = CASES[case]
    dtype, state = CONFIGS[config]
    a = make_params("cpu", dtype, shapes=SHAPES)
    b = twin(a)
    opt = ApexW(a, state=state, mode_cache=None, **MODES[mode][0])
    ref = ApexW(b, state=state, mode_cache=None, **MODES[mode][0])
    at, target = WHEN[when]
    for step in range(1, STEPS + 1):
        _grads(a, step)
        _grads(b, step)
        if step == at:
            before = _held(opt, a)
            undo = bad(opt, a, a[target])
            try:
                with pytest.raises(error):
                    opt.step()
            finally:
                undo()
            after = _held(opt, a)
            assert after[0] == before[0], "state_bytes() changed"
            for i, (x, y) in enumerate(zip(before[1], after[1], strict=True)):
                assert x.keys() == y.keys(), f"parameter {i}: state built or dropped"
                assert all(torch.equal(x[k], y[k]) for k in x), f"parameter {i} changed"
            if step == 1:
                assert not opt.state
        opt.step()
        ref.step()
        assert_same_optimizers(a, b, opt, ref, f"{mode} {case} at the {when}, step {step}")


@needs_cpu_kernels
@pytest.mark.parametrize("kind", ["strided gradient", "CPU parameters"])
def test_a_refused_capturable_step_builds_no_state(kind):
    """``capturable=True``'s capture checks (set after construction: CUDA only there) refuse
    the step before it changes anything, and now before any state is built."""
    a = make_params("cpu", shapes=[(7, 5), (33,)])
    opt = ApexW(a, mode="fused", mode_cache=None)
    opt.capturable = True
    set_grads(a, 1)
    if kind == "strided gradient":
        a[0].grad = a[0].grad.t().contiguous().t()
    with pytest.raises(ConfigError, match="contiguous" if kind == "strided gradient" else "CPU"):
        opt.step()
    assert not opt.state
    assert opt.state_bytes() == 0


@needs_cpu_kernels
@pytest.mark.parametrize("mode", ["fused", "auto"])
@pytest.mark.parametrize("bad", ["key deleted", "parameter cast"])
def test_the_fused_selection_names_what_core_refuses(mode, bad):
    """The fused mode's check of its backends (and the auto mode's choice of candidates) runs
    before core's step, without core's plans: core's checks of the group and of the parameters'
    dtypes run first, so a key deleted by hand is named (not a bare KeyError) and so is a
    parameter cast since it was added (not "no kernel backend" for its dtype)."""
    p, q = make_params("cpu", shapes=[(8,), (9,)])
    opt = ApexW([p, q], mode=mode, mode_cache=None)
    if bad == "key deleted":
        del opt.param_groups[0]["moments"]
        match = r"param group 0 has no 'moments'"
    else:
        q.data = q.data.double()
        match = r"parameter #1 of param group 0 \(shape \(9,\)\) is torch.float64 since it was"
    set_grads([p, q], 1)
    with pytest.raises(ConfigError, match=match):
        opt.step()
    assert not opt.state


def _shared(source: str, params, opt) -> torch.Tensor:
    """The memory of SOURCE's ``source`` as a flat float32 tensor."""
    if source == "another parameter":
        return params[SOURCE].detach().view(-1)
    if source == "another gradient":
        return params[SOURCE].grad.view(-1)
    return opt.state[params[SOURCE]]["exp_avg"].view(-1).view(torch.float32)  # bf16 moments


@pytest.mark.parametrize("source", ["another parameter", "another gradient", "a state"])
def test_torch_mode_takes_an_aliasing_gradient_as_a_copy(source):
    """``mode="torch"`` takes a gradient sharing memory with another parameter, gradient or
    state of its launch (here: of its param group, planned at once by ``init_state``), as
    torch's AdamW does (docs/apexw.md, "What ApexW refuses"); core's torch step computes on
    copies, so it steps as on a clone of the gradient, at every step (replays too).
    ``mode="fused"`` refuses it (test_a_refused_step_leaves_no_trace)."""
    a = make_params("cpu", shapes=SHAPES)
    b = twin(a)
    opt = ApexW(a, mode="torch", mode_cache=None)
    ref = ApexW(b, mode="torch", mode_cache=None)
    opt.init_state()
    ref.init_state()
    for step in range(1, STEPS + 1):
        a[BAD].grad = b[BAD].grad = None  # a view of another tensor: no copy into it
        _grads(a, step)
        _grads(b, step)
        a[BAD].grad = _shared(source, a, opt)[:33]
        b[BAD].grad = _shared(source, b, ref)[:33].clone()
        opt.step()
        ref.step()
        assert_same_optimizers(a, b, opt, ref, f"{source}, step {step}")
