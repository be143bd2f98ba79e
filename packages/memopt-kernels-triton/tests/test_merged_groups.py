"""Param groups in one launch: groups that share a device, a parameter dtype and formats keep
their arenas in one family (``memopt_core.plan.family_arenas``), and the backend's
``step_all`` (``ops.fused_steps``) steps them together, each tensor reading its own group's
scalars. The bits must be those of core's torch backend, step after step, on the ordinary step
and on the cached replays, with gradients that move."""

from __future__ import annotations

import pytest
import torch

from memopt_core import MemOptimizer

CASES = [
    # rule, param dtype, master, moments, group settings (one dict per group)
    pytest.param(
        "adamw", torch.bfloat16, "ecc24", "q8",
        [{"lr": 1e-3, "weight_decay": 0.1}, {"lr": 3e-4, "weight_decay": 0.0},
         {"lr": 2e-3, "betas": (0.8, 0.99), "eps": 1e-6}],
        id="adamw-ecc24-q8",
    ),
    pytest.param(
        "adam", torch.float32, "none", "bf16",
        [{"lr": 1e-2, "weight_decay": 0.01}, {"lr": 5e-3, "weight_decay": 0.02}],
        id="adam-l2-fp32-bf16-moments",
    ),
    pytest.param(
        "lion", torch.bfloat16, "ecc32", "fp32",
        [{"lr": 1e-4, "weight_decay": 0.1}, {"lr": 3e-4, "betas": (0.95, 0.98)}],
        id="lion-ecc32",
    ),
    pytest.param(
        "sgdw", torch.float16, "none", "bf16",
        [{"lr": 0.1, "momentum": 0.9, "nesterov": True},
         {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 1e-4}],
        id="sgdw-nesterov-fp16",
    ),
]  # fmt: skip


@pytest.fixture(autouse=True)
def _merge_pairs(request, monkeypatch):
    """Merge from two works on, so that the tests stay small (the default,
    ``ops.MERGE_MIN_WORKS``, is where merging measured faster; a test marked ``default_min``
    keeps it)."""
    if "default_min" not in request.keywords:
        from memopt_kernels_triton import ops

        monkeypatch.setattr(ops, "MERGE_MIN_WORKS", 2)


def _sizes(device) -> list[int]:
    return [0, 1, 33, 65, 7] if device.type == "cpu" else [0, 1, 31, 33, 4095, 65537, 1023]


def _pair(device, rule, dtype, master, moments, settings, **kw):
    """A triton optimizer and a torch-backend one over equal copies of the same groups."""
    gen = torch.Generator().manual_seed(7)
    sizes = _sizes(device)
    groups = []
    for k, extra in enumerate(settings):
        shapes = [sizes[(k + j) % len(sizes)] for j in range(3)]
        params = [torch.randn(n, generator=gen).to(dtype) for n in shapes]
        groups.append((params, extra))
    opts, models = [], []
    for backend in ("triton", "torch"):
        ps = [[torch.nn.Parameter(p.clone().to(device)) for p in params] for params, _ in groups]
        gs = [{"params": p, **extra} for p, (_, extra) in zip(ps, groups, strict=True)]
        opts.append(
            MemOptimizer(gs, rule=rule, master=master, moments=moments, backend=backend, **kw)
        )
        models.append([p for group in ps for p in group])
    return opts, models


def _grads(models, step: int, dtype, *, move: bool) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for ps in zip(*models, strict=True):
        g = torch.randn(ps[0].shape, generator=gen).to(dtype)
        for p in ps:
            if move or p.grad is None:
                p.grad = g.to(p.device)  # a new tensor: the cached step follows it
            else:
                p.grad.copy_(g.to(p.device))


def _same(opts, models) -> None:
    for a, b in zip(*models, strict=True):
        assert torch.equal(a.detach().cpu(), b.detach().cpu()), (a, b)
        sa, sb = opts[0].state[a], opts[1].state[b]
        assert sorted(sa) == sorted(sb)
        for key in sa:
            assert torch.equal(sa[key].cpu(), sb[key].cpu()), (key, sa[key], sb[key])


