"""Sharded parameters (``torch.distributed.tensor.DTensor``, as FSDP2's ``fully_shard`` makes them).

An optimizer steps a sharded parameter's local shard (``p._local_tensor``: FSDP2 keeps it as a
contiguous, persistent tensor and all-gathers from it in the next forward). What must not change
with the sharding is the bits: stochastic rounding draws its words by the element's position in
the *whole* tensor (:attr:`memopt_core.backends.GroupStep.index_bases`), so with the same
gradients every rank computes what one process computes for its part of the tensor.

Supported placements: ``Shard(0)`` and ``Replicate()`` on a mesh of any dimension (FSDP2,
HSDP). The shard is then one contiguous range of the flattened tensor, starting at its *index
base*. ``Shard(d)`` for ``d > 0``, strided shards (FSDP2 over tensor parallelism) and
``Partial`` are refused with a :class:`~memopt_core.errors.ConfigError`.

Blocked moment formats (q8, fp8: 32-element blocks) are cut with the shard: a shard whose
index base is a multiple of 32 has the whole tensor's blocks (2-D weights whose row length is a
multiple of 32 always do); otherwise the block that straddles the cut is quantized as two
partial blocks, one per rank (each with its own scale). Those few blocks then differ from one
process, within the format's error bound; :func:`block_aligned` tells which shards are affected.

**State dicts** (:func:`global_state` / :func:`local_state`). A sharded parameter's state is
handed out as DTensors sharded like the parameter, so ``torch.distributed.checkpoint`` saves one
global tensor per state and loads it into any other sharding of the same parameter (2 ranks ->
1, 1 -> 2, ...):

- per-element states (fp32/bf16 moments, master codes, decoded moments) have the parameter's
  shape;
- blocked fields (q8/fp8 codes and their per-block scales) of a parameter with at least two
  dimensions whose row length ``r`` is a multiple of the block size are shaped ``(rows, r)`` and
  ``(rows, r // 32)``: a row holds whole blocks, so every sharding on dim 0 has the same blocks
  and these load exactly, still compressed;
- other blocked fields (1-D parameters, odd row lengths) are shaped like the parameter with each
  element's block scale repeated next to it (one more byte per element, on small tensors). Loaded
  into blocks that group elements as they were saved, they give back the same values; where a
  new block mixes elements saved with different scales (a cut moved), the block is
  re-quantized (round to nearest, within the format's bound);
- ``param_shape``, which ``MemOptimizer.state_dict()`` adds after :func:`global_state`, is a
  plain int64 tensor of the global shape, the same on every rank (:func:`local_state` passes it
  through, as any plain tensor).

Each of these DTensors holds, as its local tensor, an alias of the state's own bytes in the
optimizer's arena (no copy; live, as a view is) at storage offset 0: over a view at an offset,
torch could neither ``torch.save`` nor ``copy.deepcopy`` it (see ``_own_storage``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from memopt_core.errors import ConfigError, StateDictError
from memopt_core.formats import MomentCodec
from memopt_core.plan import round_up, state_key

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "block_aligned",
    "check_sharded",
    "global_state",
    "index_base",
    "is_dtensor",
    "local_shard",
    "local_state",
    "max_over_shards",
    "sharded_like",
    "sharding_mismatch",
]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallel), without
    importing torch.distributed where nothing else did."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def _dtensor(p: Tensor) -> DTensor:
    """``p``, which the caller knows to be a DTensor (a sharded parameter), typed as one."""
    return cast("DTensor", p)


def _placement_ok(pl) -> bool:
    if pl.is_replicate():
        return True
    # a strided shard (FSDP2 over TP) is a Shard subclass in some torch versions: by type name
    return pl.is_shard(0) and type(pl).__name__ == "Shard"


def check_sharded(p: Tensor, desc: str) -> None:
    """Raise :class:`ConfigError` unless the DTensor ``p`` is sharded in a way memopt steps."""
    dp = _dtensor(p)
    bad = [pl for pl in dp.placements if not _placement_ok(pl)]
    if bad:
        raise ConfigError(
            f"{desc} is a DTensor with placements {tuple(dp.placements)}: memopt optimizers step "
            "parameters sharded on dim 0 (FSDP2's default fully_shard) or replicated; "
            f"{bad[0]} is not supported (use fully_shard without shard_placement_fn, or "
            "torch.optim for this parameter)"
        )
    local = dp._local_tensor
    if not local.is_contiguous():
        raise ConfigError(
            f"{desc}: its local shard (shape {tuple(local.shape)}) is not contiguous; memopt "
            "updates a sharded parameter's local shard in place and needs it contiguous"
        )


def local_shard(t: Tensor) -> Tensor:
    """The tensor an optimizer updates for ``t``: its local shard for a DTensor, else ``t``."""
    return _dtensor(t)._local_tensor if is_dtensor(t) else t


def max_over_shards(owners: Sequence[Tensor], rows: Tensor) -> Tensor:
    """``rows`` (one row of float32 statistics per owner, on their device) with the row of each
    sharded owner replaced by its element-wise maximum over every process of the owner's mesh;
    unsharded owners' rows are returned as they are.

    What a check decides from a sharded parameter's values (``check_numerics``: a non-finite
    gradient, the largest weight) must be decided from the whole tensor, or one rank raises
    while the others update their shards. Every process holding a shard of these owners must
    call this with the same owners in the same order (one all-reduce per mesh and dimension):
    a step or a gradient-release bucket does, since FSDP2's parameters, gradients and buckets
    (sized by the DTensor gradients' global sizes) are the same on every rank."""
    sharded = [i for i, p in enumerate(owners) if is_dtensor(p)]
    if not sharded:
        return rows
    import torch.distributed as dist

    by_mesh: dict[int, tuple[Any, list[int]]] = {}
    for i in sharded:
        mesh = _dtensor(owners[i]).device_mesh
        by_mesh.setdefault(id(mesh), (mesh, []))[1].append(i)
    out = rows.clone()
    for mesh, idx in by_mesh.values():
        at = torch.tensor(idx, dtype=torch.int64, device=rows.device)
        part = rows.index_select(0, at).to(mesh.device_type)
        for dim in range(mesh.ndim):
            dist.all_reduce(part, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        out.index_copy_(0, at, part.to(rows.device))
    return out


def index_base(p: Tensor) -> int:
    """The position in the whole flattened tensor of the first element of ``p``'s local shard
    (0 for a plain tensor). Checked placements (:func:`check_sharded`) make the shard one
    contiguous range of the whole tensor starting there."""
    if not is_dtensor(p):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dp = _dtensor(p)
    local_shape, offset = compute_local_shape_and_global_offset(
        p.shape, dp.device_mesh, dp.placements
    )
    if tuple(local_shape) != tuple(dp._local_tensor.shape):
        raise ConfigError(
            f"a DTensor of shape {tuple(p.shape)} with placements {tuple(dp.placements)} holds a "
            f"local shard of shape {tuple(dp._local_tensor.shape)}, but its mesh gives this rank "
            f"{tuple(local_shape)}: uneven custom sharding is not supported"
        )
    if not dp._local_tensor.numel():
        return 0
    return offset[0] * math.prod(p.shape[1:]) if p.dim() else 0


def block_aligned(p: Tensor, block: int = 32) -> bool:
    """Whether every block of ``block`` elements of ``p``'s local shard is a block of the whole
    tensor (true for plain tensors): the shard starts on a block boundary, and it ends on one or
    at the tensor's end."""
    if not is_dtensor(p):
        return True
    start = index_base(p)
    end = start + _dtensor(p)._local_tensor.numel()
    return start % block == 0 and (end % block == 0 or end == p.numel())


def _rows_hold_blocks(p: Tensor, block: int) -> bool:
    """Whether ``p``'s rows (dim 0) hold whole blocks: any dim-0 cut falls between blocks."""
    return p.dim() >= 2 and math.prod(p.shape[1:]) % block == 0


def _own_storage(t: Tensor) -> Tensor:
    """``t`` over a storage of its own bytes: ``t`` itself where it spans its whole storage from
    offset 0, else an alias of it (no copy: a slice of its storage, which keeps that storage
    alive) at storage offset 0.

    A DTensor made over a view of a larger storage (a state in an arena) takes the view's
    storage offset, with no storage of its own: its ``data_ptr()`` is then the offset in bytes,
    not 0, and torch (2.13) takes it for a tensor with data, so ``torch.save`` and
    ``copy.deepcopy`` of it read its storage and raise "invalid python storage". Over an alias
    at offset 0, torch handles it as the wrapper it is and saves or copies ``t``'s own bytes
    (and no others: a view would save its whole arena)."""
    if t.device.type == "meta":
        return t  # no bytes to save or copy (and meta storages cannot be sliced)
    size = t.element_size()
    span = (
        1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
    )
    storage = t.untyped_storage()
    if t.storage_offset() == 0 and storage.nbytes() == span * size:
        return t
    start = t.storage_offset() * size
    own = storage[start : start + span * size]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(own, 0, t.shape, t.stride())


def _like_param(p: Tensor, local: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``local`` (this rank's rows of a ``shape`` tensor) as a DTensor sharded like ``p``, over
    an alias of ``local`` that torch can save and deep-copy (:func:`_own_storage`)."""
    from torch.distributed.tensor import DTensor

    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    dp = _dtensor(p)
    return DTensor.from_local(
        _own_storage(local),
        dp.device_mesh,
        dp.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=stride,
    )


def sharded_like(p: Tensor, local: Tensor) -> Tensor:
    """``local`` (shaped like ``p``'s local shard) as a DTensor sharded like ``p``; ``local``
    itself when ``p`` is a plain tensor."""
    return _like_param(p, local, tuple(p.shape)) if is_dtensor(p) else local


def sharding_mismatch(p: Tensor, v: Tensor) -> str | None:
    """How the DTensor ``v`` (a saved value) is not sharded like the DTensor parameter ``p``, as
    the end of a sentence naming ``v`` ("... was saved on a device mesh of shape (2,); ..."); None
    when its mesh and placements are ``p``'s. A mesh of another shape is another world size:
    only ``torch.distributed.checkpoint`` reshards a state saved there."""
    dp, dv = _dtensor(p), _dtensor(v)
    if dv.device_mesh != dp.device_mesh:
        got, want = tuple(dv.device_mesh.shape), tuple(dp.device_mesh.shape)
        if got != want:
            return (
                f"was saved on a device mesh of shape {got}; this parameter's mesh has shape "
                f"{want} (another number of processes)"
            )
        return (
            f"was saved on another device mesh ({dv.device_mesh}; this parameter's: "
            f"{dp.device_mesh})"
        )
    if tuple(dv.placements) != tuple(dp.placements):
        return (
            f"is a DTensor with placements {tuple(dv.placements)}; the parameter's are "
            f"{tuple(dp.placements)}"
        )
    return None


def global_state(
    p: Tensor, entry: Mapping[str, Any], blocked: Mapping[str, tuple[MomentCodec, str]]
) -> dict[str, Any]:
    """The state ``entry`` (local layout, as the optimizer holds it) of sharded parameter ``p``
    as DTensors sharded like ``p`` (see the module doc). ``blocked`` maps each key of a blocked
    field to its codec and field suffix; other tensors shaped like the local shard are
    per-element; anything else (``step``) is kept."""
    local = _dtensor(p)._local_tensor
    n = local.numel()
    out: dict[str, Any] = {}
    for key, v in entry.items():
        if (
            key in blocked
            and isinstance(v, Tensor)
            and v.dtype == blocked[key][0].fields[blocked[key][1]].dtype
            and v.dim() == 1
        ):
            codec, suffix = blocked[key]
            bs = codec.block_size
            per_block = codec.fields[suffix].per_block
            if _rows_hold_blocks(p, bs):
                r = math.prod(p.shape[1:])
                width = r // bs if per_block else r
                rows = local.shape[0]
                out[key] = _like_param(p, v.reshape(rows, width), (p.shape[0], width))
            else:
                flat = v.repeat_interleave(bs)[:n] if per_block else v[:n]
                out[key] = _like_param(p, flat.reshape(local.shape), tuple(p.shape))
        elif isinstance(v, Tensor) and v.shape == local.shape:
            out[key] = _like_param(p, v, tuple(p.shape))
        else:
            out[key] = v
    return out


def local_state(
    p: Tensor,
    entry: Mapping[str, Any],
    codecs: Mapping[str, MomentCodec],
    label: str,
) -> dict[str, Any]:
    """The inverse of :func:`global_state`: ``entry`` with every DTensor turned into the local
    layout the optimizer holds (blocked fields flat and padded). ``codecs`` maps each state
    name to its codec. Plain tensors are taken as already local."""
    from torch.distributed.tensor import DTensor

    dp = _dtensor(p)
    local = dp._local_tensor
    n = local.numel()
    out = dict(entry)
    for key, v in entry.items():
        if not isinstance(v, DTensor):
            continue
        why = sharding_mismatch(p, v)
        if why is not None:
            raise StateDictError(
                f"state {key!r} of {label} {why}: it must be sharded like the parameter; load "
                "it through torch.distributed.checkpoint (dcp.load into this optimizer's own "
                "state_dict(), then load_state_dict), which reshards it"
            )
        out[key] = v.to_local()
    for name, codec in codecs.items():
        if codec.block_size == 1:
            continue
        keys = {sfx: state_key(name, sfx) for sfx in codec.fields}
        if not any(isinstance(entry.get(k), DTensor) for k in keys.values()):
            continue
        scale_sfx = next(s for s, f in codec.fields.items() if f.per_block)
        elem_sfx = next(s for s, f in codec.fields.items() if not f.per_block)
        if keys[scale_sfx] not in entry:
            continue  # a decoded moment (memopt-ecc's compress_state_dict=False): one
            # per-element tensor, made local above, which the subclass's load encodes
        if not all(isinstance(entry.get(k), DTensor) for k in keys.values()):
            raise StateDictError(
                f"state {name!r} of {label} has some of its fields {sorted(keys.values())} as "
                "DTensors and some not: pass them all as the optimizer's state_dict() gives them"
            )
        bs = codec.block_size
        padded = round_up(n, bs)
        fields = {sfx: out[k].reshape(-1) for sfx, k in keys.items()}
        if _rows_hold_blocks(p, bs):
            for sfx, k in keys.items():
                out[k] = fields[sfx]
            continue
        if any(f.numel() != n for f in fields.values()):
            raise StateDictError(
                f"state {name!r} of {label} holds {[f.numel() for f in fields.values()]} "
                f"elements; its parameter's shard has {n} (the file of another rank? load each "
                "rank's own, or reshard through torch.distributed.checkpoint)"
            )
        codes = torch.zeros(padded, dtype=fields[elem_sfx].dtype, device=local.device)
        codes[:n] = fields[elem_sfx]
        scales = fields[scale_sfx]
        padded_scales = torch.cat([scales, scales[-1:].expand(padded - n)]) if n else scales
        by_block = padded_scales.view(-1, bs)
        if bool((by_block == by_block[:, :1]).all()):
            out[keys[elem_sfx]], out[keys[scale_sfx]] = codes, by_block[:, 0].contiguous()
            continue
        # the cuts moved: decode each element with its own scale, then re-quantize per block
        lone = torch.zeros(padded * bs, dtype=codes.dtype, device=codes.device)
        lone[::bs] = codes
        values = codec.decode({elem_sfx: lone, scale_sfx: padded_scales})[::bs].contiguous()
        values[n:] = 0
        encoded = codec.encode(values)
        out[keys[elem_sfx]], out[keys[scale_sfx]] = encoded[elem_sfx], encoded[scale_sfx]
    return out
