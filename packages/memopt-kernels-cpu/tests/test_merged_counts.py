"""``ops.fused_steps`` (the backend's ``step_all``): the works of one arena, a group's parameters
at several step counts (one work per count), in one call into C++, each row reading its own
work's step, first-step flag and scalars. The bits must be those of one ``fused_step`` per work
and of core's torch backend, on ordinary steps and on cached replays; bad variants are refused
before anything is written."""

from __future__ import annotations

import pytest
import torch

from memopt_core import ConfigError, MemOptimizer
from memopt_core.formats import StateSpec
from memopt_core.testing import RULE_CONFIGS, group_state, group_step, make_grads, make_group
from memopt_kernels_cpu import _core, ops

SIZES = [33, 64, 1, 0, 100, 4097, 31]
# (slots, step) of each work of one call: disjoint slots at different counts, the first step too
WORKS = [([0, 2, 5], 1), ([1, 4], 7), ([3, 6], 2)]


class _Calls:
    """Counts the calls into ``_core.fused_step`` (they still run)."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        real = _core.fused_step

        def spy(*a, **k):
            self.n += 1
            return real(*a, **k)

        monkeypatch.setattr(_core, "fused_step", spy)

    def take(self) -> int:
        n, self.n = self.n, 0
        return n


def _same(sa: dict[str, torch.Tensor], sb: dict[str, torch.Tensor]) -> None:
    assert sorted(sa) == sorted(sb)
    bad = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not bad, f"{bad} differ"


def _pair(rule, master, moments, dtype, hyper):
    spec = StateSpec(master=master, moments=moments, stochastic_rounding=True)
    return [make_group(rule, spec, dtype, SIZES, "cpu", seed=5, **hyper) for _ in range(2)]


@pytest.mark.parametrize(("rule", "master", "moments", "dtype", "hyper"), RULE_CONFIGS)
@pytest.mark.parametrize("threads", [1, 3])
def test_one_call_equals_a_call_per_count(
    monkeypatch, rule, master, moments, dtype, hyper, threads
):
    ops.set_num_threads(threads)
    ops.set_chunk_size(64)  # several chunks per tensor: the threads share the call
    a, b = _pair(rule, master, moments, dtype, hyper)
    calls = _Calls(monkeypatch)
    for shift in range(3):  # the counts move on: each work's rows keep their own
        grads = make_grads(a, shift + 1)
        for slots, step in WORKS:
            ops.fused_step(group_step(a, grads, step + shift, slots))
        assert calls.take() == len(WORKS)
        done: list[int] = []
        works = [group_step(b, grads, step + shift, slots) for slots, step in WORKS]
        ops.fused_steps(works, done=done.append)
        assert calls.take() == 1
        assert sorted(done) == list(range(len(WORKS)))
        _same(group_state(a), group_state(b))


def test_prepared_works_merge_as_validated_ones(monkeypatch):
    """Core's cached step hands ``PreparedStep`` objects: they merge too, with the bits of
    their own launches."""
    a, b = _pair("adamw", "ecc24", "q8", torch.bfloat16, {})
    grads = make_grads(a, 1)
    works_a = [group_step(a, grads, step, slots) for slots, step in WORKS]
    works_b = [group_step(b, grads, step, slots) for slots, step in WORKS]
    for w in works_a:
        ops.fused_step(w)
    prepared = [ops.prepare_step(w) for w in works_b]
    assert all(isinstance(p, ops.PreparedStep) for p in prepared)
    calls = _Calls(monkeypatch)
    ops.fused_steps(works_b, prepared)
    assert calls.take() == 1
    _same(group_state(a), group_state(b))


def test_strided_and_empty_works_run_alone(monkeypatch):
    """A work whose parameters run through contiguous copies is called alone (and written
    back); a work without tensors calls nothing; ``done`` still reports both."""
    a, b = _pair("adam", "fp32", "fp8", torch.float32, {})
    grads = make_grads(a, 1)
    # strided gradients run through contiguous copies: they merge (the copies stay alive)
    strided = [g.reshape(-1).repeat(2)[::2].view(g.shape) for g in grads]
    plan = [([0, 2], 3, strided), ([1, 4], 5, grads), ([], 2, grads), ([5, 6], 9, grads)]

    def works(group):
        out = [group_step(group, gs, step, slots) for slots, step, gs in plan]
        assert out[1].params[0].dim() == 2
        out[1].params[0] = out[1].params[0].t()  # a strided parameter: updated through a copy
        out[1].grads[0] = out[1].grads[0].t().contiguous()
        return out

    for w in works(a):
        ops.fused_step(w)
    calls = _Calls(monkeypatch)
    done: list[int] = []
    ops.fused_steps(works(b), None, done.append)
    assert calls.take() == 2  # works 0 and 3 merged, work 1 alone
    assert sorted(done) == [0, 1, 2, 3]
    _same(group_state(a), group_state(b))


def test_a_bad_work_is_refused_before_any_call(monkeypatch):
    a, _ = _pair("adamw", "ecc24", "q8", torch.bfloat16, {})
    before = group_state(a)
    grads = make_grads(a, 1)
    works = [group_step(a, grads, step, slots) for slots, step in WORKS]
    works[-1].grads[0] = works[-1].grads[0].to(torch.float64)
    with pytest.raises(ConfigError, match="gradient"):
        ops.fused_steps(works)
    _same(before, group_state(a))
    with pytest.raises(ConfigError, match="prepared steps"):
        ops.fused_steps(works[:2], [None])
    works[0].staging = [None] * len(works[0].slots)
    with pytest.raises(ConfigError, match="staging"):
        ops.fused_steps(works[:1])


def test_a_gradient_sharing_another_works_parameter_is_refused():
    """Works checked alone run at once in a merged call: a gradient that is another work's
    parameter (each work passes its own check) is refused before anything is written, as it
    is within one work."""
    a, _ = _pair("adam", "fp32", "fp32", torch.float32, {})
    before = group_state(a)
    grads = make_grads(a, 1)
    grads[0] = a.params[4].detach()[:33]  # slot 0's gradient: a view of slot 4's parameter
    assert grads[0].shape == a.params[0].shape
    works = [group_step(a, grads, 3, [0, 2]), group_step(a, grads, 5, [1, 4])]
    with pytest.raises(ConfigError, match="share memory"):
        ops.fused_steps(works)
    _same(before, group_state(a))


def test_the_core_refuses_bad_variants():
    """The compiled call checks its variants before any row runs (ops.py builds them; these
    are the module's own guards)."""
    a, _ = _pair("adamw", "fp32", "fp32", torch.float32, {})
    work = group_step(a, make_grads(a, 1), 1, [0, 1])
    prepared, config, _, _ = ops._resolve(work, None)
    before = group_state(a)
    index = torch.tensor([0, 1], dtype=torch.int32)
    variant = [1.0, 1.0, *config["scalars"]]

    def call(variants, row_variant):
        _core.fused_step(
            prepared.table.data_ptr(),
            prepared.n,
            **prepared.static,
            **config,
            variants=variants,
            row_variant=row_variant,
        )

    with pytest.raises(ValueError, match="10 numbers per variant"):
        call(variant[:-1], index.data_ptr())
    with pytest.raises(ValueError, match=r"row_variant\[1\] is 1"):
        call(variant, index.data_ptr())
    with pytest.raises(ValueError, match="row_variant is required"):
        call(variant, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        call(variant * 2, index.data_ptr() + 2)
    with pytest.raises(ValueError, match="integer in"):
        call([1.0, 2.5, *config["scalars"], *variant], index.data_ptr())
    with pytest.raises(ValueError, match="without variants"):
        call([], index.data_ptr())
    _same(before, group_state(a))


@pytest.mark.parametrize(("rule", "master", "moments", "dtype", "hyper"), RULE_CONFIGS)
def test_skipped_steps_take_one_call_per_step(monkeypatch, rule, master, moments, dtype, hyper):
    """A MemOptimizer whose parameters skip steps (``.grad`` None, as a MoE's experts routed
    no token) steps the counts of its one group in one call, on ordinary steps and on replays
    (a skip pattern repeated), with the bits of the torch backend."""
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=gen).to(dtype) for n in (33, 64, 1, 100, 31)]
    models = [[torch.nn.Parameter(p.clone()) for p in base] for _ in range(2)]
    kw = dict(rule=rule, master=master, moments=moments, **hyper)
    opts = [
        MemOptimizer(models[0], backend="cpu", **kw),
        MemOptimizer(models[1], backend="torch", **kw),
    ]
    calls = _Calls(monkeypatch)
    # gradients refilled in place: steps 3 and 4 replay step 2's two works (counts 1 and 2,
    # then 2 and 3, ...)
    bufs = [[torch.empty_like(p) for p in ps] for ps in models]
    skips = [(), (0,), (1,), (1,), (1,), (4,), (), (2, 3)]
    for step, skip in enumerate(skips):
        g = torch.Generator().manual_seed(100 + step)
        for k in range(len(base)):
            grad = torch.randn(base[k].shape, generator=g).to(dtype)
            for ps, bs in zip(models, bufs, strict=True):
                bs[k].copy_(grad)
                ps[k].grad = None if k in skip else bs[k]
        for opt in opts:
            opt.step()
        assert calls.take() == 1, step
        if step == 4:
            assert [c.replays for c in opts[0]._cached_steps.values()] == [2]
        for p, q in zip(*models, strict=True):
            assert torch.equal(p, q), step
            sp, sq = opts[0].state[p], opts[1].state[q]
            assert all(torch.equal(sp[k], sq[k]) for k in sq), step
    assert [int(opts[0].state[p]["step"]) for p in models[0]] == [7, 5, 7, 7, 7]


