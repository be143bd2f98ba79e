"""The cached eager step (:mod:`memopt_core.cached_step`): ``step()`` replays the resolved works
of an earlier step while nothing they were resolved for changed, with the bits, step counts and
states of the ordinary step. Each scenario runs a cached optimizer next to one that always takes
the ordinary path (``Uncached``) and compares every bit, on the torch backend, the cpu backend
where installed, and Triton's prepared launches in its interpreter (a subprocess: Triton reads
``TRITON_INTERPRET`` at import)."""

from __future__ import annotations

import collections
import copy
import gc
import importlib.util
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from memopt_core import ConfigError, MemOptimizer, NumericsError, backends
from memopt_core.testing import assert_same_optimizers, bits

CONFIGS = {
    "adamw-ecc24-q8": dict(rule="adamw", dtype=torch.bfloat16, master="ecc24", moments="q8"),
    "adam-fp32-l2": dict(rule="adam", dtype=torch.float32, moments="fp32", weight_decay=0.05),
    "lion-ecc32-bf16": dict(rule="lion", dtype=torch.bfloat16, master="ecc32", moments="bf16"),
    "sgd-momentum": dict(
        rule="sgd", dtype=torch.bfloat16, master="ecc24", moments="bf16", momentum=0.9
    ),
    "sgd-nesterov": dict(
        rule="sgdw", dtype=torch.float32, moments="fp8", momentum=0.8, nesterov=True
    ),
    "sgd-plain": dict(rule="sgd", dtype=torch.float32, moments="fp32", weight_decay=0.01),
}
SHAPES = [(7, 9), (), (0, 3), (100,), (33,), (2, 65)]


class Uncached(MemOptimizer):
    """The ordinary step every time: what the cached step must equal."""

    def step(self, closure=None):  # type: ignore[override]
        with torch.no_grad():
            self._update(None)


def backend_names() -> list[str]:
    names = ["torch"]
    status = backends.available_backends().get("cpu")
    if status is not None and status.usable:
        names.append("cpu")
    return names


@pytest.fixture(params=backend_names())
def backend(request):
    return request.param


def make_params(dtype, seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * 2).to(dtype).requires_grad_() for s in shapes]


def twin(params):
    return [p.detach().clone().requires_grad_(p.requires_grad) for p in params]


def pair(cfg_name, backend, seed=0, **kw):
    """Parameters and a cached optimizer over them, a twin set and an uncached one."""
    cfg = dict(CONFIGS[cfg_name])
    dtype = cfg.pop("dtype")
    cfg.update(kw)
    a = make_params(dtype, seed)
    b = twin(a)
    opts = [
        cls(ps, lr=1e-2, backend=backend, **cfg) for cls, ps in ((MemOptimizer, a), (Uncached, b))
    ]
    return a, b, *opts


def grads_for(params, step, skip=()):
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen) * (1 + step % 3)
        out.append(None if i in skip else g.to(p.dtype))
    return out


def set_grads(params, step, *, in_place=True, skip=()):
    """Deterministic gradients of ``step``: copied into the existing ones when ``in_place``
    (their addresses stay), else new tensors; None for the positions in ``skip``."""
    for p, g in zip(params, grads_for(params, step, skip), strict=True):
        if g is None:
            p.grad = None
        elif in_place and p.grad is not None and p.grad.dtype == g.dtype:
            p.grad.copy_(g)
        else:
            p.grad = g


def step_both(a, b, opt, ref, step, **kw):
    set_grads(a, step, **kw)
    set_grads(b, step, in_place=False, skip=kw.get("skip", ()))
    opt.step()
    ref.step()


# ------------------------------------------------------------------------------- scenarios
# plain functions of the backend name, so the Triton subprocess runs them too


def run_replays_bit_exact(backend, cfg_name, steps=24):
    a, b, opt, ref = pair(cfg_name, backend)
    step_both(a, b, opt, ref, 1)
    cached = opt._cached_steps[None]
    for step in range(2, steps + 1):
        step_both(a, b, opt, ref, step)
        assert opt._cached_steps[None] is cached, f"step {step} did not replay"
        if step in (2, 3, steps):
            assert_same_optimizers(a, b, opt, ref, f"step {step}")
    assert cached.replays == steps - 1
    assert float(opt.state[a[0]]["step"]) == steps


