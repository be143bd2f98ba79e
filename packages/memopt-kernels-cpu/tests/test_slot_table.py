"""The slot table of a validated step: built in C-level passes over all tensors where every
tensor is plain (``ops._table_if_plain``), slot by slot otherwise (``ops._checked_table``, which
names the first problem). Both must give the same rows, and the passes must hand every tensor
that needs a closer look to the slot-by-slot check."""

from __future__ import annotations

import pytest
import torch

from memopt_core import ConfigError
from memopt_core.formats import StateSpec
from memopt_core.testing import RULE_CONFIGS, group_step, make_grads, make_group
from memopt_kernels_cpu import ops

SIZES = [33, 64, 1, 100, 4097]
CASE_SIZES = [64, 64, 33, 100, 4097]  # the first two alike: one's gradient can be the other's


def _tables(work, stage=None):
    """(the C-level table or None, the slot-by-slot table) of ``work``."""
    has_momentum = work.rule == "sgd" and work.scalars.momentum != 0.0
    _, arena = ops._arena_args(work, has_momentum)
    params, grads = list(work.params), list(work.grads)
    stage = [None] * len(params) if stage is None else stage
    return (
        ops._table_if_plain(work, params, grads, stage, params, arena),
        ops._checked_table(work, params, grads, stage, params, arena),
    )


@pytest.mark.parametrize(("rule", "master", "moments", "dtype", "hyper"), RULE_CONFIGS)
def test_the_passes_build_the_checked_table(rule, master, moments, dtype, hyper):
    spec = StateSpec(master=master, moments=moments, stochastic_rounding=True)
    group = make_group(rule, spec, dtype, SIZES, "cpu", index_bases=[7, 0, 3, 2**40, 9], **hyper)
    grad_dtype = torch.bfloat16 if dtype == torch.float32 else None  # widened in the kernel
    for slots in (None, [1, 3], [4]):
        work = group_step(group, make_grads(group, 2, grad_dtype=grad_dtype), 2, slots=slots)
        work.tensor_ids = [-5, 2**33 + 1, 3, 4, 5][: len(work.slots)]  # low 32 bits kept
        fast, checked = _tables(work)
        assert fast is not None
        assert fast.dtype == torch.int64
        assert fast.is_contiguous()
        assert torch.equal(fast, checked)


def test_the_passes_build_the_checked_table_with_staging():
    spec = StateSpec(master="fp32", moments="bf16", stochastic_rounding=True)
    group = make_group("adamw", spec, torch.float32, SIZES, "cpu")
    work = group_step(group, make_grads(group, 1), 1)
    stage = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    fast, checked = _tables(work, stage)
    assert fast is not None
    assert torch.equal(fast, checked)
    assert fast[:, ops.SLOT_COLUMNS.index("staging")].tolist() == [t.data_ptr() for t in stage]


def _cases():
    """Steps the passes must leave to the slot-by-slot check: (name, work edit, error or None
    where the step is valid)."""

    def numpy_id(work, stage):
        import numpy as np

        work.tensor_ids[0] = np.int64(3)

    def same_view(work, stage):
        work.grads[1] = work.params[1].detach()

    def shared_gradients(work, stage):
        work.grads[1] = work.grads[0].view(work.params[1].shape)

    def some_staging(work, stage):
        stage[0] = torch.empty(CASE_SIZES[0], dtype=torch.bfloat16)

    def grad_in_param(work, stage):
        work.grads[1] = work.params[0].detach().view(work.params[1].shape)

    def unaligned_grad(work, stage):
        raw = torch.frombuffer(bytearray(4 * 64 + 8), dtype=torch.float32, offset=2, count=64)
        work.grads[0] = raw.view(work.params[0].shape)

    def grad_shape(work, stage):
        work.grads[3] = work.grads[3].reshape(-1, 1)

    def base_limit(work, stage):
        work.index_bases = [0, 0, 0, ops.INDEX_LIMIT - 1, 0]

    def negated(work, stage):
        work.grads[2] = torch._neg_view(work.grads[2])

    return [
        ("numpy id", numpy_id, None),
        ("gradient that is its parameter", same_view, None),
        ("two gradients in one memory", shared_gradients, None),
        ("staging for some slots", some_staging, None),
        ("gradient in another parameter", grad_in_param, "share memory"),
        ("unaligned gradient", unaligned_grad, "not a multiple of its element size"),
        ("gradient shape", grad_shape, "must match the parameter"),
        ("index base", base_limit, "2\\*\\*62"),
        ("negated gradient", negated, "negated view"),
    ]


@pytest.mark.parametrize(("name", "edit", "error"), _cases(), ids=[c[0] for c in _cases()])
def test_what_the_passes_leave_to_the_slot_checks(name, edit, error):
    spec = StateSpec(master="fp32", moments="fp32")
    group = make_group("adamw", spec, torch.float32, CASE_SIZES, "cpu")
    work = group_step(group, make_grads(group, 1), 1)
    work.tensor_ids = list(work.tensor_ids)
    stage: list = [None] * len(CASE_SIZES)
    edit(work, stage)
    has_momentum = False
    _, arena = ops._arena_args(work, has_momentum)
    params, grads = list(work.params), list(work.grads)
    assert ops._table_if_plain(work, params, grads, stage, params, arena) is None
    if error is None:
        ops.fused_step(work, stage)  # valid: the slot-by-slot path takes it
    else:
        with pytest.raises(ConfigError, match=error):
            ops.fused_step(work, stage)
