"""Python wrappers of the C++ kernels: validation, slot tables, calls into ``_core``.

The fused optimizer step: :func:`fused_step` runs one :class:`memopt_core.backends.GroupStep`
(every tensor of the group) in one call: decode master weight and moments, apply the rule,
encode everything back, per element, on the thread pool. Bytes moved per parameter and step:
the gradient (4 fp32, 2 bf16/fp16) plus, read and written, the parameter (4 fp32, 2 bf16/fp16),
the master code (1 ECC-24, 2 ECC-32) and each moment (4 fp32, 2 bf16, 1 + 1/32 fp8/q8), plus
2 for an optional bf16 staging copy: 28 B for fp32 AdamW, about 12.1 B for ECC-24 + q8.
With stochastic rounding, element ``i`` of ``work.params[k]`` (padding included) draws the
words (:mod:`memopt_core.rng`) of index ``work.index_base(k) + i`` (the slot table's
``index_base`` column: 0 for a whole tensor, a shard's offset in its whole flattened tensor
(FSDP2), so the shard rounds with the whole tensor's words and gives its bits); a step computes
only the streams its formats round.

Standalone kernels (same bits as the ``memopt_core.formats`` codecs / ``memopt_core.rng``):
:func:`encode_moment` / :func:`decode_moment` (every moment format), :func:`encode_master` /
:func:`decode_master` (fp32, none, ECC-24/32 masters), :func:`stream_words`.

Every function validates all its tensors before any kernel runs (CPU, dtype, sizes, contiguity
where memory is written in place, aliasing) and raises :class:`~memopt_core.errors.ConfigError`
or :class:`~memopt_core.errors.FormatError` naming the argument; the C++ code then runs with the
GIL released. Strided inputs are copied; strided parameters are updated through contiguous
copies that are written back (slower, never an error).

Runtime settings of the compiled module, re-exported here: :func:`supported_isas`,
:func:`get_isa`, :func:`set_isa`, :func:`cpu_features`, :func:`set_num_threads`,
:func:`get_num_threads`, :func:`set_chunk_size`, :func:`get_chunk_size`; and
:func:`first_touch` (zero-fill a host buffer with the pool's static partition).
"""

from __future__ import annotations

import functools
import itertools
import numbers
import operator
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter, is_
from typing import Any, NamedTuple

import torch
from torch import Tensor

from memopt_core.aliasing import (
    Label,
    check_aliasing,
    has_memory,
    ranges_overlap,
    refuse_negated,
)
from memopt_core.backends import (
    PARAM_DTYPES,
    RULES,
    GroupStep,
    grad_dtype_ok,
    kernel_master_id,
    kernel_moment_id,
    launch_then_done,
)
from memopt_core.errors import ConfigError, FormatError
from memopt_core.formats import MomentCodec, moment_codec
from memopt_core.formats.registry import master_codec
from memopt_core.plan import overlaps_itself
from memopt_core.reference import round_to_float32
from memopt_kernels_cpu import _core
from memopt_kernels_cpu.backend import CpuBackend

__all__ = [
    "GRAD_IDS",
    "INDEX_LIMIT",
    "NONE_ID",
    "SLOT_COLUMNS",
    "PreparedStep",
    "check_step",
    "cpu_features",
    "decode_master",
    "decode_moment",
    "encode_master",
    "encode_moment",
    "first_touch",
    "fused_step",
    "fused_steps",
    "get_chunk_size",
    "get_isa",
    "get_num_threads",
    "grad_id",
    "master_id",
    "moment_id",
    "prepare_step",
    "set_chunk_size",
    "set_isa",
    "set_num_threads",
    "step_config",
    "stream_words",
    "supported_isas",
]

# ----------------------------------------------------------------------------------- settings
supported_isas = _core.supported_isas
get_isa = _core.get_isa
cpu_features = _core.cpu_features
get_num_threads = _core.get_num_threads
get_chunk_size = _core.get_chunk_size


