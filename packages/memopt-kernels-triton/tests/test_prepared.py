"""Prepared launches (``ops.prepare_step``): one resolution reused over many steps, with scalars
from the host or from a device tensor (the CUDA-graph path), gives the bits of a fresh
``fused_step`` per step, i.e. of core's torch backend."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from memopt_core.errors import ConfigError
from memopt_core.formats import StateSpec
from memopt_core.testing import (
    VARIANTS,
    at_offset,
    diff_report,
    group_step,
    make_grads,
    make_group,
)
from memopt_core.torch_backend import TorchBackend

TORCH = TorchBackend()

CASES = [
    pytest.param("fp32", "fp32", torch.float32, id="fp32-master-fp32-moments"),
    pytest.param("bf16", "fp32", torch.float32, id="fp32-master-bf16-moments"),
    pytest.param("q8", "fp32", torch.float32, id="fp32-master-q8"),
    pytest.param("q8", "ecc24", torch.bfloat16, id="ecc24-q8"),
    pytest.param("bf16", "ecc32", torch.bfloat16, id="ecc32-bf16-moments"),
]


def _sizes(device) -> list[int]:
    return [0, 1, 33, 65] if device.type == "cpu" else [0, 1, 31, 33, 4095, 65537]


@pytest.mark.parametrize("hyper_on_device", [False, True], ids=["host-scalars", "device-scalars"])
@pytest.mark.parametrize(("preset", "master", "dtype"), CASES)
def test_prepared_adamw_equals_reference(ops, device, preset, master, dtype, hyper_on_device):
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master=master, moments=preset, stochastic_rounding=True)
    ref = make_group(rule, spec, dtype, _sizes(device), device, seed=2**32 - 3, **hyper)
    mine = ref.clone()
    grads = [torch.empty_like(p) for p in mine.params]  # stable buffers, refilled every step
    prepared = None
    hyper_t = torch.zeros(len(ops.ADAM_HYPER_FIELDS), dtype=torch.int32, device=device)
    for step in range(1, 5):
        new = make_grads(ref, step)
        work = group_step(ref, new, step)
        TORCH.step(work)
        for g, n in zip(grads, new, strict=True):
            g.copy_(n)
        mine_work = group_step(mine, grads, step)
        if prepared is None:
            prepared = ops.prepare_step(mine_work)
            assert prepared.reusable
        if hyper_on_device:
            words = ops.adam_hyper_words(mine_work.scalars, mine_work.seed, step)
            hyper_t.copy_(torch.tensor(words, dtype=torch.int32))
            prepared.launch_hyper(
                hyper_t,
                maximize=bool(mine_work.scalars.maximize),
                has_l2=mine_work.scalars.l2 != 0.0,
                has_decay=True,  # a factor of exactly 1 would be harmless
            )
        else:
            prepared.launch(mine_work.scalars, step, mine_work.seed, step == 1)
        bad = diff_report(ref, mine)
        assert not bad, f"step {step}: " + "; ".join(bad)


def test_hyper_words_layout(ops):
    from memopt_core.reference import adam_scalars

    s = adam_scalars(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, step=3, decoupled=True
    )
    words = ops.adam_hyper_words(s, seed=2**32 - 1, step=3)
    assert len(words) == len(ops.ADAM_HYPER_FIELDS) == 12
    floats = torch.tensor(words[:8], dtype=torch.int32).view(torch.float32).tolist()
    expect = [
        torch.tensor(float(getattr(s, f)), dtype=torch.float32).item()
        for f in ops.ADAM_HYPER_FIELDS[:8]
    ]
    assert floats == expect
    assert words[8:] == [-1, 3, 0x3F800000, 0]  # seed, step, inv_scale 1.0, skip 0


#: (moment preset, master, parameter dtype) of the Lion/SGD device-scalar tests
RULE_CASES = [
    pytest.param("fp32", "fp32", torch.float32, id="fp32-master-fp32-moments"),
    pytest.param("q8", "ecc24", torch.bfloat16, id="ecc24-q8"),
    pytest.param("fp8", "none", torch.bfloat16, id="none-bf16-fp8"),
]
RULE_VARIANTS = ["lion", "sgd", "sgd-mom-damp-l2", "sgd-nesterov", "sgdw-mom"]


def _hyper_flags(kind: str, s) -> dict:
    """``launch_hyper`` flags of a step's scalars (decay always on: a factor of 1 is harmless)."""
    flags = {"maximize": bool(s.maximize), "has_decay": True}
    if kind != "lion":
        flags["has_l2"] = s.l2 != 0.0
    if kind == "sgd":
        flags["nesterov"] = bool(s.nesterov)
    return flags


