"""The per-tensor device words of a capturable step, computed and counted on the device.

A capturable step (core's ``GroupStep.device_step``) keeps each tensor's step count in a float32
device tensor, so neither the step nor a GradScaler's found-inf flag is read on the host. This
kernel runs before the rule kernel and, for the step's ``i``-th tensor (plan slot ``s``):

- takes the step being computed, ``k = steps[s] + 1``;
- writes row ``i`` of the ``[tensors, W]`` word table in the rule's layout
  (``ops.HYPER_FIELDS``): the step-independent words come from the host arguments ``w0..w8``
  (the rule's words at step 1, in layout order); Adam's ``step_size = float32(lr / bc1[j])``
  (a double division, as ``memopt_core.reference.adam_scalars`` does it) and
  ``bc2_sqrt = bc2[j]`` with ``j = min(k, last)`` (core's ``adam_bias_table``); the ``step``
  word ``k``; SGD's ``first_step`` word ``k == 1``;
- with ``NORM`` (Adam's decay-normalized second moments, ``DeviceStep.normalized``), Adam's
  ``beta2``, ``one_minus_beta2`` and ``bc2_sqrt`` words of ``adam_scalars(normalized=True)``
  at ``r = k % period``: ``beta2`` is 1.0, or the word ``b2p`` (``beta2**period``) where
  ``r == 0``; the other two come from the int32 table at ``bc2_ptr`` that the host computed
  in double as core does and rounded once (``ops._normalized_table``): ``bc2_sqrt[k] /
  R[k % period]`` for ``k`` in ``0..last``, then ``1 / R[r]`` (every step past ``last``, whose
  bias correction is 1.0), then ``(1 - beta2) / N[r]``;
- ``inv_scale = float32(1 / float64(scale))`` when a GradScaler's scale is given
  (``GradScaler.unscale_``'s factor), else 1.0, and ``skip = found_inf != 0``;
- advances ``steps[s]`` to ``k`` unless the step is skipped, and with ``MIRROR``
  ``norm_steps[s]`` the same way (core's record of the counts its decay-normalized second
  moments are stored for, ``DeviceStep.norm_steps``: advanced here, no copy follows the step).

``lr`` arrives as the two int32 halves of its double's bits (Triton types a Python float argument
as fp32), or with ``LR_PTR`` as a one-element float64 tensor read here, so that a captured graph
uses its value at each replay. Then the other words that depend on it are computed here too, in
double as ``memopt_core.reference`` does: Lion's and SGD's ``lr`` word and, with ``DECAY``, the
decoupled decay factor ``1 - lr * wd`` (or ``1 - (lr / initial_lr) * wd`` with ``ILR``; the
initial lr as bits, or from a float64 tensor with ``ILR_PTR``). The weight decay arrives as
bits, or with ``WD_PTR`` from a one-element float64 tensor; with ``L2`` (a coupled rule, Adam's
or SGD's L2 term) the kernel writes it as the ``l2`` word. Launched with
``enable_fp_fusion=False`` like the rule kernels, so no product and sum fuse.
"""

from __future__ import annotations

import triton
import triton.language as tl

RULE_ADAM: tl.constexpr = tl.constexpr(0)
RULE_LION: tl.constexpr = tl.constexpr(1)
RULE_SGD: tl.constexpr = tl.constexpr(2)


@triton.jit
def _put(row, k: tl.constexpr, value, mask):
    tl.store(row + k, value, mask=mask)


@triton.jit
def _double(lo, hi):
    """The double whose bits are the int32 halves ``lo``, ``hi``."""
    bits = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
    return bits.to(tl.float64, bitcast=True)