def _c_integer(n: object, fn: str, bits: int) -> int:
    """``n`` for a C++ setter taking a ``bits``-bit signed integer: pybind11 would turn a bool
    into 1 and refuse a float or a wider int with a generic message naming no argument."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{fn}: n must be an int, got {type(n).__name__} {n!r}")
    if not -(2 ** (bits - 1)) <= int(n) < 2 ** (bits - 1):
        raise ValueError(f"{fn}: n = {n} is out of range")
    return int(n)


def set_isa(name: str) -> str:
    """Use instruction set ``name`` (``"auto"``, ``"scalar"``, ``"avx2"``, ``"avx512"``,
    ``"neon"``; case and surrounding blanks ignored) and return the one now in use. ValueError
    for an unknown name, RuntimeError for a set not built or not supported by this CPU,
    TypeError for anything but a str."""
    if not isinstance(name, str):  # pybind11's own message names no argument
        raise TypeError(f"set_isa: name must be a str, got {type(name).__name__} {name!r}")
    stripped = name.strip()
    # C++ drops every blank and takes "" as auto: only the surrounding blanks go here, and a
    # name must name a set (a NUL would also cut C++'s message short)
    if not stripped or "\x00" in name or any(c.isspace() for c in stripped):
        raise ValueError(
            f"set_isa: {name!r} is not an instruction set name; choose one of auto, "
            f"{', '.join(supported_isas())}"
        )
    return _core.set_isa(stripped)


def set_num_threads(n: int) -> None:
    """Threads of the pool (1 to 4096); the pool restarts with ``n`` threads at its next run.
    ValueError outside that range, TypeError for anything but an int."""
    _core.set_num_threads(_c_integer(n, "set_num_threads", 32))


def set_chunk_size(n: int) -> None:
    """Elements per chunk of a fused step: a positive multiple of 32 (ValueError otherwise,
    TypeError for anything but an int)."""
    _core.set_chunk_size(_c_integer(n, "set_chunk_size", 64))


# ----------------------------------------------------------------------------------- ids
#: ``FMT_NONE``: the rule keeps no such state.
NONE_ID = 5
#: Gradient dtype -> ``Grad`` id.
GRAD_IDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: Columns of the int64 slot table (``SlotRow`` of ``kernel_api.hpp``), in order: addresses of
#: the parameter and gradient, the gradient's ``Grad`` id, the tensor id (low 32 bits; a key
#: word of the step's random words), real and padded element counts, the offset in the state
#: arena, the bf16 staging address (0: none) and ``index_base``, the stochastic-rounding index
#: of the tensor's element 0
#: (:meth:`memopt_core.backends.GroupStep.index_base`).
SLOT_COLUMNS = (
    "param",
    "grad",
    "grad_kind",
    "tensor_id",
    "numel",
    "padded",
    "arena_offset",
    "staging",
    "index_base",
)
if getattr(_core, "SLOT_ROW_WORDS", None) != len(SLOT_COLUMNS):
    raise ImportError(
        "memopt_kernels_cpu's compiled _core reads slot-table rows of "
        f"{getattr(_core, 'SLOT_ROW_WORDS', 8)} words, this ops.py writes {len(SLOT_COLUMNS)} (a "
        "stale build). Rebuild and reinstall it: "
        "pip install --force-reinstall --no-deps packages/memopt-kernels-cpu"
    )
if getattr(_core, "KERNEL_API", None) != CpuBackend.KERNEL_API:
    raise ImportError(
        "memopt_kernels_cpu's compiled _core computes the bits of KERNEL_API "
        f"{getattr(_core, 'KERNEL_API', 'below 4')}, this package those of KERNEL_API "
        f"{CpuBackend.KERNEL_API} (a stale build). Rebuild and reinstall it: "
        "pip install --force-reinstall --no-deps packages/memopt-kernels-cpu"
    )
if getattr(_core, "STEP_VARIANTS", None) is not True:
    raise ImportError(
        "memopt_kernels_cpu's compiled _core predates fused_step's per-row variants (parameters "
        "at several step counts in one call; a stale build). Rebuild and reinstall it: "
        "pip install --force-reinstall --no-deps packages/memopt-kernels-cpu"
    )
#: Stochastic-rounding indices (``index_base + padded``) stay below this (far from int64
#: overflow).
INDEX_LIMIT = 2**62
_RULE_IDS = {"sgd": 0, "adam": 1, "lion": 2}
_U32 = 0xFFFFFFFF


moment_id = kernel_moment_id
master_id = kernel_master_id


def grad_id(dtype: torch.dtype) -> int:
    """Kernel id of a gradient dtype (fp32 0, bf16 1, fp16 2)."""
    if dtype not in GRAD_IDS:
        raise ConfigError(f"gradients are float32, bfloat16 or float16, got {dtype}")
    return GRAD_IDS[dtype]


# ----------------------------------------------------------------------------------- checks
def _check_tensor(t: object, what: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise ConfigError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ConfigError(
            f"the cpu backend runs on CPU tensors; {what} is on {t.device}: move it with "
            ".cpu() or use the triton/torch backend"
        )
    if t.layout != torch.strided:
        raise ConfigError(f"{what} is a {t.layout} tensor; the CPU kernels take dense tensors")
    if not has_memory(t):
        raise ConfigError(
            f"{what} is a {type(t).__name__} without memory of its own (a tensor subclass): "
            "the CPU kernels read and write memory directly; step it on the torch backend "
            "(backend='torch'; the Flash optimizers: fused=False)"
        )
    if not _aligned(t):
        raise ConfigError(
            f"{what} starts at address {t.data_ptr()}, not a multiple of its element size "
            f"({t.element_size()} bytes; torch.frombuffer with an offset or an unaligned numpy "
            "array makes one): the CPU kernels read whole elements; copy it (.clone()) or step "
            "it on the torch backend (backend='torch'; the Flash optimizers: fused=False)"
        )
    return t


def _aligned(t: Tensor) -> bool:
    """Whether ``t``'s address is a multiple of its element size: the kernels access typed
    elements, and a misaligned access is undefined behaviour in C++ (a fault where the compiler
    uses aligned vector loads)."""
    return t.data_ptr() % t.element_size() == 0


def _check_float32(x: object, what: str) -> Tensor:
    x = _check_tensor(x, what)
    if x.dtype != torch.float32:
        raise FormatError(f"{what} must be float32, got {x.dtype}: convert it with .float()")
    return x


def _flat(t: Tensor) -> Tensor:
    """``t`` as a flat contiguous tensor (a view when it already is contiguous), its negative
    bit resolved (``x.conj().imag`` is contiguous, and its memory holds the opposite signs)."""
    return t.resolve_neg().reshape(-1).contiguous()


def _rand_words(rand: object, n: int) -> Tensor | None:
    """``rand`` (int64 words, ``n`` of them) as int32 bit patterns the kernels read as uint32."""
    if rand is None:
        return None
    rand = _check_tensor(rand, "rand")
    if rand.dtype != torch.int64 or rand.numel() != n:
        raise FormatError(
            f"rand must be an int64 tensor of {n} uniform 32-bit words (one per element), got "
            f"{rand.dtype}{tuple(rand.shape)}: use memopt_core.rng.uniform_bits"
        )
    r = rand.reshape(-1) & _U32
    return torch.where(r >= 2**31, r - 2**32, r).to(torch.int32)


def _ptr(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _label(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, {t.dtype}"


# ----------------------------------------------------------------------------------- standalone
def encode_moment(fmt: str, x: Tensor, *, rand: Tensor | None = None) -> dict[str, Tensor]:
    """Fields of fp32 ``x`` in moment format ``fmt`` (``{"": codes, "scale": uint8 per 32}``
    for blocked formats): the same bits as ``moment_codec(fmt).encode(x, rand=rand)``.

    ``rand``: int64 words (one per element) for stochastic rounding, None for nearest-even.
    Blocked formats (fp8, q8: 1 B per element + 1/32 B of scale) need a multiple of 32 elements.
    """
    codec = moment_codec(fmt)
    x = _check_float32(x, "x")
    n = x.numel()
    codec.check_length(n)
    words = _rand_words(rand, n)
    flat = _flat(x)
    fields = _empty_fields(codec, n)
    _core.encode_moment(
        moment_id(fmt),
        _ptr(flat),
        n,
        _ptr(fields[""]),
        _ptr(fields.get("scale")),
        _ptr(words),
    )
    fields[""] = fields[""].view(x.shape)
    return fields


def _empty_fields(codec: MomentCodec, n: int) -> dict[str, Tensor]:
    return {
        k: torch.empty(f.numel(n, codec.block_size), dtype=f.dtype, device="cpu")
        for k, f in codec.fields.items()
    }


def decode_moment(fmt: str, fields: Mapping[str, Tensor]) -> Tensor:
    """fp32 values held by ``fields`` of moment format ``fmt`` (= ``moment_codec(fmt).decode``)."""
    codec = moment_codec(fmt)
    if not isinstance(fields, Mapping):
        raise FormatError(
            f"fields must be a mapping of field name to tensor, got {type(fields).__name__}"
        )
    missing = [k for k in codec.fields if k not in fields]
    if missing:
        raise FormatError(f"format {fmt!r} needs fields {list(codec.fields)}; missing {missing}")
    for k, f in codec.fields.items():
        t = _check_tensor(fields[k], f"field {k!r} of {fmt!r}")
        if t.dtype != f.dtype:
            raise FormatError(f"field {k!r} of {fmt!r} must be {f.dtype}, got {t.dtype}")
    main = fields[""]
    n = main.numel()
    codec.check_length(n)
    scale = fields.get("scale") if "scale" in codec.fields else None
    if scale is not None and scale.numel() != n // codec.block_size:
        raise FormatError(
            f"field 'scale' of {fmt!r}: {n} codes need {n // codec.block_size} scales (one per "
            f"{codec.block_size}), got {scale.numel()}"
        )
    codes = _flat(main)
    scales = _flat(scale) if scale is not None else None
    out = torch.empty(n, dtype=torch.float32, device="cpu")
    _core.decode_moment(moment_id(fmt), _ptr(codes), _ptr(scales), n, _ptr(out))
    return out.view(main.shape)


def encode_master(
    fmt: str,
    x: Tensor,
    param_dtype: torch.dtype = torch.bfloat16,
    *,
    rand: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``(param, code)`` of fp32 master ``x`` in master format ``fmt`` for ``param_dtype``
    parameters: the same bits as ``master_codec(fmt, param_dtype).encode(x, rand=rand)``.

    Per element: fp32 4 B; none 2 B (bf16/fp16); ECC-24 2 + 1 B (uint8 code); ECC-32 2 + 2 B.
    """
    mid = master_id(fmt, param_dtype)
    codec = master_codec(fmt, param_dtype)
    x = _check_float32(x, "x")
    n = x.numel()
    words = _rand_words(rand, n)
    flat = _flat(x)
    param = torch.empty(n, dtype=param_dtype, device="cpu")
    code = (
        torch.empty(n, dtype=codec.code_dtype, device="cpu")
        if codec.code_dtype is not None
        else None
    )
    _core.encode_master(mid, _ptr(flat), n, _ptr(param), _ptr(code), _ptr(words))
    return param.view(x.shape), (code.view(x.shape) if code is not None else None)


