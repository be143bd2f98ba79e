"""The pure-torch backend: every rule x format, on any device torch runs on (CPU, CUDA).

It is the executable form of the semantics every kernel reproduces bit for bit. A group's step
runs in *pieces* of at most :data:`MEMOPT_TORCH_PIECE` elements (default ``2**22``) of the
arena's layout: large tensors are cut at block boundaries, small ones are packed many to a
piece. For each piece it gathers the parameters and gradients into flat fp32 vectors laid out
like the arena (padding elements zero), decodes the master weights and moments with the reference
codecs, runs the reference rule (:mod:`memopt_core.reference`), encodes the results (stochastic
rounding words from :mod:`memopt_core.rng`, keyed by each element's index within its own tensor
and its tensor id, so the cut changes no bit) and writes the piece back before the next starts.

Memory: every rule and format is elementwise within a quantization block, so a piece needs only
its own elements, and the transient memory of a step is proportional to the piece size, whatever
the size of the group. Its peak (measured on CPU and CUDA, which agree) is about 280 bytes per
piece element with q8 moments and stochastic rounding, about 1.1 GiB for the default piece (the
q8 second-moment encoder's int64 temporaries dominate), and 115-150 bytes for the other formats
(the stochastic-rounding generator works in int64 too).

Cost: a fixed number of vectorized torch ops per piece plus a few Python operations per tensor
segment, so it is slower than a fused kernel but has no per-element Python work.

State names by rule (the optimizer's convention): ``adam``: ``exp_avg`` (first-moment codec) and
``exp_avg_sq`` (second); ``lion``: ``exp_avg``; ``sgd``: ``momentum_buffer`` (first), only when
momentum is non-zero.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from memopt_core import reference
from memopt_core.aliasing import refuse_negated
from memopt_core.backends import KERNEL_API, RULES, GroupStep, grad_dtype_ok, supports_formats
from memopt_core.errors import ConfigError, FormatError
from memopt_core.formats import MasterCodec, MomentCodec, StateSpec
from memopt_core.plan import Slot
from memopt_core.rng import (
    STREAM_FIRST,
    STREAM_MASTER,
    STREAM_SECOND,
    fold_index,
    lowbias32,
    step_keys,
)

__all__ = ["MEMOPT_TORCH_PIECE", "TorchBackend"]

#: Elements per piece: the transient memory of a step is proportional to it, not to the group.
#: The environment variable of the same name overrides it (read at every step; tests may also
#: set this attribute). It must be a multiple of :data:`PIECE_UNIT`.
MEMOPT_TORCH_PIECE = 2**22
#: The largest block size of any format: pieces cut tensors only at multiples of it.
PIECE_UNIT = 32

# Codecs whose encode ignores ``rand``: no need to draw words for them.
_EXACT_MOMENTS = ("fp32",)
_EXACT_MASTERS = ("fp32", "ecc32")


@dataclass(frozen=True)
class _Segment:
    """Elements ``start .. start + length`` of the padded slot of tensor ``pos`` of the step.

    ``pos`` indexes the step's ``slots``/``params``/``grads``/``tensor_ids``; ``start`` and
    ``length`` are multiples of the plan's block size; the first ``real`` elements are the
    tensor's, the rest padding.
    """

    pos: int
    start: int
    length: int
    real: int


@dataclass(frozen=True)
class _Piece:
    """Consecutive segments of the step's layout, processed together.

    ``runs`` are the ``(arena offset, length)`` ranges the segments cover, adjacent ones merged:
    one run when every tensor takes part, so arena fields are read as views and written in place.
    """

    segments: tuple[_Segment, ...]
    runs: tuple[tuple[int, int], ...]
    length: int


def _piece_size(block_size: int) -> int:
    """Elements per piece: ``MEMOPT_TORCH_PIECE`` from the environment, else the module's."""
    piece = os.environ.get("MEMOPT_TORCH_PIECE") or MEMOPT_TORCH_PIECE
    unit = math.lcm(PIECE_UNIT, block_size)
    try:
        n = int(piece)
    except ValueError:
        n = 0
    if n <= 0 or n % unit:
        raise ConfigError(
            f"MEMOPT_TORCH_PIECE must be a positive multiple of {unit} elements (whole blocks), "
            f"got {piece!r}"
        )
    return n