def run_lr_schedule(backend):
    a, b, opt, ref = pair("adamw-ecc24-q8", backend, decouple_lr=True, weight_decay=0.1)
    sa = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=30)
    sb = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=5e-2, total_steps=30)
    for step in range(1, 26):
        if step == 12:  # hand-edited hyperparameters take effect on a replay too
            for g in (opt.param_groups[0], ref.param_groups[0]):
                g["betas"] = (0.8, 0.99)
                g["eps"] = 1e-6
        step_both(a, b, opt, ref, step)
        sa.step()
        sb.step()
    assert opt._cached_steps[None].replays == 24
    assert_same_optimizers(a, b, opt, ref)


def run_new_gradient_addresses(backend):
    """Gradients at new addresses (what zero_grad(set_to_none=True) and the next backward make)
    keep the cached step: it follows them, and replays read the new ones, never the freed."""
    a, b, opt, ref = pair("lion-ecc32-bf16", backend)
    step_both(a, b, opt, ref, 1)
    cached = opt._cached_steps[None]
    for step in range(2, 25):  # new tensors every step until 8, then every fifth step
        moved = not (step > 8 and step % 5 != 0)
        if moved:  # the old gradients die: a launch that still read them would read garbage
            for p in a:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        step_both(a, b, opt, ref, step, in_place=not moved)
        assert_same_optimizers(a, b, opt, ref, f"step {step}")
        assert opt._cached_steps[None] is cached, f"step {step} did not replay"
    assert cached.replays == 23


def run_gradient_dtype_switch(backend):
    """bfloat16 parameters whose gradients change from bfloat16 to float32 at the same
    addresses: the cached step must not replay works resolved for the other dtype."""
    a, b, opt, ref = pair("adamw-ecc24-q8", backend)
    bufs = [torch.zeros(max(p.numel(), 1)) for p in a]  # fp32 storage; bf16 views share it
    for p in a + b:
        p.grad_dtype = None  # torch then accepts a float32 gradient of a bfloat16 tensor

    def set_viewed(step, dtype):
        for p, buf, g in zip(a, bufs, grads_for(a, step), strict=True):
            view = buf[: p.numel()] if dtype == torch.float32 else buf.view(torch.bfloat16)
            view = view[: p.numel()].view(p.shape)
            view.copy_(g.to(dtype))
            p.grad = view
        for q, g in zip(b, grads_for(b, step), strict=True):
            q.grad = g.to(dtype)

    for step in range(1, 13):
        dtype = torch.bfloat16 if step <= 4 or step > 8 else torch.float32
        set_viewed(step, dtype)
        before = opt._cached_steps.get(None)
        opt.step()
        ref.step()
        if step in (5, 9):  # the same addresses, another dtype: resolved again
            assert opt._cached_steps.get(None) is not before
        assert_same_optimizers(a, b, opt, ref, f"step {step}")
    assert all(a[i].grad.data_ptr() == bufs[i].data_ptr() for i in (0, 3))


def run_partial_and_frozen(backend):
    a, b, opt, ref = pair("sgd-momentum", backend)
    a[1].requires_grad_(False)  # frozen: never a gradient, no state
    b[1].requires_grad_(False)
    for step in range(1, 25):
        skip = {1} | ({3, 4} if 6 <= step < 12 else set()) | ({5} if 13 <= step < 17 else set())
        step_both(a, b, opt, ref, step, skip=skip)
        assert_same_optimizers(a, b, opt, ref, f"step {step}")
    assert 1 not in [i for i, p in enumerate(a) if p in opt.state]
    assert opt._cached_steps[None].replays > 0