def decode_master(fmt: str, param: Tensor, code: Tensor | None = None) -> Tensor:
    """fp32 master held by ``param`` (and ``code``): ``master_codec(fmt, param.dtype).decode``."""
    param = _check_tensor(param, "param")
    mid = master_id(fmt, param.dtype)
    codec = master_codec(fmt, param.dtype)
    n = param.numel()
    codes = None
    if codec.code_dtype is None and code is not None:
        got = f"a {code.dtype} tensor" if isinstance(code, Tensor) else type(code).__name__
        raise FormatError(f"master format {fmt!r} has no code; got {got}")
    if codec.code_dtype is not None:
        if code is None:
            raise FormatError(
                f"master format {fmt!r} decodes a parameter together with its code; got None"
            )
        code = _check_tensor(code, "code")
        if code.dtype != codec.code_dtype or code.numel() != n:
            raise FormatError(
                f"master format {fmt!r} needs a {codec.code_dtype} code of {n} entries (one per "
                f"parameter element), got code {code.dtype}{tuple(code.shape)}"
            )
        codes = _flat(code)
    flat = _flat(param)
    out = torch.empty(n, dtype=torch.float32, device="cpu")
    _core.decode_master(mid, _ptr(flat), _ptr(codes), n, _ptr(out))
    return out.view(param.shape)


