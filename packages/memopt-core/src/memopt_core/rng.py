"""Counter-based random bits for stochastic rounding: Philox4x32-10 (Salmon et al., SC'11).

The generator is a pure function of (counter, key), so every backend (this torch reference, C++,
Triton's ``tl.randint4x``-style Philox) produces the same words for the same element, whatever
the chunking or thread layout. This is the standard Random123 ``philox4x32`` with 10 rounds.

Stochastic rounding draws one Philox block per element and step, and each stream takes one of
its four words::

    key     = (seed & 0xFFFFFFFF, tensor_id & 0xFFFFFFFF)
    counter = (index & 0xFFFFFFFF, index >> 32, step & 0xFFFFFFFF, 0)
    word    = philox4x32(counter, key)[stream]

``index`` is the element's position in its tensor, ``step`` the optimizer step and ``stream`` one
of :data:`STREAM_MASTER`, :data:`STREAM_FIRST`, :data:`STREAM_SECOND`, so the master weight and the
two moments round with independent words from a single generator call (a fused kernel computes
one Philox block per element, not three).

Arithmetic is int64 on values in ``[0, 2**32)``; the 32x32 -> 64-bit products rely on int64
multiplication wrapping modulo ``2**64`` (it does on every torch device; the known-answer tests
exercise products above ``2**63``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "PHILOX_M0",
    "PHILOX_M1",
    "PHILOX_W0",
    "PHILOX_W1",
    "STREAM_FIRST",
    "STREAM_MASTER",
    "STREAM_SECOND",
    "philox4x32",
    "stream_words",
    "uniform_bits",
]

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
ROUNDS = 10

STREAM_MASTER = 0
STREAM_FIRST = 1
STREAM_SECOND = 2

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
    return tuple(t.contiguous() for t in out)  # type: ignore[return-value]


def stream_words(
    seed: int, tensor_id: int | Tensor, index: Tensor, step: int | Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four stream words (int64 in ``[0, 2**32)``) of elements ``index`` (int64 tensor) of
    tensor ``tensor_id`` at optimizer ``step``; word ``k`` belongs to stream ``k``. Tensor
    arguments broadcast (e.g. a column of steps against a row of indices draws many steps)."""
    index = index.to(torch.int64)
    return philox4x32(index & _U32, index >> 32, step & _U32, 0, seed & _U32, tensor_id)


def uniform_bits(
    seed: int, tensor_id: int | Tensor, index: Tensor, step: int | Tensor, stream: int
) -> Tensor:
    """The word of one ``stream`` (see :func:`stream_words`)."""
    if stream not in (0, 1, 2, 3):
        raise ValueError(f"stream is an output word of Philox4x32, 0..3; got {stream}")
    return stream_words(seed, tensor_id, index, step)[stream]