def run_mixed_dtypes_in_a_group(backend):
    """float32 and bfloat16 parameters in one group: two state groups whose parameters sit
    interleaved in the group's list."""
    gen = torch.Generator().manual_seed(5)
    a = [
        torch.randn(s, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
        for i, s in enumerate(SHAPES)
    ]
    a = [p.requires_grad_() for p in a]
    b = twin(a)
    kw = dict(rule="adamw", lr=1e-2, master="ecc24", moments="q8", backend=backend)
    opt, ref = MemOptimizer(a, **kw), Uncached(b, **kw)
    for step in range(1, 21):
        step_both(a, b, opt, ref, step, skip={2} if 6 <= step < 10 else ())
    # the float32 parameters at two step counts (#2 skipped four steps), the bfloat16 ones
    assert len(opt._cached_steps[None].entries) == 3
    assert opt._cached_steps[None].replays == 10
    assert_same_optimizers(a, b, opt, ref)


def run_add_param_group_and_load_state_dict(backend):
    a, b, opt, ref = pair("adamw-ecc24-q8", backend)
    extra_a = make_params(torch.float32, seed=7, shapes=[(17,), (3, 5)])
    extra_b = twin(extra_a)
    for step in range(1, 5):
        step_both(a, b, opt, ref, step)
    opt.add_param_group({"params": extra_a, "lr": 5e-3, "moments": "bf16"})
    ref.add_param_group({"params": extra_b, "lr": 5e-3, "moments": "bf16"})
    assert not opt._cached_steps
    for step in range(5, 11):
        step_both(a + extra_a, b + extra_b, opt, ref, step)
    assert_same_optimizers(a + extra_a, b + extra_b, opt, ref, "after add_param_group")
    assert float(opt.state[extra_a[0]]["step"]) == 6.0
    opt.load_state_dict(ref.state_dict())  # the same values in new tensors
    assert not opt._cached_steps
    for step in range(11, 17):
        step_both(a + extra_a, b + extra_b, opt, ref, step)
    assert_same_optimizers(a + extra_a, b + extra_b, opt, ref, "after load_state_dict")
    assert float(opt.state[a[0]]["step"]) == 16.0


def run_step_parameters_between_steps(backend):
    a, b, opt, ref = pair("sgd-momentum", backend)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step)
    set_grads(a, 4)
    set_grads(b, 4)
    opt.step_parameters(a[:3])
    ref.step_parameters(b[:3])
    assert not opt._cached_steps
    for step in range(5, 12):  # parameters at two step counts now: two works, both replayed
        step_both(a, b, opt, ref, step)
        assert_same_optimizers(a, b, opt, ref, f"step {step}")
    assert len(opt._cached_steps[None].entries) == 2
    assert opt._cached_steps[None].replays == 6
    assert float(opt.state[a[0]]["step"]) == 11.0
    assert float(opt.state[a[4]]["step"]) == 10.0


def run_momentum_switched_on(backend):
    """SGD's momentum buffer appears when momentum goes from 0 to nonzero: plans rebuild."""
    a, b, opt, ref = pair("sgd-plain", backend)
    for step in range(1, 16):
        if step == 6:
            for g in (opt.param_groups[0], ref.param_groups[0]):
                g["momentum"] = 0.9
        if step == 11:
            for g in (opt.param_groups[0], ref.param_groups[0]):
                g["momentum"] = 0.0
        step_both(a, b, opt, ref, step)
        assert_same_optimizers(a, b, opt, ref, f"step {step}")


def run_parameter_resized_in_place(backend):
    """A parameter cut to fewer elements at its own address (``p.data = p.data[:n]``) with its
    gradient buffer refilled in place: the replay must not run the old plan (a prepared launch
    would write the old size), so the step refuses it as an ordinary step does, changing
    nothing."""
    a, b, opt, ref = pair("adamw-ecc24-q8", backend)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step)
    assert opt._cached_steps[None].replays > 0
    p = a[3]  # (100,)
    address = p.data_ptr()
    p.data = p.data[:10]
    assert p.data_ptr() == address
    p.grad.normal_()  # the same 100-element buffer
    before = [bits(q).clone() for q in a]
    with pytest.raises(ConfigError, match=r"changed since its state was created"):
        opt.step()
    assert all(torch.equal(bits(q), x) for q, x in zip(a, before, strict=True))
    assert None not in opt._cached_steps


