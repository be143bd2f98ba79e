"""The slot table of a validated step: built in C-level passes over all tensors where every
tensor is plain (``ops._table_if_plain``), slot by slot otherwise (``ops._checked_table``, which
names the first problem). Both must give the same rows, and the passes must hand every tensor
that needs a closer look to the slot-by-slot check. The passes also run on the values the table
cache's key read (``ops._read``, passed down by ``fused_step`` and ``prepare_step``): the same
rows and the same refusals."""

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
    """(the C-level table or None, the same from the values passed down, the slot-by-slot
    table) of ``work``."""
    has_momentum = work.rule == "sgd" and work.scalars.momentum != 0.0
    _, arena = ops._arena_args(work, has_momentum)
    params, grads = list(work.params), list(work.grads)
    stage = [None] * len(params) if stage is None else stage
    reads = ops._read(params, grads)
    return (
        ops._table_if_plain(work, params, grads, stage, params, arena),
        ops._table_if_plain(work, params, grads, stage, params, arena, reads),
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
        fast, passed_down, checked = _tables(work)
        assert fast is not None
        assert fast.dtype == torch.int64
        assert fast.is_contiguous()
        assert torch.equal(fast, checked)
        assert passed_down is not None
        assert torch.equal(passed_down, checked)


def test_the_passes_build_the_checked_table_with_staging():
    spec = StateSpec(master="fp32", moments="bf16", stochastic_rounding=True)
    group = make_group("adamw", spec, torch.float32, SIZES, "cpu")
    work = group_step(group, make_grads(group, 1), 1)
    stage = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    fast, passed_down, checked = _tables(work, stage)
    assert fast is not None
    assert torch.equal(fast, checked)
    assert passed_down is not None
    assert torch.equal(passed_down, checked)
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

    def negated_param(work, stage):
        work.params[0] = torch._neg_view(work.params[0])

    def param_dtype(work, stage):
        work.params[1] = work.params[1].double()

    def param_size(work, stage):  # and its gradient's: only the size tells
        work.params[4] = work.params[4][:100]
        work.grads[4] = work.grads[4][:100]

    def strided_grad(work, stage):
        work.grads[3] = work.grads[3].t().contiguous().t()  # the same shape, strided

    return [
        ("numpy id", numpy_id, None),
        ("gradient that is its parameter", same_view, None),
        ("two gradients in one memory", shared_gradients, None),
        ("staging for some slots", some_staging, None),
        ("strided gradient", strided_grad, None),
        (
            "gradient in another parameter",
            grad_in_param,
            "parameter 0 .* and the gradient of parameter 1 .* share memory",
        ),
        (
            "unaligned gradient",
            unaligned_grad,
            "the gradient of parameter 0 .* not a multiple of its element size",
        ),
        ("gradient shape", grad_shape, "the gradient of parameter 3 .* must match the parameter"),
        ("index base", base_limit, "index base of parameter 3 .* 2\\*\\*62"),
        ("negated gradient", negated, "the gradient of parameter 2 .* is a negated view"),
        ("negated parameter", negated_param, "^parameter 0 .* is a negated view"),
        ("parameter dtype", param_dtype, "^parameter 1 .* the group holds torch.float32"),
        ("parameter size", param_size, "^parameter 4 .* has 100 elements but the plan's slot 4"),
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
    if all(t.is_contiguous() for t in (*params, *grads)):  # what fused_step passes down
        reads = ops._read(params, grads)
        assert ops._table_if_plain(work, params, grads, stage, params, arena, reads) is None
    if error is None:
        ops.fused_step(work, stage)  # valid: the slot-by-slot path takes it
    else:
        with pytest.raises(ConfigError, match=error):
            ops.fused_step(work, stage)
        with pytest.raises(ConfigError, match=error):  # it passes its values down too
            ops.prepare_step(work)


def test_prepare_step_refuses_a_tensor_whose_address_cannot_be_read_by_name():
    """prepare_step reads the tensors once for the table's passes; a tensor whose
    ``data_ptr()`` raises goes to the slot-by-slot check, which names it."""

    class NoAddress(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.data_ptr:
                raise RuntimeError("no data pointer")
            return super().__torch_function__(func, types, args, kwargs or {})

    spec = StateSpec(master="fp32", moments="fp32")
    group = make_group("adamw", spec, torch.float32, CASE_SIZES, "cpu")
    work = group_step(group, make_grads(group, 1), 1)
    work.grads[2] = work.grads[2].as_subclass(NoAddress)
    with pytest.raises(ConfigError, match=r"the gradient of parameter 2 .* without memory"):
        ops.prepare_step(work)
    with pytest.raises(ConfigError, match=r"the gradient of parameter 2 .* without memory"):
        ops.fused_step(work)