def _cut(slots: list[Slot], piece: int) -> list[_Piece]:
    """``slots`` (in step order) cut into pieces of at most ``piece`` elements of padded layout."""
    pieces: list[_Piece] = []
    segments: list[_Segment] = []
    runs: list[tuple[int, int]] = []
    used = 0
    for pos, slot in enumerate(slots):
        start = 0
        while start < slot.padded:
            # padded lengths and the piece size are multiples of the block size, so every cut
            # falls on a block boundary
            n = min(slot.padded - start, piece - used)
            segments.append(_Segment(pos, start, n, max(0, min(n, slot.numel - start))))
            at = slot.offset + start
            if runs and runs[-1][0] + runs[-1][1] == at:
                runs[-1] = (runs[-1][0], runs[-1][1] + n)
            else:
                runs.append((at, n))
            used += n
            start += n
            if used == piece:
                pieces.append(_Piece(tuple(segments), tuple(runs), used))
                segments, runs, used = [], [], 0
    if segments:
        pieces.append(_Piece(tuple(segments), tuple(runs), used))
    return pieces


def _pieces(work: GroupStep, piece: int) -> list[_Piece]:
    """The pieces of ``work``; cached on the plan when every tensor takes part."""
    plan = work.plan
    if work.full:
        return plan.cache(("torch_pieces", piece), lambda: _cut(plan.slots, piece))
    return _cut([plan.slots[i] for i in work.slots], piece)


def _flat_range(t: Tensor, a: int, b: int) -> list[Tensor]:
    """Views of ``t`` that cover its elements ``a .. b`` in row-major order, in order.

    One view for a contiguous tensor. A non-contiguous one (a transposed or channels-last
    parameter) has no flat view, so the range is split along the leading dimension into a partial
    row, whole rows and a partial row, recursively: at most ``2 * t.dim() - 1`` views.
    """
    if t.dim() <= 1 or t.is_contiguous():
        return [t.reshape(-1)[a:b]]
    row = t[0].numel()
    first, last = a // row, b // row
    if first == last:
        return _flat_range(t[first], a - first * row, b - first * row)
    views: list[Tensor] = []
    if a % row:
        views += _flat_range(t[first], a % row, row)
        first += 1
    if last > first:
        views.append(t[first:last])
    if b % row:
        views += _flat_range(t[last], 0, b % row)
    return views


def _gather(tensors: list[Tensor], piece: _Piece, pad: Tensor) -> Tensor:
    """The piece's elements of ``tensors`` as one flat vector, padding taken from ``pad``.

    A piece within one contiguous tensor is returned as a view (no copy); readers never write it.
    Mixed dtypes (fp32 and low-precision gradients) promote to the wider one, exactly.
    """
    parts: list[Tensor] = []
    for seg in piece.segments:
        t = tensors[seg.pos].detach()
        parts += [v.reshape(-1) for v in _flat_range(t, seg.start, seg.start + seg.real)]
        if seg.real < seg.length:
            parts.append(pad[: seg.length - seg.real])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _scatter(tensors: list[Tensor], piece: _Piece, values: Tensor) -> None:
    """Write the real (non-padding) elements of the piece vector ``values`` into ``tensors``."""
    for seg, src in zip(
        piece.segments, values.split([s.length for s in piece.segments]), strict=True
    ):
        at = 0
        for view in _flat_range(tensors[seg.pos].detach(), seg.start, seg.start + seg.real):
            view.copy_(src[at : at + view.numel()].view(view.shape))
            at += view.numel()