def run_parameter_retyped_at_its_address(backend):
    """A parameter of another dtype at the old one's address (the allocator reuses freed
    memory; here a view of the same memory): the replay wrote the old dtype's bytes into it (on
    the cpu backend a 4-byte fp32 master into a 2-byte tensor corrupted the heap), so the step
    refuses it as an ordinary step does, changing nothing."""
    a, b, opt, ref = pair("adamw-ecc24-q8", backend)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step)
    assert opt._cached_steps[None].replays > 0
    p = a[3]
    address = p.data_ptr()
    p.data = p.data.view(torch.float16)
    assert p.data_ptr() == address
    p.grad.normal_()  # the same buffer, of the dtype the replay was prepared for
    before = [bits(q).clone() for q in a]
    with pytest.raises(ConfigError, match=r"changed since its state was created"):
        opt.step()
    assert all(torch.equal(bits(q), x) for q, x in zip(a, before, strict=True))
    assert None not in opt._cached_steps


def run_transposed_gradient_at_its_address(backend):
    """A gradient replaced by a transposed view of itself (``p.grad = p.grad.t()`` on a square
    parameter): the same address, dtype and size, another layout. The step must read it as the
    ordinary step does (its values, through a contiguous copy), not as the memory it was
    prepared for, which holds the transpose."""
    cfg = dict(CONFIGS["adamw-ecc24-q8"])
    dtype = cfg.pop("dtype")
    a = make_params(dtype, shapes=[(8, 8), (33,)])
    b = twin(a)
    opt = MemOptimizer(a, lr=1e-2, backend=backend, **cfg)
    ref = Uncached(b, lr=1e-2, backend=backend, **cfg)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step)
    assert opt._cached_steps[None].replays > 0
    for step in range(4, 7):
        set_grads(a, step)  # refilled in place: the addresses stay
        address = a[0].grad.data_ptr()
        a[0].grad = a[0].grad.t()
        assert a[0].grad.data_ptr() == address
        assert not a[0].grad.is_contiguous()
        for p, q in zip(a, b, strict=True):
            q.grad = p.grad.contiguous()
        opt.step()
        ref.step()
        assert_same_optimizers(a, b, opt, ref, f"step {step}")
        a[0].grad = a[0].grad.t()  # contiguous again for the next in-place refill


def _run_layout_change(backend, change):
    """An fp32 parameter with a strided gradient and a square bf16 one in one group (two works);
    at step 4 ``change`` gives the square one another layout at the same address: the step must
    equal the ordinary one, which reads and writes through contiguous copies."""

    def build():
        a = torch.randn(24, generator=torch.Generator().manual_seed(0)).requires_grad_()
        w = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
        b = w.to(torch.bfloat16).requires_grad_()
        a.grad = torch.empty(48)[::2]  # strided: the group's gradients are not all contiguous
        b.grad = torch.zeros(8, 8, dtype=torch.bfloat16)
        return [a, b]

    ps, qs = build(), build()
    opt = MemOptimizer(ps, rule="sgd", lr=0.1, momentum=0.9, backend=backend)
    ref = Uncached(qs, rule="sgd", lr=0.1, momentum=0.9, backend=backend)
    gen = torch.Generator().manual_seed(2)
    for step in range(1, 7):
        ga, gb = torch.randn(24, generator=gen), torch.randn(8, 8, generator=gen).bfloat16()
        for (a, b), o in (((ps[0], ps[1]), opt), ((qs[0], qs[1]), ref)):
            if step == 4:
                change(b)
            a.grad.copy_(ga)
            b.grad.copy_(gb)
            o.step()
        if step == 3:
            assert opt._cached_steps[None].replays > 0
        assert_same_optimizers(ps, qs, opt, ref, f"step {step}")


def run_transposed_parameter_at_its_address(backend):
    """``p.data = p.data.t()`` on a square parameter: a prepared launch would write its memory in
    the old order."""

    def change(b):
        b.data = b.data.t()

    _run_layout_change(backend, change)


def run_transposed_gradient_beside_a_strided_one(backend):
    """``p.grad = p.grad.t()`` in a group whose gradients were not all contiguous (the check
    once looked at contiguous groups only, while launches are prepared per work)."""

    def change(b):
        b.grad = b.grad.t()

    _run_layout_change(backend, change)