@triton.jit(
    do_not_specialize=[
        "n",
        "w0",
        "w1",
        "w2",
        "w3",
        "w4",
        "w5",
        "w6",
        "w7",
        "w8",
        "lr_lo",
        "lr_hi",
        "last",
        "wd_lo",
        "wd_hi",
        "ilr_lo",
        "ilr_hi",
        "period",
        "b2p",
    ]
)
def device_words_kernel(
    out_ptr,
    steps_ptr,
    norm_ptr,
    slots_ptr,
    n,
    w0,
    w1,
    w2,
    w3,
    w4,
    w5,
    w6,
    w7,
    w8,
    lr_lo,
    lr_hi,
    bc1_ptr,
    bc2_ptr,
    last,
    found_ptr,
    scale_ptr,
    lr_ptr,
    wd_ptr,
    wd_lo,
    wd_hi,
    ilr_ptr,
    ilr_lo,
    ilr_hi,
    period,
    b2p,
    RULE: tl.constexpr,
    W: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    LR_PTR: tl.constexpr,
    DECAY: tl.constexpr,
    WD_PTR: tl.constexpr,
    L2: tl.constexpr,
    ILR: tl.constexpr,
    ILR_PTR: tl.constexpr,
    NORM: tl.constexpr,
    MIRROR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    s = tl.load(slots_ptr + i, mask=mask, other=0).to(tl.int64)
    cur = tl.load(steps_ptr + s, mask=mask, other=0.0)
    k_f = cur + 1.0
    k = k_f.to(tl.int32)
    zero = tl.zeros([BLOCK], dtype=tl.int32)
    if HAS_FOUND:  # noqa: SIM108 (constexpr branch)
        skip = (tl.load(found_ptr) != 0.0).to(tl.int32) + zero
    else:
        skip = zero
    if HAS_SCALE:
        inv = (1.0 / tl.load(scale_ptr).to(tl.float64)).to(tl.float32)
        inv_bits = inv.to(tl.int32, bitcast=True) + zero
    else:
        inv_bits = zero + 0x3F800000  # 1.0
    row = out_ptr + i.to(tl.int64) * W
    if LR_PTR:  # noqa: SIM108 (constexpr branch)
        lr = tl.load(lr_ptr)
    else:
        lr = _double(lr_lo, lr_hi)
    lr_word = lr.to(tl.float32).to(tl.int32, bitcast=True) + zero
    if WD_PTR:  # noqa: SIM108 (constexpr branch)
        wd = tl.load(wd_ptr)
    else:
        wd = _double(wd_lo, wd_hi)
    if DECAY:
        if ILR:
            if ILR_PTR:  # noqa: SIM108 (constexpr branch)
                ilr = tl.load(ilr_ptr)
            else:
                ilr = _double(ilr_lo, ilr_hi)
            decay = 1.0 - (lr / ilr) * wd
        else:
            decay = 1.0 - lr * wd
        decay_word = decay.to(tl.float32).to(tl.int32, bitcast=True) + zero
    if L2:
        l2_word = wd.to(tl.float32).to(tl.int32, bitcast=True) + zero
    if RULE == RULE_ADAM:
        # one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bc2_sqrt, decay, l2, seed,
        # step, inv_scale, skip
        j = tl.minimum(k, last)
        bc1 = tl.load(bc1_ptr + j, mask=mask, other=1.0)
        step_size = (lr / bc1).to(tl.float32).to(tl.int32, bitcast=True)
        _put(row, 0, zero + w0, mask)
        if NORM:
            r = k % period
            # past 'last' the bias correction is 1.0: entry last + 1 + r holds 1 / R[r]
            at = tl.where(k > last, last + 1 + r, j)
            bc2 = tl.load(bc2_ptr + at, mask=mask, other=0)
            omb2 = tl.load(bc2_ptr + (last + 1 + period) + r, mask=mask, other=0)
            _put(row, 1, tl.where(r == 0, zero + b2p, zero + 0x3F800000), mask)  # 1.0
            _put(row, 2, omb2, mask)
        else:
            bc2 = tl.load(bc2_ptr + j, mask=mask, other=0)
            _put(row, 1, zero + w1, mask)
            _put(row, 2, zero + w2, mask)
        _put(row, 3, zero + w3, mask)
        _put(row, 4, step_size, mask)
        _put(row, 5, bc2, mask)
        if DECAY:
            _put(row, 6, decay_word, mask)
        else:
            _put(row, 6, zero + w6, mask)
        if L2:
            _put(row, 7, l2_word, mask)
        else:
            _put(row, 7, zero + w7, mask)
        _put(row, 8, zero + w8, mask)
        _put(row, 9, k, mask)
        _put(row, 10, inv_bits, mask)
        _put(row, 11, skip, mask)
    elif RULE == RULE_LION:
        # lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay, seed, step, inv_scale, skip
        if LR_PTR:
            _put(row, 0, lr_word, mask)
        else:
            _put(row, 0, zero + w0, mask)
        _put(row, 1, zero + w1, mask)
        _put(row, 2, zero + w2, mask)
        _put(row, 3, zero + w3, mask)
        _put(row, 4, zero + w4, mask)
        if DECAY:
            _put(row, 5, decay_word, mask)
        else:
            _put(row, 5, zero + w5, mask)
        _put(row, 6, zero + w6, mask)
        _put(row, 7, k, mask)
        _put(row, 8, inv_bits, mask)
        _put(row, 9, skip, mask)
    else:
        # RULE_SGD: lr, momentum, one_minus_dampening, decay, l2, seed, step, first_step,
        # inv_scale, skip
        if LR_PTR:
            _put(row, 0, lr_word, mask)
        else:
            _put(row, 0, zero + w0, mask)
        _put(row, 1, zero + w1, mask)
        _put(row, 2, zero + w2, mask)
        if DECAY:
            _put(row, 3, decay_word, mask)
        else:
            _put(row, 3, zero + w3, mask)
        if L2:
            _put(row, 4, l2_word, mask)
        else:
            _put(row, 4, zero + w4, mask)
        _put(row, 5, zero + w5, mask)
        _put(row, 6, k, mask)
        _put(row, 7, (k == 1).to(tl.int32), mask)
        _put(row, 8, inv_bits, mask)
        _put(row, 9, skip, mask)
    counted = tl.where(skip != 0, cur, k_f)
    tl.store(steps_ptr + s, counted, mask=mask)
    if MIRROR:
        tl.store(norm_ptr + s, counted, mask=mask)
