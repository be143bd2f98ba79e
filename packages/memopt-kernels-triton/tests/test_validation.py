"""Validation of a fused step's arguments (``ops.prepare_step``): every tensor against its plan
slot, the slots, the arena and the counts, before any launch, and also when the step's tables
are cached (a cache hit stands in for validation only for what validation checked)."""

from __future__ import annotations

import pytest
import torch

from memopt_core.backends import DeviceStep
from memopt_core.errors import ConfigError
from memopt_core.formats import StateSpec
from memopt_core.testing import VARIANTS, diff_report, group_step, make_grads, make_group
from memopt_core.torch_backend import TorchBackend

TORCH = TorchBackend()
SPEC = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)


def _group(sizes=(40, 70)):
    rule, hyper = VARIANTS["adamw"]
    return make_group(rule, SPEC, torch.bfloat16, list(sizes), "cpu", seed=3, **hyper)


def _sentinel(n: int, extra: int = 64) -> torch.Tensor:
    """A buffer whose first ``n`` elements stand in for a parameter; the rest must stay 7."""
    return torch.full((n + extra,), 7.0, dtype=torch.bfloat16)


def test_parameter_smaller_than_its_slot(ops):
    group = _group()
    grads = make_grads(group, 1)
    buf = _sentinel(30, 170)
    work = group_step(group, grads, 1)
    work.params[1], work.grads[1] = buf[:30], grads[1].reshape(-1)[:30]
    with pytest.raises(ConfigError, match=r"parameter 1 \(plan slot 1\) has 30 elements .* 70"):
        ops.fused_step(work)
    assert bool((buf[30:] == 7.0).all())


def test_tensors_without_memory_are_refused_by_name(ops, device):
    """A storage resized to 0 bytes, a wrapper subclass (torch's TwoTensor stands for
    torchao-style ones) and autograd's zero tensor have data pointer 0: the kernels read
    address 0 (an illegal access on the GPU, a crash of the interpreter)."""
    from torch.testing._internal.two_tensor import TwoTensor

    rule, hyper = VARIANTS["adamw"]
    group = make_group(rule, SPEC, torch.bfloat16, [40, 70], device, seed=3, **hyper)
    grads = make_grads(group, 1)
    before = [p.clone() for p in group.params]
    freed = grads[1].clone()
    freed.untyped_storage().resize_(0)
    zero = torch.nn.Parameter(torch.zeros_like(grads[0]))
    torch.sgn(zero).sum().backward()
    assert zero.grad._is_zerotensor()
    cases = [
        ("grads", 1, freed, r"the gradient of parameter 1 \(plan slot 1\) is a Tensor without"),
        ("grads", 0, zero.grad, r"the gradient of parameter 0 .* is a Tensor without memory"),
        ("params", 0, TwoTensor(before[0].clone(), before[0].clone()), r"0 .* is a TwoTensor"),
    ]
    for field, k, t, pattern in cases:
        work = group_step(group, grads, 1)
        getattr(work, field)[k] = t
        with pytest.raises(ConfigError, match=pattern):
            ops.fused_step(work)
    assert all(map(torch.equal, group.params, before))


def test_cache_hit_does_not_skip_validation(ops):
    """A smaller gradient, or a parameter of another dtype, at the address of a cached step's
    tensor is refused as on a fresh plan."""
    group = _group((64,))
    big = make_grads(group, 1)[0].reshape(-1)
    ops.fused_step(group_step(group, [big], 1))
    with pytest.raises(
        ConfigError, match=r"gradient of parameter 0 \(plan slot 0\) has shape \(10,\)"
    ):
        ops.fused_step(group_step(group, [big[:10]], 2))

    wide = [big.float()]
    ops.fused_step(group_step(group, wide, 1))
    before = group.params[0].clone()
    work = group_step(group, wide, 2)
    work.params = [group.params[0].view(torch.float16)]
    with pytest.raises(ConfigError, match=r"bfloat16 parameters, got torch\.float16"):
        ops.fused_step(work)
    assert torch.equal(group.params[0], before)


def test_negated_views_are_refused_also_at_a_cached_address(ops):
    """A negated view (torch's negative bit) shares its tensor's address, dtype and size, and
    its memory holds the opposite values: the kernel would step with -g or update -p."""
    group = _group((64,))
    g = make_grads(group, 1)[0]
    ops.fused_step(group_step(group, [g], 1))  # cached
    before = group.params[0].clone()
    with pytest.raises(ConfigError, match=r"the gradient of parameter 0 .* is a negated view"):
        ops.fused_step(group_step(group, [torch._neg_view(g)], 2))
    work = group_step(group, [g], 2)
    work.params = [torch._neg_view(group.params[0])]
    with pytest.raises(ConfigError, match=r"parameter 0 \(plan slot 0\) is a negated view"):
        ops.fused_step(work)
    assert torch.equal(group.params[0], before)


def test_arena_of_another_plan(ops):
    group, other = _group(), _group((8,))
    work = group_step(group, make_grads(group, 1), 1)
    work.arena = other.arena
    with pytest.raises(ConfigError, match="arena was allocated for another plan"):
        ops.prepare_step(work)


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        ([0, 0], r"slots\[1\] repeats slot 0"),
        ([0, 5], r"slots\[1\] is 5: .* plan's 2 tensors"),
        ([-1, 0], r"slots\[0\] is -1"),
        ([True, 0], r"slots\[0\] is True"),
    ],
)
def test_bad_slots(ops, slots, message):
    group = _group()
    grads = make_grads(group, 1)
    work = group_step(group, grads, 1)
    work.slots = slots
    with pytest.raises(ConfigError, match=message):
        ops.prepare_step(work)


