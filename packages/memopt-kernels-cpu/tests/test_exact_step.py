"""The fused C++ step vs memopt-core's torch backend: the same bits for every rule x format.

Both backends step identical copies of one group (plan, arena, parameters as ``MemOptimizer``
builds them, :mod:`memopt_core.testing`) with the same gradients; afterwards every parameter,
master code and moment field must be bit-identical. Each case runs on every instruction set
this CPU supports, with a thread count and chunk size that cut tensors across threads, so one
reference run checks them all.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from memopt_core.formats import StateSpec
from memopt_core.testing import (
    MASTER_IDS,
    MASTERS,
    PRESETS,
    VARIANTS,
    diff_report,
    group_step,
    make_grads,
    make_group,
    step_group,
)
from memopt_core.torch_backend import TorchBackend
from memopt_kernels_cpu import (
    BACKEND,
    ops,
    set_chunk_size,
    set_isa,
    set_num_threads,
    supported_isas,
)

TORCH = TorchBackend()
ISAS = supported_isas()
SMALL_SIZES = [0, 1, 7, 31, 33, 1025, 4097]


def run_compare(
    variant: str,
    preset: str,
    master: str,
    dtype: torch.dtype,
    sr: bool,
    *,
    sizes: list[int],
    steps: int = 3,
    grad_dtype: torch.dtype | None = None,
    isas: list[str] = ISAS,
    threads: int = 3,
    chunk: int = 64,
    slots: list[int] | None = None,
) -> None:
    """Step a reference copy with the torch backend and one copy per instruction set with the
    C++ kernels; assert identical bits after the last step."""
    rule, hyper = VARIANTS[variant]
    spec = StateSpec(master=master, moments=preset, stochastic_rounding=sr)
    ref = make_group(rule, spec, dtype, sizes, "cpu", seed=11, **hyper)
    copies = {isa: ref.clone() for isa in isas}
    set_num_threads(threads)
    set_chunk_size(chunk)
    for step in range(1, steps + 1):
        grads = make_grads(ref, step, grad_dtype=grad_dtype)
        step_group(TORCH, ref, grads, step, slots)
        for isa, group in copies.items():
            set_isa(isa)
            step_group(BACKEND, group, grads, step, slots)
    for isa, group in copies.items():
        bad = diff_report(ref, group)
        assert not bad, f"{isa}: {variant} {preset} {master} {dtype} sr={sr}: {bad}"


@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize(("master", "dtype"), MASTERS, ids=MASTER_IDS)
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_rule_and_format(variant, preset, master, dtype, sr):
    run_compare(variant, preset, master, dtype, sr, sizes=SMALL_SIZES)


@pytest.mark.parametrize(("master", "dtype"), MASTERS[1:], ids=MASTER_IDS[1:])
@pytest.mark.parametrize("variant", ["adamw", "sgd-nesterov", "lion"])
def test_fp32_gradients_of_low_precision_parameters(variant, master, dtype):
    run_compare(variant, "q8", master, dtype, True, sizes=SMALL_SIZES, grad_dtype=torch.float32)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("preset", ["fp32", "bf16", "fp8", "q8"])
@pytest.mark.parametrize("variant", ["adamw", "sgd-nesterov", "lion"])
def test_low_precision_gradients_of_fp32_parameters(variant, preset, grad_dtype):
    # memopt-offload's case: an fp32 host master updated from the bf16 gradient copied off the GPU
    run_compare(
        variant, preset, "fp32", torch.float32, True, sizes=SMALL_SIZES, grad_dtype=grad_dtype
    )


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("variant", "preset", "master", "dtype"),
    [
        ("adamw", "q8", "ecc24", torch.bfloat16),
        ("adamw", "fp32", "fp32", torch.float32),
        ("adamw", "q8", "fp32", torch.float32),  # fp32 master updated in place, tile by tile
        ("adamw", "bf16", "ecc24", torch.bfloat16),  # the one-loop ECC-24 + bf16 moments path
        ("lion", "bf16", "none", torch.bfloat16),
        ("sgd-nesterov", "fp8", "ecc32", torch.bfloat16),
    ],
)
def test_large_tensor_and_thread_counts(variant, preset, master, dtype, threads):
    # 1000003 elements: many chunks, a ragged last block, every thread busy
    run_compare(
        variant, preset, master, dtype, True, sizes=[1000003, 5], steps=2, threads=threads,
        chunk=4096,
    )  # fmt: skip


def test_chunk_size_does_not_change_bits():
    for chunk in (32, 96, 65536):
        run_compare("adamw", "q8", "ecc24", torch.bfloat16, True, sizes=[33, 3000], chunk=chunk)


def test_subset_of_slots():
    # step_parameters / gradient release update some tensors of a group only
    run_compare("adamw", "q8", "ecc24", torch.bfloat16, True, sizes=[31, 100, 7, 65], slots=[1, 3])


@pytest.mark.parametrize("isa", ISAS)
def test_unaligned_and_strided_parameters(isa):
    # parameters that start one element into their storage (unaligned for every vector width)
    # and a transposed one (strided: updated through a contiguous copy)
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    ref = make_group("adamw", spec, torch.bfloat16, [257, 96, 33], "cpu", lr=1e-2)
    group = ref.clone()
    params = []
    for i, p in enumerate(group.params):
        if i == 1:
            q = torch.empty(p.shape[::-1], dtype=p.dtype).t()
        else:
            q = torch.empty(p.numel() + 1, dtype=p.dtype)[1:].view(p.shape)
        q.copy_(p)
        params.append(q)
    group.plan.params[:] = params
    set_isa(isa)
    set_num_threads(2)
    for step in (1, 2, 3):
        grads = make_grads(ref, step)
        step_group(TORCH, ref, grads, step)
        unaligned = [torch.empty(g.numel() + 1, dtype=g.dtype)[1:].view(g.shape) for g in grads]
        for u, g in zip(unaligned, grads, strict=True):
            u.copy_(g)
        step_group(BACKEND, group, unaligned, step)
    assert params[0].data_ptr() % 4 == 2  # really unaligned
    assert not params[1].is_contiguous()
    assert not diff_report(ref, group)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "preset", "master", "dtype"),
    [
        ("adamw", "q8", "ecc24", torch.bfloat16),
        ("adamw", "bf16", "fp32", torch.float32),
        ("sgd-mom-damp-l2", "fp8", "none", torch.bfloat16),
        ("lion", "q8", "ecc32", torch.bfloat16),
    ],
)
def test_hundred_and_twenty_steps(variant, preset, master, dtype):
    run_compare(variant, preset, master, dtype, True, sizes=[31, 1000, 4099], steps=120)


def test_non_finite_gradients_match_the_reference():
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    ref = make_group("adamw", spec, torch.bfloat16, [64, 33], "cpu", lr=1e-2)
    copies = {isa: ref.clone() for isa in ISAS}
    set_num_threads(2)
    for step in (1, 2):
        grads = make_grads(ref, step)
        grads[0].view(-1)[3] = float("nan")
        grads[0].view(-1)[40] = float("inf")
        grads[1].view(-1)[0] = -float("inf")
        step_group(TORCH, ref, grads, step)
        for isa, group in copies.items():
            set_isa(isa)
            step_group(BACKEND, group, grads, step)
    for isa, group in copies.items():
        assert not diff_report(ref, group, nan_equal=True), isa


@pytest.mark.parametrize(("isa", "n"), list(itertools.product(ISAS, [0, 1, 33])))
def test_empty_and_tiny_groups(isa, n):
    set_isa(isa)
    run_compare("adamw", "q8", "ecc24", torch.bfloat16, True, sizes=[n], isas=[isa])


def test_callers_flush_to_zero_mode_does_not_change_bits():
    # torch.set_flush_denormal(True) sets FTZ/DAZ in the calling thread, which runs one part of
    # every step; the kernels compute in IEEE mode whatever the caller's mode is
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero control")
    spec = StateSpec(master="fp32", moments="q8", stochastic_rounding=True)
    ref = make_group("adamw", spec, torch.float32, [64, 4099], "cpu", lr=1e-2)
    group = ref.clone()
    for p in ref.params + group.params:
        p.view(-1)[:32] *= 1e-38  # subnormal weights and, after a step, tiny moments
    set_num_threads(1)  # everything in the caller's thread
    for step in (1, 2):
        grads = make_grads(ref, step, scale=1e-36)
        step_group(TORCH, ref, grads, step)
        torch.set_flush_denormal(True)
        try:
            step_group(BACKEND, group, grads, step)
        finally:
            torch.set_flush_denormal(False)
    assert not diff_report(ref, group)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("master", "dtype", "preset"),
    [("fp32", torch.float32, "fp32"), ("fp32", torch.float32, "q8"), ("ecc24", torch.bfloat16, "q8"),
     ("none", torch.bfloat16, "bf16"), ("fp32", torch.float32, "bf16"),
     ("ecc24", torch.bfloat16, "bf16")],
)  # fmt: skip
def test_bf16_staging_copy_of_the_updated_weights(isa, master, dtype, preset):
    # memopt-offload's output: the new weights as bf16 (nearest even), written in the same pass
    # with streaming stores; buffers start at odd offsets so the aligned middle has a head and a tail
    set_isa(isa)
    set_num_threads(2)
    set_chunk_size(64)
    spec = StateSpec(master=master, moments=preset, stochastic_rounding=True)
    ref = make_group("adamw", spec, dtype, [1, 31, 33, 1000], "cpu", lr=1e-2)
    group = ref.clone()
    for step in (1, 2):
        grads = make_grads(ref, step)
        step_group(TORCH, ref, grads, step)
        staging = [
            torch.full((p.numel() + 1,), 7.0, dtype=torch.bfloat16)[1:] for p in group.params
        ]
        ops.fused_step(group_step(group, grads, step), staging=staging)
        assert not diff_report(ref, group)
        for p, st in zip(group.params, staging, strict=True):
            want = p.detach().reshape(-1).to(torch.bfloat16)  # exact for bf16, RNE from fp32
            assert torch.equal(st.view(torch.int16), want.view(torch.int16))