@pytest.mark.parametrize(("preset", "master", "dtype"), RULE_CASES)
@pytest.mark.parametrize("variant", RULE_VARIANTS)
def test_prepared_lion_sgd_equal_reference(ops, device, variant, preset, master, dtype):
    """Lion and SGD (momentum, dampening, L2, Nesterov, SGDW): one prepared step launched with
    host scalars and another with device words (step 1, SGD's first step, and later steps from
    the same launch) both give the torch backend's bits every step."""
    rule, hyper = VARIANTS[variant]
    spec = StateSpec(master=master, moments=preset, stochastic_rounding=True)
    ref = make_group(rule, spec, dtype, _sizes(device), device, seed=2**31 + 5, **hyper)
    host, dev = ref.clone(), ref.clone()
    grads = {id(g): [torch.empty_like(p) for p in g.params] for g in (host, dev)}
    prepared: dict = {}
    hyper_t = torch.zeros(len(ops.HYPER_FIELDS[ref.kind]), dtype=torch.int32, device=device)
    for step in range(1, 4):
        new = make_grads(ref, step)
        TORCH.step(group_step(ref, new, step))
        for g in (host, dev):
            for buf, n in zip(grads[id(g)], new, strict=True):
                buf.copy_(n)
            work = group_step(g, grads[id(g)], step)
            if id(g) not in prepared:
                prepared[id(g)] = ops.prepare_step(work)
                assert prepared[id(g)].reusable
            p = prepared[id(g)]
            if g is host:
                p.launch(work.scalars, step, work.seed, step == 1)
            else:
                assert p.hyper_fields == ops.HYPER_FIELDS[work.rule]
                words = ops.hyper_words(work.rule, work.scalars, work.seed, step)
                hyper_t.copy_(torch.tensor(words, dtype=torch.int32))  # rewritten in place
                p.launch_hyper(hyper_t, **_hyper_flags(work.rule, work.scalars))
        for name, g in (("host", host), ("device", dev)):
            bad = diff_report(ref, g)
            assert not bad, f"{name} scalars, step {step}: " + "; ".join(bad)


def test_sgd_first_step_word(ops):
    """SGD's ``first_step`` word restarts the momentum buffer from the gradient at any step, as
    a host launch with ``first_step=True`` (and core's torch backend) does."""
    import dataclasses

    rule, hyper = VARIANTS["sgd-mom-damp-l2"]
    spec = StateSpec(master="fp32", moments="bf16", stochastic_rounding=True)
    ref = make_group(rule, spec, torch.float32, [33, 65], "cpu", **hyper)
    mine = ref.clone()
    grads = [torch.empty_like(p) for p in mine.params]
    hyper_t = torch.zeros(len(ops.SGD_HYPER_FIELDS), dtype=torch.int32)
    prepared = None
    for step, first in ((1, None), (2, None), (3, True), (4, False)):
        new = make_grads(ref, step)
        work = group_step(ref, new, step)
        if first is not None:
            work = dataclasses.replace(work, first_step=first)
        TORCH.step(work)
        for g, n in zip(grads, new, strict=True):
            g.copy_(n)
        mine_work = group_step(mine, grads, step)
        prepared = prepared or ops.prepare_step(mine_work)
        words = ops.sgd_hyper_words(mine_work.scalars, mine_work.seed, step, first)
        assert words[ops.SGD_HYPER_FIELDS.index("first_step")] == int(
            step == 1 if first is None else first
        )
        hyper_t.copy_(torch.tensor(words, dtype=torch.int32))
        prepared.launch_hyper(hyper_t, maximize=False, has_l2=True, has_decay=False, nesterov=False)
        bad = diff_report(ref, mine)
        assert not bad, f"step {step}: " + "; ".join(bad)


