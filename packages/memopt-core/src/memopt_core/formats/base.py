"""The codec interfaces every state format implements.

A *moment codec* stores a flat fp32 vector (a first or second moment, a momentum buffer) in
compact fields; a *master codec* splits an fp32 master weight into the low-precision parameter the
model sees plus an optional correction code. Both are pure-torch references: kernels reproduce
their bits exactly (DESIGN section 4), so every operation here is exact integer/bit arithmetic or a
single correctly rounded IEEE operation.

Blocked formats work on whole blocks of ``block_size`` elements: the plan pads every tensor to a
multiple of the block so a block never straddles two tensors, and callers pass padded lengths.

Stochastic rounding: ``encode(x, rand=r)`` takes ``r``, an int64 tensor of x's element count
(any shape, read in x's flattened order, as the kernels read it) holding uniform 32-bit words
(values in [0, 2**32); others count modulo 2**32, as in the kernels) from
:mod:`memopt_core.rng`; ``rand=None`` rounds to nearest. The rule, the same in every format: with ``lo <= |y| <= hi`` the two neighbours of the
magnitude ``|y|`` on the target grid, ``frac24 = floor((|y| - lo) / (hi - lo) * 2**24)``, the
magnitude rounds up to ``hi`` iff ``(r >> 8) < frac24``; the sign is kept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ENCODE_SLICE", "FieldSpec", "MasterCodec", "MomentCodec"]

#: Elements per slice of the sliced encoders (a multiple of every block size): the reference
#: codecs hold bit patterns in int64 temporaries, tens of bytes per element, so encoding a whole
#: embedding at once (136M elements in Qwen2.5-0.5B) takes gigabytes; slices bound that.
ENCODE_SLICE = 1 << 22


@dataclass(frozen=True)
class FieldSpec:
    """One stored field of a format: its dtype and how many entries it holds per element/block."""

    dtype: torch.dtype
    per_block: bool = False  # True: one entry per block (scales); False: one per element

    def numel(self, n: int, block_size: int) -> int:
        return n // block_size if self.per_block else n


class MomentCodec(ABC):
    """A moment format. ``name`` is its key in the registry; ``block_size`` is 1 when unblocked."""

    name: str
    block_size: int = 1
    #: ``{field suffix: FieldSpec}``; the optimizer stores field ``f`` of state ``exp_avg`` under
    #: the state key ``exp_avg`` when the suffix is ``""``, else ``f"exp_avg_{suffix}"``.
    fields: dict[str, FieldSpec]
    #: True when the stored value can be negative (first moments); second moments are >= 0.
    signed: bool = True

    def bytes_per_element(self) -> float:
        return sum(
            f.dtype.itemsize / (self.block_size if f.per_block else 1) for f in self.fields.values()
        )

    def allocate(
        self,
        n: int,
        device: torch.device | str = "cpu",
        zeros: Callable[[int, torch.dtype, torch.device], Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """Zeroed fields for ``n`` elements (``n`` a multiple of ``block_size``); they decode to 0.
        ``zeros(numel, dtype, device)`` allocates each field (default ``torch.zeros``)."""
        self.check_length(n)
        device = torch.device(device)
        return {
            k: (
                torch.zeros(f.numel(n, self.block_size), dtype=f.dtype, device=device)
                if zeros is None
                else zeros(f.numel(n, self.block_size), f.dtype, device)
            )
            for k, f in self.fields.items()
        }

    def check_length(self, n: int) -> None:
        if n % self.block_size:
            from memopt_core.errors import FormatError

            raise FormatError(
                f"format {self.name!r} stores whole blocks of {self.block_size} elements; got a "
                f"length of {n}: pad it to a multiple of {self.block_size} (memopt_core.plan does)"
            )

    def check_fields(self, fields: Mapping[str, Tensor]) -> None:
        """FormatError unless ``fields`` holds this format's fields, each of its dtype, with one
        scale per block of the codes: :meth:`decode` reads bit patterns, so a field of another
        dtype would be reinterpreted (a float32 tensor read as twice as many bf16 values)."""
        from memopt_core.errors import FormatError

        what = f"format {self.name!r}"
        if not isinstance(fields, Mapping):
            raise FormatError(f"{what} decodes a dict of fields, got {type(fields).__name__}")
        missing = [k for k in self.fields if k not in fields]
        if missing:
            raise FormatError(f"{what} needs fields {list(self.fields)}; missing {missing}")
        for k, spec in self.fields.items():
            t = fields[k]
            if not isinstance(t, Tensor) or t.dtype != spec.dtype:
                got = t.dtype if isinstance(t, Tensor) else type(t).__name__
                raise FormatError(f"field {k!r} of {what} must be a {spec.dtype} tensor, got {got}")
        n = next(fields[k].numel() for k, f in self.fields.items() if not f.per_block)
        self.check_length(n)
        for k, spec in self.fields.items():
            if spec.per_block and fields[k].numel() != n // self.block_size:
                raise FormatError(
                    f"field {k!r} of {what} holds {fields[k].numel()} entries; {n} elements "
                    f"take {n // self.block_size} (one per block of {self.block_size})"
                )

    @abstractmethod
    def encode(self, x: Tensor, *, rand: Tensor | None = None) -> dict[str, Tensor]:
        """Fields holding fp32 vector ``x`` (round to nearest, or stochastically with ``rand``)."""

    @abstractmethod
    def decode(self, fields: dict[str, Tensor]) -> Tensor:
        """The fp32 vector the fields hold (checked by :meth:`check_fields`)."""

    def encode_sliced(self, x: Tensor, *, slice_elems: int = ENCODE_SLICE) -> dict[str, Tensor]:
        """:meth:`encode` (round to nearest) of fp32 vector ``x``, a slice of whole blocks at a
        time: the same bits, with temporaries bounded by the slice instead of ``x``."""
        self.check_length(x.numel())
        if slice_elems <= 0 or slice_elems % self.block_size:
            raise ValueError(f"slice_elems must be a positive multiple of {self.block_size}")
        out = self.allocate(x.numel(), x.device)
        for i in range(0, x.numel(), slice_elems):
            j = min(i + slice_elems, x.numel())
            for k, v in self.encode(x[i:j]).items():
                per = self.block_size if self.fields[k].per_block else 1  # j is a whole block
                out[k][i // per : j // per].copy_(v)
        return out

    def decode_sliced(
        self, fields: dict[str, Tensor], *, slice_elems: int = ENCODE_SLICE
    ) -> Tensor:
        """:meth:`decode`, a slice of whole blocks at a time: the same values, with temporaries
        bounded by the slice (the output, 4 bytes per element, is the only full-size tensor)."""
        if slice_elems <= 0 or slice_elems % self.block_size:
            raise ValueError(f"slice_elems must be a positive multiple of {self.block_size}")
        n = next(
            (t.numel() for k, t in fields.items() if not self.fields[k].per_block),
            None,
        )
        if n is None:
            raise ValueError(f"format {self.name!r} needs its per-element field")
        first = next(iter(fields.values()))
        out = torch.empty(n, dtype=torch.float32, device=first.device)
        for i in range(0, n, slice_elems):
            j = min(i + slice_elems, n)
            part = {}
            for k, t in fields.items():
                per = self.block_size if self.fields[k].per_block else 1
                part[k] = t.reshape(-1)[i // per : -(-j // per)]
            out[i:j] = self.decode(part)
        return out


class MasterCodec(ABC):
    """A master-weight format: fp32 master -> (parameter in ``param_dtype``, optional code)."""

    name: str
    param_dtype: torch.dtype
    #: dtype of the correction code, or None when the parameter alone holds the weight.
    code_dtype: torch.dtype | None

    @abstractmethod
    def encode(self, x: Tensor, *, rand: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """``(param, code)`` for fp32 ``x``."""

    def check_decode(self, param: Tensor, code: Tensor | None) -> None:
        """FormatError unless ``param`` has this format's parameter dtype and ``code`` its code
        dtype (None where the format has no code) with one entry per element: :meth:`decode`
        reads bit patterns, so another dtype would be reinterpreted, not refused."""
        from memopt_core.errors import FormatError

        what = f"master format {self.name!r}"
        if not isinstance(param, Tensor) or param.dtype != self.param_dtype:
            got = param.dtype if isinstance(param, Tensor) else type(param).__name__
            raise FormatError(f"{what} decodes a {self.param_dtype} parameter, got {got}")
        if self.code_dtype is None:
            if code is not None:
                raise FormatError(f"{what} has no code; got a {code.dtype} tensor")
            return
        if code is None:
            raise FormatError(f"{what} decodes a parameter together with its code; got None")
        if not isinstance(code, Tensor) or code.dtype != self.code_dtype:
            got = code.dtype if isinstance(code, Tensor) else type(code).__name__
            raise FormatError(f"{what} takes a {self.code_dtype} code, got {got}")
        if code.numel() != param.numel():
            raise FormatError(
                f"{what}: the code holds {code.numel()} entries for {param.numel()} elements"
            )

    @abstractmethod
    def decode(self, param: Tensor, code: Tensor | None) -> Tensor:
        """The fp32 master weight held by ``param`` and ``code`` (checked by
        :meth:`check_decode`)."""

    def encode_into(
        self,
        x: Tensor,
        param: Tensor | None,
        code: Tensor | None,
        *,
        slice_elems: int = ENCODE_SLICE,
        encode: Callable[[Tensor], tuple[Tensor, Tensor | None]] | None = None,
    ) -> None:
        """:meth:`encode` (round to nearest) of ``x`` written into ``param`` and/or ``code``
        (either may be None: not wanted), a slice at a time. Every master format is elementwise,
        so the bits are :meth:`encode`'s, with temporaries bounded by the slice instead of ``x``.
        ``x`` is converted to fp32 a slice at a time; the outputs must be contiguous with
        ``x``'s number of elements. ``encode``: what encodes a slice, if not :meth:`encode` (a
        kernel's codec with the same bits, :mod:`memopt_core.conversions`)."""
        if slice_elems <= 0:
            raise ValueError("slice_elems must be positive")
        flat = x.reshape(-1)
        outs = [t.view(-1) if t is not None else None for t in (param, code)]
        for o in outs:
            if o is not None and o.numel() != flat.numel():
                raise ValueError(f"an output holds {o.numel()} elements, x {flat.numel()}")
        for i in range(0, flat.numel(), slice_elems):
            j = min(i + slice_elems, flat.numel())
            for o, v in zip(outs, (encode or self.encode)(flat[i:j].float()), strict=True):
                if o is not None and v is not None:
                    o[i:j].copy_(v)

    def decode_sliced(
        self, param: Tensor, code: Tensor | None, *, slice_elems: int = ENCODE_SLICE
    ) -> Tensor:
        """:meth:`decode` of flat ``param`` and ``code``, a slice at a time: the same values,
        with temporaries bounded by the slice (the fp32 output is the only full-size tensor)."""
        if slice_elems <= 0:
            raise ValueError("slice_elems must be positive")
        p = param.reshape(-1)
        c = None if code is None else code.reshape(-1)
        out = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
        for i in range(0, p.numel(), slice_elems):
            j = min(i + slice_elems, p.numel())
            out[i:j] = self.decode(p[i:j], None if c is None else c[i:j])
        return out