def stream_words(
    seed: int, tensor_id: int, index: Tensor, step: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The stochastic-rounding words (int64 in ``[0, 2**32)``) of streams 0, 1 and 2 (master,
    first and second moment) of elements ``index`` (an integer tensor), computed by the fused
    step's generator: ``memopt_core.rng.stream_words(seed, tensor_id, index, step)`` for scalar
    ids."""
    seed, tensor_id, step = (
        _word(v, what) for what, v in (("seed", seed), ("tensor_id", tensor_id), ("step", step))
    )
    index = _check_tensor(index, "index")
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise FormatError(f"index must be an integer tensor, got {index.dtype}")
    idx = index.resolve_neg().reshape(-1).to(torch.int64).contiguous()
    n = idx.numel()
    out = torch.empty((3, n), dtype=torch.int32, device="cpu")
    _core.stream_words(seed, tensor_id, step, _ptr(idx), n, _ptr(out))
    words = out.to(torch.int64) & _U32
    return tuple(w.view(index.shape) for w in words)


def first_touch(t: Tensor) -> Tensor:
    """Zero-fill ``t`` (a contiguous CPU tensor) from the pool's threads with the static
    partition fused steps use, so on a NUMA host each page lands on the node of the thread that
    will update it; returns ``t``. Meant for freshly allocated (untouched) host buffers."""
    t = _check_tensor(t, "t")
    if not t.is_contiguous():
        raise ConfigError(f"first_touch needs a contiguous tensor, got strides {t.stride()}")
    _core.first_touch(_ptr(t), t.numel() * t.element_size())
    return t


# ----------------------------------------------------------------------------------- fused step
def step_config(work: GroupStep) -> dict:
    """The per-step keyword arguments of ``_core.fused_step`` that come from ``work.scalars``:
    flags and the 8 floats of ``StepConfig::s`` (order in ``kernel_api.hpp``), each rounded once
    from double to float32 as ``memopt_core.reference.to_compute`` does; seed and step masked to
    32 bits."""
    return _scalar_config(work.rule, work.scalars, work.first_step, work.seed, work.step)


def _scalar_config(rule: str, s, first_step: bool, seed: int, step: int) -> dict:
    if rule == "adam":
        vals = [s.one_minus_beta1, s.beta2, s.one_minus_beta2, s.eps, s.step_size, s.bc2_sqrt]
        vals += [s.decay, s.l2]
        l2, momentum, nesterov = s.l2, 0.0, False
    elif rule == "sgd":
        vals = [s.lr, s.momentum, s.one_minus_dampening, 0.0, 0.0, 0.0, s.decay, s.l2]
        l2, momentum, nesterov = s.l2, s.momentum, bool(s.nesterov)
    elif rule == "lion":
        vals = [s.lr, s.beta1, s.one_minus_beta1, s.beta2, s.one_minus_beta2, 0.0, s.decay, 0.0]
        l2, momentum, nesterov = 0.0, 0.0, False
    else:
        raise ConfigError(f"the cpu backend runs rules {RULES}, got {rule!r}")
    has_momentum = rule == "sgd" and momentum != 0.0
    return dict(
        maximize=bool(s.maximize),
        has_l2=l2 != 0.0,
        has_decay=s.decay != 1.0,
        nesterov=nesterov and has_momentum,
        first_step=bool(first_step),
        has_momentum=has_momentum,
        scalars=[round_to_float32(v) for v in vals],  # double -> float32 once
        seed=_word(seed, "seed"),
        step=_word(step, "step"),
    )


def _word(v: object, what: str) -> int:
    """``v`` masked to 32 bits; a float or bool is refused (``int()`` would truncate 2.5)."""
    if type(v) is int:  # the common case, checked first: this runs at every launch
        return v & _U32
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ConfigError(f"{what} must be an int, got {type(v).__name__} {v!r}")
    return int(v) & _U32


@dataclass
class _Prepared:
    """What a validated call needs besides the per-step scalars: the slot table and the
    static keyword arguments (ids, arena addresses)."""

    table: Tensor
    n: int
    static: dict


def _state_names(rule: str, has_momentum: bool) -> tuple[str | None, str | None]:
    if rule == "adam":
        return "exp_avg", "exp_avg_sq"
    if rule == "lion":
        return "exp_avg", None
    return ("momentum_buffer" if has_momentum else None), None


def _arena_args(work: GroupStep, has_momentum: bool) -> tuple[dict, list[tuple[Tensor, str]]]:
    """Format ids and addresses of the arena's fields, validated; and the tensors, labelled."""
    plan, arena = work.plan, work.arena
    mcodec = work.spec.master_for(plan.param_dtype)
    out = dict(code=0, m=0, ms=0, v=0, vs=0, fmt1=NONE_ID, fmt2=NONE_ID)
    tensors: list[tuple[Tensor, str]] = []

    def check(t: object, what: str, dtype: torch.dtype, numel: int) -> Tensor:
        t = _check_tensor(t, what)
        if t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
            raise FormatError(
                f"{what} must be a contiguous {dtype} tensor of {numel} entries for the group's "
                f"{plan.total} arena elements, got {t.dtype}{tuple(t.shape)}"
                + ("" if t.is_contiguous() else " (not contiguous)")
            )
        tensors.append((t, what))
        return t

    if mcodec.code_dtype is not None:
        if arena.master_code is None:
            raise FormatError(
                f"master format {mcodec.name!r} keeps a code per element but the arena has no "
                "master_code; the optimizer must allocate it"
            )
        code = check(arena.master_code, "the arena's master_code", mcodec.code_dtype, plan.total)
        out["code"] = code.data_ptr()
    for slot, (name, key, scale_key) in enumerate(
        zip(_state_names(work.rule, has_momentum), ("m", "v"), ("ms", "vs"), strict=True)
    ):
        if name is None:
            continue
        if name not in arena.codecs or name not in arena.fields:
            raise FormatError(
                f"the state arena of {plan} has no {name!r} state (it has "
                f"{sorted(arena.codecs)}); the optimizer must allocate it"
            )
        codec = arena.codecs[name]
        fid = moment_id(codec.name)
        if codec.block_size not in (1, plan.block_size):
            raise FormatError(
                f"state {name!r} uses blocks of {codec.block_size}, the plan pads to "
                f"{plan.block_size}"
            )
        fields = arena.fields[name]
        for suffix, f in codec.fields.items():
            what = f"the arena's {name}[{suffix!r}]"
            if suffix not in fields:
                raise FormatError(f"{what} is missing; format {codec.name!r} stores it")
            t = check(fields[suffix], what, f.dtype, f.numel(plan.total, codec.block_size))
            out[key if suffix == "" else scale_key] = t.data_ptr()
        out["fmt1" if slot == 0 else "fmt2"] = fid
    return out, tensors


def _staging_list(staging: object, work: GroupStep) -> list[Tensor | None]:
    if staging is None:
        return [None] * len(work.slots)
    if isinstance(staging, Mapping):
        unknown = sorted(set(staging) - set(work.slots))
        if unknown:
            raise ConfigError(
                f"staging has entries for slots {unknown[:8]} that do not take part in this step "
                f"(slots {work.slots[:8]}{'...' if len(work.slots) > 8 else ''})"
            )
        return [staging.get(si) for si in work.slots]
    if isinstance(staging, Sequence) and not isinstance(staging, (str, bytes)):
        if len(staging) != len(work.slots):
            raise ConfigError(
                f"staging holds {len(staging)} entries for the {len(work.slots)} parameters of "
                "the step; pass one per parameter (None for none) or a {slot: tensor} mapping"
            )
        return list(staging)
    raise ConfigError(
        f"staging must be None, a {{slot: tensor}} mapping or a sequence, got "
        f"{type(staging).__name__}"
    )


def _is_cpu_dense(t: object) -> bool:
    return (
        isinstance(t, Tensor)
        and t.is_cpu  # not t.device.type: a device object per call
        and t.layout == torch.strided
        and not t.is_neg()
        and has_memory(t)
        and _aligned(t)
    )


def _is_int(v: object) -> bool:
    # numbers.Integral: numpy integers pass as torch's backend takes them (the rows hold int(v));
    # a plain int first: the ABC check costs a microsecond, twice per tensor of a new table
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def _slot_ok(plan, slot, p0, g, st, tid, base) -> bool:
    """Whether one slot's tensors pass every check of :func:`_check_slot`."""
    return (
        _is_cpu_dense(p0)
        and p0.dtype == plan.param_dtype
        and p0.numel() == slot.numel
        and _is_cpu_dense(g)
        and grad_dtype_ok(p0.dtype, g.dtype)
        and g.shape == p0.shape
        and _is_int(tid)
        and _is_int(base)
        and base >= 0
        and base + slot.padded < INDEX_LIMIT
        and (
            st is None
            or (
                _is_cpu_dense(st)
                and plan.param_dtype != torch.float16
                and st.dtype == torch.bfloat16
                and st.numel() == slot.numel
                and st.is_contiguous()
            )
        )
    )


class _SlotLabel:
    """The names of a slot's tensors in error messages, built only when one is needed."""

    def __init__(self, k: int, si: int, p0: Tensor) -> None:
        self.k, self.si, self.p0 = k, si, p0

    def __call__(self) -> str:
        return f"parameter {self.k} (slot {self.si}, {_label(self.p0)})"

    def gradient(self) -> str:
        return f"the gradient of {self()}"

    def staging(self) -> str:
        return f"staging of {self()}"


def _check_slot(plan, slot, k, si, p0, g, st, tid, base) -> None:
    """ConfigError naming the first problem of one slot's parameter, gradient, staging tensor,
    tensor id or index base."""
    what = f"parameter {k} (slot {si}"
    _check_tensor(p0, f"{what})")
    what += f", {_label(p0)})"
    refuse_negated(what, p0)
    if p0.dtype != plan.param_dtype:
        raise ConfigError(f"{what}: the group holds {plan.param_dtype} parameters")
    if p0.numel() != slot.numel:
        raise ConfigError(
            f"{what} has {p0.numel()} elements but the plan's slot {si} has {slot.numel} "
            f"(shape {tuple(slot.shape)}); rebuild the plan after resizing a parameter"
        )
    _check_tensor(g, f"the gradient of {what}")
    refuse_negated(f"the gradient of {what}", g)
    if not grad_dtype_ok(p0.dtype, g.dtype):
        raise ConfigError(
            f"the gradient of {what} is {g.dtype}; gradients have the parameter's dtype or "
            "float32 (float32 parameters also bfloat16 or float16)"
        )
    if g.shape != p0.shape:
        raise ConfigError(
            f"the gradient of {what} has shape {tuple(g.shape)}; it must match the parameter"
        )
    if not _is_int(tid):
        raise ConfigError(f"tensor id of {what} must be an int, got {type(tid).__name__}")
    if not _is_int(base):
        raise ConfigError(f"index base of {what} must be an int, got {type(base).__name__}")
    if base < 0:
        raise ConfigError(
            f"index base of {what} must be >= 0 (its first element's stochastic-rounding "
            f"index), got {base}"
        )
    if base + slot.padded >= INDEX_LIMIT:
        raise ConfigError(
            f"index base of {what} is {base}: with its {slot.padded} padded elements the "
            "stochastic-rounding indices reach 2**62 (index base + padded must stay below "
            "2**62)"
        )
    if st is not None:
        _check_tensor(st, f"staging of {what}")
        refuse_negated(f"staging of {what}", st)
        if plan.param_dtype == torch.float16:
            raise ConfigError(
                f"staging of {what}: bf16 staging copies are for float32 and bfloat16 "
                "parameters; float16 parameters have none"
            )
        if st.dtype != torch.bfloat16 or st.numel() != slot.numel or not st.is_contiguous():
            raise ConfigError(
                f"staging of {what} must be a contiguous bfloat16 tensor of {slot.numel} "
                f"elements, got {st.dtype}{tuple(st.shape)}"
                + ("" if st.is_contiguous() else " (not contiguous)")
            )


def _prepare(
    work: GroupStep,
    params: list[Tensor],
    grads: list[Tensor],
    stage: list[Tensor | None],
    originals: list[Tensor],
    reads: _Reads | None = None,
) -> _Prepared:
    """Validate everything (before any kernel runs) and build the slot table; ``reads``: see
    :func:`_table_if_plain`."""
    plan = work.plan
    n = len(work.slots)
    if not (len(work.params) == len(work.grads) == len(work.tensor_ids) == n):
        raise ConfigError(
            f"a step of {n} slots got {len(work.params)} parameters, {len(work.grads)} "
            f"gradients and {len(work.tensor_ids)} tensor ids"
        )
    if any(b <= a for a, b in zip(work.slots, work.slots[1:], strict=False)) or (
        n and not 0 <= work.slots[0] <= work.slots[-1] < len(plan.slots)
    ):
        raise ConfigError(
            f"slots must be ascending, distinct indices into the plan's {len(plan.slots)} "
            f"tensors, got {work.slots[:16]}"
        )
    bases = work.index_bases
    if bases is not None and (
        not isinstance(bases, Sequence) or isinstance(bases, (str, bytes)) or len(bases) != n
    ):
        raise ConfigError(
            "index_bases must be None or hold one index base per parameter of the step "
            f"({n}), got "
            + (f"{len(bases)} entries" if isinstance(bases, Sequence) else type(bases).__name__)
        )
    has_momentum = work.rule == "sgd" and work.scalars.momentum != 0.0
    arena_kw, arena_tensors = _arena_args(work, has_momentum)
    table = _table_if_plain(work, params, grads, stage, originals, arena_tensors, reads)
    if table is None:
        table = _checked_table(work, params, grads, stage, originals, arena_tensors)
    mcodec = work.spec.master_for(plan.param_dtype)
    static = dict(
        rule=_RULE_IDS[work.rule],
        master=master_id(mcodec.name, plan.param_dtype),
        block=plan.block_size,
        sr=bool(work.spec.stochastic_rounding),
        arena_elements=plan.total,
        **arena_kw,
    )
    return _Prepared(table, n, static)


_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")
_IS_CPU = attrgetter("is_cpu")
_NBYTES = attrgetter("nbytes")
_LAYOUT = attrgetter("layout")


def _slot_columns(plan) -> tuple[list[int], list[int], list[int]]:
    """The plan's slots' element counts, padded counts and arena offsets (cached per plan)."""
    return plan.cache(
        "cpu_slot_columns",
        lambda: (
            [s.numel for s in plan.slots],
            [s.padded for s in plan.slots],
            [s.offset for s in plan.slots],
        ),
    )


class _Reads(NamedTuple):
    """What one C-level pass per property read of a step's parameters and gradients, each of
    them contiguous (:func:`_read`). The table cache's key holds these values. On a miss (every
    step whose gradients moved or whose stepping set changed) they are passed down to the
    passes that build the new table (:func:`_table_if_plain`) rather than read again;
    :func:`prepare_step` passes its own down too."""

    pptrs: tuple[int, ...]
    pdtypes: tuple[torch.dtype, ...]
    pnumels: tuple[int, ...]
    gptrs: tuple[int, ...]
    gdtypes: tuple[torch.dtype, ...]
    gshapes: tuple[torch.Size, ...]
    pneg: tuple[bool, ...]
    gneg: tuple[bool, ...]


def _read(params: list[Tensor], grads: list[Tensor]) -> _Reads:
    """The :class:`_Reads` of ``params`` and ``grads`` (the caller found them contiguous);
    torch's errors for odd tensors come through."""
    return _Reads(
        tuple(map(Tensor.data_ptr, params)),
        tuple(map(_DTYPE, params)),
        tuple(map(Tensor.numel, params)),
        tuple(map(Tensor.data_ptr, grads)),
        tuple(map(_DTYPE, grads)),
        tuple(map(_SHAPE, grads)),
        tuple(map(Tensor.is_neg, params)),
        tuple(map(Tensor.is_neg, grads)),
    )


def _table_if_plain(
    work: GroupStep,
    params: list[Tensor],
    grads: list[Tensor],
    stage: list[Tensor | None],
    originals: list[Tensor],
    arena_tensors: list[tuple[Tensor, str]],
    reads: _Reads | None = None,
) -> Tensor | None:
    """The slot table of the common case, every check of :func:`_checked_table` passed in
    C-level passes over all tensors at once; None where any tensor needs a closer look (which
    :func:`_checked_table` gives it, naming the problem): strided tensors updated through copies,
    empty ones, numpy ids or bases, staging for some slots only, memory shared anywhere (a
    gradient that is its own parameter included). That function's loop costs about 7 us per
    tensor, and a step whose gradients moved (``zero_grad(set_to_none=True)``) or whose
    stepping set changed (a mixture of experts) builds a new table.

    ``reads``: the caller's :func:`_read` of ``originals`` and ``grads``, which it found
    contiguous (the table cache's key holds it); None: both are checked and read here."""
    plan, slots, n = work.plan, work.slots, len(work.slots)
    given = work.grads
    staged = [st for st in stage if st is not None]
    if not n or (staged and len(staged) != n):
        return None
    try:
        # no contiguous copies: the table points at the caller's tensors
        if not (all(map(is_, params, originals)) and all(map(is_, grads, given))):
            return None
        tensors = [*originals, *grads, *staged]
        if not (
            all(map(isinstance, tensors, itertools.repeat(Tensor)))
            and all(map(_IS_CPU, tensors))
            and set(map(_LAYOUT, tensors)) == {torch.strided}
        ):
            return None
        if reads is None:
            # strided tensors are updated through copies (staging is checked below)
            if not all(map(Tensor.is_contiguous, [*originals, *grads])):
                return None
            reads = _read(originals, grads)
        if any(reads.pneg) or any(reads.gneg) or any(map(Tensor.is_neg, staged)):
            return None
        pptrs, gptrs = reads.pptrs, reads.gptrs
        sptrs = list(map(Tensor.data_ptr, staged)) if staged else [0] * n
        gdtypes = set(reads.gdtypes)
        numels, padded, offsets = _slot_columns(plan)
        snumel = [numels[si] for si in slots]
        spadded = [padded[si] for si in slots]
        tids, bases = work.tensor_ids, work.index_bases
        if not (
            all(pptrs)  # 0: empty (or no memory)
            and all(gptrs)
            and (not staged or (all(sptrs) and functools.reduce(operator.or_, sptrs) % 2 == 0))
            and set(reads.pdtypes) == {plan.param_dtype}
            and all(grad_dtype_ok(plan.param_dtype, d) for d in gdtypes)
            # addresses aligned to the largest element size there (a power of two)
            and functools.reduce(operator.or_, pptrs) % plan.param_dtype.itemsize == 0
            and functools.reduce(operator.or_, gptrs) % max(d.itemsize for d in gdtypes) == 0
            and list(reads.pnumels) == snumel
            and list(reads.gshapes) == list(map(_SHAPE, originals))
            and set(map(type, tids)) <= {int}
            and (bases is None or set(map(type, bases)) <= {int})
        ):
            return None
        bases = [0] * n if bases is None else list(bases)
        if min(bases) < 0 or max(map(operator.add, bases, spadded)) >= INDEX_LIMIT:
            return None
        if staged and not (
            plan.param_dtype != torch.float16
            and set(map(_DTYPE, staged)) == {torch.bfloat16}
            and list(map(Tensor.numel, staged)) == snumel
            and all(map(Tensor.is_contiguous, staged))
        ):
            return None
        # the byte ranges from what was read above (the arena's few tensors read here): a
        # range shared anywhere goes to the exact check, which allows a gradient that is its
        # own parameter
        pbytes = list(map(operator.mul, snumel, itertools.repeat(plan.param_dtype.itemsize)))
        if len(gdtypes) == 1:
            gbytes = list(map(operator.mul, snumel, itertools.repeat(next(iter(gdtypes)).itemsize)))
        else:
            gbytes = list(map(_NBYTES, grads))
        arena = [t for t, _ in arena_tensors]
        astarts = list(map(Tensor.data_ptr, arena))
        starts = [*pptrs, *gptrs, *astarts]
        stops = [
            *map(operator.add, pptrs, pbytes),
            *map(operator.add, gptrs, gbytes),
            *map(operator.add, astarts, map(_NBYTES, arena)),
        ]
        if staged:  # bf16 copies of the parameters' sizes
            starts += sptrs
            stops += map(operator.add, sptrs, map(operator.mul, snumel, itertools.repeat(2)))
        if ranges_overlap(starts, stops):
            return None
    except (RuntimeError, TypeError, AttributeError):  # odd tensors: looked at one by one
        return None
    columns = (
        pptrs,
        gptrs,
        [GRAD_IDS[d] for d in reads.gdtypes],
        map(_U32.__and__, tids),
        snumel,
        spadded,
        [offsets[si] for si in slots],
        sptrs,
        bases,
    )
    # column by column through an array: a list of rows to torch.tensor took 1.8 us per tensor
    flat = torch.frombuffer(array("q", itertools.chain.from_iterable(columns)), dtype=torch.int64)
    return flat.reshape(len(SLOT_COLUMNS), n).t().contiguous()


def _checked_table(
    work: GroupStep,
    params: list[Tensor],
    grads: list[Tensor],
    stage: list[Tensor | None],
    originals: list[Tensor],
    arena_tensors: list[tuple[Tensor, str]],
) -> Tensor:
    """The slot table, each slot checked on its own (ConfigError naming the first problem)."""
    plan = work.plan
    written: list[tuple[Tensor, Label]] = list(arena_tensors)
    read: list[tuple[Tensor, Label]] = []
    pairs: list[tuple[Tensor, Tensor]] = []
    rows = []
    for k, (si, p0, p, g, st, tid) in enumerate(
        zip(work.slots, originals, params, grads, stage, work.tensor_ids, strict=True)
    ):
        slot = plan.slots[si]
        base = work.index_base(k)
        # checked without building any message first: a slot that passes costs a few
        # microseconds
        if not _slot_ok(plan, slot, p0, g, st, tid, base):
            _check_slot(plan, slot, k, si, p0, g, st, tid, base)  # raises the first problem
        label = _SlotLabel(k, si, p0)
        written.append((p0, label))
        # the caller's gradient, not its contiguous copy: a strided view of a parameter is
        # refused as a contiguous one is (and as the Triton backend refuses both)
        given = work.grads[k]
        read.append((given, label.gradient))
        pairs.append((p0, given))
        if st is not None:
            written.append((st, label.staging))
        rows.append(
            [
                p.data_ptr(),
                g.data_ptr(),
                GRAD_IDS[g.dtype],
                int(tid) & _U32,
                slot.numel,
                slot.padded,
                slot.offset,
                _ptr(st),
                int(base),
            ]
        )
    check_aliasing(written, read, pairs)
    return torch.tensor(rows, dtype=torch.int64, device="cpu").reshape(-1, len(SLOT_COLUMNS))


def _check_group(work: GroupStep) -> None:
    plan = work.plan
    if work.rule not in RULES:
        raise ConfigError(f"the cpu backend runs rules {RULES}, got {work.rule!r}")
    if plan.device.type != "cpu":
        raise ConfigError(
            f"the cpu backend runs on CPU tensors; the group {plan} is on {plan.device}"
        )
    if plan.param_dtype not in PARAM_DTYPES:
        raise ConfigError(
            f"the cpu backend updates float32, bfloat16 or float16 parameters, got "
            f"{plan.param_dtype}"
        )
    if plan.block_size not in (1, 32):
        raise ConfigError(
            f"the CPU kernels pad to blocks of 1 or 32 elements, got {plan.block_size}"
        )


# validated slot tables kept per plan: memopt-offload steps each plan in a few dozen buckets
# (different slot subsets) per optimizer step; a table is 72 B per tensor
_CACHE_SIZE = 128


def _cache_key(work: GroupStep, reads: _Reads, stage) -> tuple:
    """Everything validation checked and the kernel call depends on, so that a hit stands in
    for validation: the tensors' addresses, dtypes and sizes (a smaller tensor at a cached
    address must not get the cached bounds), the gradients' shapes, the negative bits (a
    negated view shares its tensor's address), the ids and index bases (with their types: a
    bool or float base equal to a valid int is refused by validation, so it must not find that
    int's table), the formats and rounding (``work.spec``), the rule. The tensors' values come
    from ``reads`` (:func:`_read` of the step's parameters and gradients)."""
    bases = work.index_bases
    return (
        tuple(work.slots),
        reads,
        tuple(work.tensor_ids),
        None if bases is None else tuple((type(b), b) for b in bases),
        tuple(map(_ptr, stage)),
        tuple(
            None if st is None else (st.dtype, st.numel(), st.is_contiguous(), st.is_neg())
            for st in stage
        ),
        tuple(map(Tensor.data_ptr, work.arena.tensors())),
        work.spec,
        work.rule,
        work.rule == "sgd" and work.scalars.momentum != 0.0,
    )


def fused_step(
    work: GroupStep, staging: Mapping[int, Tensor | None] | Sequence[Tensor | None] | None = None
) -> None:
    """One optimizer step of every tensor of ``work`` in one call into C++ (see module doc).

    ``staging`` (for memopt-offload): a contiguous bfloat16 CPU tensor per parameter that
    receives the updated weights rounded to bf16 (2 more bytes per parameter; float32 and
    bfloat16 parameters only), as a
    ``{plan slot index: tensor}`` mapping or a sequence aligned with ``work.params`` (None:
    no copy for that tensor). Parameters are updated in place; strided ones through contiguous
    copies written back afterwards. The slot table is cached on the plan, keyed by the tensors'
    addresses, so a repeated step validates nothing again."""
    resolved = _resolve(work, staging)
    if resolved is None:
        return
    prepared, config, copies, _grads = resolved  # _grads: contiguous copies the table points at
    _call(prepared, config, copies)


def _call(prepared: _Prepared, config: dict, copies: list[tuple[Tensor, Tensor]]) -> None:
    """One validated call into C++, then the write-back of strided parameters' copies."""
    try:
        _core.fused_step(
            prepared.table.data_ptr(),
            prepared.n,
            **prepared.static,
            **config,
        )
    finally:
        # also when a KeyboardInterrupt is raised as the kernel returns (Python delivers it
        # then): the kernel has written codes and state, so the strided parameters must get
        # their new values too (after an error raised before the kernel ran, the copies still
        # hold the old values)
        for dst, tmp in copies:
            dst.detach().copy_(tmp)


def check_step(
    work: GroupStep, staging: Mapping[int, Tensor | None] | Sequence[Tensor | None] | None = None
) -> None:
    """Raise what :func:`fused_step` would raise for ``work``, changing nothing. Its validated
    table stays cached, so the step that follows finds it: core checks every group of a step
    this way before the first one runs."""
    _resolve(work, staging)


def _resolve(
    work: GroupStep, staging: Mapping[int, Tensor | None] | Sequence[Tensor | None] | None
) -> tuple[_Prepared, dict, list[tuple[Tensor, Tensor]], list[Tensor]] | None:
    """``work`` validated (or found in the plan's table cache): its prepared table, the
    call's scalar configuration, the (parameter, contiguous copy) pairs of strided
    parameters to write back, and the gradients the table points at (contiguous copies of
    strided ones, which must stay alive until the kernel ran); None when it has no tensors."""
    _check_group(work)
    try:
        config = step_config(work)
    except AttributeError as e:
        raise ConfigError(
            f"work.scalars ({type(work.scalars).__name__}) lacks {e.name!r}: rule {work.rule!r} "
            "takes memopt_core.reference's AdamScalars / SGDScalars / LionScalars"
        ) from None
    if not work.slots:
        return None
    stage = _staging_list(staging, work)
    originals = list(work.params)
    params, grads = originals, list(work.grads)
    copies: list[tuple[Tensor, Tensor]] = []
    try:
        strided = not (
            all(map(Tensor.is_contiguous, params)) and all(map(Tensor.is_contiguous, grads))
        )
        # read once: on a miss, the new table's passes take what the key read
        reads = None if strided else _read(params, grads)
        key: tuple | None = None if reads is None else _cache_key(work, reads, stage)
        hash(key)  # an unhashable index base: validation says why
    except (TypeError, RuntimeError, AttributeError):  # not tensors: validation says why
        _prepare(work, params, grads, stage, originals)
        raise  # pragma: no cover - _prepare raises a clearer error first
    if strided:
        for i, (p, g) in enumerate(zip(originals, grads, strict=True)):
            # checked before anything is copied, so a copy never hides a bad argument
            _check_tensor(p, f"parameter {i} (slot {work.slots[i]})")
            _check_tensor(g, f"the gradient of parameter {i} (slot {work.slots[i]})")
            if overlaps_itself(p):
                raise ConfigError(
                    f"parameter {i} (slot {work.slots[i]}, {_label(p)}) has elements that share "
                    "memory (an expanded tensor?): it cannot be updated in place"
                )
        params = list(params)
        for i, (p, g) in enumerate(zip(originals, grads, strict=True)):
            if not p.is_contiguous():
                tmp = p.detach().contiguous()
                copies.append((p, tmp))
                params[i] = tmp
            if not g.is_contiguous():
                grads[i] = g.contiguous()
    lru: OrderedDict = work.plan.cache("cpu_tables", OrderedDict)
    prepared = lru.get(key) if key is not None else None
    if prepared is None:
        prepared = _prepare(work, params, grads, stage, originals, reads)
        if key is not None:
            _remember(lru, key, prepared, _CACHE_SIZE)
    else:
        lru.move_to_end(key)
    return prepared, config, copies, grads


class PreparedStep:
    """One group's fused step validated once (:func:`prepare_step`): its slot table and the
    arena's addresses. :meth:`launch` runs it with a step's scalars and checks nothing, which
    is valid while every parameter and gradient keeps its address, dtype and size, every
    gradient stays contiguous and the arena keeps its tensors: memopt_core's cached step checks
    the tensors before each replay (it
    calls :func:`prepare_step` again for gradients that moved) and is dropped with the
    optimizer's state. For ``n`` tensors this saves the per-tensor key of :func:`fused_step`'s
    table cache (about 0.5 us per tensor)."""

    __slots__ = ("_momentum", "_prepared", "rule")
    reusable = True

    def __init__(self, rule: str, prepared: _Prepared) -> None:
        self.rule, self._prepared = rule, prepared
        # SGD's momentum buffer (its format and address) is part of the prepared arguments
        self._momentum = rule == "sgd" and prepared.static["fmt1"] != NONE_ID

    def launch(self, scalars, step: int, seed: int, first_step: bool) -> None:
        """Run the step with ``scalars`` (core's ``adam_scalars`` / ``sgd_scalars`` /
        ``lion_scalars``) for 1-based ``step``; the same bits as :func:`fused_step`.
        ConfigError when SGD's momentum turned zero or non-zero since :func:`prepare_step`."""
        p = self._prepared
        _core.fused_step(
            p.table.data_ptr(), p.n, **p.static, **self.config(scalars, step, seed, first_step)
        )

    def config(self, scalars, step: int, seed: int, first_step: bool) -> dict:
        """The call's scalar keywords for ``scalars`` and ``step`` (what :meth:`launch`
        passes); ConfigError when SGD's momentum turned zero or non-zero since
        :func:`prepare_step`."""
        config = _scalar_config(self.rule, scalars, first_step, seed, step)
        if config["has_momentum"] != self._momentum:
            raise ConfigError(
                f"this step was prepared for SGD {'with' if self._momentum else 'without'} "
                f"momentum, and its scalars have momentum {scalars.momentum}: the momentum "
                "buffer is part of what prepare_step() validated; call it again"
            )
        return config


#: the keywords of a call that depend on the step count: what a merged call takes per work
_PER_COUNT = ("first_step", "step", "scalars")


def fused_steps(
    works: Sequence[GroupStep],
    prepared: Sequence[PreparedStep | None] | None = None,
    done: Callable[[int], None] | None = None,
) -> None:
    """Every step of ``works`` (none with staging), the works that share an arena and all
    but their step count in one call into C++ (the backend's ``step_all``): a state group's
    parameters at several step counts, which core steps as one work per count (a MoE's experts
    that skipped steps). Each table row reads its own work's step, first-step flag and scalars
    (a variant of the call), so the bits are those of one :func:`fused_step` per work; a call
    per work costs the thread pool's wake-up and its own small parts.

    ``prepared``: None, or aligned with ``works``: each work's :class:`PreparedStep` (core's
    cached step, for its current gradients) or None (validated here, as :func:`fused_step`
    does). Every work is validated before the first call. ``done(i)`` is called once work
    ``i``'s call returned (also when a KeyboardInterrupt comes out of it: the call ran)."""
    n = len(works)
    ready = [None] * n if prepared is None else list(prepared)
    if len(ready) != n:
        raise ConfigError(f"fused_steps got {len(ready)} prepared steps for {n} works")
    if any(w.staging is not None for w in works):
        raise ConfigError("fused_steps runs steps without staging; those go through fused_step")
    calls: dict[tuple, list[tuple[int, _Prepared, dict]]] = {}
    # (first work index, the call, the works it runs), every work validated before the first
    runs: list[tuple[int, Callable[[], None], list[int]]] = []
    # contiguous copies of strided gradients, which the tables point at: alive until the calls
    keep: list[list[Tensor]] = []
    for i, (w, p) in enumerate(zip(works, ready, strict=True)):
        if p is not None:
            config = p.config(w.scalars, w.step, w.seed, w.first_step)
            calls.setdefault(_merge_key(p._prepared, config), []).append((i, p._prepared, config))
            continue
        resolved = _resolve(w, None)
        if resolved is None:  # no tensors
            runs.append((i, lambda: None, [i]))
            continue
        prep, config, copies, grads = resolved
        keep.append(grads)
        if copies:  # strided parameters, written back after their own call
            runs.append((i, functools.partial(_call, prep, config, copies), [i]))
            continue
        calls.setdefault(_merge_key(prep, config), []).append((i, prep, config))
    for members in calls.values():
        first, prep, config = members[0]
        if len(members) == 1:
            runs.append((first, functools.partial(_call, prep, config, []), [first]))
        else:
            _check_apart_once([works[m[0]] for m in members], [ready[m[0]] for m in members])
            runs.append((first, functools.partial(_merged_call, members), [m[0] for m in members]))
    for _, launch, indices in sorted(runs, key=lambda r: r[0]):
        launch_then_done(launch, indices, done)


#: merged calls of prepared works whose memory was checked apart, per plan (a few)
_APART_CACHE_SIZE = 4


def _check_apart_once(works: list[GroupStep], prepared: list[PreparedStep | None]) -> None:
    """:func:`_check_apart`, once per set of prepared works: core's cached step replays the
    same :class:`PreparedStep` objects while every parameter and gradient stays where it was
    prepared (it prepares a work again for gradients that moved), so their memory is apart as
    it was (the check took 0.34 ms per replay over 170 tensors). The cache holds the prepared
    steps themselves, so that an id is not reused by another."""
    if any(p is None for p in prepared):
        _check_apart(works)
        return
    checked: OrderedDict = works[0].plan.cache("cpu_apart_checked", OrderedDict)
    key = tuple(map(id, prepared))
    held = checked.get(key)
    if held is not None and all(map(is_, held, prepared)):
        checked.move_to_end(key)
        return
    _check_apart(works)
    _remember(checked, key, tuple(prepared), _APART_CACHE_SIZE)


def _remember(lru: OrderedDict, key: Any, value: Any, size: int) -> None:
    """Put ``value`` in the least-recently-used cache ``lru``, holding at most ``size``."""
    lru[key] = value
    while len(lru) > size:
        lru.popitem(last=False)


def _check_apart(works: list[GroupStep]) -> None:
    """ConfigError when a gradient of one work shares memory with a parameter of another:
    each work was checked alone, and one call runs them at once (one after the other, such a
    pair read and wrote in a fixed order)."""
    written: list[tuple[Tensor, Label]] = []
    read: list[tuple[Tensor, Label]] = []
    pairs: list[tuple[Tensor, Tensor]] = []
    for w in works:
        for k, (si, p, g) in enumerate(zip(w.slots, w.params, w.grads, strict=True)):
            label = _SlotLabel(k, si, p)
            written.append((p, label))
            read.append((g, label.gradient))
            pairs.append((p, g))
    check_aliasing(written, read, pairs)


def _merge_key(prep: _Prepared, config: dict) -> tuple:
    """What the works of one merged call share: the arena and formats (the static keywords)
    and every scalar keyword that does not depend on the step count."""
    return (
        *prep.static.items(),
        *((k, v) for k, v in config.items() if k not in _PER_COUNT),
    )


def _merged_call(members: list[tuple[int, _Prepared, dict]]) -> None:
    """One call over the rows of every member (index, prepared table, config), each member's
    rows reading its own variant (its ``_PER_COUNT`` keywords)."""
    tables = [prep.table for _, prep, _ in members]
    counts = [prep.n for _, prep, _ in members]
    table = torch.cat(tables)
    # through an array (a list converted to a tensor took 48 us at 13 works of 13 rows, this
    # 28 us; torch.repeat_interleave took longer still at that size)
    indices = itertools.chain.from_iterable(itertools.repeat(k, n) for k, n in enumerate(counts))
    row_variant = torch.frombuffer(array("i", indices), dtype=torch.int32)
    variants: list[float] = []
    for _, _, config in members:
        variants += (float(config["first_step"]), float(config["step"]), *config["scalars"])
    head = members[0][2]
    _core.fused_step(
        table.data_ptr(),
        sum(counts),
        **members[0][1].static,
        **head,
        variants=variants,
        row_variant=row_variant.data_ptr(),
    )


def prepare_step(work: GroupStep) -> PreparedStep | None:
    """``work`` (its current parameters and gradients, no staging) validated for repeated
    :meth:`PreparedStep.launch` calls, or None where :func:`fused_step` must run each time: a
    step with staging copies or strided tensors (updated through copies), or without tensors.
    Raises what :func:`fused_step` raises for bad input."""
    _check_group(work)
    if work.staging is not None or not work.slots:
        return None
    params, grads = list(work.params), list(work.grads)
    try:
        strided = not (
            all(map(Tensor.is_contiguous, params)) and all(map(Tensor.is_contiguous, grads))
        )
    except TypeError:  # not tensors: fused_step's validation says why
        strided = True
    if strided:
        return None
    try:  # passed down, as in fused_step: the table's passes then read no tensor again
        reads: _Reads | None = _read(params, grads)
    except (RuntimeError, TypeError, AttributeError):  # an odd tensor: validation names it
        reads = None
    prepared = _prepare(work, params, grads, [None] * len(params), params, reads)
    return PreparedStep(work.rule, prepared)