def test_rule_hyper_words_layout(ops):
    from memopt_core.reference import lion_scalars, sgd_scalars

    lion = lion_scalars(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    words = ops.lion_hyper_words(lion, seed=7, step=2**31)
    assert len(words) == len(ops.LION_HYPER_FIELDS) == 10
    assert ops.hyper_words("lion", lion, 7, 2**31) == words
    floats = torch.tensor(words[:6], dtype=torch.int32).view(torch.float32).tolist()
    assert floats == [
        torch.tensor(float(getattr(lion, f)), dtype=torch.float32).item()
        for f in ops.LION_HYPER_FIELDS[:6]
    ]
    assert words[6:] == [7, -(2**31), 0x3F800000, 0]

    sgd = sgd_scalars(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-4)
    words = ops.sgd_hyper_words(sgd, seed=2**32 - 2, step=1)
    assert len(words) == len(ops.SGD_HYPER_FIELDS) == 10
    floats = torch.tensor(words[:5], dtype=torch.int32).view(torch.float32).tolist()
    assert floats == [
        torch.tensor(float(getattr(sgd, f)), dtype=torch.float32).item()
        for f in ops.SGD_HYPER_FIELDS[:5]
    ]
    # seed, step, first step (default: step == 1), inv_scale, skip
    assert words[5:] == [-2, 1, 1, 0x3F800000, 0]
    first = ops.SGD_HYPER_FIELDS.index("first_step")
    assert ops.sgd_hyper_words(sgd, 0, 2)[first] == 0
    assert ops.sgd_hyper_words(sgd, 0, 2, first_step=True)[first] == 1
    assert ops.hyper_words("sgd", sgd, 0, 5, first_step=True)[first] == 1
    assert ops.HYPER_FIELDS == {
        "adam": ops.ADAM_HYPER_FIELDS,
        "lion": ops.LION_HYPER_FIELDS,
        "sgd": ops.SGD_HYPER_FIELDS,
    }
    with pytest.raises(ConfigError, match="not 'adamw'"):
        ops.hyper_words("adamw", sgd, 0, 1)


def test_hyper_words_refuse_bad_arguments(ops):
    from memopt_core.reference import adam_scalars, lion_scalars

    adam = adam_scalars(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=1, decoupled=True
    )
    with pytest.raises(ConfigError, match=r"\(AdamScalars\) have no 'lr'"):
        ops.hyper_words("lion", adam, 0, 1)
    lion = lion_scalars(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    with pytest.raises(ConfigError, match=r"seed must be an int, got float 1\.5"):
        ops.hyper_words("lion", lion, 1.5, 1)


def _prepared(ops, device, variant, sizes=(33,)):
    rule, hyper = VARIANTS[variant]
    spec = StateSpec(master="fp32", moments="bf16", stochastic_rounding=True)
    g = make_group(rule, spec, torch.float32, list(sizes), device, **hyper)
    return ops.prepare_step(group_step(g, make_grads(g, 1), 1))


def test_launch_hyper_refuses_bad_input(ops, device):
    adam = _prepared(ops, device, "adamw")
    ok = {"maximize": False, "has_l2": False, "has_decay": True}
    with pytest.raises(ConfigError, match="int32 tensor of 12 words"):
        adam.launch_hyper(torch.zeros(12, dtype=torch.float32, device=device), **ok)
    with pytest.raises(ConfigError, match="int32 tensor of 12 words"):
        adam.launch_hyper(torch.zeros(10, dtype=torch.int32, device=device), **ok)
    with pytest.raises(ConfigError, match="not contiguous"):
        adam.launch_hyper(torch.zeros((12, 2), dtype=torch.int32, device=device)[:, 0], **ok)
    # a per-slot table needs one row per plan slot
    with pytest.raises(ConfigError, match=rf"or of \({adam.n_slots}, 12\) words"):
        adam.launch_hyper(
            torch.zeros((adam.n_slots + 1, 12), dtype=torch.int32, device=device), **ok
        )
    with pytest.raises(ConfigError, match="needs has_l2"):
        adam.launch_hyper(
            torch.zeros(12, dtype=torch.int32, device=device), maximize=False, has_decay=True
        )
    with pytest.raises(ConfigError, match="nesterov=True does not apply to the adam rule"):
        adam.launch_hyper(torch.zeros(12, dtype=torch.int32, device=device), nesterov=True, **ok)
    with pytest.raises(ConfigError, match="needs has_decay=True/False"):
        adam.launch_hyper(
            torch.zeros(12, dtype=torch.int32, device=device),
            maximize=False,
            has_l2=False,
            has_decay=None,
        )
    with pytest.raises(ConfigError, match="hyper must be an int32 tensor of 12 words, got list"):
        adam.launch_hyper([0] * 12, **ok)
    from memopt_core.reference import adam_scalars

    scalars = adam_scalars(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, step=1, decoupled=True
    )
    with pytest.raises(ConfigError, match=r"seed must be an int, got float 0\.5"):
        adam.launch(scalars, 1, 0.5, True)

    lion = _prepared(ops, device, "lion")
    words10 = torch.zeros(10, dtype=torch.int32, device=device)
    with pytest.raises(ConfigError, match="lion step must be a contiguous int32 tensor of 10"):
        lion.launch_hyper(torch.zeros(12, dtype=torch.int32, device=device), **ok)
    with pytest.raises(ConfigError, match="has_l2=True does not apply to the lion rule"):
        lion.launch_hyper(words10, maximize=False, has_l2=True, has_decay=True)
    with pytest.raises(ConfigError, match="nesterov=True does not apply to the lion rule"):
        lion.launch_hyper(words10, maximize=False, has_decay=True, nesterov=True)

    sgd = _prepared(ops, device, "sgd-nesterov")
    with pytest.raises(ConfigError, match="sgd step needs nesterov"):
        sgd.launch_hyper(words10, maximize=False, has_l2=False, has_decay=False)
    with pytest.raises(ConfigError, match="sgd step needs has_l2"):
        sgd.launch_hyper(words10, maximize=False, has_decay=False, nesterov=True)
    with pytest.raises(ConfigError, match="sgd step must be a contiguous int32 tensor of 10"):
        sgd.launch_hyper(
            torch.zeros(7, dtype=torch.int32, device=device),
            maximize=False,
            has_l2=False,
            has_decay=False,
            nesterov=True,
        )
    if device.type == "cpu":
        return
    with pytest.raises(ConfigError, match="hyper is on cpu"):
        sgd.launch_hyper(
            torch.zeros(10, dtype=torch.int32),
            maximize=False,
            has_l2=False,
            has_decay=False,
            nesterov=True,
        )


def test_table_cache_keeps_one_step_per_tensor(ops, device):
    """Gradient release steps one tensor at a time: with gradients at the same addresses, the
    second round reuses every table (no rebuild, no upload), and the cache stays bounded."""
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    n = 12
    group = make_group(rule, spec, torch.bfloat16, [33] * n, device, **hyper)
    grads = make_grads(group, 1)
    lru = None
    for round_ in range(2):
        seen = []
        for si in range(n):
            ops.prepare_step(group_step(group, grads, 1 + round_, slots=[si]))
            lru = ops._slot_tables(group.plan)
            seen.append(next(reversed(lru.entries.values()))[0])
        if round_ == 0:
            first = seen
    assert [a is b for a, b in zip(first, seen, strict=True)] == [True] * n
    entries, rows = ops._table_cache_limits(n)
    for k in range(3 * n):  # many distinct subsets: the cache evicts, within its bounds
        pair = sorted({k % n, (k + 1 + k // n) % n})
        ops.prepare_step(group_step(group, grads, 1, slots=pair))
    assert len(lru.entries) <= entries
    assert sum(t.rows for t, _ in lru.entries.values()) == lru.rows
    assert lru.rows <= rows
    # the subsets' chunk tables are bounded too (kept for good, one per new subset stayed)
    (chunks,) = [v for k, v in group.plan._aux.items() if k[0] == "triton_chunk_tables"]
    assert len(chunks.entries) <= entries
    assert sum(int(t.shape[0]) for t, _ in chunks.entries.values()) == chunks.rows


def test_default_geometry(monkeypatch):
    """On a GPU every group gets 16 rows x 4 warps by default, AdamW with blocked moments over an
    fp32 or ECC-24 master with a register cap; a configuration set by the caller wins for all
    until reset."""
    from memopt_kernels_triton import ops as triton_ops

    monkeypatch.setattr(triton_ops, "interpreting", lambda: False)
    triton_ops.reset_kernel_config()
    try:
        ecc24 = triton_ops.master_id("ecc24", torch.bfloat16)
        ecc32 = triton_ops.master_id("ecc32", torch.bfloat16)
        blocked = triton_ops.kernel_config(blocked=True)
        plain = triton_ops.kernel_config()
        for cfg in (blocked, plain):
            assert (cfg.rows, cfg.num_warps) == (16, 4)
        assert (blocked.maxnreg, plain.maxnreg) == (64, None)
        assert triton_ops.kernel_config(blocked=True, master=ecc24).maxnreg == 80
        assert triton_ops.kernel_config(blocked=False, master=ecc24) is plain
        assert triton_ops.kernel_config(blocked=True, master=ecc32) is plain
        for master in (0, ecc24):
            assert triton_ops.kernel_config(blocked=True, rule="lion", master=master) is plain
        mine = triton_ops.KernelConfig(rows=32, num_warps=2)
        assert triton_ops.kernel_config(mine) is mine
        assert triton_ops.kernel_config(blocked=True) is mine
        triton_ops.reset_kernel_config()
        assert triton_ops.kernel_config(blocked=True) is blocked
        assert "reset_kernel_config" in triton_ops.__all__
    finally:
        triton_ops.reset_kernel_config()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("programs", -1),
        ("programs", 0),
        ("programs", 2.5),
        ("waves", 0),
        ("waves", -1),
        ("rows", 2.0),
        ("rows", True),
        ("rows", "4"),
        ("rows", 3),
        ("num_warps", 3),
        ("num_warps", 0),
        ("num_stages", 0),
        ("maxnreg", 64.5),
        ("chunk_size", 48),
        ("chunk_size", 32.0),
        ("max_chunk", 100),
    ],
)
def test_kernel_config_refuses_bad_fields(field, value):
    """Checked at construction: a negative grid would launch nothing, silently."""
    from memopt_kernels_triton import ops as triton_ops

    with pytest.raises(ConfigError, match=f"KernelConfig's {field} must be"):
        triton_ops.KernelConfig(**{field: value})


def test_kernel_config_refuses_bad_register_caps():
    from memopt_kernels_triton import ops as triton_ops

    for cap in (0, 23, 256, 1000):
        with pytest.raises(ConfigError, match="maxnreg"):
            triton_ops.KernelConfig(maxnreg=cap)
    assert triton_ops.KernelConfig(maxnreg=24).maxnreg == 24


@pytest.mark.parametrize(
    ("rule", "preset", "master", "dtype", "ahead"),
    [
        ("adamw", "bf16", "fp32", torch.float32, True),
        ("adamw", "fp32", "fp32", torch.float32, True),
        ("lion", "bf16", "fp32", torch.float32, True),
        ("adamw", "bf16", "ecc24", torch.bfloat16, True),
        ("adamw", "bf16", "ecc32", torch.bfloat16, False),
        ("adamw", "q8", "fp32", torch.float32, False),
        ("adamw", "q8", "ecc24", torch.bfloat16, True),
        ("adamw", "q8", "ecc32", torch.bfloat16, False),
        ("lion", "q8", "ecc24", torch.bfloat16, True),
        ("lion", "q8", "fp32", torch.float32, False),
    ],
)
def test_loads_ahead_where_it_measured_faster(ops, rule, preset, master, dtype, ahead):
    """The launcher's AHEAD choice (ops._loads_ahead)."""
    kind, hyper = VARIANTS[rule]
    spec = StateSpec(master=master, moments=preset, stochastic_rounding=True)
    group = make_group(kind, spec, dtype, [65], "cpu", **hyper)
    prepared = ops.prepare_step(group_step(group, make_grads(group, 1), 1))
    assert prepared._kw["AHEAD"] is ahead


@pytest.mark.parametrize(("preset", "master", "dtype"), CASES)
def test_with_grads_follows_moved_gradients(ops, device, preset, master, dtype):
    """A prepared step moved to gradients at new addresses (``with_grads``: what core's cached
    step does after ``zero_grad(set_to_none=True)``) gives the bits of a fresh step, and reads
    the new gradients, never the old ones (poisoned with NaN once replaced)."""
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master=master, moments=preset, stochastic_rounding=True)
    ref = make_group(rule, spec, dtype, _sizes(device), device, seed=11, **hyper)
    mine = ref.clone()
    prepared = old = None
    for step in range(1, 5):
        new = make_grads(ref, step)
        TORCH.step(group_step(ref, new, step))
        grads = [n.clone() for n in new]  # new tensors every step
        work = group_step(mine, grads, step)
        if prepared is None:
            prepared = ops.prepare_step(work)
        else:
            for g in old:
                g.fill_(float("nan"))
            prepared = prepared.with_grads(grads)
            assert prepared is not None
            assert prepared.reusable
        prepared.launch(work.scalars, step, work.seed, step == 1)
        old = grads
        bad = diff_report(ref, mine)
        assert not bad, f"step {step}: " + "; ".join(bad)


def test_with_grads_refuses_other_gradients(ops, device):
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    group = make_group(rule, spec, torch.bfloat16, [33, 65], device, seed=5, **hyper)
    grads = make_grads(group, 1)
    prepared = ops.prepare_step(group_step(group, grads, 1))
    with pytest.raises(ConfigError, match="2 gradients of the prepared dtypes"):
        prepared.with_grads(grads[:1])
    with pytest.raises(ConfigError, match="prepared dtypes"):
        prepared.with_grads([g.float() for g in grads])  # float32 where bf16 was prepared
    with pytest.raises(ConfigError, match="prepared dtypes and sizes"):
        prepared.with_grads([g.reshape(-1)[:3].clone() for g in grads])
    with pytest.raises(ConfigError, match=r"sizes \(tensors on"):
        prepared.with_grads([g.tolist() for g in grads])
    with pytest.raises(ConfigError, match=rf"sizes \(tensors on {device}"):  # a raw address of
        prepared.with_grads([torch.empty_like(g, device="meta") for g in grads])  # another device
    strided = [torch.stack([g, g], dim=-1)[..., 0] for g in grads]
    assert not strided[0].is_contiguous()
    assert prepared.with_grads(strided) is None  # prepare again: contiguous copies


@pytest.mark.parametrize("rule", ["adamw", "lion", "sgd-mom-damp-l2"])
@pytest.mark.parametrize(
    ("preset", "master", "dtype"),
    [("q8", "ecc24", torch.bfloat16), ("bf16", "fp32", torch.float32)],
    ids=["ecc24-q8", "fp32-bf16"],
)
def test_unaligned_tensors_take_the_unaligned_kernel(ops, device, rule, preset, master, dtype):
    """Parameters and gradients one element into their buffers (contiguous, off the 16-byte
    alignment the vectorized kernel assumes) get the kernel without the assumption, and its bits;
    a prepared aligned step refuses such gradients (``with_grads`` gives None: prepare again)."""
    variant, hyper = VARIANTS[rule]
    spec = StateSpec(master=master, moments=preset, stochastic_rounding=True)
    ref = make_group(variant, spec, dtype, _sizes(device), device, seed=3, **hyper)
    mine = ref.clone(offset=1)
    assert all(p.data_ptr() % 16 for p in mine.params if p.numel())
    for step in range(1, 4):
        grads = make_grads(ref, step)
        TORCH.step(group_step(ref, grads, step))
        work = group_step(mine, at_offset(grads, 1), step)
        prepared = ops.prepare_step(work)
        assert prepared._kw["ALIGNED"] is False
        prepared.launch(work.scalars, step, work.seed, step == 1)
        bad = diff_report(ref, mine)
        assert not bad, f"step {step}: " + "; ".join(bad)
    aligned = ref.clone()
    grads = make_grads(aligned, 4)
    prepared = ops.prepare_step(group_step(aligned, grads, 4))
    assert prepared._kw["ALIGNED"] is True
    assert prepared.with_grads(at_offset(grads, 1)) is None
    assert prepared.with_grads(at_offset(grads, 8)) is not None  # 16 or 32 bytes: still aligned


@pytest.mark.parametrize(
    ("preset", "sizes", "want"),
    [
        ("bf16", [64, 8, 1000, 24], True),  # every tensor starts at a multiple of 8
        ("bf16", [8, 33, 64], False),  # the third starts at 41
        ("fp32", [7], True),  # one tensor, at 0
        ("q8", [8, 33, 64], True),  # blocked arenas pad every tensor to 32
    ],
)
def test_arena_alignment_is_checked(ops, device, preset, sizes, want):
    """The launcher marks an unblocked arena aligned (``ARENA_ALIGNED``: vector accesses of its
    states) only when every tensor starts at a multiple of 8 elements, and the step's bits do not
    depend on it."""
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master="fp32", moments=preset, stochastic_rounding=True)
    ref = make_group(rule, spec, torch.float32, sizes, device, seed=9, **hyper)
    mine = ref.clone()
    for step in (1, 2):
        grads = make_grads(ref, step)
        TORCH.step(group_step(ref, grads, step))
        work = group_step(mine, grads, step)
        prepared = ops.prepare_step(work)
        assert prepared._kw["ARENA_ALIGNED"] is want
        prepared.launch(work.scalars, step, work.seed, step == 1)
        bad = diff_report(ref, mine)
        assert not bad, f"step {step}: " + "; ".join(bad)


def test_strided_gradient_step_is_not_reusable(ops, device):
    """A strided gradient runs through a contiguous copy that lives only as long as the prepared
    step: the step is not reusable, gives no ``with_grads`` shortcut and caches no table (which
    would hold the copy's address), and each fresh step reads the gradient's current values."""
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    ref = make_group(rule, spec, torch.bfloat16, [64], device, seed=3, **hyper)
    mine = ref.clone()
    gbuf = torch.zeros(128, dtype=torch.bfloat16, device=device)
    strided = gbuf[::2]  # the same storage every step
    for step in (1, 2, 3):
        strided.copy_(make_grads(ref, step)[0])
        work = group_step(mine, [strided], step)
        prepared = ops.prepare_step(work)
        assert not prepared.reusable
        assert prepared.with_grads([strided.clone()]) is None
        assert not ops._slot_tables(mine.plan).entries
        prepared.launch(work.scalars, step, work.seed, step == 1)
        TORCH.step(group_step(ref, [strided.clone()], step))
        bad = diff_report(ref, mine)
        assert not bad, f"step {step}: " + "; ".join(bad)


@pytest.mark.parametrize("entry", ["fused_step", "prepared", "codecs"])
@pytest.mark.gpu(min_devices=2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensors_on_another_gpu_than_the_current_one(ops, entry):
    """Triton launches on the current device and stream: tensors on cuda:1 while cuda:0 is
    current (a model moved with ``.to("cuda:1")``) must still be updated on cuda:1, with the
    reference's bits, and the current device must stay what it was."""
    from memopt_core.formats import moment_codec
    from memopt_core.testing import bits

    dev = torch.device("cuda", 1)
    before = torch.cuda.current_device()
    torch.cuda.set_device(0)
    try:
        if entry == "codecs":
            x = torch.randn(4096 + 32, device=dev).abs()
            got = ops.encode_moment("q8_sqrt", x)
            want = moment_codec("q8_sqrt").encode(x.cpu())
            for k in want:
                assert got[k].device == dev
                assert torch.equal(bits(got[k]).cpu(), bits(want[k])), k
            assert torch.equal(
                bits(ops.decode_moment("q8_sqrt", got)).cpu(),
                bits(moment_codec("q8_sqrt").decode(want)),
            )
            assert torch.cuda.current_device() == 0
            return
        rule, hyper = VARIANTS["adamw"]
        spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
        ref = make_group(rule, spec, torch.bfloat16, [33, 4095, 65537], dev, **hyper)
        mine = ref.clone()
        kept = [torch.empty_like(p) for p in mine.params]
        prepared = None
        for step in range(1, 4):
            grads = make_grads(ref, step)
            TORCH.step(group_step(ref, grads, step))
            for k, g in zip(kept, grads, strict=True):
                k.copy_(g)
            work = group_step(mine, kept, step)
            if entry == "fused_step":
                ops.fused_step(work)
            else:
                prepared = prepared or ops.prepare_step(work)
                prepared.launch(work.scalars, step, work.seed, step == 1)
            assert torch.cuda.current_device() == 0
            bad = diff_report(ref, mine)
            assert not bad, f"step {step}: " + "; ".join(bad)
    finally:
        torch.cuda.set_device(before)


def test_a_captured_step_of_a_strided_gradient_is_refused_naming_it(ops, device, monkeypatch):
    """Its table is made at every step, so a capture can never hold it: the refusal names the
    tensor and its strides, where "take one eager step first" could not be followed."""
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    group = make_group(rule, spec, torch.bfloat16, [64], device, seed=3, **hyper)
    strided = torch.zeros(128, dtype=torch.bfloat16, device=device)[::2]
    strided.copy_(make_grads(group, 1)[0])
    ops.prepare_step(group_step(group, [strided], 1))  # an eager step: accepted
    monkeypatch.setattr(ops, "_capturing", lambda: True)
    with pytest.raises(ConfigError, match=r"gradient of tensor 0 .* strides \(2,\)\) is not"):
        ops.prepare_step(group_step(group, [strided], 2))


def _adamw_update(ops, device, keep_grads: bool) -> tuple[torch.Tensor, bool]:
    """One prepared AdamW step whose caller drops its work and, unless ``keep_grads``, its
    gradients before launching, with new tensors of the gradients' size allocated in between
    (the allocator hands them the freed memory): the update, and whether the gradient object
    was still alive at the launch."""
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master="fp32", moments="fp32", stochastic_rounding=True)
    g = make_group(rule, spec, torch.float32, [33], device, seed=7, **hyper)
    before = g.params[0].detach().clone()
    grads = make_grads(g, 1)
    work = group_step(g, grads, 1)
    prepared = ops.prepare_step(work)
    scalars, seed = work.scalars, work.seed
    alive = weakref.ref(grads[0])
    kept = grads if keep_grads else None
    del work, grads
    gc.collect()
    junk = [torch.full((33,), 1e30, device=device) for _ in range(16)]
    held = alive() is not None
    prepared.launch(scalars, 1, seed, True)
    del junk, kept
    return g.params[0].detach() - before, held


def test_prepared_step_holds_the_tensors_it_points_at(ops, device):
    """``prepare_step`` keeps the gradients' addresses in its tables: it holds the gradients
    too, so a caller that drops them (``prepare_step(group_step(g, make_grads(g, 1), 1))``)
    still gets the update of kept gradients, not one read from freed memory (which other
    tensors reused: different numbers from run to run)."""
    kept, _ = _adamw_update(ops, device, keep_grads=True)
    dropped, held = _adamw_update(ops, device, keep_grads=False)
    assert torch.equal(dropped, kept), (dropped - kept).abs().max()
    assert kept.abs().max() > 0
    assert held


def test_prepared_step_holds_references_only(ops, device):
    """What a prepared step holds is the tensors themselves (no copies), ``with_grads`` lets the
    old gradients go and holds the new ones, and ``hold=False`` (the backend's ``prepare``:
    core's cached step checks addresses itself) holds nothing, so freed gradients are freed."""
    from memopt_kernels_triton.backend import BACKEND

    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master="fp32", moments="bf16", stochastic_rounding=True)
    group = make_group(rule, spec, torch.float32, [33, 65], device, **hyper)
    grads = make_grads(group, 1)
    prepared = ops.prepare_step(group_step(group, grads, 1))
    assert all(h is t for h, t in zip(prepared._held, [*group.params, *grads], strict=True))
    old = [weakref.ref(x) for x in grads]
    moved = [x.clone() for x in grads]
    follow = prepared.with_grads(moved)
    assert follow is not None
    assert all(h is t for h, t in zip(follow._held, [*group.params, *moved], strict=True))
    del prepared, grads
    gc.collect()
    assert [r() for r in old] == [None, None]
    unheld = BACKEND.prepare(group_step(group, moved, 1))
    assert unheld._held == ()
    assert unheld.with_grads([x.clone() for x in moved])._held == ()
    with pytest.raises(ConfigError, match="hold must be True or False, got 1"):
        ops.prepare_step(group_step(group, moved, 1), hold=1)


