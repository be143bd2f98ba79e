"""``GroupStep.index_bases`` (KERNEL_API 2): each tensor's stochastic-rounding element indices
start at its index base (a shard's offset in its whole tensor), in the fused step, the prepared
launches (host and device scalars) and every rule; bad bases are refused with the tensor named.

Core's ``test_index_bases`` shows the torch backend's shards with bases give the whole tensor's
bits; here the Triton backend must give the torch backend's bits with the same bases. CPU runs use
Triton's interpreter (``ops`` fixture: skipped without triton/numpy) on a trimmed matrix; the full
matrix on large tensors is ``test_gpu_large.test_index_bases_full_matrix``.
"""

from __future__ import annotations

import os

import pytest
import torch

from memopt_core.errors import ConfigError
from memopt_core.formats import StateSpec, moment_codec
from memopt_core.plan import StateArena
from memopt_core.testing import (
    MASTER_IDS,
    MASTERS,
    VARIANTS,
    diff_report,
    group_step,
    make_grads,
    make_group,
    step_group,
)
from memopt_core.torch_backend import TorchBackend
from memopt_kernels_triton.backend import BACKEND

TORCH = TorchBackend()
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0").strip() in ("", "0"),
    reason="CPU tensors run under TRITON_INTERPRET=1 only (the GPU runs test_gpu_large.py)",
)

# 300 spans two chunks of the interpreter's 256 (a chunk start past 0); 100 elements from
# 2**32 - 40 carry into the index's high word
SIZES = [1, 33, 300, 100]
BASES = [5, 2**31 + 7, 2**33 + 1, 2**32 - 40]
SEED = 2**32 - 5


def _compare(variant, preset, master, dtype, *, sizes=SIZES, bases=BASES, steps=3, slots=None):
    rule, hyper = VARIANTS[variant]
    spec = StateSpec(master=master, moments=preset, stochastic_rounding=True)
    a = make_group(rule, spec, dtype, sizes, "cpu", seed=SEED, index_bases=list(bases), **hyper)
    b = a.clone()
    for step in range(1, steps + 1):
        grads = make_grads(a, step)
        step_group(TORCH, a, grads, step, slots)
        step_group(BACKEND, b, grads, step, slots)
        bad = diff_report(a, b)
        assert not bad, f"step {step}: " + "; ".join(bad)


# Every rule variant with an ECC-24 master and q8 / bf16 moments; every master with AdamW.
CASES = [
    pytest.param(v, p, "ecc24", torch.bfloat16, id=f"{v}-{p}-ecc24-bfloat16")
    for v in VARIANTS
    for p in ("q8", "bf16")
] + [
    pytest.param("adamw", "fp8", m, d, id=f"adamw-fp8-{mid}")
    for (m, d), mid in zip(MASTERS, MASTER_IDS, strict=True)
    if m != "ecc24"  # above
]


@pytest.mark.parametrize(("variant", "preset", "master", "dtype"), CASES)
def test_bases_match_torch_backend(ops, variant, preset, master, dtype):
    _compare(variant, preset, master, dtype)


def test_bases_partial_step(ops):
    """A step over some tensors (gradient release) takes those tensors' bases."""
    _compare("adamw", "q8", "ecc24", torch.bfloat16, slots=[1, 3], steps=2)


# Tensors across 2**32 and 2**33 (their elements' words fold the index's high word in with the
# step's K3: a carry into it must show) and one past 2**40, in chunks of the interpreter's 256
CROSS_SIZES = [300, 45, 1025]
CROSS_BASES = [2**32 - 100, 2**33 - 5, 2**40 + 3]


@pytest.mark.parametrize(
    ("preset", "master", "dtype"),
    [
        ("bf16", "fp32", torch.float32),
        ("q8", "ecc24", torch.bfloat16),
        ("fp8", "none", torch.bfloat16),
    ],
    ids=["bf16-fp32", "q8-ecc24", "fp8-none"],
)
def test_adam_across_2_pow_32(ops, preset, master, dtype):
    """A fused AdamW step with stochastic rounding on tensors whose indices cross 2**32 (and
    2**33, and past 2**40): the torch backend's (core's reference) bits."""
    _compare("adamw", preset, master, dtype, sizes=CROSS_SIZES, bases=CROSS_BASES, steps=2)


