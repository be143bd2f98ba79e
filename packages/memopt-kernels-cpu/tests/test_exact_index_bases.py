"""``GroupStep.index_bases`` (sharded parameters): the C++ step draws the stochastic-rounding
words of index ``index_base + i`` for element ``i``, bit-identical with core's torch backend.

The bases cover an index whose low word wraps inside a tensor (``2**32 - 13``: the generator
cuts a tile there and restarts its hash inputs from the new high word), high words above 1 and
bases that are not block-aligned. Chunks of 1056 elements (not a multiple of the 1024-element
tile) make tiles start at odd offsets. Each case checks every instruction set this CPU supports
with 1 and 3 threads against one reference run (the reference dominates the run time: every
rule x master x moment preset on a 5000-element largest tensor, a few on 70000 elements).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from memopt_core.errors import ConfigError
from memopt_core.formats import StateSpec
from memopt_core.testing import (
    MASTER_IDS,
    MASTERS,
    PRESETS,
    VARIANTS,
    bits,
    diff_report,
    make_grads,
    make_group,
    step_group,
)
from memopt_core.torch_backend import TorchBackend
from memopt_kernels_cpu import BACKEND, set_chunk_size, set_isa, set_num_threads, supported_isas

TORCH = TorchBackend()
ISAS = supported_isas()
THREADS = (1, 3)
SIZES = [0, 1, 33, 1000, 5000]
BASES = [5, 2**31 + 7, 2**32 - 13, 2**33 + 1, 2**32 - 3011]
LARGE_SIZES = [0, 1, 33, 1000, 70000]
LARGE_BASES = [5, 2**31 + 7, 96, 2**33 + 1, 2**32 - 30011]


def compare(variant, preset, master, dtype, *, sizes=SIZES, bases=BASES, steps=3, slots=None):
    """Step a reference copy (torch backend) and one copy per (instruction set, thread count)
    (C++) with stochastic rounding; assert identical bits after every step."""
    rule, hyper = VARIANTS[variant]
    spec = StateSpec(master=master, moments=preset, stochastic_rounding=True)
    ref = make_group(rule, spec, dtype, sizes, "cpu", seed=11, index_bases=bases, **hyper)
    copies = {run: ref.clone() for run in itertools.product(ISAS, THREADS)}
    set_chunk_size(1056)
    for step in range(1, steps + 1):
        grads = make_grads(ref, step)
        step_group(TORCH, ref, grads, step, slots)
        for (isa, threads), group in copies.items():
            set_isa(isa)
            set_num_threads(threads)
            step_group(BACKEND, group, grads, step, slots)
        for run, group in copies.items():
            bad = diff_report(ref, group)
            assert not bad, f"{run} step {step}: {variant} {preset} {master} {dtype}: {bad}"
    return ref


@pytest.mark.parametrize(("master", "dtype"), MASTERS, ids=MASTER_IDS)
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_index_bases_match_the_torch_backend(variant, preset, master, dtype):
    compare(variant, preset, master, dtype)


@pytest.mark.parametrize(
    ("variant", "preset", "master", "dtype"),
    [
        ("adamw", "q8", "ecc24", torch.bfloat16),
        ("adamw", "bf16", "fp32", torch.float32),  # the one-loop fp32-master, bf16-moment path
        ("lion", "fp8", "none", torch.bfloat16),
        ("sgd-nesterov", "bf16", "ecc32", torch.bfloat16),
    ],
    ids=["adamw-q8-ecc24", "adamw-bf16-fp32", "lion-fp8-none", "sgd-nesterov-bf16-ecc32"],
)
def test_index_bases_of_a_large_tensor(variant, preset, master, dtype):
    # 70000 elements: many chunks on every thread, the low index word wrapping mid-tensor
    compare(variant, preset, master, dtype, sizes=LARGE_SIZES, bases=LARGE_BASES)


@pytest.mark.parametrize(
    ("variant", "preset", "master", "dtype"),
    [
        ("adamw", "q8", "ecc24", torch.bfloat16),  # streams 0, 1, 2
        ("adamw", "fp32", "none", torch.bfloat16),  # stream 0 alone
        ("adamw", "q8", "fp32", torch.float32),  # streams 1 and 2
        ("adamw", "bf16", "fp32", torch.float32),  # 1 and 2, the one-loop bf16-moment path
        ("sgd-nesterov", "fp8", "none", torch.float16),  # 0 and 1
        ("lion", "bf16", "ecc32", torch.bfloat16),  # 1 alone (ECC-32 is exact)
    ],
    ids=["all", "master", "moments", "bf16-moments", "master-momentum", "lion-moment"],
)
def test_tiles_across_the_32_bit_index_boundary(variant, preset, master, dtype):
    # every subset of streams a step draws, with tiles (chunks of 1056) whose indices cross 2**32
    # and 2**33 mid-tile and a tensor at 2**40 + 3
    compare(
        variant,
        preset,
        master,
        dtype,
        sizes=[3000, 4099, 33],
        bases=[2**32 - 100, 2**33 - 1000, 2**40 + 3],
        steps=2,
    )


def test_index_bases_of_a_subset_of_slots():
    # a partial step: the bases of the stepped tensors only (GroupStep.index_base(position))
    compare("adamw", "q8", "ecc24", torch.bfloat16, slots=[2, 4])


def test_the_bases_change_the_bits():
    """The control: with the bases left out, the same group rounds differently (so the tests
    above can fail)."""
    ref = compare("adamw", "bf16", "ecc24", torch.bfloat16, steps=1)
    group = make_group(
        "adamw", ref.spec, torch.bfloat16, SIZES, "cpu", seed=11, **VARIANTS["adamw"][1]
    )
    step_group(BACKEND, group, make_grads(group, 1), 1)
    assert diff_report(ref, group)


@pytest.mark.parametrize("isa", ISAS)
def test_shards_give_the_whole_tensors_bits(isa):
    """What the bases are for (FSDP2): shards of one tensor, each stepped with its offset as
    base, end with the bits of the whole tensor stepped at once."""
    set_isa(isa)
    set_num_threads(2)
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    whole = make_group("adamw", spec, torch.bfloat16, [3000], "cpu", seed=7, lr=1e-2)
    cuts = [0, 1024, 1056, 3000]  # block-aligned, as FSDP2 shards of a blocked format are
    shards = []
    flat = whole.params[0].detach().reshape(-1)
    for a, b in itertools.pairwise(cuts):
        g = make_group(
            "adamw", spec, torch.bfloat16, [b - a], "cpu", seed=7, index_bases=[a], lr=1e-2
        )
        g.tensor_ids = list(whole.tensor_ids)
        g.params[0].copy_(flat[a:b].view(g.params[0].shape))
        g.arena.master_code[: b - a].copy_(whole.arena.master_code[a:b])
        shards.append(g)
    for step in (1, 2, 3):
        (grad,) = make_grads(whole, step)
        step_group(BACKEND, whole, [grad], step)
        for g, a, b in zip(shards, cuts, cuts[1:], strict=False):
            step_group(BACKEND, g, [grad.reshape(-1)[a:b].view(g.params[0].shape)], step)
    got = torch.cat([g.params[0].detach().reshape(-1) for g in shards])
    assert torch.equal(bits(got), bits(whole.params[0]))
    codes = torch.cat([g.arena.master_code[: g.plan.slots[0].numel] for g in shards])
    assert torch.equal(codes, whole.arena.master_code[:3000])
    for name in ("exp_avg", "exp_avg_sq"):
        for suffix in ("", "scale"):
            got = torch.cat([bits(g.arena.fields[name][suffix]) for g in shards])
            assert torch.equal(got, bits(whole.arena.fields[name][suffix])), (name, suffix)


# ----------------------------------------------------------------------------------- bad input
def _step_with_bases(bases):
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    group = make_group("adamw", spec, torch.bfloat16, [33, 64], "cpu", index_bases=bases, lr=1e-2)
    step_group(BACKEND, group, make_grads(group, 1), 1)


def test_negative_index_base_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"index base of parameter 1 \(slot 1, shape \(16, 4\), torch.bfloat16\) must be "
        r">= 0 \(its first element's stochastic-rounding index\), got -32",
    ):
        _step_with_bases([0, -32])


def test_bool_index_base_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"index base of parameter 0 \(slot 0, shape \(33,\), torch.bfloat16\) must be an "
        r"int, got bool",
    ):
        _step_with_bases([True, 0])


def test_too_large_index_base_is_refused():
    _step_with_bases([0, 2**62 - 65])  # the last index, 2**62 - 2, is fine
    with pytest.raises(
        ConfigError,
        match=r"index base of parameter 1 \(slot 1, shape \(16, 4\), torch.bfloat16\) is "
        r"4611686018427387840: with its 64 padded elements the stochastic-rounding indices reach "
        r"2\*\*62",
    ):
        _step_with_bases([0, 2**62 - 64])