_NOT_BOOLS = ["False", [False], 0, 1.0, np.bool_(False)]


@pytest.mark.parametrize("value", _NOT_BOOLS, ids=repr)
@pytest.mark.parametrize("flag", ["maximize", "has_decay", "has_l2", "unscale"])
def test_launch_hyper_takes_only_bool_flags(ops, device, flag, value):
    """A flag that is not a bool is refused naming it: ``maximize="False"`` was truthy and
    compiled the maximizing variant (an update of the opposite sign), ``unscale=[False]`` one
    that multiplies by the ``inv_scale`` word. Nothing is launched."""
    adam = _prepared(ops, device, "adamw")
    flags = {"maximize": False, "has_l2": False, "has_decay": True, flag: value}
    words = torch.zeros(12, dtype=torch.int32, device=device)
    with pytest.raises(ConfigError, match=rf"^{flag} must be True or False, got "):
        adam.launch_hyper(words, **flags)


@pytest.mark.parametrize("value", _NOT_BOOLS, ids=repr)
def test_flags_a_rule_lacks_take_only_bool_or_none(ops, device, value):
    """A flag the rule has no term for is left out (None) or False, not a falsy or truthy
    stand-in, and SGD's ``nesterov`` is a bool like the others."""
    words10 = torch.zeros(10, dtype=torch.int32, device=device)
    lion = _prepared(ops, device, "lion")
    with pytest.raises(ConfigError, match=r"^has_l2 must be True or False"):
        lion.launch_hyper(words10, maximize=False, has_decay=True, has_l2=value)
    sgd = _prepared(ops, device, "sgd-nesterov")
    with pytest.raises(ConfigError, match=r"^nesterov must be True or False"):
        sgd.launch_hyper(words10, maximize=False, has_l2=False, has_decay=False, nesterov=value)