def _with_moments(group, first: str, second: str):
    """``group`` with its Adam moments in formats ``first`` and ``second``."""
    codecs = {"exp_avg": moment_codec(first), "exp_avg_sq": moment_codec(second)}
    group.arena = StateArena(group.plan, codecs, group.arena.master)
    return group


@pytest.mark.parametrize(
    ("master", "dtype", "first", "second"),
    [
        ("fp32", torch.float32, "fp32", "bf16"),  # the second moment's stream only
        ("fp32", torch.float32, "fp8_e4m3", "fp32"),  # the first moment's only
        ("none", torch.bfloat16, "fp32", "fp32"),  # the master's only
        ("none", torch.float16, "fp32", "fp8_e5m2"),  # master and second moment
        ("ecc32", torch.bfloat16, "bf16", "fp32"),  # first moment only (ECC-32 rounds to nearest)
    ],
    ids=["v", "m", "master", "master-v", "ecc32-m"],
)
def test_only_rounded_streams_are_drawn(ops, master, dtype, first, second):
    """A kernel computes the words of the streams its formats round only: each state still
    takes its own stream's words (the torch backend draws all three), whichever are left out."""
    rule, hyper = VARIANTS["adamw"]
    blocked = "fp8" in first + second  # the plan pads to the blocked format's 32
    spec = StateSpec(master=master, moments="fp8" if blocked else "fp32", stochastic_rounding=True)
    a = make_group(
        rule, spec, dtype, CROSS_SIZES, "cpu", seed=SEED, index_bases=CROSS_BASES, **hyper
    )
    a = _with_moments(a, first, second)
    b = a.clone()
    for step in range(1, 3):
        grads = make_grads(a, step)
        step_group(TORCH, a, grads, step)
        step_group(BACKEND, b, grads, step)
        bad = diff_report(a, b)
        assert not bad, f"step {step}: " + "; ".join(bad)


def test_largest_accepted_base(ops):
    """``base + padded length`` just below 2**62 is accepted and draws the torch backend's words
    (a q8 tensor of 33 elements pads to 64)."""
    _compare("lion", "q8", "ecc24", torch.bfloat16, sizes=[33], bases=[2**62 - 65], steps=1)


def test_bases_change_the_bits(ops):
    """The control: the Triton backend without the bases differs from the torch backend with
    them (so the tests above can fail), and stepping one group with and without bases uses two
    slot tables (the bases are part of the table cache's key)."""
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master="ecc24", moments="bf16", stochastic_rounding=True)
    a = make_group(rule, spec, torch.bfloat16, SIZES, "cpu", seed=SEED, index_bases=BASES, **hyper)
    b = a.clone()
    grads = make_grads(a, 1)
    step_group(TORCH, a, grads, 1)
    b.index_bases = None
    step_group(BACKEND, b, grads, 1)  # caches the table without bases
    bad = diff_report(a, b)
    assert any(k.startswith("param") for k in bad), bad
    assert any("exp_avg" in k for k in bad), bad

    plain = ops.prepare_step(group_step(b, grads, 2))
    b.index_bases = list(BASES)
    based = ops.prepare_step(group_step(b, grads, 2))
    again = ops.prepare_step(group_step(b, grads, 2))
    plain_tab, based_tab = plain._head[2].view(-1, 5), based._head[2].view(-1, 5)
    assert plain_tab[:, 4].tolist() == [0] * len(SIZES)
    assert based_tab[:, 4].tolist() == BASES
    assert torch.equal(plain_tab[:, :4], based_tab[:, :4])
    assert again._head[2] is based._head[2]  # cached under its bases