def run_step_count_edited_in_place(backend):
    """One parameter's count restarted in place (``state[p]["step"].zero_()``, with its moments):
    no write counter sees it, and the replay counted the whole work from its first parameter,
    so the restarted parameter took step 4's bias corrections (adversarial testing,
    2026-12-04). The ordinary step splits the work by count; the replay must equal it."""
    a, b, opt, ref = pair("adamw-ecc24-q8", backend)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step)
    assert opt._cached_steps[None].replays > 0
    for ps, o in ((a, opt), (b, ref)):
        state = o.state[ps[3]]
        for k in ("step", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"):
            state[k].zero_()
    for step in range(4, 7):
        step_both(a, b, opt, ref, step)
        assert_same_optimizers(a, b, opt, ref, f"step {step}")
    assert float(opt.state[a[3]]["step"]) == 3
    assert float(opt.state[a[0]]["step"]) == 6


def run_parameter_replaced_over_its_memory(backend):
    """A group's parameter replaced by a new tensor over the same memory
    (``group["params"][i] = nn.Parameter(p.data)``): the same address, size and dtype, so the
    replay kept updating the old tensor's state, where the ordinary step (as torch) starts the
    new one fresh (adversarial testing, 2026-12-04)."""
    a, b, opt, ref = pair("adamw-ecc24-q8", backend)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step)
    assert opt._cached_steps[None].replays > 0
    for ps, o in ((a, opt), (b, ref)):
        new = torch.nn.Parameter(ps[3].data)
        new.grad = ps[3].grad
        o.param_groups[0]["params"][3] = new
        ps[3] = new
    for step in range(4, 7):
        step_both(a, b, opt, ref, step)
        assert_same_optimizers(a, b, opt, ref, f"step {step}")
    assert float(opt.state[a[3]]["step"]) == 3


def run_gradient_cut_at_its_address(backend):
    """``p.grad.data = p.grad.data[:n]`` (the .grad setter checks shapes, .data does not): the
    replay read the old size from the same address (a prepared launch), or failed deep in the
    torch backend after another work had stepped; the ordinary step refuses it, changing
    nothing (adversarial testing, 2026-12-04)."""
    a, b, opt, ref = pair("adamw-ecc24-q8", backend)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step)
    assert opt._cached_steps[None].replays > 0
    set_grads(a, 4)
    a[3].grad.data = a[3].grad.data[:10]
    before = [bits(q).clone() for q in a]
    with pytest.raises(ConfigError, match=r"has a gradient of shape \(10,\)"):
        opt.step()
    assert all(torch.equal(bits(q), x) for q, x in zip(a, before, strict=True))
    assert float(opt.state[a[0]]["step"]) == 3


def run_gradient_moved_onto_another_parameter(backend):
    """A gradient that is another parameter's memory (``p4.grad = p3.detach()[:33]``) at a
    replay whose gradients moved: the kernel would read it while writing p3. Triton followed
    moved gradients without the aliasing check (adversarial testing, 2026-12-04); the replay
    must do what the ordinary step does (refuse it where that does, changing nothing)."""
    a, b, opt, ref = pair("sgd-plain", backend)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step, in_place=False)
    assert opt._cached_steps[None].replays > 0
    outcomes = []
    for ps, o in ((a, opt), (b, ref)):
        set_grads(ps, 4, in_place=False)
        ps[4].grad = ps[3].detach()[:33]
        before = [bits(q).clone() for q in ps]
        try:
            o.step()
            outcomes.append(None)
        except ConfigError as e:
            outcomes.append(str(e))
            assert all(torch.equal(bits(q), x) for q, x in zip(ps, before, strict=True))
    assert outcomes[0] == outcomes[1]
    if outcomes[0] is None:
        assert_same_optimizers(a, b, opt, ref, "step 4")
    else:
        assert "share memory" in outcomes[0]