def _read(flat: Tensor, runs: tuple[tuple[int, int], ...], unit: int) -> Tensor:
    """The piece's entries of an arena tensor (``unit`` elements per entry): a view for one run."""
    parts = [flat[a // unit : (a + n) // unit] for a, n in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _write(flat: Tensor, runs: tuple[tuple[int, int], ...], unit: int, value: Tensor) -> None:
    """Store the piece's entries ``value`` of an arena tensor (the inverse of :func:`_read`)."""
    for (a, n), v in zip(runs, value.split([n // unit for _, n in runs]), strict=True):
        flat[a // unit : (a + n) // unit].copy_(v)


def _sr_words(work: GroupStep, piece: _Piece) -> Callable[[int], Tensor]:
    """``draw(stream)``: the words of one stream for the piece's elements, keyed by each one's
    index in its own tensor (plus the tensor's :meth:`~memopt_core.backends.GroupStep.index_base`).
    Streams are drawn on demand, so a step pays only for the ones its formats round."""
    dev = work.plan.device
    segs = piece.segments
    if len(segs) == 1:
        # a piece of one tensor (every piece of a large one): its keys stay scalars
        seg = segs[0]
        first = work.index_base(seg.pos) + seg.start
        index = torch.arange(first, first + seg.length, dtype=torch.int64, device=dev)
        keys = step_keys(work.seed, work.tensor_ids[seg.pos], work.step)
        y = fold_index(index, keys[3])
        return lambda stream: lowbias32(y ^ keys[stream])
    lengths = torch.tensor([s.length for s in segs], dtype=torch.int64, device=dev)
    at, shift = 0, []
    for s in segs:
        shift.append(work.index_base(s.pos) + s.start - at)
        at += s.length
    ids = torch.tensor([work.tensor_ids[s.pos] for s in segs], dtype=torch.int64, device=dev)
    # one Philox block per tensor; each element looks its tensor's keys up when a stream is drawn
    # (one int64 vector at a time, not the four keys of every element at once)
    seg_keys = step_keys(work.seed, ids, work.step)
    seg_of = torch.repeat_interleave(
        torch.arange(len(segs), device=dev), lengths, output_size=piece.length
    )
    index = torch.arange(piece.length, dtype=torch.int64, device=dev)
    index += torch.tensor(shift, dtype=torch.int64, device=dev)[seg_of]
    y = fold_index(index, seg_keys[3][seg_of])
    del index
    return lambda stream: lowbias32(y ^ seg_keys[stream][seg_of])


def _states(work: GroupStep) -> tuple[str, ...]:
    """The states the step's rule updates, which the arena must hold."""
    if work.rule == "adam":
        return ("exp_avg", "exp_avg_sq")
    if work.rule == "lion":
        return ("exp_avg",)
    return ("momentum_buffer",) if work.scalars.momentum != 0.0 else ()


def _apply_rule(
    work: GroupStep, x: Tensor, g: Tensor, moments: dict[str, Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """The reference rule on one piece: the new master weights and ``{state: new value}``."""
    s = work.scalars
    if work.rule == "adam":
        x, m, v = reference.adam(x, g, moments["exp_avg"], moments["exp_avg_sq"], s)
        return x, {"exp_avg": m, "exp_avg_sq": v}
    if work.rule == "lion":
        x, m = reference.lion(x, g, moments["exp_avg"], s)
        return x, {"exp_avg": m}
    x, buf = reference.sgd(x, g, moments.get("momentum_buffer"), s, first_step=work.first_step)
    return x, {} if buf is None else {"momentum_buffer": buf}


def _field_unit(codec: MomentCodec, suffix: str) -> int:
    """Arena elements per entry of field ``suffix``: the block size for per-block scales."""
    return codec.block_size if codec.fields[suffix].per_block else 1


def _updated(
    work: GroupStep, piece: _Piece, mcodec: MasterCodec
) -> tuple[Tensor, dict[str, Tensor]]:
    """Gather and decode the piece and run the rule: its new master weights and states.

    The inputs (parameters, gradients, decoded states) are freed on return, before encoding.
    """
    plan, arena = work.plan, work.arena
    dev, bs = plan.device, plan.block_size
    p_low = _gather(work.params, piece, torch.zeros(bs, dtype=plan.param_dtype, device=dev))
    g = _gather(work.grads, piece, torch.zeros(bs, dtype=torch.float32, device=dev)).float()
    code = _read(arena.master_code, piece.runs, 1) if arena.master_code is not None else None
    x = mcodec.decode(p_low, code).float()
    # SGD's first step starts the momentum buffer from the gradient: no need to decode it
    names = () if work.rule == "sgd" and work.first_step else _states(work)
    moments = {}
    for name in names:
        codec = arena.codecs[name]
        fields = arena.fields[name]
        moments[name] = codec.decode(
            {f: _read(fields[f], piece.runs, _field_unit(codec, f)) for f in codec.fields}
        )
    return _apply_rule(work, x, g, moments)


def _step_piece(work: GroupStep, piece: _Piece, mcodec: MasterCodec) -> None:
    """Update, encode and write back one piece."""
    arena = work.arena
    x, new = _updated(work, piece, mcodec)

    # encode everything before writing anything: an encoder error leaves the piece untouched.
    # Each value is dropped once encoded and each rounding word drawn just before its encoder,
    # so the encoders' own int64 temporaries (the peak of the step) do not add to them.
    draw = _sr_words(work, piece) if work.spec.stochastic_rounding else None

    def rand(stream: int, exact: bool) -> Tensor | None:
        return None if exact or draw is None else draw(stream)

    p_new, code_new = mcodec.encode(x, rand=rand(STREAM_MASTER, mcodec.name in _EXACT_MASTERS))
    del x
    if arena.master_code is not None and code_new is None:
        raise FormatError(f"master format {mcodec.name!r} returned no code")
    encoded: dict[str, dict[str, Tensor]] = {}
    for name in list(new):
        codec = arena.codecs[name]
        stream = STREAM_SECOND if name == "exp_avg_sq" else STREAM_FIRST
        exact = codec.name in _EXACT_MOMENTS
        encoded[name] = codec.encode(new.pop(name), rand=rand(stream, exact))

    for name, fields in encoded.items():
        codec = arena.codecs[name]
        for suffix, value in fields.items():
            _write(arena.fields[name][suffix], piece.runs, _field_unit(codec, suffix), value)
    if arena.master_code is not None:
        assert code_new is not None  # refused above where the arena keeps a code
        _write(arena.master_code, piece.runs, 1, code_new)
    _scatter(work.params, piece, p_new)


class TorchBackend:
    """Always available; supports every rule and format for fp32/bf16/fp16 parameters."""

    name = "torch"
    KERNEL_API = KERNEL_API

    def available(self) -> tuple[bool, str]:
        """See :meth:`memopt_core.backends.Backend.available`."""
        return True, "pure-torch reference backend (always available)"

    def supports(
        self, rule: str, spec: StateSpec, device: torch.device, param_dtype: torch.dtype
    ) -> bool:
        """See :meth:`memopt_core.backends.Backend.supports`."""
        return supports_formats(rule, spec, param_dtype)

    def __repr__(self) -> str:
        return "TorchBackend()"

    def _check_grads(self, work: GroupStep) -> None:
        """ConfigError naming the first gradient of ``work`` the step cannot take: not a dense
        tensor of its parameter's device and element count, of a dtype
        :func:`~memopt_core.backends.grad_dtype_ok` refuses, or negated. MemOptimizer checks
        them before it calls a backend; a direct caller of :meth:`step` gets the same
        refusals as from the cpu and Triton kernels (a gradient of another size or dtype
        updated part of the group or ran with its values converted). Not the optional
        ``check`` of the backend protocol: ``backends.check_works`` would run it a second
        time before each step that already runs it; skipped for work whose
        ``grads_checked`` says its caller checked them."""
        n = len(work.slots)
        if len(work.params) != n or len(work.grads) != n:
            raise ConfigError(
                f"a step over {n} slots got {len(work.params)} parameters and "
                f"{len(work.grads)} gradients"
            )
        for k, (si, p, g) in enumerate(zip(work.slots, work.params, work.grads, strict=True)):
            what = f"the gradient of parameter {k} (plan slot {si})"
            if not isinstance(g, Tensor):
                raise ConfigError(f"{what} must be a torch.Tensor, got {type(g).__name__}")
            if g.layout != torch.strided or g.device != p.device or g.numel() != p.numel():
                raise ConfigError(
                    f"{what} is a {g.layout} tensor of {g.numel()} elements on {g.device}; its "
                    f"parameter has {p.numel()} on {p.device} (a dense gradient of its size)"
                )
            if not grad_dtype_ok(p.dtype, g.dtype):
                raise ConfigError(
                    f"{what} is {g.dtype}: gradients must have the parameter's dtype "
                    f"({p.dtype}) or float32 (float32 parameters also bfloat16 or float16)"
                )
            refuse_negated(what, g)

    def step(self, work: GroupStep) -> None:
        """See :meth:`memopt_core.backends.Backend.step`."""
        if work.rule not in RULES:
            raise ConfigError(f"the torch backend runs rules {RULES}, got {work.rule!r}")
        if not work.grads_checked:  # a direct caller; MemOptimizer checked them already
            self._check_grads(work)
        # checked before the first piece: a missing state must not leave the group half updated
        missing = [name for name in _states(work) if name not in work.arena.codecs]
        if missing:
            raise FormatError(
                f"the state arena of {work.plan} has no {missing[0]!r} state (it has "
                f"{sorted(work.arena.codecs)}); the optimizer must allocate it"
            )
        mcodec = work.spec.master_for(work.plan.param_dtype)
        for piece in _pieces(work, _piece_size(work.plan.block_size)):
            _step_piece(work, piece, mcodec)