@pytest.mark.parametrize(
    ("variant", "hyper_on_device"),
    [
        ("adamw", False),
        ("adamw", True),
        ("lion", False),
        ("lion", True),
        ("sgd-mom-damp-l2", False),
        ("sgd-mom-damp-l2", True),
    ],
    ids=[
        "adamw-host-scalars",
        "adamw-device-scalars",
        "lion-host-scalars",
        "lion-device-scalars",
        "sgd-momentum-host-scalars",
        "sgd-momentum-device-scalars",
    ],
)
def test_prepared_launch_honours_bases(ops, variant, hyper_on_device):
    """One ``prepare_step`` reused over steps (``launch``, or ``launch_hyper``: the CUDA-graph
    path) with bases gives the torch backend's bits."""
    rule, hyper = VARIANTS[variant]
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    ref = make_group(
        rule, spec, torch.bfloat16, SIZES, "cpu", seed=SEED, index_bases=BASES, **hyper
    )
    mine = ref.clone()
    grads = [torch.empty_like(p) for p in mine.params]  # stable buffers, refilled every step
    hyper_t = torch.zeros(len(ops.HYPER_FIELDS[ref.kind]), dtype=torch.int32)
    prepared = None
    for step in range(1, 4):
        new = make_grads(ref, step)
        TORCH.step(group_step(ref, new, step))
        for g, n in zip(grads, new, strict=True):
            g.copy_(n)
        work = group_step(mine, grads, step)
        if prepared is None:
            prepared = ops.prepare_step(work)
            assert prepared.reusable
        if hyper_on_device:
            s = work.scalars
            hyper_t.copy_(torch.tensor(ops.hyper_words(work.rule, s, work.seed, step)))
            flags = {"maximize": bool(s.maximize), "has_decay": True}
            if work.rule != "lion":
                flags["has_l2"] = s.l2 != 0.0
            if work.rule == "sgd":
                flags["nesterov"] = bool(s.nesterov)
            prepared.launch_hyper(hyper_t, **flags)
        else:
            prepared.launch(work.scalars, step, work.seed, step == 1)
        bad = diff_report(ref, mine)
        assert not bad, f"step {step}: " + "; ".join(bad)


def _group(sizes=(33, 7)):
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    return make_group(rule, spec, torch.bfloat16, list(sizes), "cpu", **hyper)


def _work_with_bases(bases, group=None):
    group = group or _group()
    work = group_step(group, make_grads(group, 1), 1)
    work.index_bases = bases
    return work


@pytest.mark.parametrize(
    ("bases", "message"),
    [
        ([0, -1], r"index_bases\[1\] \(for the parameter of shape \(7,\) in plan slot 1\) must be "
         r">= 0 \(a shard's offset in its whole tensor\), got -1"),
        ([True, 0], r"index_bases\[0\] \(for the parameter of shape \(33,\) in plan slot 0\) "
         r"must be an int, got bool True"),
        ([5.0, 0], r"index_bases\[0\] .* must be an int, got float 5\.0"),
        ([0, 2**62 - 32], r"index_bases\[1\] \(for the parameter of shape \(7,\) in plan slot 1\) "
         r"is 4611686018427387872: base \+ padded length 32 reaches 2\*\*62"),
        ([0, 2**64], r"index_bases\[1\] .* is 18446744073709551616: .* reaches 2\*\*62"),
        ([0], r"index_bases holds 1 entries for a step over 2 tensors"),
    ],
    ids=["negative", "bool", "float", "too-large", "past-int64", "wrong-length"],
)  # fmt: skip
def test_bad_bases_are_refused(ops, bases, message):
    with pytest.raises(ConfigError, match=message):
        BACKEND.step(_work_with_bases(bases))


def test_bad_bases_refused_after_equal_ones_are_cached(ops):
    """True == 1 and 5.0 == 5 as cache keys: a cached table for bases (1, 5) must not let
    (True, 5) or (1, 5.0) through."""
    group = _group()
    work = _work_with_bases([1, 5], group)
    first = ops.prepare_step(work)
    assert ops.prepare_step(work)._head[2] is first._head[2]  # the cache answers
    work.index_bases = [True, 5]
    with pytest.raises(ConfigError, match="must be an int, got bool True"):
        ops.prepare_step(work)
    work.index_bases = [1, 5.0]
    with pytest.raises(ConfigError, match=r"must be an int, got float 5\.0"):
        ops.prepare_step(work)