#: what a prepared launch fixed (addresses, gradient dtype, arenas, momentum buffer) changing
ADDRESS_SCENARIOS = [
    run_new_gradient_addresses,
    run_gradient_dtype_switch,
    run_partial_and_frozen,
    run_add_param_group_and_load_state_dict,
    run_step_parameters_between_steps,
    run_momentum_switched_on,
    run_parameter_resized_in_place,
    run_parameter_retyped_at_its_address,
    run_transposed_gradient_at_its_address,
    run_transposed_parameter_at_its_address,
    run_transposed_gradient_beside_a_strided_one,
    run_step_count_edited_in_place,
    run_parameter_replaced_over_its_memory,
    run_gradient_cut_at_its_address,
    run_gradient_moved_onto_another_parameter,
]
SCENARIOS = [run_lr_schedule, run_mixed_dtypes_in_a_group, *ADDRESS_SCENARIOS]


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_replays_bit_exact(backend, cfg_name):
    run_replays_bit_exact(backend, cfg_name)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__.removeprefix("run_"))
def test_scenario(backend, scenario):
    scenario(backend)


def test_check_numerics_on_a_replay(backend):
    a, b, opt, ref = pair("adamw-ecc24-q8", backend, check_numerics=True)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step)
    cached = opt._cached_steps[None]
    before = [bits(p).clone() for p in a]
    steps = float(opt.state[a[0]]["step"])
    a[3].grad[5] = float("nan")
    with pytest.raises(NumericsError, match="non-finite"):
        opt.step()
    assert all(torch.equal(bits(p), x) for p, x in zip(a, before, strict=True))
    assert float(opt.state[a[0]]["step"]) == steps
    assert opt._cached_steps[None] is cached  # still valid: nothing changed
    step_both(a, b, opt, ref, 4)
    assert_same_optimizers(a, b, opt, ref)


def test_parameters_moving_every_step_back_off(backend):
    """A cached step that never replays stops being built for a while (it would only cost),
    and caching resumes once the parameters stay."""
    a, b, opt, ref = pair("adamw-ecc24-q8", backend)
    built = 0
    for step in range(1, 31):
        for p in a:  # same values, new storage
            p.data = p.data.clone()
        step_both(a, b, opt, ref, step)
        built += None in opt._cached_steps
    assert built < 10
    for step in range(31, 71):
        step_both(a, b, opt, ref, step)
    assert opt._cached_steps[None].replays > 0
    assert_same_optimizers(a, b, opt, ref)


def test_holds_no_gradient_between_steps(backend):
    a, b, opt, ref = pair("adamw-ecc24-q8", backend)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step)
    refs = [weakref.ref(p.grad) for p in a]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_copies_start_without_a_cached_step():
    params = make_params(torch.float32)
    opt = MemOptimizer(params, lr=1e-2, backend="torch")
    set_grads(params, 1)
    opt.step()
    assert None in opt._cached_steps
    assert copy.deepcopy(opt)._cached_steps == {}


_TRITON_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import test_cached_step as t
for name in t.CONFIGS:
    t.run_replays_bit_exact("triton", name, steps=4)
for scenario in t.ADDRESS_SCENARIOS:
    scenario("triton")
