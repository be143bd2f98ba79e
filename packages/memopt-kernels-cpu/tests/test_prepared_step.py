"""``ops.prepare_step`` / ``PreparedStep.launch``: the step validated once, replayed with each
step's scalars. The same bits as ``ops.fused_step`` over many steps; None where a step must run
through ``fused_step`` each time; bad input refused as ``fused_step`` refuses it; and core's
cached step uses it."""

from __future__ import annotations

import pytest
import torch

from memopt_core import ConfigError, MemOptimizer
from memopt_core.formats import StateSpec
from memopt_core.testing import RULE_CONFIGS, group_state, group_step, make_grads, make_group
from memopt_kernels_cpu import ops

SIZES = [33, 64, 1, 0, 100, 4097]


@pytest.mark.parametrize(("rule", "master", "moments", "dtype", "hyper"), RULE_CONFIGS)
@pytest.mark.parametrize("threads", [1, 3])
def test_launch_equals_fused_step_over_steps(rule, master, moments, dtype, hyper, threads):
    ops.set_num_threads(threads)
    ops.set_chunk_size(64)  # several chunks per tensor: the threads share the step
    spec = StateSpec(master=master, moments=moments, stochastic_rounding=True)
    a = make_group(rule, spec, dtype, SIZES, "cpu", seed=5, **hyper)
    b = make_group(rule, spec, dtype, SIZES, "cpu", seed=5, **hyper)
    kept = make_grads(b, 1)  # the prepared step reads these tensors: refilled in place
    prepared = ops.prepare_step(group_step(b, kept, 1))
    assert isinstance(prepared, ops.PreparedStep)
    assert prepared.reusable
    for step in range(1, 13):
        grads = make_grads(a, step)
        ops.fused_step(group_step(a, grads, step))
        for k, g in zip(kept, grads, strict=True):
            k.copy_(g)
        work = group_step(b, kept, step)
        prepared.launch(work.scalars, work.step, work.seed, work.first_step)
        sa, sb = group_state(a), group_state(b)
        bad = [k for k in sa if not torch.equal(sa[k], sb[k])]
        assert not bad, f"step {step}: {bad} differ"


def test_none_where_fused_step_must_run_each_time():
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    group = make_group("adamw", spec, torch.bfloat16, [64, 33], "cpu")
    grads = make_grads(group, 1)
    strided = [g.reshape(-1).repeat(2)[::2].view(g.shape) for g in grads]
    assert not strided[0].is_contiguous()
    assert ops.prepare_step(group_step(group, strided, 1)) is None
    work = group_step(group, grads, 1)
    work.staging = [torch.empty(64, dtype=torch.bfloat16), None]
    assert ops.prepare_step(work) is None
    assert ops.prepare_step(group_step(group, grads, 1, slots=[])) is None


def test_bad_input_is_refused_as_fused_step_refuses_it():
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    group = make_group("adamw", spec, torch.bfloat16, [64, 33], "cpu")
    grads = make_grads(group, 1)
    grads[1] = grads[1].to(torch.float16)  # neither the parameter's dtype nor float32
    work = group_step(group, grads, 1)
    with pytest.raises(ConfigError, match=r"the gradient of parameter 1 .* is torch.float16"):
        ops.fused_step(work)
    with pytest.raises(ConfigError, match=r"the gradient of parameter 1 .* is torch.float16"):
        ops.prepare_step(work)


def test_a_launch_whose_momentum_turned_zero_or_non_zero_is_refused():
    """SGD's momentum buffer is part of the prepared arguments: scalars with the other kind
    of momentum failed in C++ with "fmt1 must be FMT_NONE", naming nothing."""
    from memopt_core.reference import sgd_scalars

    spec = StateSpec(master="fp32", moments="fp32")
    for prepared, launched in ((0.9, 0.0), (0.0, 0.9)):
        group = make_group("sgd", spec, torch.float32, [64], "cpu", lr=0.1, momentum=prepared)
        prep = ops.prepare_step(group_step(group, make_grads(group, 1), 1))
        scalars = sgd_scalars(
            lr=0.1, momentum=launched, dampening=0.0, nesterov=False, weight_decay=0.0,
            decoupled=False,
        )  # fmt: skip
        with pytest.raises(ConfigError, match=r"prepared for SGD with(out)? momentum, and its "):
            prep.launch(scalars, 2, 0, False)


def test_the_cached_step_replays_the_prepared_launch(monkeypatch):
    """MemOptimizer on the cpu backend: the first step validates through fused_step, the
    replays launch the prepared step (fused_step runs no more), with the same bits as an
    optimizer that never replays."""
    calls = []
    real = ops.fused_step
    monkeypatch.setattr(
        ops, "fused_step", lambda work, staging=None: calls.append(work) or real(work, staging)
    )

    def build(seed):
        torch.manual_seed(seed)
        ps = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (33, 64, 1000)]
        return ps, MemOptimizer(ps, rule="adamw", master="ecc24", moments="q8", backend="cpu")

    ps, opt = build(0)
    ref_ps, ref = build(0)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ps, ref_ps, strict=True):
            grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            if p.grad is None:
                p.grad = grad.clone()
            else:
                p.grad.copy_(grad)  # kept at its address: the step is replayed
            q.grad = grad.clone()
        opt.step()
        ref._drop_cached_steps()  # the reference never replays
        ref.step()
    assert len(calls) == 1 + 6  # opt's first step, and every step of the reference
    (cached,) = opt._cached_steps.values()
    assert isinstance(cached.entries[0].prepared, ops.PreparedStep)
    for p, q in zip(ps, ref_ps, strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
        for key, value in opt.state[p].items():
            assert torch.equal(value, ref.state[q][key]), key