def test_prepared_works_are_checked_apart_once_per_set(monkeypatch):
    """A merged call of prepared works (core's cached step) checks that one work's gradient is
    no other work's parameter when that set of prepared steps first runs together, not at
    every replay; a work prepared again (its gradients moved) is checked again, and refused
    where it now shares memory."""
    a, _ = _pair("adam", "fp32", "fp32", torch.float32, {})
    grads = make_grads(a, 1)
    works = [group_step(a, grads, 3, [0, 2]), group_step(a, grads, 5, [1, 4])]
    prepared = [ops.prepare_step(w) for w in works]
    checks = []
    real = ops._check_apart
    monkeypatch.setattr(ops, "_check_apart", lambda ws: checks.append(len(ws)) or real(ws))
    for _ in range(3):
        ops.fused_steps(works, prepared)
    assert checks == [2]
    works[0].grads[0] = a.params[4].detach()[:33]  # now a view of the other work's parameter
    prepared[0] = ops.prepare_step(works[0])  # alone, it passes its own check
    before = group_state(a)
    with pytest.raises(ConfigError, match="share memory"):
        ops.fused_steps(works, prepared)
    assert checks == [2, 2]
    _same(before, group_state(a))
    with pytest.raises(ConfigError, match="share memory"):
        ops.fused_steps(works, [None, prepared[1]])  # unprepared: checked at every call
    assert checks == [2, 2, 2]