print("same bits")
"""


def interpret_triton(tmp_path, script_text):
    """Run ``script_text`` (which imports the test modules by name: the tests folder is its
    first argument, and prints "same bits" when every check passed) with the Triton backend in
    its interpreter, in a subprocess: Triton reads ``TRITON_INTERPRET`` at import. Skips
    without the Triton packages."""
    for mod in ("memopt_kernels_triton", "triton", "numpy"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"needs {mod} (Triton's interpreter on CPU tensors)")
    script = tmp_path / "triton_script.py"
    script.write_text(script_text)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("MEMOPT_BACKEND", None)
    done = subprocess.run(
        [sys.executable, str(script), str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "same bits" in done.stdout


def test_triton_prepared_launches_in_the_interpreter(tmp_path):
    """Triton's prepared launches hold raw addresses and the gradient dtype: every configuration
    and every scenario that changes what they fixed, in the interpreter (about a minute)."""
    interpret_triton(tmp_path, _TRITON_SCRIPT)


def _trained(backend, moments="q8", steps=4):
    ps = make_params(torch.float32, shapes=[(7, 9), (33,)])
    opt = MemOptimizer(ps, rule="adamw", lr=1e-2, moments=moments, backend=backend)
    for step in range(1, steps + 1):
        set_grads(ps, step)
        opt.step()
    assert opt._cached_steps[None].replays > 0
    return ps, opt


@pytest.mark.parametrize("moments", ["fp32", "q8"])
def test_a_state_tensor_replaced_by_hand_is_used(backend, moments):
    """``opt.state[p]["exp_avg"] = t`` (torch's optimizers use t next step): the same bits as
    writing t's values into the state in place."""
    (a, opt), (b, ref) = _trained(backend, moments), _trained(backend, moments)
    for p, q in zip(a, b, strict=True):
        new = torch.zeros_like(opt.state[p]["exp_avg"])
        opt.state[p]["exp_avg"] = new.clone()
        ref.state[q]["exp_avg"].copy_(new)  # a view of the arena: in place
    for step in range(5, 8):
        set_grads(a, step)
        set_grads(b, step)
        opt.step()
        ref.step()
        assert_same_optimizers(a, b, opt, ref, f"step {step}")
    assert opt._cached_steps[None].replays > 0  # cached again after the rebuild


@pytest.mark.parametrize("how", ["del", "clear", "empty dict", "new mapping"])
def test_a_state_deleted_by_hand_starts_fresh(backend, how):
    """torch's optimizers re-create a state that was deleted: step 1 from zero moments."""
    a, opt = _trained(backend)
    p = a[0]
    if how == "del":
        del opt.state[p]
    elif how == "clear":
        opt.state.clear()
    elif how == "empty dict":
        opt.state[p] = {}
    else:
        opt.state = collections.defaultdict(dict)
    fresh = [t.detach().clone().requires_grad_() for t in a]
    ref = MemOptimizer(fresh, rule="adamw", lr=1e-2, moments="q8", backend=backend)
    if how == "del" or how == "empty dict":  # the other parameter keeps its state and count
        ref.load_state_dict({**opt.state_dict(), "state": {1: opt.state_dict()["state"][1]}})
    set_grads(a, 5)
    set_grads(fresh, 5)
    opt.step()
    ref.step()
    assert_same_optimizers(a, fresh, opt, ref, how)
    assert float(opt.state[p]["step"]) == 1
    assert 0 in opt.state_dict()["state"]


def test_autograd_sees_every_step_write(backend):
    """A graph that saved a parameter before the step must fail its backward afterwards, as
    with torch's optimizers: kernels write through raw pointers, so the optimizer bumps the
    parameters' version counters (ordinary steps and cached replays alike)."""
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = MemOptimizer([w], rule="adamw", moments="q8", backend=backend)
    for step in range(5):  # the third and later steps replay the cached step
        loss = (w * w).sum()  # saves w for its backward
        loss.backward(retain_graph=True)
        before = w._version
        opt.step()
        assert w._version > before, f"step {step}"
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        opt.zero_grad()


def test_a_replay_that_fails_is_not_replayed_again(backend, monkeypatch):
    """A replay whose launch, prepared again for moved gradients, fails drops the cached step:
    the retry with the same gradients takes the ordinary step (it once replayed the failing
    launch until the gradients moved again)."""
    from memopt_core.cached_step import CachedStep

    class FailingLaunch:
        reusable = True

        def launch(self, *args):
            raise RuntimeError("launch failed")

    def follow_grads_badly(self):
        for e in self.entries:
            e.prepared = FailingLaunch()

    a, b, opt, ref = pair("adamw-ecc24-q8", backend)
    for step in range(1, 4):
        step_both(a, b, opt, ref, step)
    assert opt._cached_steps[None].replays == 2
    set_grads(a, 4, in_place=False)
    with monkeypatch.context() as m:
        m.setattr(CachedStep, "follow_grads", follow_grads_badly)
        with pytest.raises(RuntimeError, match="launch failed"):
            opt.step()
    assert None not in opt._cached_steps
    opt.step()  # the same gradients
    set_grads(b, 4, in_place=False)
    ref.step()
    assert_same_optimizers(a, b, opt, ref)