def test_every_slot_in_another_order_is_a_partial_step(ops):
    """Slots ``[1, 0]`` cover the plan but not in its order: each tensor keeps its own slot's
    geometry and state (the bits of the ordered step), never the next slot's."""
    mine = _group()
    ref = mine.clone()
    buf = _sentinel(40)
    buf[:40] = mine.params[0].reshape(-1)
    grads = make_grads(mine, 1)
    work = group_step(mine, grads, 1)
    work.slots = [1, 0]
    work.params = [mine.params[1], buf[:40]]
    work.grads = [grads[1], grads[0]]
    work.tensor_ids = work.tensor_ids[::-1]
    ops.fused_step(work)
    assert bool((buf[40:] == 7.0).all())
    TORCH.step(group_step(ref, grads, 1))
    mine.params[0].copy_(buf[:40].view(mine.params[0].shape))
    assert not diff_report(ref, mine)


def test_counts_and_non_tensors(ops):
    group = _group()
    grads = make_grads(group, 1)
    work = group_step(group, grads, 1)
    work.params, work.grads = work.params[:1], work.grads[:1]
    with pytest.raises(ConfigError, match="step over 2 slots got 1 parameters, 1 gradients"):
        ops.prepare_step(work)
    work = group_step(group, grads, 1)
    work.tensor_ids = work.tensor_ids[:1]
    with pytest.raises(ConfigError, match="and 1 tensor ids"):
        ops.prepare_step(work)
    work = group_step(group, grads, 1)
    work.grads = [grads[0], grads[1].tolist()]
    with pytest.raises(ConfigError, match=r"gradient of parameter 1 .* torch.Tensor, got list"):
        ops.prepare_step(work)
    work = group_step(group, grads, 1)
    work.index_bases = 5
    with pytest.raises(ConfigError, match="index_bases holds int"):
        ops.prepare_step(work)


def test_tensor_ids_take_their_low_32_bits(ops):
    """As core's words do: an id past 64 bits gives the bits of its low 32 bits."""
    mine = _group()
    ref = mine.clone()
    mine.tensor_ids = [2**64 + 1000, 1007]
    ref.tensor_ids = [1000, 1007]
    grads = make_grads(mine, 1)
    ops.fused_step(group_step(mine, grads, 1))
    TORCH.step(group_step(ref, grads, 1))
    assert not diff_report(ref, mine)


def test_device_step_betas_are_a_pair(ops):
    group = _group()
    work = group_step(group, make_grads(group, 1), 1)
    work.device_step = DeviceStep(
        steps=torch.zeros(2),
        lr=1e-2,
        betas=(0.9, 0.999, 0.5),  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigError, match=r"betas must be a pair \(beta1, beta2\)"):
        ops.fused_step(work)


def test_shared_memory_is_refused_but_a_gradient_may_be_its_parameter(ops):
    """A gradient that overlaps a parameter (its own shifted, or another's) would race with
    the programs writing it: refused before any launch, as by the cpu backend. A gradient that
    is exactly its own parameter is read before it is written: the reference's bits."""
    results = []
    for step in (ops.fused_step, TORCH.step):
        group = _group()
        work = group_step(group, make_grads(group, 1), 1)
        work.grads = [work.params[0], work.grads[1]]
        step(work)
        results.append(group)
    assert diff_report(*results) == []

    group = _group()
    buf = _sentinel(40, 30)
    work = group_step(group, make_grads(group, 1), 1)
    work.params[0], work.grads[0] = buf[:40], buf[1:41]  # its own parameter, shifted
    with pytest.raises(ConfigError, match=r"parameter 0 .* and the gradient of parameter 0 .*"):
        ops.fused_step(work)
    work = group_step(group, make_grads(group, 1), 1)
    work.params[0], work.grads[1] = buf[:40], buf[:70]  # another parameter's memory
    with pytest.raises(ConfigError, match=r"parameter 0 .* and the gradient of parameter 1 .*"):
        ops.fused_step(work)
    assert bool((buf[40:] == 7.0).all())


def _misfits(group, grads):
    """(name, field, index, tensor) of every kind of tensor the per-tensor check refuses."""
    p0, g1 = group.params[0], grads[1]
    freed = g1.clone()
    freed.untyped_storage().resize_(0)
    return [
        ("a list", "grads", 1, [1.0]),
        ("sparse", "grads", 1, g1.reshape(-1).to_sparse()),
        ("negated parameter", "params", 0, torch._neg_view(p0)),
        ("negated gradient", "grads", 1, torch._neg_view(g1)),
        ("another dtype", "params", 0, p0.view(torch.float16)),
        ("float64 gradient", "grads", 1, g1.double()),
        ("fewer elements", "params", 0, p0.reshape(-1)[:10]),
        ("another shape", "grads", 1, g1.reshape(-1)[:7]),
        ("no memory", "grads", 1, freed),
        ("meta", "grads", 1, torch.empty_like(g1, device="meta")),
    ]


@pytest.mark.parametrize("case", range(10))
def test_the_whole_work_check_passes_only_what_the_per_tensor_one_does(ops, case):
    """``_tensors_fit`` (C-level passes over every tensor, run first) passes a good work, so a
    step skips the per-tensor loop, and passes none of the misfits: each is refused by the
    per-tensor check with its message, as before."""
    group = _group()
    grads = make_grads(group, 1)
    assert ops._tensors_fit(group_step(group, grads, 1), group.plan)
    name, field, k, t = _misfits(group, grads)[case]
    work = group_step(group, grads, 1)
    getattr(work, field)[k] = t
    assert not ops._tensors_fit(work, group.plan), name
    with pytest.raises(ConfigError):
        ops._refuse_misfit(work, group.plan)
