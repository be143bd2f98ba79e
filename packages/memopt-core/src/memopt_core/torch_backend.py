"""The pure-torch backend: every rule x format, on any device torch runs on (CPU, CUDA).

It is the executable form of the semantics every kernel reproduces bit for bit: for a group of
tensors it gathers the parameters and gradients into flat fp32 vectors laid out like the state
arena (padding elements zero), decodes the master weights and moments with the reference codecs,
runs the reference rule (:mod:`memopt_core.reference`) once over the whole vector, encodes the
results (stochastic rounding words from :mod:`memopt_core.rng` when the spec asks for it) and
scatters the parameters back. Cost: one Python loop over the tensors for gather/scatter and a
fixed number of vectorized torch ops per group, so it is slower than a fused kernel but has no
per-element Python work.

State names by rule (the optimizer's convention): ``adam``: ``exp_avg`` (first-moment codec) and
``exp_avg_sq`` (second); ``lion``: ``exp_avg``; ``sgd``: ``momentum_buffer`` (first), only when
momentum is non-zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from memopt_core import reference
from memopt_core.backends import KERNEL_API, RULES, GroupStep
from memopt_core.errors import ConfigError, FormatError
from memopt_core.formats import MasterCodec, MomentCodec, StateSpec
from memopt_core.plan import GroupPlan, Slot
from memopt_core.rng import STREAM_FIRST, STREAM_MASTER, STREAM_SECOND, stream_words

__all__ = ["TorchBackend", "sr_counters"]

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Codecs whose encode ignores ``rand``: no need to draw words for them.
_EXACT_MOMENTS = ("fp32",)
_EXACT_MASTERS = ("fp32", "ecc32")


@dataclass
class _Layout:
    """The compact layout of the tensors taking part in one step (the arena's when all do)."""

    slots: list[Slot]
    offsets: list[int]  # element offset of each slot in the compact vectors
    total: int
    index: Tensor | None = None  # element index within its own tensor (int64, device)
    tensor_id: Tensor | None = None  # tensor id of each element (int64, device)


def _layout(plan: GroupPlan, slots: list[int]) -> _Layout:
    chosen = [plan.slots[i] for i in slots]
    offsets, off = [], 0
    for s in chosen:
        offsets.append(off)
        off += s.padded
    return _Layout(chosen, offsets, off)


def sr_counters(plan: GroupPlan, slots: list[int], tensor_ids: list[int]) -> tuple[Tensor, Tensor]:
    """``(index, tensor_id)`` int64 vectors of the compact layout of ``slots``.

    Cached on the plan when every tensor takes part (16 bytes per arena element, kept with the
    plan); computed afresh for partial steps (gradient release steps one tensor at a time, and a
    cache per subset would keep 16 bytes per element for every tensor).
    """

    def build() -> tuple[Tensor, Tensor]:
        lens = torch.tensor([plan.slots[i].padded for i in slots], dtype=torch.int64)
        total = int(lens.sum())
        starts = torch.cumsum(lens, 0) - lens
        index = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(starts, lens)
        tid = torch.repeat_interleave(torch.tensor(tensor_ids, dtype=torch.int64), lens)
        return index.to(plan.device), tid.to(plan.device)

    if len(slots) != len(plan.slots):
        return build()
    return plan.cache(("sr_index", tuple(tensor_ids)), build)


class TorchBackend:
    """Always available; supports every rule and format for fp32/bf16/fp16 parameters."""

    name = "torch"
    KERNEL_API = KERNEL_API

    def available(self) -> tuple[bool, str]:
        return True, "pure-torch reference backend (always available)"

    def supports(
        self, rule: str, spec: StateSpec, device: torch.device, param_dtype: torch.dtype
    ) -> bool:
        if rule not in RULES or param_dtype not in _PARAM_DTYPES:
            return False
        try:
            spec.master_for(param_dtype)
        except ConfigError:
            return False
        return True

    def __repr__(self) -> str:
        return "TorchBackend()"

    # ------------------------------------------------------------------------------------ step
    def step(self, work: GroupStep) -> None:
        plan, arena, spec = work.plan, work.arena, work.spec
        if work.rule not in RULES:
            raise ConfigError(f"the torch backend runs rules {RULES}, got {work.rule!r}")
        full = len(work.slots) == len(plan.slots)
        lay = (
            plan.cache("layout", lambda: _layout(plan, work.slots))
            if full
            else _layout(plan, work.slots)
        )
        n = lay.total
        if n == 0:
            return
        dev = plan.device
        mcodec: MasterCodec = spec.master_for(plan.param_dtype)

        # gather parameters and gradients (padding stays zero)
        p_low = torch.zeros(n, dtype=plan.param_dtype, device=dev)
        g = torch.zeros(n, dtype=torch.float32, device=dev)
        for s, off, p, gr in zip(lay.slots, lay.offsets, work.params, work.grads, strict=True):
            if s.numel:
                p_low[off : off + s.numel].copy_(p.detach().reshape(-1))
                g[off : off + s.numel].copy_(gr.detach().reshape(-1))

        def gather_elems(flat: Tensor) -> Tensor:
            if full:
                return flat
            return torch.cat([flat[s.offset : s.offset + s.padded] for s in lay.slots])

        def gather_field(name: str, suffix: str) -> Tensor:
            if full:
                return arena.fields[name][suffix]
            return torch.cat([arena.field_slice(name, suffix, s) for s in lay.slots])

        code = gather_elems(arena.master_code) if arena.master_code is not None else None
        x = mcodec.decode(p_low, code)
        if x.dtype != torch.float32:
            x = x.float()

        def moment(name: str) -> Tensor:
            if name not in arena.codecs:
                raise FormatError(
                    f"the state arena of {plan} has no {name!r} state (it has "
                    f"{sorted(arena.codecs)}); the optimizer must allocate it"
                )
            codec = arena.codecs[name]
            return codec.decode({f: gather_field(name, f) for f in codec.fields})

        s = work.scalars
        new: dict[str, Tensor] = {}
        if work.rule == "adam":
            x, new["exp_avg"], new["exp_avg_sq"] = reference.adam(
                x, g, moment("exp_avg"), moment("exp_avg_sq"), s
            )
        elif work.rule == "lion":
            x, new["exp_avg"] = reference.lion(x, g, moment("exp_avg"), s)
        else:
            buf = None
            if s.momentum != 0.0:
                current = moment("momentum_buffer")  # also raises when the arena lacks it
                buf = None if work.first_step else current  # first step: buf = g
            x, buf = reference.sgd(x, g, buf, s, first_step=work.first_step)
            if buf is not None:
                new["momentum_buffer"] = buf

        # encode everything before writing anything
        streams = None
        if spec.stochastic_rounding:
            index, tensor_id = sr_counters(plan, work.slots, work.tensor_ids)
            streams = stream_words(work.seed, tensor_id, index, work.step)

        def rand(stream: int, exact: bool) -> Tensor | None:
            return None if streams is None or exact else streams[stream]

        p_new, code_new = mcodec.encode(x, rand=rand(STREAM_MASTER, mcodec.name in _EXACT_MASTERS))
        encoded: dict[str, dict[str, Tensor]] = {}
        for name, value in new.items():
            codec: MomentCodec = arena.codecs[name]
            stream = STREAM_SECOND if name == "exp_avg_sq" else STREAM_FIRST
            encoded[name] = codec.encode(value, rand=rand(stream, codec.name in _EXACT_MOMENTS))

        # write back: arena fields, master codes, parameters
        for name, fields in encoded.items():
            codec = arena.codecs[name]
            for suffix, value in fields.items():
                if full:
                    arena.fields[name][suffix].copy_(value)
                    continue
                per_block = codec.fields[suffix].per_block
                bs = codec.block_size if per_block else 1
                for sl, off in zip(lay.slots, lay.offsets, strict=True):
                    arena.field_slice(name, suffix, sl).copy_(
                        value[off // bs : (off + sl.padded) // bs]
                    )
        if arena.master_code is not None:
            if code_new is None:
                raise FormatError(f"master format {mcodec.name!r} returned no code")
            if full:
                arena.master_code.copy_(code_new)
            else:
                for sl, off in zip(lay.slots, lay.offsets, strict=True):
                    arena.master_code[sl.offset : sl.offset + sl.padded].copy_(
                        code_new[off : off + sl.padded]
                    )
        for sl, off, p in zip(lay.slots, lay.offsets, work.params, strict=True):
            if sl.numel:
                p.detach().copy_(p_new[off : off + sl.numel].view(p.shape))
