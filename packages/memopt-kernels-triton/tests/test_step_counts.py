"""Parameters that skip steps (``.grad`` None: a mixture of experts' idle experts) leave one
param group at several step counts, which core hands over as one work per count. The backend's
``step_all`` (``ops.fused_steps``) runs the works of one arena as one launch over their tensors
in slot order, each tensor reading its own count's words: one table per step, not one per
count. The bits must be those of core's torch backend, on ordinary steps and on replays."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memopt_core import MemOptimizer
from memopt_core.testing import RULE_CONFIGS

#: tensors skipped at each step: counts drift apart, a pattern repeats (steps 3-4 replay step
#: 2's works), every tensor steps again at a count of its own (step 6), two stay behind
SKIPS = [(), (0,), (1,), (1,), (1,), (4,), (), (2, 3), (0, 2)]


def _sizes(device) -> list[int]:
    return [33, 64, 1, 100, 31] if device.type == "cpu" else [33, 4095, 1, 65537, 31]


def _same(opts, models, step) -> None:
    for p, q in zip(*models, strict=True):
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), step
        sp, sq = opts[0].state[p], opts[1].state[q]
        assert sorted(sp) == sorted(sq)
        for key in sq:
            assert torch.equal(sp[key].cpu(), sq[key].cpu()), (step, key)


def _run(models, opts, skips, dtype, *, move: bool, check=None) -> None:
    """Steps with the tensors of ``skips[step]`` left without a gradient; gradients refilled in
    place (so that a repeated pattern replays), or new tensors with ``move``."""
    bufs = [[torch.empty_like(p) for p in ps] for ps in models]
    for step, skip in enumerate(skips):
        gen = torch.Generator().manual_seed(100 + step)
        for k in range(len(models[0])):
            grad = torch.randn(models[0][k].shape, generator=gen).to(dtype)
            for ps, bs in zip(models, bufs, strict=True):
                if move:
                    bs[k] = grad.clone().to(ps[k].device)
                else:
                    bs[k].copy_(grad)
                ps[k].grad = None if k in skip else bs[k]
        for opt in opts:
            opt.step()
        _same(opts, models, step)
        if check is not None:
            check(step)


@pytest.mark.parametrize(("rule", "master", "moments", "dtype", "hyper"), RULE_CONFIGS)
def test_the_counts_of_a_group_run_in_one_launch(
    launches, ops, device, rule, dtype, master, moments, hyper
):
    """One group at several step counts: one launch per step, on ordinary steps and replays,
    with the torch backend's bits; every tensor ends at its own count."""
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=gen).to(dtype) for n in _sizes(device)]
    models = [[torch.nn.Parameter(p.clone().to(device)) for p in base] for _ in range(2)]
    kw = dict(rule=rule, master=master, moments=moments, **hyper)
    opts = [MemOptimizer(models[0], backend="triton", **kw)]
    opts.append(MemOptimizer(models[1], backend="torch", **kw))

    def check(step):
        stepping = len(base) - len(SKIPS[step])
        counts = {int(opts[0].state[p]["step"]) for p in models[0]}
        got = launches.take()
        assert len(got) == 1, (step, got)  # one launch whatever the counts
        assert got[0][1] == stepping, step
        if step == 4:  # the pattern of steps 2-4 replayed, counts 3 and 4 in one launch
            assert [c.replays for c in opts[0]._cached_steps.values()] == [2]
            assert got == [("launch_hyper", stepping)]
        assert len(counts) > 1 or step == 0

    _run(models, opts, SKIPS, dtype, move=False, check=check)
    assert [int(opts[0].state[p]["step"]) for p in models[0]] == [7, 6, 7, 8, 8]


def test_moved_gradients_and_several_groups(launches, ops, device, monkeypatch):
    """Gradients at new addresses every step, and three param groups of one family: each
    group's counts run as one share of the family's merged launch (one launch per step), with
    each group's own scalars."""
    monkeypatch.setattr(ops, "MERGE_MIN_WORKS", 2)  # three groups: merged, at a small size
    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in _sizes(device) * 2]

    def groups(ps):
        return [
            {"params": ps[0:4], "lr": 1e-3},
            {"params": ps[4:7], "lr": 3e-3, "weight_decay": 0.0},
            {"params": ps[7:], "lr": 2e-3, "betas": (0.8, 0.99)},
        ]

    models = [[torch.nn.Parameter(p.clone().to(device)) for p in base] for _ in range(2)]
    opts = [
        MemOptimizer(groups(ps), master="ecc24", moments="q8", backend=b, weight_decay=0.1)
        for ps, b in zip(models, ("triton", "torch"), strict=True)
    ]
    skips = [(), (0, 5), (1, 9), (1,), (4, 5, 6), (), (2, 8)]

    def check(step):
        assert launches.take() == [("launch_hyper", len(base) - len(skips[step]))], step

    _run(models, opts, skips, torch.bfloat16, move=True, check=check)


