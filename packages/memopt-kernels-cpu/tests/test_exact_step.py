"""The fused C++ step vs memopt-core's torch backend: the same bits for every rule x format.

Both backends step identical copies of one group (plan, arena, parameters as ``MemOptimizer``
builds them, :mod:`memopt_core.testing`) with the same gradients; afterwards every parameter,
master code and moment field must be bit-identical. Each case runs on every instruction set
this CPU supports, with chunks small enough to cut tensors across threads; the matrix of every
rule x format x gradient dtype runs at 1, 2 and 3 threads too. One reference run checks them all.
"""

from __future__ import annotations

import ctypes
import itertools
import platform
from collections.abc import Sequence

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
#: 86 chunks at run_compare's 64 elements per chunk: at 2 or 3 threads every thread gets a part
#: (chunks split by element count), and 4097's chunks are spread over all of them
SMALL_SIZES = [0, 1, 7, 31, 33, 1025, 4097]
#: thread counts: one (all in the caller's thread), two, and an odd count
THREADS = (1, 2, 3)


def grad_dtypes(dtype: torch.dtype) -> list[torch.dtype]:
    """Gradient dtypes ops.fused_step accepts for ``dtype`` parameters: their own and float32;
    float32 parameters also bfloat16 and float16."""
    if dtype == torch.float32:
        return [dtype, torch.bfloat16, torch.float16]
    return [dtype, torch.float32]


#: (master, parameter dtype, gradient dtype) of every master with every gradient it accepts
GRAD_CASES = [
    pytest.param(master, dtype, grad, id=f"{master_id}-grad-{str(grad)[6:]}")
    for (master, dtype), master_id in zip(MASTERS, MASTER_IDS, strict=True)
    for grad in grad_dtypes(dtype)
]


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
    threads: Sequence[int] = (3,),
    chunk: int = 64,
    slots: list[int] | None = None,
) -> None:
    """Step a reference copy with the torch backend and one copy per instruction set and thread
    count with the C++ kernels; assert identical bits after the last step."""
    rule, hyper = VARIANTS[variant]
    spec = StateSpec(master=master, moments=preset, stochastic_rounding=sr)
    ref = make_group(rule, spec, dtype, sizes, "cpu", seed=11, **hyper)
    copies = {(isa, n): ref.clone() for n in threads for isa in isas}
    set_chunk_size(chunk)
    for step in range(1, steps + 1):
        grads = make_grads(ref, step, grad_dtype=grad_dtype)
        step_group(TORCH, ref, grads, step, slots)
        for (isa, n), group in copies.items():
            set_num_threads(n)
            set_isa(isa)
            step_group(BACKEND, group, grads, step, slots)
    for (isa, n), group in copies.items():
        bad = diff_report(ref, group)
        where = f"{isa}, {n} threads: {variant} {preset} {master} {dtype} grad {grad_dtype}"
        assert not bad, f"{where} sr={sr}: {bad}"


@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize(("master", "dtype", "grad_dtype"), GRAD_CASES)
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_rule_format_and_gradient_dtype(variant, preset, master, dtype, grad_dtype, sr):
    # fp32 gradients of bf16/fp16 parameters, and memopt-offload's case: an fp32 host master
    # updated from the bf16 gradient copied off the GPU; every ISA at 1, 2 and 3 threads
    run_compare(
        variant, preset, master, dtype, sr, sizes=SMALL_SIZES, grad_dtype=grad_dtype,
        threads=THREADS,
    )  # fmt: skip


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
def test_large_tensor_and_thread_counts(variant, preset, master, dtype):
    # 1000003 elements: many chunks, a ragged last block, every thread busy
    run_compare(
        variant, preset, master, dtype, True, sizes=[1000003, 5], steps=2, threads=THREADS,
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


@pytest.mark.skipif(platform.system() != "Linux", reason="fesetround through glibc's libm")
def test_callers_rounding_direction_does_not_change_bits():
    """A caller's rounding direction (C's fesetround) applied to the part of a step run in its
    thread, and not to the pool threads' parts: the bits depended on the chunk size (2823 of
    4096 differed from a split run, rounding upward). Python's own float arithmetic (the step's
    scalars) rounds upward too here, the same in both runs."""
    libm = ctypes.CDLL("libm.so.6")
    fe_upward = {"x86_64": 0x800, "aarch64": 0x400000}.get(platform.machine())
    if fe_upward is None:
        pytest.skip(f"no FE_UPWARD value known for {platform.machine()}")
    spec = StateSpec(master="fp32", moments="fp32", stochastic_rounding=False)
    base = make_group("adamw", spec, torch.float32, [4096], "cpu", lr=1e-2, weight_decay=0.1)
    grads = make_grads(base, 1)
    set_num_threads(2)
    set_chunk_size(64)
    step_group(BACKEND, base.clone(), grads, 1)  # the pool starts now: its threads round to nearest
    runs = []
    for chunk in (1 << 20, 64):  # one part, in the calling thread; parts on the pool's threads
        set_chunk_size(chunk)
        group = base.clone()
        assert libm.fesetround(fe_upward) == 0
        try:
            step_group(BACKEND, group, grads, 1)
        finally:
            libm.fesetround(0)
        runs.append(group)
    assert not diff_report(runs[0], runs[1])


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