@pytest.mark.parametrize(("rule", "dtype", "master", "moments", "settings"), CASES)
def test_groups_of_one_family_run_in_one_launch(
    launches, ops, device, rule, dtype, master, moments, settings
):
    opts, models = _pair(device, rule, dtype, master, moments, settings)
    n = len(models[0])
    for step in range(5):
        # steps 0-1: gradients kept in place (a replay reuses the prepared launches); then new
        # gradient tensors every step (the replay follows them)
        _grads(models, step, dtype, move=step >= 2)
        for opt in opts:
            opt.step()
        assert launches.take() == [("launch_hyper", n)], step
        _same(opts, models)
    entries = [e for gp in opts[0]._plans.values() for e in gp.entries]
    assert all(e.arena.family is entries[0].arena.family for e in entries)
    assert entries[0].arena.family is not None


def test_groups_of_other_formats_or_variants_launch_apart(launches, ops, device):
    """Another master format is another family; a maximize group compiles another variant:
    each runs in a launch of its own. A decay of exactly 1 (weight_decay 0) rides in a launch
    compiled with the decay term, multiplying by 1."""
    gen = torch.Generator().manual_seed(3)
    base = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in (33, 1, 65, 7, 31)]

    def groups(dev):
        ps = [torch.nn.Parameter(p.clone().to(dev)) for p in base]
        return ps, [
            {"params": ps[0:1], "weight_decay": 0.1},
            {"params": ps[1:2], "weight_decay": 0.0},
            {"params": ps[2:3], "master": "ecc32"},
            {"params": ps[3:4], "maximize": True},
            {"params": ps[4:5], "lr": 3e-3},
        ]

    (pa, ga), (pb, gb) = groups(device), groups(device)
    opts = [
        MemOptimizer(ga, master="ecc24", moments="q8", backend="triton"),
        MemOptimizer(gb, master="ecc24", moments="q8", backend="torch"),
    ]
    for step in range(3):
        _grads([pa, pb], step, torch.bfloat16, move=False)
        for opt in opts:
            opt.step()
        # groups 0, 1 and 4 together; the ecc32 group and the maximize group alone
        assert sorted(launches.take()) == [("launch", 1), ("launch", 1), ("launch_hyper", 3)]
        _same(opts, [pa, pb])


def test_a_merged_launch_sizes_its_chunks_for_all_its_works(ops, device, monkeypatch):
    """A merged launch cuts its tensors into chunks sized for the merged total, as one group of
    the same tensors is cut, not for each work's own total: each work's size fills the GPU with
    that work alone, and 25 groups ran chunks 7x smaller and a 5% slower kernel on the H200.
    Chunking does not change the bits."""
    # 4 programs' worth of chunks of 32 elements upwards, on every device
    monkeypatch.setattr(ops, "kernel_config", lambda **_: ops.KernelConfig(rows=1, waves=1))
    monkeypatch.setattr(ops, "_sm_count", lambda _: 4)
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(n, generator=gen) for n in (40, 70) * 3]

    def groups(dev):
        ps = [torch.nn.Parameter(p.clone().to(dev)) for p in base]
        return ps, [{"params": ps[2 * k : 2 * k + 2], "lr": 1e-3 * (k + 1)} for k in range(3)]

    (pa, ga), (pb, gb) = groups(device), groups(device)
    opts = [
        MemOptimizer(g, master="none", moments="fp32", backend=b)
        for g, b in ((ga, "triton"), (gb, "torch"))
    ]
    merged = []
    original = ops.PreparedStep.launch_hyper

    def spy(this, *a, **k):
        merged.append(this)
        return original(this, *a, **k)

    monkeypatch.setattr(ops.PreparedStep, "launch_hyper", spy)
    for step in range(3):
        _grads([pa, pb], step, torch.float32, move=step == 2)
        for opt in opts:
            opt.step()
        _same(opts, [pa, pb])
    # each group alone (110 elements over 4 programs) takes chunks of 32: 2 + 3 per group;
    # the merged total (330) takes chunks of 96: one per tensor
    assert {m._head[1] for m in merged} == {6}
    chunks = merged[-1]._head[0].cpu()
    assert chunks[:, 2].tolist() == [40, 70] * 3  # lengths
    assert chunks[:, 1].tolist() == [0] * 6  # every tensor from its start


