"""Multi-tensor planning: groups of tensors, one state arena per group, chunk tables.

A *plan group* (:class:`GroupPlan`) holds the parameters of one optimizer param group that share
a device, a parameter dtype and a :class:`~memopt_core.formats.StateSpec`. Each parameter gets a
:class:`Slot`: its element count, that count rounded up to the spec's block size (so a
quantization block never straddles two tensors) and its offset in the group's arena.

A :class:`StateArena` stores every state of the group in a few flat tensors: for each state name
(``exp_avg``, ...) and each field of its codec one tensor for the whole group (per-block fields
hold ``total / block_size`` entries), plus the master-weight codes of ECC formats. Per-parameter
state entries are views of these tensors.

Param groups whose plans share a device, a parameter dtype and a spec can keep their arenas in
one *family* (:func:`family_arenas`): a :class:`StateArena` over all their tensors (its plan
concatenates theirs), of which each group's arena is a view. A backend can then step those
groups in one launch, addressing every group's state from the family's fields (memopt's
optimizers do so where the backend offers it, ``merges_groups``).

A *chunk table* (:meth:`GroupPlan.chunk_table`; :meth:`GroupPlan.subset_chunk_table` for the
tensors of one step, numbered by their position in it) cuts the work into chunks of at most
``chunk_size`` elements that never cross a tensor: an int64 ``(n_chunks, 4)`` tensor with
columns ``(slot, start within the tensor, length, arena offset of the chunk's first element)``.
``chunk_size`` is a multiple of the block size, so every chunk covers whole blocks; ``length``
counts the tensor's real elements (the last chunk of a tensor stops at ``numel``, and its last
block is completed by zero padding up to the slot's padded length). Tables are cached on the tuple
of the tensors' ``data_ptr()`` (plus sizes, offsets and chunk size): asking twice with the same
tensors returns the identical tensor object, so kernels can keep device-side pointers.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from memopt_core.errors import ConfigError
from memopt_core.formats import MasterCodec, MomentCodec, StateSpec

__all__ = [
    "CHUNK_COLUMNS",
    "GroupPlan",
    "Slot",
    "StateArena",
    "clear_chunk_cache",
    "element_offsets",
    "expected_layout",
    "family_arenas",
    "make_plans",
    "overlaps_itself",
    "own_storage",
    "padding_unit",
    "round_up",
    "state_key",
]

#: Columns of a chunk table, in order.
CHUNK_COLUMNS = ("slot", "start", "length", "arena_offset")


def ceil_div(n: int, d: int) -> int:
    """``n / d`` rounded up, for integers (``d > 0``)."""
    return -(-n // d)


def round_up(n: int, block: int) -> int:
    """``n`` rounded up to a multiple of ``block``."""
    return ceil_div(n, block) * block


_EXACT_LAYOUT_LIMIT = (
    1 << 22
)  # elements: beyond, a layout the quick test doubts counts as overlapping


def element_offsets(t: Tensor) -> Tensor:
    """The storage offset, in elements from ``t``'s first, of each element of ``t`` (int64, C
    order, on the CPU): what its strides address."""
    offsets = torch.zeros((), dtype=torch.int64, device="cpu")
    for size, stride in zip(t.shape, t.stride(), strict=True):
        offsets = (
            offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64, device="cpu") * stride
        )
    return offsets.reshape(-1)


def overlaps_itself(t: Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an ``expand``ed tensor, stride 0): updating
    it in place is undefined, and a kernel that runs on a contiguous copy could not write the
    result back. Each stride beyond the memory the smaller ones reach proves there is none;
    a layout that fails that test is checked element by element (up to 4M elements, beyond
    which it counts as overlapping)."""
    reach = 0
    for stride, size in sorted(
        (st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz > 1
    ):
        if stride <= reach:
            break
        reach += (size - 1) * stride
    else:
        return False
    if t.numel() > _EXACT_LAYOUT_LIMIT:
        return True
    return bool(element_offsets(t).unique().numel() < t.numel())


def own_storage(t: Tensor) -> Tensor:
    """``t`` when it is contiguous and its storage holds nothing else, else a compact copy: a
    view of an arena, or of a padded buffer, would take its whole storage into ``torch.save``
    and keep it alive."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def state_key(name: str, suffix: str) -> str:
    """The optimizer-state key of field ``suffix`` of state ``name`` (``exp_avg``, ``exp_avg_scale``)."""
    return name if suffix == "" else f"{name}_{suffix}"


@dataclass(frozen=True)
class Slot:
    """One tensor's place in its group: ``index`` in the group, sizes, arena ``offset``."""

    index: int
    shape: torch.Size
    numel: int
    padded: int
    offset: int


class GroupPlan:
    """The layout of one group of tensors (same device, parameter dtype, spec, param group).

    ``params`` are kept in the order given; ``slots[i]`` describes ``params[i]``; ``total`` is the
    arena length in elements (sum of the padded lengths).
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        spec: StateSpec,
        *,
        group_index: int = 0,
        device: torch.device | None = None,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        self.params = list(params)
        if not self.params and (device is None or param_dtype is None):
            raise ConfigError("an empty plan group needs an explicit device and param_dtype")
        self.device = torch.device(device) if device is not None else self.params[0].device
        self.param_dtype = param_dtype if param_dtype is not None else self.params[0].dtype
        self.spec = spec
        self.group_index = group_index
        self.block_size = padding_unit(spec)
        slots = []
        offset = 0
        for i, p in enumerate(self.params):
            if p.device != self.device or p.dtype != self.param_dtype:
                raise ConfigError(
                    f"plan group of {self.param_dtype} tensors on {self.device} got a "
                    f"{p.dtype} tensor of shape {tuple(p.shape)} on {p.device}"
                )
            n = p.numel()
            padded = round_up(n, self.block_size)
            slots.append(Slot(i, p.shape, n, padded, offset))
            offset += padded
        self.slots: list[Slot] = slots
        self.total = offset
        self._aux: dict = {}  # per-plan caches of backends (index vectors, layouts, ...)

    @property
    def key(self) -> tuple:
        """``(device, param dtype, spec, param-group index)``: what the tensors share."""
        return (self.device, self.param_dtype, self.spec, self.group_index)

    def over(self, tensors: Sequence[Tensor]) -> GroupPlan:
        """A plan of this one's spec, param group, device and dtype over ``tensors`` (a family
        of several plans' tensors, a bucket of views)."""
        return GroupPlan(
            tensors,
            self.spec,
            group_index=self.group_index,
            device=self.device,
            param_dtype=self.param_dtype,
        )

    def __len__(self) -> int:
        return len(self.slots)

    def __repr__(self) -> str:
        return (
            f"GroupPlan({len(self.slots)} tensors, {self.total} elements, {self.param_dtype} on "
            f"{self.device}, {self.spec}, group {self.group_index})"
        )

    def cache(self, key, build: Callable[[], object]):
        """A per-plan memo for backends: ``build()`` once per ``key`` (keep keys small)."""
        try:
            return self._aux[key]
        except KeyError:
            value = self._aux[key] = build()
            return value

    def chunk_table(self, chunk_size: int, slots: Sequence[int] | None = None) -> Tensor:
        """The chunk table of ``slots`` (all by default), on the plan's device; cached (see module doc)."""
        _check_chunk_size(chunk_size, self.block_size, self.spec)
        chosen = [self.slots[i] for i in (range(len(self.slots)) if slots is None else slots)]
        key = (
            tuple(self.params[s.index].data_ptr() for s in chosen),
            tuple((s.index, s.numel, s.offset) for s in chosen),
            chunk_size,
            str(self.device),
        )
        table = _CHUNK_CACHE.get(key)
        if table is None:
            table = _build_chunk_table(chosen, chunk_size, self.device)
            _CHUNK_CACHE[key] = table
            while len(_CHUNK_CACHE) > _CHUNK_CACHE_SIZE:
                _CHUNK_CACHE.popitem(last=False)
        else:
            _CHUNK_CACHE.move_to_end(key)
        return table

    def subset_chunk_table(self, chunk_size: int, slots: Sequence[int]) -> Tensor:
        """The chunk table of plan ``slots`` (any order) whose slot column holds each chunk's
        position in ``slots``, not its plan slot: the row of its tensor in tables of the step's
        tensors alone (a backend's per-tensor addresses and words). On the CPU, for the caller
        to upload with its other tables (a blocking copy would wait for the kernels queued
        before it). Built at every call, uncached: the set of tensors a step updates changes
        with the gradients present (a mixture of experts' idle experts), and a cache keyed on
        it would grow with every new set; the caller keeps, bounded, what it reuses."""
        _check_chunk_size(chunk_size, self.block_size, self.spec)
        chosen = [self.slots[i] for i in slots]
        return _build_chunk_table(chosen, chunk_size, torch.device("cpu"), range(len(chosen)))


def padding_unit(spec: StateSpec) -> int:
    """Padding unit of ``spec``'s arena: a multiple of every moment codec's block size."""
    bs = spec.block_size
    lcm = math.lcm(spec.first.block_size, spec.second.block_size)
    return bs if bs % lcm == 0 else lcm


_CHUNK_CACHE: OrderedDict[tuple, Tensor] = OrderedDict()
_CHUNK_CACHE_SIZE = 256


def clear_chunk_cache() -> None:
    """Forget every cached chunk table."""
    _CHUNK_CACHE.clear()


def _check_chunk_size(chunk_size: int, block_size: int, spec: StateSpec) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ConfigError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if chunk_size % block_size:
        raise ConfigError(
            f"chunk_size {chunk_size} must be a multiple of the block size {block_size} "
            f"of {spec} so that a chunk covers whole blocks"
        )


def _build_chunk_table(
    slots: Sequence[Slot], chunk_size: int, device: torch.device, ids: Iterable[int] | None = None
) -> Tensor:
    """The chunk table of ``slots``, with ``ids`` (default: each slot's index) in the slot
    column. The per-slot numbers go to torch through an ``array`` (converting a Python list
    cost about 0.4 us per number), and each slot's row is repeated once per chunk and
    adjusted in place: a few torch calls whatever the number of tensors."""
    if not slots:
        return torch.zeros((0, 4), dtype=torch.int64, device=device)
    numels = [s.numel for s in slots]
    counts = [-(-n // chunk_size) for n in numels]
    n = sum(counts)
    firsts = itertools.accumulate(counts[:-1], initial=0)  # each slot's first row
    ids = (s.index for s in slots) if ids is None else ids
    # per slot: (id, first row x chunk_size, numel, offset); the rows become (slot, start,
    # length, arena offset) below, with start = row x chunk_size - first row x chunk_size
    columns = (ids, (f * chunk_size for f in firsts), numels, (s.offset for s in slots))
    per = array("q", itertools.chain.from_iterable(zip(*columns, strict=True)))
    repeats = torch.frombuffer(array("q", counts), dtype=torch.int64)
    rows = torch.frombuffer(per, dtype=torch.int64).view(-1, 4)
    table = rows.repeat_interleave(repeats, dim=0, output_size=n)
    start = torch.arange(0, n * chunk_size, chunk_size, dtype=torch.int64, device="cpu")
    start.sub_(table[:, 1])
    table[:, 2].sub_(start).clamp_(max=chunk_size)
    table[:, 3].add_(start)
    table[:, 1] = start
    return table.to(device)


def make_plans(
    params: Iterable[Tensor],
    spec_for: StateSpec | Callable[[torch.dtype], StateSpec],
    *,
    group_index: int = 0,
) -> list[GroupPlan]:
    """Split ``params`` into :class:`GroupPlan` s by (device, dtype, spec), in order of first use.

    ``spec_for`` is one spec for every tensor or a function of the parameter dtype (the master
    format depends on it: fp32 parameters use master ``fp32``).
    """
    buckets: dict[tuple, list[Tensor]] = {}
    specs: dict[tuple, StateSpec] = {}
    for p in params:
        spec = spec_for if isinstance(spec_for, StateSpec) else spec_for(p.dtype)
        key = (p.device, p.dtype, spec)
        buckets.setdefault(key, []).append(p)
        specs[key] = spec
    return [
        GroupPlan(ps, specs[key], group_index=group_index, device=key[0], param_dtype=key[1])
        for key, ps in buckets.items()
    ]


class StateArena:
    """Flat state storage of one :class:`GroupPlan`.

    ``moments`` maps each state name to its codec (e.g. ``{"exp_avg": spec.first, "exp_avg_sq":
    spec.second}``). ``fields[name][suffix]`` is one flat tensor for the whole group;
    ``master_code`` is the flat int code tensor of an ECC master (``total`` entries) or None.
    :meth:`views` gives one tensor's entries under the optimizer's state keys: unblocked fields
    (codec block 1) and master codes shaped like the parameter, blocked fields as flat padded views.
    ``zeros(numel, dtype, device)`` allocates each zero-filled flat field (default
    ``torch.zeros``; memopt-offload passes one that first-touches host pages from the threads
    that update them).
    """

    def __init__(
        self,
        plan: GroupPlan,
        moments: Mapping[str, MomentCodec],
        master: MasterCodec | None = None,
        zeros: Callable[[int, torch.dtype, torch.device], Tensor] | None = None,
    ) -> None:
        self.plan = plan
        self.codecs: dict[str, MomentCodec] = dict(moments)
        self.master = master
        #: the family arena this one is a view of (:func:`family_arenas`), or None; then
        #: ``plan.slots[i]`` is slot ``family_slot + i`` of the family's plan, at element
        #: ``family_offset + plan.slots[i].offset`` of its fields
        self.family: StateArena | None = None
        self.family_slot = 0
        self.family_offset = 0
        self.fields: dict[str, dict[str, Tensor]] = {}
        for name, codec in self.codecs.items():
            if plan.block_size % codec.block_size:
                raise ConfigError(
                    f"codec {codec.name!r} has block size {codec.block_size}, which does not divide "
                    f"the plan's padding unit {plan.block_size}"
                )
            self.fields[name] = codec.allocate(plan.total, plan.device, zeros)
        code_dtype = master.code_dtype if master is not None else None
        zeros = zeros or (lambda n, dtype, device: torch.zeros(n, dtype=dtype, device=device))
        self.master_code: Tensor | None = (
            zeros(plan.total, code_dtype, plan.device) if code_dtype is not None else None
        )

    def _member(self, plan: GroupPlan, slot: int) -> StateArena:
        """The arena of ``plan``, whose tensors are this arena's slots ``slot, slot + 1, ...``:
        views of this arena's fields (see :func:`family_arenas`)."""
        first = self.plan.slots[slot]
        offset, total = first.offset, plan.total
        member = StateArena.__new__(StateArena)
        member.plan, member.codecs, member.master = plan, self.codecs, self.master
        member.family, member.family_slot, member.family_offset = self, slot, offset
        member.fields = {}
        for name, codec in self.codecs.items():
            member.fields[name] = {}
            for suffix, flat in self.fields[name].items():
                unit = codec.block_size if codec.fields[suffix].per_block else 1
                member.fields[name][suffix] = flat[offset // unit : (offset + total) // unit]
        code = self.master_code
        member.master_code = None if code is None else code[offset : offset + total]
        return member

    def field_slice(self, name: str, suffix: str, slot: Slot) -> Tensor:
        """Flat view of field ``suffix`` of state ``name`` covering ``slot`` (padded length)."""
        codec = self.codecs[name]
        flat = self.fields[name][suffix]
        if codec.fields[suffix].per_block:
            bs = codec.block_size
            return flat[slot.offset // bs : (slot.offset + slot.padded) // bs]
        return flat[slot.offset : slot.offset + slot.padded]

    def views(self, slot: Slot) -> dict[str, Tensor]:
        """``{state key: view}`` of every field of ``slot``; the master code under ``master_code``."""
        out: dict[str, Tensor] = {}
        for name, codec in self.codecs.items():
            for suffix in codec.fields:
                view = self.field_slice(name, suffix, slot)
                if codec.block_size == 1:
                    view = view[: slot.numel].view(slot.shape)
                out[state_key(name, suffix)] = view
        if self.master_code is not None:
            code = self.master_code[slot.offset : slot.offset + slot.numel]
            out["master_code"] = code.view(slot.shape)
        return out

    def layout(self, slot: Slot) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{state key: (shape, dtype)}`` of :meth:`views` without building them."""
        return expected_layout(self.codecs, self.master, slot.shape, slot.padded)

    def tensors(self) -> list[Tensor]:
        """Every flat tensor of the arena."""
        out = [t for fs in self.fields.values() for t in fs.values()]
        if self.master_code is not None:
            out.append(self.master_code)
        return out

    def nbytes(self) -> int:
        """Bytes of all the arena's tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def family_arenas(
    plans: Sequence[GroupPlan],
    moments: Mapping[str, MomentCodec],
    master: MasterCodec | None = None,
    zeros: Callable[[int, torch.dtype, torch.device], Tensor] | None = None,
) -> list[StateArena]:
    """The arenas of ``plans`` (one device, parameter dtype and spec; several param groups),
    as views of one family arena: a :class:`StateArena` over a plan of all their tensors in
    order, allocated once (``zeros`` as for :class:`StateArena`). Each returned arena's
    ``family`` is that arena; its plan's slot ``i`` is the family plan's slot ``family_slot +
    i``, at the same arena offset plus ``family_offset``, so a chunk table of the family plan
    addresses every member's state from the family's fields. The arenas hold what separate
    arenas would (zeroed fields of the same shapes), and no padding lies between members."""
    if not plans:
        return []
    head = plans[0]
    for plan in plans[1:]:
        if (plan.device, plan.param_dtype, plan.spec) != (head.device, head.param_dtype, head.spec):
            raise ConfigError(
                f"a family of arenas needs plans of one device, parameter dtype and spec; got "
                f"{head!r} and {plan!r}"
            )
    whole = head.over([t for plan in plans for t in plan.params])
    family = StateArena(whole, moments, master, zeros)
    out, slot = [], 0
    for plan in plans:
        out.append(
            family._member(plan, slot) if plan.slots else StateArena(plan, moments, master, zeros)
        )
        slot += len(plan.slots)
    return out


def expected_layout(
    moments: Mapping[str, MomentCodec],
    master: MasterCodec | None,
    shape: Sequence[int],
    padded: int,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{state key: (shape, dtype)}`` of a tensor of ``shape`` padded to ``padded`` elements."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, codec in moments.items():
        for suffix, f in codec.fields.items():
            if codec.block_size == 1:
                size: tuple[int, ...] = tuple(shape)
            else:
                size = (f.numel(padded, codec.block_size),)
            out[state_key(name, suffix)] = (size, f.dtype)
    if master is not None and master.code_dtype is not None:
        out["master_code"] = (tuple(shape), master.code_dtype)
    return out
