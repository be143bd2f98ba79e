"""Counter-based random words for stochastic rounding: a Philox key per step, a hash per element.

Every (seed, tensor, step) draws one Philox4x32-10 block (Salmon et al., SC'11; Random123's
``philox4x32`` with 10 rounds) as its four keys. Each element then takes, for each stream, a
32-bit hash of its index mixed with that stream's key::

    K0, K1, K2, K3 = philox4x32(counter=(step, 0, 0, 0), key=(seed, tensor_id))   # 32-bit each
    y              = (index & 0xFFFFFFFF) * 0x9E3779B9 + (index >> 32) * K3       # mod 2**32
    word[stream]   = lowbias32(y ^ K[stream])      # STREAM_MASTER 0, STREAM_FIRST 1, STREAM_SECOND 2
    lowbias32(x)   : x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16

``index`` is the element's position in its tensor and ``step`` the optimizer step. The words are a
pure function of (seed, tensor_id, index, step, stream), so every backend (this torch reference,
the C++ kernels, the Triton kernels) computes the same words whatever the chunking or threads.

Why this shape. What stochastic rounding needs is that each element's words be uniform and
independent from step to step and between its streams; that makes the rounding unbiased and lets
small updates accumulate. For a fixed element ``y`` is fixed, and ``K[stream]`` is a fresh Philox
word for every (step, stream), so ``y ^ K[stream]`` and its image under the bijection
``lowbias32`` are exactly as uniform and independent as Philox's own output. The hash (Wellons'
``lowbias32``, from the hash-prospector search) only decorrelates the neighbouring elements of one
step, and the multiplier of the index's low word spreads a neighbour's small difference over
all 32 bits first: without it, elements ``lag`` apart (a power of two) had visibly dependent
words (a chi-square test of joint top bits, ``tests/test_rng.py``, failed by far). It costs two
32-bit multiplies per element and stream (the index's one is shared), and a kernel computes only the
streams its formats round, where one Philox4x32-10 block per element (the generator before
``KERNEL_API`` 3) costs twenty 32x32 -> 64-bit products. ``y`` is a bijection of the low word
(the multiplier is odd); tensors of more than 2**32 elements fold the index's high word in with
the step's ``K3``, so two of their elements can share ``y`` at one step, never the same pair at
every step.

Arithmetic is int64 on values in ``[0, 2**32)``; the 32x32 -> 64-bit products rely on int64
multiplication wrapping modulo ``2**64`` (it does on every torch device; the known-answer tests
exercise products above ``2**63``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "INDEX_M",
    "MIX_M0",
    "MIX_M1",
    "PHILOX_M0",
    "PHILOX_M1",
    "PHILOX_W0",
    "PHILOX_W1",
    "STREAM_FIRST",
    "STREAM_MASTER",
    "STREAM_SECOND",
    "fold_index",
    "lowbias32",
    "philox4x32",
    "step_keys",
    "stream_words",
    "uniform_bits",
]

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
ROUNDS = 10

INDEX_M = 0x9E3779B9
MIX_M0 = 0x7FEB352D
MIX_M1 = 0x846CA68B

STREAM_MASTER = 0
STREAM_FIRST = 1
STREAM_SECOND = 2
_STREAMS = (STREAM_MASTER, STREAM_FIRST, STREAM_SECOND)

_U32 = 0xFFFFFFFF


def _as_u32(v: Tensor | int, device: torch.device | None) -> Tensor:
    if isinstance(v, Tensor):
        return v.to(device=device, dtype=torch.int64) & _U32
    return torch.tensor(v & _U32, dtype=torch.int64, device=device)


def philox4x32(
    c0: Tensor | int,
    c1: Tensor | int,
    c2: Tensor | int,
    c3: Tensor | int,
    k0: Tensor | int,
    k1: Tensor | int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10 of counter ``(c0, c1, c2, c3)`` and key ``(k0, k1)``: four int64 tensors in
    ``[0, 2**32)``. Arguments are tensors or ints (taken modulo ``2**32``) and broadcast."""
    device = next((v.device for v in (c0, c1, c2, c3, k0, k1) if isinstance(v, Tensor)), None)
    x0, x1, x2, x3, key0, key1 = (_as_u32(v, device) for v in (c0, c1, c2, c3, k0, k1))
    # keys and counters broadcast inside the operations (scalar keys stay scalars)
    for r in range(ROUNDS):
        if r:
            key0 = (key0 + PHILOX_W0) & _U32
            key1 = (key1 + PHILOX_W1) & _U32
        # 32x32 -> 64-bit products: int64 multiplication wraps modulo 2**64, so the 64 bits are
        # right even when the product exceeds 2**63; the arithmetic shift's sign extension is
        # masked off after the XORs (x1, x3 and the keys are below 2**32)
        p0 = x0 * PHILOX_M0
        p1 = x2 * PHILOX_M1
        x0, x1, x2, x3 = (
            ((p1 >> 32) ^ x1 ^ key0) & _U32,
            p1 & _U32,
            ((p0 >> 32) ^ x3 ^ key1) & _U32,
            p0 & _U32,
        )
    out = torch.broadcast_tensors(x0, x1, x2, x3)
    return tuple(t.contiguous() for t in out)


def step_keys(
    seed: int, tensor_id: int | Tensor, step: int | Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(K0, K1, K2, K3)``, the keys of one tensor at one step: Philox4x32-10 of counter
    ``(step, 0, 0, 0)`` and key ``(seed, tensor_id)`` (int64 in ``[0, 2**32)``; tensor arguments
    broadcast)."""
    return philox4x32(step, 0, 0, 0, seed, tensor_id)


def lowbias32(x: Tensor) -> Tensor:
    """Wellons' ``lowbias32`` of int64 ``x`` in ``[0, 2**32)``: a bijection of 32-bit words."""
    x = x ^ (x >> 16)
    x = (x * MIX_M0) & _U32
    x = x ^ (x >> 15)
    x = (x * MIX_M1) & _U32
    return x ^ (x >> 16)


def fold_index(index: Tensor, k3: Tensor | int) -> Tensor:
    """``y``, int64 ``index`` folded to 32 bits with the step's key ``K3``: ``(index & 0xFFFFFFFF)
    * INDEX_M + (index >> 32) * K3`` modulo ``2**32``."""
    index = index.to(torch.int64)
    return ((index & _U32) * INDEX_M + (index >> 32) * k3) & _U32


def stream_words(
    seed: int, tensor_id: int | Tensor, index: Tensor, step: int | Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The words (int64 in ``[0, 2**32)``) of streams 0, 1 and 2 of elements ``index`` (int64
    tensor) of tensor ``tensor_id`` at optimizer ``step``. Tensor arguments broadcast (e.g. a
    column of steps against a row of indices draws many steps)."""
    keys = step_keys(seed, tensor_id, step)
    y = fold_index(index, keys[3])
    w0, w1, w2 = (lowbias32(y ^ keys[s]) for s in _STREAMS)
    return w0, w1, w2


def uniform_bits(
    seed: int, tensor_id: int | Tensor, index: Tensor, step: int | Tensor, stream: int
) -> Tensor:
    """The words of one ``stream`` (see :func:`stream_words`), computing that stream only."""
    if stream not in _STREAMS:
        raise ValueError(
            f"stream is one of {_STREAMS} (master, first, second moment); got {stream}"
        )
    keys = step_keys(seed, tensor_id, step)
    return lowbias32(fold_index(index, keys[3]) ^ keys[stream])