def test_a_rebuilt_group_rebuilds_its_family(launches, ops, device):
    """A param group whose params list is edited in place gets a new plan; the groups sharing
    its family arena are rebuilt with it, so that no region of the old arena stays held, and
    every state carries over."""
    opts, models = _pair(
        device, "adamw", torch.bfloat16, "ecc24", "q8", [{"lr": 1e-3}, {"lr": 2e-3}, {}]
    )
    for step in range(2):
        _grads(models, step, torch.bfloat16, move=False)
        for opt in opts:
            opt.step()
    old = opts[0]._plans[0].entries[0].arena.family
    extra = torch.randn(17, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for opt, ps in zip(opts, models, strict=True):
        p = torch.nn.Parameter(extra.clone().to(device))
        opt.param_groups[1]["params"].append(p)
        ps.append(p)
    launches.take()  # the steps before the rebuild do not count
    for step in range(2, 4):
        _grads(models, step, torch.bfloat16, move=False)
        for opt in opts:
            opt.step()
        assert launches.take() == [("launch_hyper", len(models[0]))]
        _same(opts, models)
    entries = [e for gp in opts[0]._plans.values() for e in gp.entries]
    assert {id(e.arena.family) for e in entries} == {id(entries[0].arena.family)}
    assert entries[0].arena.family is not old
    family = entries[0].arena.family
    assert opts[0].state_bytes() == family.nbytes()  # the members cover it, nothing else held


def test_an_interrupted_merged_launch_counts_every_group(ops, device, monkeypatch):
    """A KeyboardInterrupt out of a merged launch comes after the kernel was issued (Python
    delivers it when the call returns): every group's step count advances, as after one
    launch per group."""
    opts, models = _pair(device, "adamw", torch.float32, "none", "fp32", [{}, {"lr": 2e-3}])
    opt = opts[0]
    _grads(models, 0, torch.float32, move=False)
    original = ops.PreparedStep.launch_hyper

    def interrupted(this, *a, **k):
        original(this, *a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(ops.PreparedStep, "launch_hyper", interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert [int(opt.state[p]["step"]) for p in models[0]] == [1] * len(models[0])


def test_fused_steps_refuses_device_steps_and_other_counts(ops, device):
    from memopt_core.errors import ConfigError

    opts, models = _pair(device, "adamw", torch.float32, "none", "fp32", [{}, {}])
    _grads(models, 0, torch.float32, move=False)
    opts[0].step()
    works = [e.work for e in opts[0]._cached_steps[None].entries]
    with pytest.raises(ConfigError, match="prepared steps for"):
        ops.fused_steps(works, [None])
    from dataclasses import replace

    from memopt_core.backends import DeviceStep

    capturable = replace(works[0], device_step=DeviceStep(torch.zeros(1), 1e-3, (0.9, 0.999)))
    with pytest.raises(ConfigError, match="runs host steps"):
        ops.fused_steps([capturable, works[1]])


@pytest.mark.parametrize("rule", ["adam", "lion", "sgd"])
def test_words_table_equals_hyper_words(ops, rule):
    """The merged launch's words, rounded by one array conversion, are hyper_words' bits
    (rounded one Python call at a time), also past the fp32 range and below its normal
    numbers, one row per work."""
    from memopt_core import reference
    from memopt_core.backends import GroupStep

    values = [1e-3, 0.9, 1e39, -1e39, 1e-45, 3e-39, 0.1 + 1e-12, 1.0 / 3.0]
    works = []
    for k, v in enumerate(values):
        if rule == "adam":
            s = reference.adam_scalars(
                lr=v, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=k + 1, decoupled=True
            )
        elif rule == "lion":
            s = reference.lion_scalars(lr=v, betas=(0.9, 0.99), weight_decay=0.1)
        else:
            s = reference.sgd_scalars(
                lr=v, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=1e-4
            )
        work = GroupStep(rule, None, None, [], [], [], None, s, k + 1, 2**40 + k, [], k == 0)
        works.append(work)
    want = [
        ops.hyper_words(rule, w.scalars, w.seed, w.step, first_step=w.first_step) for w in works
    ]
    blob = bytearray(b"".join(ops._work_rows(rule, works)))
    got = ops._upload_words(blob, len(ops.HYPER_FIELDS[rule]), torch.device("cpu"))
    assert got.tolist() == want


def test_back_to_back_steps_read_their_own_words(device):
    """Steps queued without a synchronization, each with other lrs (a scheduler): every merged
    launch reads the words its step uploaded, not a later step's (the host buffer of a queued
    copy is not reused)."""
    opts, models = _pair(
        device, "adamw", torch.bfloat16, "ecc24", "q8", [{"lr": 1e-3}, {"lr": 2e-3}, {"lr": 3e-3}]
    )
    _grads(models, 0, torch.bfloat16, move=False)
    for step in range(12):
        for opt in opts:
            for k, group in enumerate(opt.param_groups):
                group["lr"] = 1e-3 * (k + 1) * (1 + step / 7)
            opt.step()
    _same(opts, models)


@pytest.mark.default_min
def test_fewer_works_than_the_minimum_launch_apart(launches, ops, device):
    """Below ``MERGE_MIN_WORKS`` works the merged launch's word upload costs more than the
    launches it saves (2 groups measured slower): each group launches alone, and at the minimum
    they launch together, the same bits either way."""
    n = ops.MERGE_MIN_WORKS
    for groups, want in ((n - 1, [("launch", 3)] * (n - 1)), (n, [("launch_hyper", 3 * n)])):
        opts, models = _pair(
            device,
            "adamw",
            torch.float32,
            "none",
            "bf16",
            [{"lr": 1e-3 * (k + 1)} for k in range(groups)],
        )
        for step in range(2):
            _grads(models, step, torch.float32, move=False)
            for opt in opts:
                opt.step()
            assert launches.take() == want, (groups, step)
            _same(opts, models)


def _capturable_twin(opt, **kw):
    """A ``capturable=True`` triton optimizer over copies of ``opt``'s param groups (same
    settings), and its parameters in order."""
    groups = [
        {**g, "params": [torch.nn.Parameter(p.detach().clone()) for p in g["params"]]}
        for g in opt.param_groups
    ]
    mine = MemOptimizer(groups, backend="triton", capturable=True, **kw)
    return mine, [p for g in mine.param_groups for p in g["params"]]


@pytest.mark.parametrize(("rule", "dtype", "master", "moments", "settings"), CASES)
def test_capturable_groups_run_in_one_launch(
    launches, ops, device, monkeypatch, rule, dtype, master, moments, settings
):
    """Capturable steps (``capturable=True``) of a family merge from two groups on (captured
    in a CUDA graph; here eagerly, as the flag allows): each group's device-words kernel
    writes its rows into one table and one launch reads it. The bits and step counts are the
    host step's, also at a step where some tensors have no gradient (their groups step a part
    of their tensors, at other counts)."""
    monkeypatch.setattr(ops, "MERGE_MIN_WORKS", 10**6)  # host merging off: device steps merge
    monkeypatch.setattr(ops, "MERGE_DEVICE_STEPS_EAGERLY", True)  # as under a graph capture
    opts, models = _pair(device, rule, dtype, master, moments, settings)
    mine, ps = _capturable_twin(opts[0], rule=rule, master=master, moments=moments)
    for step in range(4):
        _grads([models[1], ps], step, dtype, move=True)
        if step == 2:  # two tensors without a gradient: their counts fall behind
            for p in (models[1][0], ps[0], models[1][-1], ps[-1]):
                p.grad = None
        opts[1].step()
        mine.step()
        stepped = sum(p.grad is not None and p.numel() > 0 for p in ps)
        calls = launches.take()
        assert calls == [("launch_hyper", sum(p.grad is not None for p in ps))], (step, calls)
        assert stepped > 0
        _same([mine, opts[1]], [ps, models[1]])


def test_capturable_groups_launch_apart_outside_a_capture(launches, ops, device):
    """Eager capturable steps (no capture, ``MERGE_DEVICE_STEPS_EAGERLY`` off) launch per
    group, every group of the family, with the host step's bits."""
    opts, models = _pair(
        device, "adamw", torch.bfloat16, "ecc24", "q8", [{"lr": 1e-3}, {"lr": 2e-3}, {}]
    )
    mine, ps = _capturable_twin(opts[0], master="ecc24", moments="q8")
    for step in range(3):
        _grads([models[1], ps], step, torch.bfloat16, move=True)
        opts[1].step()
        mine.step()
        assert launches.take() == [("launch_hyper", len(g["params"])) for g in mine.param_groups]
        _same([mine, opts[1]], [ps, models[1]])


def test_capturable_merged_groups_with_a_grad_scaler(launches, ops, device, monkeypatch):
    """A GradScaler's scale and found-inf reach every group of a merged capturable launch: a
    power-of-two scale unscales exactly (the bits of the host step on unscaled gradients), and
    a nonzero found-inf leaves every group, its state and its counts unchanged."""
    monkeypatch.setattr(ops, "MERGE_DEVICE_STEPS_EAGERLY", True)
    opts, models = _pair(
        device, "adamw", torch.bfloat16, "ecc24", "q8", [{"lr": 1e-3}, {"lr": 2e-3}, {}]
    )
    mine, ps = _capturable_twin(opts[0], master="ecc24", moments="q8")
    mine.grad_scale = torch.full((1,), 8.0, device=device)
    for step in range(3):
        _grads([models[1], ps], step, torch.bfloat16, move=True)
        for p in ps:
            p.grad = p.grad * 8  # exact: a power of two (a new tensor: CPU copies share one)
        mine.found_inf = torch.full((1,), float(step == 1), device=device)
        if step != 1:
            opts[1].step()
        before = [p.detach().clone() for p in ps]
        mine.step()
        if step == 1:
            assert all(torch.equal(a, b) for a, b in zip(before, ps, strict=True))
        assert launches.take() == [("launch_hyper", len(ps))]
        _same([mine, opts[1]], [ps, models[1]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_capturable_merged_groups_in_a_cuda_graph(launches, ops):
    """The capturable step of three groups captured in a CUDA graph after one eager step: the
    capture merges their launches (the eager step launches per group), and replays with new
    gradients in the same buffers give the host step's bits."""
    import os

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("GPU tests compile kernels: unset TRITON_INTERPRET")
    opts, models = _pair(
        torch.device("cuda"), "adamw", torch.bfloat16, "ecc24", "q8",
        [{"lr": 1e-3}, {"lr": 2e-3, "weight_decay": 0.0}, {"betas": (0.8, 0.99)}],
    )  # fmt: skip
    mine, ps = _capturable_twin(opts[0], master="ecc24", moments="q8")
    for p in ps:
        p.grad = torch.zeros_like(p)
    graph = None
    for step in range(5):
        _grads([models[1], ps], step, torch.bfloat16, move=False)
        opts[1].step()
        if step == 0:
            mine.step()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                mine.step()
            torch.cuda.current_stream().wait_stream(stream)
            sizes = [len(g["params"]) for g in mine.param_groups]
            assert launches.take() == [
                *(("launch_hyper", n) for n in sizes),  # eager: per group
                ("launch_hyper", len(ps)),  # captured: merged
            ]
        else:
            graph.replay()
        torch.cuda.synchronize()
        _same([mine, opts[1]], [ps, models[1]])


def test_a_merged_launch_takes_numpy_coefficients(launches, ops, device):
    """Works whose scalars hold a numpy L2 coefficient (core's ``adam_scalars`` keeps the
    weight decay it is given) merge into one launch with the bits of float scalars: the
    launch's ``has_l2`` flag is a bool (``launch_hyper`` takes only bools), as is a capturable
    launch's."""
    import dataclasses

    import numpy as np

    after = []
    for as_numpy in (False, True):
        settings = [{"weight_decay": 0.01}, {"weight_decay": 0.02}]
        opts, models = _pair(device, "adam", torch.float32, "none", "fp32", settings)
        _grads(models, 0, torch.float32, move=False)
        opts[0].step()
        works = [e.work for e in opts[0]._cached_steps[None].entries]
        for w, group in zip(works, opts[0].param_groups, strict=True):
            w.grads = [p.grad for p in group["params"]]
            if as_numpy:
                w.scalars = dataclasses.replace(w.scalars, l2=np.float64(w.scalars.l2))
        assert type(works[1].scalars.l2) is (np.float64 if as_numpy else float)
        launches.take()  # the optimizer's step does not count
        ops.fused_steps(works)
        assert launches.take() == [("launch_hyper", 6)]
        after.append([p.detach().clone() for p in models[0]])
    assert all(map(torch.equal, *after))
    from memopt_core.backends import DeviceStep  # a capturable launch's flags, likewise

    capturable = dataclasses.replace(
        works[0], device_step=DeviceStep(torch.zeros(1), 1e-3, (0.9, 0.999))
    )
    assert ops._device_flags([capturable])["has_l2"] is True