def _works(device, n_counts=3):
    """Works of one group at ``n_counts`` counts (one tensor each) on the triton and torch
    backends' own copies."""
    from memopt_core import reference
    from memopt_core.backends import GroupStep
    from memopt_core.formats import StateSpec
    from memopt_core.plan import GroupPlan, StateArena

    gen = torch.Generator().manual_seed(2)
    sizes = [33, 1, 64, 7][: n_counts + 1]
    base = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) for n in sizes]
    spec = StateSpec(master="fp32", moments="bf16", stochastic_rounding=True)
    out = []
    for _ in range(2):
        params = [p.clone().to(device) for p in base]
        plan = GroupPlan(params, spec, device=params[0].device)  # cuda:0, not cuda
        arena = StateArena(plan, {"exp_avg": spec.first, "exp_avg_sq": spec.second})
        works = []
        for k in range(n_counts):
            slots = [k] if k < n_counts - 1 else [k, k + 1]  # the last count holds two tensors
            step = k + 2
            s = reference.adam_scalars(
                lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, step=step, decoupled=True
            )
            works.append(
                GroupStep(
                    "adam", spec, plan, slots, [params[i] for i in slots],
                    [grads[i].clone().to(device) for i in slots], arena, s, step, 7,
                    [100 + i for i in slots], False,
                )
            )  # fmt: skip
        out.append((params, arena, works))
    return out


def test_works_of_one_arena_equal_their_launches_apart(launches, ops, device):
    """fused_steps over works of one arena (slots in no particular order across works): one
    launch, the bits of each work stepped alone (fused_step), state included; with index bases
    on one work, the union keeps each tensor's own."""
    (pa, aa, wa), (pb, ab, wb) = _works(device)
    wa[1] = dataclasses.replace(wa[1], index_bases=[5000])
    wb[1] = dataclasses.replace(wb[1], index_bases=[5000])
    wa = [wa[2], wa[0], wa[1]]  # counts handed over in any order
    done: list[int] = []
    ops.fused_steps(wa, done=done.append)
    assert launches.take() == [("launch_hyper", 4)]
    assert sorted(done) == [0, 1, 2]
    for w in wb:
        ops.fused_step(w)
    for p, q in zip(pa, pb, strict=True):
        assert torch.equal(p, q)
    for name in ("exp_avg", "exp_avg_sq"):
        for key, t in aa.fields[name].items():
            assert torch.equal(t, ab.fields[name][key]), (name, key)


def test_works_stepping_one_tensor_twice_run_one_after_the_other(launches, ops, device):
    """Two works of one arena over the same tensor (two steps of it, queued by a direct
    caller) cannot share a launch: they run apart, in order, as fused_step runs them."""
    outs = []
    for params, _, works in _works(device, n_counts=2):
        first = works[0]
        twice = dataclasses.replace(
            works[1], slots=first.slots, params=first.params, tensor_ids=first.tensor_ids
        )
        outs.append((params, [first, dataclasses.replace(twice, grads=list(first.grads))]))
    (pa, wa), (pb, wb) = outs
    ops.fused_steps(wa)
    assert [name for name, _ in launches.take()] == ["launch", "launch"]
    for w in wb:
        ops.fused_step(w)
    assert torch.equal(pa[0], pb[0])


def test_a_bad_tensor_in_a_union_is_refused_before_any_launch(launches, ops, device):
    """A gradient of another size in the second count's work: ConfigError naming the plan slot
    of the tensor, nothing launched, nothing written."""
    from memopt_core.errors import ConfigError

    (pa, _, wa), _ = _works(device)
    before = [p.clone() for p in pa]
    wa[1].grads[0] = torch.zeros(2, device=device)
    with pytest.raises(ConfigError, match=r"plan slot 1"):
        ops.fused_steps(wa)
    assert launches.take() == []
    assert all(torch.equal(p, q) for p, q in zip(pa, before, strict=True))


def test_a_strided_parameter_in_a_union_is_written_back(ops, device):
    """A union with a strided parameter runs through contiguous copies and writes them back,
    with the bits of the works stepped alone."""
    gen = torch.Generator().manual_seed(4)
    square, grad = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    outs = _works(device)
    for _, _, works in outs:  # the 64-element tensor of slot 2 as the transpose of a square
        works[2].params[0] = square.clone().to(device).t()
        works[2].grads[0] = grad.clone().to(device)
    (pa, _, wa), (pb, _, wb) = outs
    ops.fused_steps(wa)
    for w in wb:
        ops.fused_step(w)
    assert not wa[2].params[0].is_contiguous()
    for x, y in zip([*pa, wa[2].params[0]], [*pb, wb[2].params[0]], strict=True):
        assert torch.equal(x, y)