@pytest.mark.parametrize("value", _NOT_BOOLS, ids=repr)
def test_sgd_first_step_word_takes_only_bool_or_none(ops, value):
    """``first_step`` writes SGD's first-step word: "False" was truthy (the momentum buffer
    restarted from the gradient at every step). None means ``step == 1``."""
    from memopt_core.reference import sgd_scalars

    s = sgd_scalars(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False)
    first = ops.SGD_HYPER_FIELDS.index("first_step")
    assert ops.sgd_hyper_words(s, 0, 1)[first] == 1
    assert ops.hyper_words("sgd", s, 0, 1, first_step=None)[first] == 1
    assert ops.hyper_words("sgd", s, 0, 1, first_step=False)[first] == 0
    assert ops.sgd_hyper_words(s, 0, 2, True)[first] == 1
    with pytest.raises(ConfigError, match=r"^first_step must be True or False, got "):
        ops.sgd_hyper_words(s, 0, 2, value)
    with pytest.raises(ConfigError, match=r"^first_step must be True or False, got "):
        ops.hyper_words("sgd", s, 0, 2, first_step=value)


def test_with_grads_refuses_negated_gradients(ops, device):
    """A gradient with torch's negative bit shares its tensor's address, dtype and size:
    ``with_grads`` read its raw memory (the opposite values) where ``prepare_step`` refuses
    it; now it refuses it too, naming it."""
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master="fp32", moments="fp32", stochastic_rounding=True)
    group = make_group(rule, spec, torch.float32, [33, 65], device, **hyper)
    grads = make_grads(group, 1)
    prepared = ops.prepare_step(group_step(group, grads, 1))
    moved = [grads[0].clone(), torch._neg_view(grads[1].clone())]
    with pytest.raises(ConfigError, match=r"^gradient 1 of the prepared step is a negated view"):
        prepared.with_grads(moved)
