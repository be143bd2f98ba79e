"""State conversions outside the optimizer step, on a kernel backend's standalone codecs.

Decoding compressed state for ``state_dict(compress=False)``, exporting fp32 master weights,
converting to and from torch optimizers' state dicts, and writing the master code of fresh state
all apply a format's codec to whole tensors. The reference codecs of :mod:`memopt_core.formats`
do that in pure torch, in slices (their int64 temporaries take tens of bytes per element). The
kernel packages' standalone codecs give the same bits in one pass with no temporaries:
``memopt_kernels_triton.ops`` for CUDA tensors, ``memopt_kernels_cpu.ops`` for CPU tensors.

A backend offers them through an optional method ``codecs(device)`` that returns an object with
``encode_moment(fmt, x)``, ``decode_moment(fmt, fields)``, ``encode_master(fmt, x,
param_dtype)`` and ``decode_master(fmt, param, code)`` (the signatures of those ``ops``
modules), or None where it does not run them. :func:`codec_kernels` asks the backends in the
order a step would choose them (``MEMOPT_BACKEND`` included: ``torch`` means the reference) and
the functions below fall back to the reference where none answers. Every result is the
reference's, bit for bit: each backend's tests check its codecs against the reference on every
format.

The functions take and return flat tensors (fields as the optimizer stores them); every tensor of
one call must be a plain tensor (not a subclass such as DTensor) on one device, else the
reference runs (and explains what is wrong).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import Tensor

from memopt_core import backends
from memopt_core.errors import StateDictError
from memopt_core.formats.base import ENCODE_SLICE, MasterCodec, MomentCodec

__all__ = [
    "check_second_moment",
    "codec_kernels",
    "decode_master",
    "decode_moment",
    "denormalize_second_moment",
    "encode_master",
    "encode_master_into",
    "encode_moment",
    "normalize_second_moment",
    "saved_step_count",
]


def codec_kernels(device: torch.device | str) -> Any | None:
    """The standalone codecs of the first backend that runs them on ``device`` (in the order
    :func:`memopt_core.backends.default_order` gives, or the forced backend alone), else None:
    use the reference codecs."""
    device = torch.device(device)
    forced = backends.forced_backend()
    names = (forced,) if forced is not None else backends.default_order(device)
    registry = backends.available_backends()
    for name in names:
        status = registry.get(name)
        offer = getattr(status.backend, "codecs", None) if status and status.usable else None
        if offer is None:
            continue
        try:
            kernels = offer(device)
        except Exception:  # a backend's probe must not break a conversion: use the reference
            continue
        if kernels is not None:
            return kernels
    return None


def _kernels_for(*tensors: Tensor | None) -> Any | None:
    present = [t for t in tensors if t is not None]
    # plain tensors only: a subclass (a sharded DTensor) keeps its bytes elsewhere than
    # data_ptr(), and the reference's torch operations handle it
    if not present or not all(type(t) is Tensor for t in present):
        return None
    device = present[0].device
    if any(t.device != device for t in present):
        return None
    return codec_kernels(device)


def decode_moment(codec: MomentCodec, fields: Mapping[str, Tensor]) -> Tensor:
    """The flat fp32 vector ``fields`` hold (:meth:`MomentCodec.decode_sliced`'s values)."""
    kernels = _kernels_for(*fields.values()) if isinstance(fields, Mapping) else None
    if kernels is None:
        return codec.decode_sliced(dict(fields))
    return kernels.decode_moment(codec.name, dict(fields)).reshape(-1)


def encode_moment(
    codec: MomentCodec, x: Tensor, *, rand: Tensor | None = None
) -> dict[str, Tensor]:
    """The fields of flat fp32 ``x``, rounded to nearest (:meth:`MomentCodec.encode_sliced`'s
    bits), or stochastically with ``rand`` (int64 words, one per element: ``encode``'s)."""
    kernels = _kernels_for(x, rand)
    if kernels is None:
        return codec.encode_sliced(x) if rand is None else codec.encode(x, rand=rand)
    # rand only where given: codec kernels of KERNEL_API 8 need not take it for nearest
    fields = (
        kernels.encode_moment(codec.name, x)
        if rand is None
        else kernels.encode_moment(codec.name, x, rand=rand)
    )
    return {k: v.reshape(-1) for k, v in fields.items()}


def decode_master(codec: MasterCodec, param: Tensor, code: Tensor | None) -> Tensor:
    """The flat fp32 master weight ``param`` and ``code`` hold (:meth:`MasterCodec.decode_sliced`'s
    values)."""
    kernels = _kernels_for(param, code)
    if kernels is None:
        return codec.decode_sliced(param, code)
    return kernels.decode_master(codec.name, param, code).reshape(-1)


def encode_master(codec: MasterCodec, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(param, code)`` of flat fp32 ``x``, rounded to nearest (:meth:`MasterCodec.encode`'s
    bits)."""
    kernels = _kernels_for(x)
    if kernels is None:
        return codec.encode(x)
    return kernels.encode_master(codec.name, x, codec.param_dtype)


def encode_master_into(
    codec: MasterCodec,
    x: Tensor,
    param: Tensor | None,
    code: Tensor | None,
    *,
    slice_elems: int = ENCODE_SLICE,
) -> None:
    """:meth:`MasterCodec.encode_into`: ``x`` rounded to nearest, written into ``param`` and/or
    ``code`` (None: not wanted) a slice at a time, so the kernels' outputs are no larger than a
    slice."""
    kernels = _kernels_for(x, param, code)
    encode = (
        None
        if kernels is None
        else partial(kernels.encode_master, codec.name, param_dtype=codec.param_dtype)
    )
    codec.encode_into(x, param, code, slice_elems=slice_elems, encode=encode)


def check_second_moment(v: Tensor, what: str) -> None:
    """:class:`StateDictError` naming ``what`` where the second moment ``v`` (stored values or
    codes of any floating dtype, float8 included, whose sign is the value's) holds a value below
    zero. An average of squares never is one, and a state dict that loads it (torch's
    ``load_state_dict`` does) steps to NaN weights through its square root. -0.0 and NaN pass
    (NaN is what a diverged run holds: the caller may want it back). In slices of
    ``ENCODE_SLICE`` elements, so that a float8 tensor's float32 copy stays small."""
    flat = v.detach().reshape(-1)
    for i in range(0, flat.numel(), ENCODE_SLICE):
        part = flat[i : i + ENCODE_SLICE]
        if part.element_size() == 1:  # torch compares no float8
            part = part.float()
        if bool((part < 0).any()):
            raise StateDictError(
                f"{what} holds negative values, which no second moment (an average of squared "
                "gradients) can: the state is corrupt"
            )


def denormalize_second_moment(u: Tensor, norm: float) -> Tensor:
    """The fp32 second moment ``v = u * norm`` of a decoded decay-normalized one (``norm``:
    ``MemOptimizer.decay_norm``), rounded once (a double product); ``u`` itself where ``norm``
    is 1.0."""
    if norm == 1.0:
        return u
    return (u.double() * norm).to(torch.float32)


def saved_step_count(step: Any) -> int | None:
    """A saved state entry's ``step`` (a number or a one-element tensor) as an int, or None
    where it is not a whole number >= 0. For conversions that need a count before the
    optimizer's ``load_state_dict`` has checked it (the ``decay_norm`` of a second moment):
    None makes them leave the entry alone, and the load then refuses it, naming the entry."""
    if isinstance(step, Tensor):
        if step.numel() != 1 or step.is_complex() or step.is_meta:
            return None
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        return None
    try:
        count = float(step)
    except OverflowError:
        return None
    return int(count) if count >= 0 and count.is_integer() else None


def normalize_second_moment(v: Tensor, norm: float) -> Tensor:
    """``u = v / norm`` in fp32, rounded toward zero, to encode (the inverse of
    :func:`denormalize_second_moment`). Toward zero, so that a decoded ``u`` survives the round
    trip: ``v / norm`` lies within an fp32 unit of ``u``, and a value just above a block's
    largest code would move the block's scale up, where one just below encodes back to ``u``."""
    if norm == 1.0:
        return v
    exact = v.double() / norm
    out = exact.to(torch.float32)
    above = out.double().abs() > exact.abs()
    return torch.where(above, torch.nextafter(out, torch.zeros_like(out)), out)
