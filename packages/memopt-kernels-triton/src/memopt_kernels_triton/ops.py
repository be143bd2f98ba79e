"""Python wrappers of the Triton kernels: validation, tables, launches.

Standalone kernels (checkpoints, fp32 export, tests of the inlined codecs):
:func:`encode_moment` / :func:`decode_moment` (every moment format; :func:`q8_quantize` /
:func:`q8_dequantize` are the q8 shorthands), :func:`encode_master` / :func:`decode_master`
(:func:`ecc_encode` / :func:`ecc_decode` for ECC-24/32), :func:`stream_words`. Each gives the
same bits as the corresponding ``memopt_core.formats`` codec / ``memopt_core.rng`` function,
except a NaN's payload: a NaN decodes as a NaN, not always of the reference's bits (a q8 or fp8
scale byte of 255, which no encoder writes, decodes a zero code to 0 x inf).

The fused optimizer step: :func:`fused_step` runs one :class:`memopt_core.backends.GroupStep`
(every tensor of the group) in one launch of the rule's kernel, driven by core's chunk table and
a per-slot table of (parameter address, gradient address, gradient is fp32, tensor id, index
base). The index base (:meth:`GroupStep.index_base <memopt_core.backends.GroupStep.index_base>`,
0 unless the tensor is a shard) is added to every element index that stochastic rounding draws
words for, so a shard of an FSDP2-sharded parameter draws the words the whole tensor would.

A capturable step (``GroupStep.device_step``, :func:`device_step`) keeps step counts on the
device: a small kernel (:mod:`~memopt_kernels_triton.kernels.device_words`) writes one row of
device words per tensor from them, with a GradScaler's scale and found-inf flag, then the rule
kernel reads its tensor's row: no host synchronisation, so the step can be captured in a CUDA
graph.

Importing this module imports triton. Kernels run on CUDA tensors, or on CPU tensors under
``TRITON_INTERPRET=1`` (Triton's interpreter, used by the CPU tests); :func:`interpreting` says
which. Every launch passes ``enable_fp_fusion=False`` so no multiply-add is contracted.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import itertools
import numbers
import os
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import Any, cast

import torch
from torch import Tensor

from memopt_core.aliasing import (
    Label,
    any_extents_overlap,
    check_aliasing,
    has_memory,
    refuse_negated,
)
from memopt_core.backends import (
    RULES,
    DeviceStep,
    GroupStep,
    grad_dtype_ok,
    kernel_master_id,
    kernel_moment_id,
    launch_then_done,
)
from memopt_core.errors import ConfigError, FormatError
from memopt_core.formats import MomentCodec, moment_codec
from memopt_core.formats.registry import MASTER_FORMATS, master_codec
from memopt_core.optimizer import check_bool
from memopt_core.plan import StateArena, ceil_div, overlaps_itself, round_up
from memopt_core.reference import (
    adam_bias_last,
    bias_correction_table,
    decay_norm_table,
    round_to_float32,
)
from memopt_core.rng import STREAM_FIRST, STREAM_MASTER, STREAM_SECOND
from memopt_kernels_triton.kernels import adam as _adam
from memopt_kernels_triton.kernels import convert as _convert
from memopt_kernels_triton.kernels import device_words as _words
from memopt_kernels_triton.kernels import lion as _lion
from memopt_kernels_triton.kernels import sgd as _sgd

__all__ = [
    "ADAM_HYPER_FIELDS",
    "HYPER_FIELDS",
    "LION_HYPER_FIELDS",
    "MERGE_MIN_WORKS",
    "SGD_HYPER_FIELDS",
    "KernelConfig",
    "PreparedStep",
    "adam_hyper_words",
    "check_step",
    "decode_master",
    "decode_moment",
    "device_step",
    "ecc_decode",
    "ecc_encode",
    "encode_master",
    "encode_moment",
    "fused_step",
    "fused_steps",
    "hyper_words",
    "interpreting",
    "kernel_config",
    "lion_hyper_words",
    "master_id",
    "moment_id",
    "prepare_step",
    "q8_dequantize",
    "q8_quantize",
    "reset_kernel_config",
    "sgd_hyper_words",
    "stream_words",
]

_STANDALONE_ROWS = 32  # blocks of 32 per program of the standalone kernels (GPU)
_INTERP_ROWS = 4


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")


def _interpreter_compat() -> None:
    """Under ``TRITON_INTERPRET=1``, two ways Triton's CPU interpreter differs from its compiler,
    evened out (idempotent; nothing is touched otherwise):

    - Triton < 3.7 converts scalar tensors (1-element arrays) to ints with ``int(array)``, which
      numpy >= 2.4 refuses (triton-lang/triton#9171, fixed by #9172): loops with tensor bounds
      then fail. ``__index__`` is re-set the way the fix does.
    - The compiler passes every Python float argument as fp32 (``mangle_type``); the
      interpreter passes it on as a Python float, which its ``to_tensor`` types as fp64 below
      2**-126, so a subnormal fp32 scalar (``eps=1e-40``) failed the kernel's fp32 arithmetic.
      Float arguments become fp32 scalars, as ints become int32 ones."""
    if not interpreting():
        return
    try:
        import numpy as np
        from triton import language as tl
        from triton.runtime import interpreter as _interp
    except Exception:  # pragma: no cover - no interpreter in this triton
        return
    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is not None and not getattr(orig, "_memopt_compat", False):

        def patched(tensor, scope):
            orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        patched._memopt_compat = True  # type: ignore[attr-defined]
        _interp._patch_lang_tensor = patched
    cvt, handle = getattr(_interp, "_implicit_cvt", None), getattr(_interp, "TensorHandle", None)
    if cvt is not None and handle is not None and not getattr(cvt, "_memopt_compat", False):

        def fp32_floats(arg):
            if type(arg) is float:
                return tl.tensor(handle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
            return cvt(arg)

        fp32_floats._memopt_compat = True  # type: ignore[attr-defined]
        _interp._implicit_cvt = fp32_floats


_interpreter_compat()


def _check_device(t: Tensor, what: str) -> None:
    if not isinstance(t, Tensor):
        raise ConfigError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ConfigError(f"{what} is a {t.layout} tensor; the Triton kernels take dense tensors")
    if not (t.device.type == "cuda" or (t.device.type == "cpu" and interpreting())):
        raise ConfigError(
            f"the triton backend runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); "
            f"{what} is on {t.device}"
        )
    if not has_memory(t):  # the kernels would read address 0: an illegal access on the GPU
        raise ConfigError(
            f"{what} is a {type(t).__name__} without memory of its own (a tensor subclass, or "
            "a freed storage): the Triton kernels read and write memory directly; step it on "
            "the torch backend (backend='torch'; the Flash optimizers: fused=False)"
        )


def _launch(
    kernel,
    grid,
    *args,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    **constexprs,
) -> None:
    opts: dict[str, bool | int] = {"enable_fp_fusion": False}
    if not interpreting():
        if num_warps is not None:
            opts["num_warps"] = num_warps
        if num_stages is not None:
            opts["num_stages"] = num_stages
        if maxnreg is not None:
            opts["maxnreg"] = maxnreg
    with _on_device_of(args):
        kernel[grid](*args, **constexprs, **opts)


def _on_device_of(args: Sequence) -> contextlib.AbstractContextManager:
    """The device of the first CUDA tensor in ``args`` made current for a launch, where another
    one is: Triton launches on the current device and its current stream, so with tensors on
    ``cuda:1`` and ``cuda:0`` current (a model moved with ``.to("cuda:1")`` without
    ``torch.cuda.set_device``) it would run on the wrong GPU (an illegal address, or a race
    with the stream that wrote the gradients), as torch's own ops never do."""
    for a in args:
        if isinstance(a, Tensor):
            if a.device.type == "cuda" and a.device.index != torch.cuda.current_device():
                return torch.cuda.device(a.device)
            break
    return contextlib.nullcontext()


def _i32(v: int, what: str = "a 32-bit word") -> int:
    """A 32-bit value as a signed int32 Python int (kernels bit-cast it back to uint32);
    ConfigError naming ``what`` for a non-int (a bool, a float, a tensor: a tensor reached the
    kernel as its address), as memopt-kernels-cpu's ops refuse them."""
    if type(v) is not int:  # the common case first: this runs at every launch
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ConfigError(f"{what} must be an int, got {type(v).__name__} {v!r}")
        v = int(v)
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v


def _rows() -> int:
    return _INTERP_ROWS if interpreting() else _STANDALONE_ROWS


# ----------------------------------------------------------------------------------- ids
moment_id = kernel_moment_id
master_id = kernel_master_id


def _kernel_view(t: Tensor) -> Tensor:
    """The tensor as the kernels address it: fp32 as is, 16-bit floats as int16, fp8 as uint8."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t


def _rand_arg(rand: Tensor | None, n: int, device: torch.device) -> Tensor:
    if rand is None:
        return torch.zeros(1, dtype=torch.int32, device=device)
    if not isinstance(rand, Tensor) or rand.dtype != torch.int64 or rand.numel() != n:
        got = (
            f"{rand.dtype}{tuple(rand.shape)}" if isinstance(rand, Tensor) else type(rand).__name__
        )
        raise FormatError(
            f"rand must be an int64 tensor of {n} uniform 32-bit words, got {got}: use "
            "memopt_core.rng.uniform_bits"
        )
    if rand.device != device:
        raise ConfigError(f"rand is on {rand.device}; the encoded tensor is on {device}")
    r = rand.reshape(-1) & 0xFFFFFFFF
    return torch.where(r >= 2**31, r - 2**32, r).to(torch.int32)


_STREAMS = (STREAM_MASTER, STREAM_FIRST, STREAM_SECOND)


def _sr_mode(
    rand: Tensor | None, rng: tuple[int, int, int, int] | None
) -> tuple[int, int, int, int, int]:
    """``(mode, seed, tensor_id, step, stream)``, the ids as int32 words; mode 0: round to
    nearest even, 1: explicit words ``rand``, 2: words drawn in the kernel."""
    if rand is not None and rng is not None:
        raise ConfigError(
            "pass either rand (explicit words) or rng=(seed, tensor_id, step, stream)"
        )
    if rng is None:
        return (1 if rand is not None else 0), 0, 0, 0, 0
    if not isinstance(rng, Sequence) or len(rng) != 4:
        raise ConfigError(f"rng is (seed, tensor_id, step, stream), got {rng!r}")
    seed, tid, step, stream = rng
    if type(stream) is not int or stream not in _STREAMS:  # ConfigError is a ValueError
        raise ConfigError(
            f"rng's stream is {STREAM_MASTER} (master), {STREAM_FIRST} (first moment) or "
            f"{STREAM_SECOND} (second moment); got {stream!r}"
        )
    return (
        2,
        _i32(seed, "rng's seed"),
        _i32(tid, "rng's tensor_id"),
        _i32(step, "rng's step"),
        stream,
    )


# ----------------------------------------------------------------------------------- standalone
def encode_moment(
    fmt: str,
    x: Tensor,
    *,
    rand: Tensor | None = None,
    rng: tuple[int, int, int, int] | None = None,
) -> dict[str, Tensor]:
    """Fields of fp32 ``x`` in moment format ``fmt``: the same bits as
    ``moment_codec(fmt).encode(x, rand=rand)``.

    Stochastic rounding with explicit words ``rand`` (int64, ``x``'s size), or with words drawn in
    the kernel: ``rng=(seed, tensor_id, step, stream)``, stream 0, 1 or 2, draws
    ``memopt_core.rng.uniform_bits(seed, tensor_id, index, step, stream)`` with ``index`` =
    position in ``x``. Blocked formats need a length that is a multiple of 32.
    """
    codec = moment_codec(fmt)
    _check_device(x, "x")
    if x.dtype != torch.float32:
        raise FormatError(f"codecs encode float32 tensors, got {x.dtype}: convert with .float()")
    n = x.numel()
    codec.check_length(n)
    flat = x.resolve_neg().reshape(-1).contiguous()
    fields = codec.allocate(n, x.device)
    mode, seed, tid, step, stream = _sr_mode(rand, rng)
    words = _rand_arg(rand, n, x.device)  # checked for an empty x too, as the other backends do
    code = _kernel_view(fields[""])
    scale = fields.get("scale", torch.zeros(1, dtype=torch.uint8, device=x.device))
    if n:
        rows = _rows()
        grid = (ceil_div(n, 32 * rows),)
        _launch(
            _convert.moment_encode_kernel,
            grid,
            flat,
            code,
            scale,
            words,
            n,
            seed,
            tid,
            step,
            FMT=moment_id(fmt),
            RAND=mode,
            STREAM=stream,
            ROWS=rows,
        )
    fields[""] = fields[""].view(x.shape)
    return fields


def decode_moment(fmt: str, fields: dict[str, Tensor]) -> Tensor:
    """fp32 vector held by ``fields`` of moment format ``fmt`` (= ``moment_codec(fmt).decode``)."""
    codec: MomentCodec = moment_codec(fmt)
    if not isinstance(fields, Mapping):
        raise FormatError(
            f"fields must be a mapping of field name to tensor (what encode_moment returns), "
            f"got {type(fields).__name__}"
        )
    missing = [k for k in codec.fields if k not in fields]
    if missing:
        raise FormatError(f"format {fmt!r} needs fields {list(codec.fields)}; missing {missing}")
    main = fields[""]
    _check_device(main, "the codes")
    for k, f in codec.fields.items():
        _check_device(fields[k], f"field {k!r} of {fmt!r}")
        if fields[k].device != main.device:  # the kernel would read another GPU's address
            raise ConfigError(
                f"field {k!r} of {fmt!r} is on {fields[k].device}; the codes are on {main.device}"
            )
        if fields[k].dtype != f.dtype:
            raise FormatError(f"field {k!r} of {fmt!r} is {f.dtype}, got {fields[k].dtype}")
    n = main.numel()
    codec.check_length(n)
    scale = fields.get("scale", torch.zeros(1, dtype=torch.uint8, device=main.device))
    if codec.block_size > 1 and scale.numel() != n // codec.block_size:
        raise FormatError(f"{n} codes need {n // codec.block_size} scales, got {scale.numel()}")
    out = torch.empty(n, dtype=torch.float32, device=main.device)
    if n:
        rows = _rows()
        _launch(
            _convert.moment_decode_kernel,
            (ceil_div(n, 32 * rows),),
            _kernel_view(main.resolve_neg().reshape(-1).contiguous()),
            scale.resolve_neg().reshape(-1).contiguous(),
            out,
            n,
            FMT=moment_id(fmt),
            ROWS=rows,
        )
    return out.view(main.shape)


def q8_quantize(
    x: Tensor, *, second_moment: bool = False, rand: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(codes, scales)`` of ``x`` in ``q8_signed`` (or ``q8_sqrt`` for a second moment)."""
    f = encode_moment("q8_sqrt" if second_moment else "q8_signed", x, rand=rand)
    return f[""], f["scale"]


def q8_dequantize(codes: Tensor, scales: Tensor, *, second_moment: bool = False) -> Tensor:
    """fp32 values of q8 ``codes`` with per-32 ``scales`` (inverse of :func:`q8_quantize`)."""
    return decode_moment("q8_sqrt" if second_moment else "q8_signed", {"": codes, "scale": scales})


def encode_master(
    fmt: str,
    x: Tensor,
    param_dtype: torch.dtype = torch.bfloat16,
    *,
    rand: Tensor | None = None,
    rng: tuple[int, int, int, int] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``(param, code)`` of fp32 master ``x`` in master format ``fmt`` for ``param_dtype``
    parameters: the same bits as ``master_codec(fmt, param_dtype).encode(x, rand=rand)``.

    Stochastic rounding as in :func:`encode_moment` (``rand``, or ``rng=(seed, tensor_id, step,
    stream)``; a fused step rounds masters with stream 0)."""
    if fmt not in MASTER_FORMATS:
        raise ConfigError(f"unknown master format {fmt!r}; choose one of {MASTER_FORMATS}")
    codec = master_codec(fmt, param_dtype)
    _check_device(x, "x")
    if x.dtype != torch.float32:
        raise FormatError(f"codecs encode float32 tensors, got {x.dtype}: convert with .float()")
    mid = master_id(fmt, param_dtype)
    n = x.numel()
    flat = x.resolve_neg().reshape(-1).contiguous()
    param = torch.empty(n, dtype=param_dtype, device=x.device)
    code = (
        torch.empty(n, dtype=codec.code_dtype, device=x.device)
        if codec.code_dtype is not None
        else None
    )
    mode, seed, tid, step, stream = _sr_mode(rand, rng)
    words = _rand_arg(rand, n, x.device)
    if n:
        rows = _rows()
        _launch(
            _convert.master_encode_kernel,
            (ceil_div(n, 32 * rows),),
            flat,
            _kernel_view(param),
            code if code is not None else torch.zeros(1, dtype=torch.uint8, device=x.device),
            words,
            n,
            seed,
            tid,
            step,
            MASTER=mid,
            RAND=mode,
            STREAM=stream,
            ROWS=rows,
        )
    return param.view(x.shape), (code.view(x.shape) if code is not None else None)


def decode_master(fmt: str, param: Tensor, code: Tensor | None = None) -> Tensor:
    """fp32 master held by ``param`` (and ``code``): ``master_codec(fmt, param.dtype).decode``."""
    _check_device(param, "param")
    codec = master_codec(fmt, param.dtype)
    codec.check_decode(param, code)
    if code is not None and code.device != param.device:
        raise ConfigError(f"code is on {code.device}; param is on {param.device}")
    n = param.numel()
    out = torch.empty(n, dtype=torch.float32, device=param.device)
    if n:
        rows = _rows()
        _launch(
            _convert.master_decode_kernel,
            (ceil_div(n, 32 * rows),),
            _kernel_view(param.resolve_neg().reshape(-1).contiguous()),
            (
                code.resolve_neg().reshape(-1).contiguous()
                if code is not None
                else torch.zeros(1, dtype=torch.uint8, device=param.device)
            ),
            out,
            n,
            MASTER=master_id(fmt, param.dtype),
            ROWS=rows,
        )
    return out.view(param.shape)


def ecc_encode(x: Tensor, bits: int = 24, *, rand: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Split fp32 ``x`` into a bf16 parameter and an ECC code (``bits`` 24: uint8, 32: int16)."""
    if type(bits) is not int or bits not in (24, 32):  # 24.0 would name format "ecc24.0"
        raise ConfigError(f"ECC masters have 24 or 32 bits (an int), got {bits!r}")
    p, c = encode_master(f"ecc{bits}", x, torch.bfloat16, rand=rand)
    assert c is not None
    return p, c


def ecc_decode(param: Tensor, code: Tensor) -> Tensor:
    """fp32 master of a bf16 ``param`` and its ECC ``code`` (uint8: ECC-24, int16: ECC-32)."""
    _check_device(code, "code")
    if code.dtype == torch.uint8:
        return decode_master("ecc24", param, code)
    if code.dtype == torch.int16:
        return decode_master("ecc32", param, code)
    raise FormatError(f"ECC codes are uint8 (ECC-24) or int16 (ECC-32), got {code.dtype}")


def stream_words(
    seed: int, tensor_id: int, index: Tensor, step: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The words (int64 in ``[0, 2**32)``) of streams 0, 1 and 2 (master, first moment, second
    moment) of elements ``index`` (int64) at optimizer ``step``: the same as
    ``memopt_core.rng.stream_words(seed, tensor_id, index, step)`` for scalar ids."""
    _check_device(index, "index")
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise FormatError(f"index must be an integer tensor, got {index.dtype}")  # 2.7 -> 2
    idx = index.resolve_neg().reshape(-1).to(torch.int64).contiguous()
    n = idx.numel()
    out = torch.empty((3, n), dtype=torch.int32, device=index.device)
    if n:
        block = 128 if interpreting() else 1024
        _launch(
            _convert.stream_words_kernel,
            (ceil_div(n, block),),
            idx,
            out,
            n,
            _i32(seed, "seed"),
            _i32(tensor_id, "tensor_id"),
            _i32(step, "step"),
            BLOCK=block,
        )
    # masked in place: ``& 0xFFFFFFFF`` would allocate the 8 bytes per word a second time
    words = out.to(torch.int64).bitwise_and_(0xFFFFFFFF)
    return tuple(w.view(index.shape) for w in words)


# ----------------------------------------------------------------------------------- fused step
class KernelConfig:
    """Launch geometry of the fused step: tile ``rows`` (x32 elements), ``chunk_size`` (elements
    per chunk-table row; None: chosen from the group size), ``num_warps``, ``programs``
    (persistent grid size; None: a multiple of the SM count), ``num_stages`` (Triton's
    software pipelining depth; None: Triton's default) and ``maxnreg`` (a cap on registers per
    thread, ptxas' ``.maxnreg``: more programs fit on an SM; None: the compiler's choice)."""

    def __init__(
        self,
        rows: int = 16,
        chunk_size: int | None = None,
        num_warps: int = 8,
        programs: int | None = None,
        max_chunk: int = 16384,
        waves: int = 64,
        num_stages: int | None = None,
        maxnreg: int | None = None,
    ) -> None:
        # checked here: a negative grid launches nothing, and the compiler's own errors come
        # from deep in Triton (or not at all under the interpreter)
        _check_field("rows", rows, power_of_two=True)  # tl.arange spans of 32 x rows
        _check_field("chunk_size", chunk_size, none_ok=True, multiple=32)
        _check_field("num_warps", num_warps, power_of_two=True)
        _check_field("programs", programs, none_ok=True)
        _check_field("max_chunk", max_chunk, multiple=32)
        _check_field("waves", waves)
        _check_field("num_stages", num_stages, none_ok=True)
        _check_field("maxnreg", maxnreg, none_ok=True)
        if maxnreg is not None and not 24 <= maxnreg <= 255:
            raise ConfigError(f"maxnreg must be None or in [24, 255], got {maxnreg}")
        self.rows, self.chunk_size, self.num_warps = rows, chunk_size, num_warps
        self.programs, self.max_chunk, self.waves = programs, max_chunk, waves
        self.num_stages, self.maxnreg = num_stages, maxnreg

    def __repr__(self) -> str:
        return (
            f"KernelConfig(rows={self.rows}, chunk_size={self.chunk_size}, num_warps="
            f"{self.num_warps}, programs={self.programs}, max_chunk={self.max_chunk}, "
            f"waves={self.waves}, num_stages={self.num_stages}, maxnreg={self.maxnreg})"
        )


def _check_field(
    name: str, v, *, none_ok: bool = False, power_of_two: bool = False, multiple: int = 1
) -> None:
    """ConfigError naming ``KernelConfig``'s field ``name`` unless ``v`` is a positive int (not a
    bool; None where ``none_ok``), a power of two or a multiple of ``multiple`` where asked."""
    if v is None and none_ok:
        return
    if type(v) is not int or v <= 0 or (power_of_two and v & (v - 1)) or v % multiple:
        want = "a power of two" if power_of_two else "a positive int"
        if multiple > 1:
            want += f" multiple of {multiple}"
        raise ConfigError(
            f"KernelConfig's {name} must be {want}"
            + (" or None" if none_ok else "")
            + f", got {v!r}"
        )


_INTERP_CONFIG = KernelConfig(rows=4, chunk_size=256, num_warps=4, programs=3)
# On the H200 (2026-11-30, tools/bench/kernel_geometry.py, docs/benchmarks/2026-11-30-vector-tiles.md;
# 8 x 64M and 4096 x 32K): since the whole tiles' accesses are vectorized, a thread wants several
# contiguous elements of a row, 4 at 16 rows x 4 warps, for every rule and format measured. AdamW
# with q8 moments over an fp32 master, in place, registers capped at 64: 3.36 and 0.89 ms against
# 4.92 and 1.31 at the former 8 x 4 loading ahead; over an ECC-24 master, loading ahead, capped at
# 80: 4.54 and 1.22 against 5.33 and 1.41 at the former 4 x 4 (the caps gain 3-5%: more programs
# per SM); bf16 moments over an fp32 master, loading ahead: 3.17 and 0.84 against 3.59 and 0.82 at
# the former 32 x 8; over an ECC-24 master: 4.20 and 1.16.
_GPU_CONFIG = KernelConfig(rows=16, num_warps=4)
_GPU_ADAM_Q8_CONFIG = KernelConfig(rows=16, num_warps=4, maxnreg=64)
_GPU_ADAM_ECC24_Q8_CONFIG = KernelConfig(rows=16, num_warps=4, maxnreg=80)
_config_override: KernelConfig | None = None
_ECC24 = 3  # kernel_master_id("ecc24", torch.bfloat16)


def _loads_ahead(rule: str, block_size: int, master: int) -> bool:
    """Whether the Adam and Lion kernels load each whole tile one tile ahead (their ``AHEAD``),
    where it measured faster on the H200 with the vectorized tiles (2026-11-30-vector-tiles.md):
    an fp32 or ECC-24 master with unblocked moments (AdamW with bf16 moments: 3.17 against 3.63 ms
    over an fp32 master, 4.20 against 5.44 over ECC-24, on 8 x 64M), an ECC-24 master with blocked
    ones (AdamW with q8 moments 4.76 against 6.03 ms, Lion 2.61 against 2.95). Not an fp32 master
    with blocked moments (AdamW 3.49 in place against 3.57 ahead), nor the masters not measured."""
    if block_size == 1:
        return master in (0, _ECC24)
    return master == _ECC24


def kernel_config(
    config: KernelConfig | None = None,
    *,
    blocked: bool = False,
    rule: str = "adam",
    master: int = 0,
) -> KernelConfig:
    """The fused step's launch configuration. ``config`` replaces it for every later step (until
    :func:`reset_kernel_config`); without a replacement, the default on a GPU: 16 rows x 4 warps,
    with registers capped for AdamW with ``blocked`` moments (an 8-bit format with block scales)
    over an fp32 master (64) or an ECC-24 master (80; ``master`` is a :func:`master_id`)."""
    global _config_override
    if config is not None:
        _config_override = config
    if _config_override is not None:
        return _config_override
    if interpreting():
        return _INTERP_CONFIG
    if rule == "adam" and blocked and master in (0, _ECC24):
        return _GPU_ADAM_ECC24_Q8_CONFIG if master == _ECC24 else _GPU_ADAM_Q8_CONFIG
    return _GPU_CONFIG


def reset_kernel_config() -> None:
    """Back to the default launch configuration."""
    global _config_override
    _config_override = None


_SM_COUNT: dict[str, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    key = str(device)
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[key]


def _aligned(addresses: Sequence[int]) -> bool:
    """Whether every address is a multiple of 16 bytes: the kernels' ``ALIGNED`` (vector accesses
    of the parameters and gradients, tiles.chunk_info)."""
    return all(a % 16 == 0 for a in addresses)


def _arena_aligned(plan) -> bool:
    """Whether every tensor of the plan starts at a multiple of 8 elements of its arena, so that
    every chunk does (chunk starts are multiples of 32): the kernels' ``ARENA_ALIGNED`` (vector
    accesses of unblocked states; blocked arenas always are). True for most models (layer widths
    are multiples of 8); one odd-sized tensor makes it false for the tensors after it."""
    return all(s.offset % 8 == 0 for s in plan.slots)


def _chunk_size(cfg: KernelConfig, plan, total: int) -> int:
    """Elements per chunk-table row: a multiple of 32 (KernelConfig checks its fields)."""
    if cfg.chunk_size is not None:
        return cfg.chunk_size
    unit = 32 * cfg.rows
    target = ceil_div(total, _sm_count(plan.device) * cfg.waves)
    return min(max(round_up(target, unit), unit), cfg.max_chunk)


_DUMMY: dict[tuple, Tensor] = {}


def _dummy(device: torch.device, dtype: torch.dtype) -> Tensor:
    key = (str(device), dtype)
    t = _DUMMY.get(key)
    if t is None:
        t = _DUMMY[key] = torch.zeros(32, dtype=dtype, device=device)
    return t


def _moment_args(arena, name: str | None, device: torch.device) -> tuple[int, Tensor, Tensor]:
    if name is None:
        return 5, _dummy(device, torch.float32), _dummy(device, torch.uint8)
    if name not in arena.codecs:
        raise FormatError(
            f"the state arena of {arena.plan} has no {name!r} state (it has "
            f"{sorted(arena.codecs)}); the optimizer must allocate it"
        )
    codec = arena.codecs[name]
    fields = arena.fields[name]
    scale = fields.get("scale")
    return (
        moment_id(codec.name),
        _kernel_view(fields[""]),
        scale if scale is not None else _dummy(device, torch.uint8),
    )


_DTYPE = attrgetter("dtype")
_DATA_PTR = Tensor.data_ptr


class _Tables:
    """Device tables of one (tensor set, chunk size, index bases): the chunk table and the slot
    table (``rows`` rows; ``host_slots`` its host copy, from which
    :meth:`PreparedStep.with_grads` derives the table of moved gradients)."""

    __slots__ = ("chunks", "host_slots", "n_chunks", "rows", "slots")

    def __init__(self, chunks: Tensor, slots: Tensor, host_slots: Tensor) -> None:
        self.chunks, self.n_chunks, self.slots = chunks, int(chunks.shape[0]), slots
        self.rows = int(slots.shape[0])
        self.host_slots = host_slots


def _table_cache_limits(n_slots: int) -> tuple[int, int]:
    """(entries, slot-table rows) a plan's table cache keeps: a few whole steps, and also one
    step per tensor, since gradient release steps one tensor at a time and the caching allocator
    usually gives its gradients the same addresses every iteration. Rows bound the memory."""
    return 2 * n_slots + 8, 4 * n_slots + 64


class _TableCache:
    """Tables a plan keeps for the sets of tensors its steps update (``entries``: key ->
    (table, rows), the most recently used last), within ``max_entries`` and ``max_rows`` rows
    in all (their memory). The least recently used go first; the newest always stays."""

    __slots__ = ("entries", "max_entries", "max_rows", "rows")

    def __init__(self, max_entries: int, max_rows: int) -> None:
        self.entries: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
        self.max_entries, self.max_rows, self.rows = max_entries, max_rows, 0

    def get(self, key: tuple) -> Any:
        hit = self.entries.get(key)
        if hit is None:
            return None
        self.entries.move_to_end(key)
        return hit[0]

    def put(self, key: tuple, value: Any, rows: int) -> None:
        old = self.entries.pop(key, None)
        self.rows += rows - (old[1] if old is not None else 0)
        self.entries[key] = (value, rows)
        while len(self.entries) > 1 and (
            len(self.entries) > self.max_entries or self.rows > self.max_rows
        ):
            self.rows -= self.entries.popitem(last=False)[1][1]


def _slot_tables(plan) -> _TableCache:
    """``plan``'s cache of :class:`_Tables` (bounded by :func:`_table_cache_limits`)."""
    return plan.cache("triton_tables", lambda: _TableCache(*_table_cache_limits(len(plan.slots))))


#: What CUDA graphs captured by the caller read besides the state arenas, parameters and
#: gradients: chunk, slot and word tables, and the host sources of tables uploaded during a
#: capture, whose copy the graph repeats at every replay. Their memory must never go back to an
#: allocator (a replay would read or write whatever took it), and a graph's lifetime is not
#: known here, so they stay for the process's (by id: a table captured again is held once).
#: Tens of bytes per tensor of a captured step: the tables, not the state.
_GRAPH_HELD: dict[int, Tensor] = {}


def _hold_for_graph(*tensors: Tensor) -> None:
    """Keep ``tensors`` alive for good when a CUDA graph capture is reading them."""
    if _capturing():
        for t in tensors:
            _GRAPH_HELD.setdefault(id(t), t)


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    """A device copy of the host table ``host`` (a tensor the caller made and no one writes).
    During a CUDA graph capture the copy is captured: every replay copies ``host`` again, so it
    is held (:func:`_hold_for_graph`), unchanged, with its device copy; a capture can then make
    the tables of gradients at new addresses (torch's whole-network recipe sets them to None
    before the capture, so that backward allocates them from the graph's pool)."""
    if device.type != "cuda":
        return host.to(device)
    pinned = host.pin_memory()
    out = pinned.to(device, non_blocking=True)
    _hold_for_graph(pinned, out)  # captured: the graph copies from ``pinned`` at every replay
    return out


def _chunk_table(plan, slots: Sequence[int], full: bool, cs: int) -> Tensor:
    """The chunk table (slot, start, length, arena offset) of a step over plan ``slots``, on
    the plan's device, with the slot column holding each chunk's position in ``slots`` (the row
    of its tensor in the slot table and in a device step's word table; the plan slot itself
    when every tensor takes part), so a step over a few tensors (gradient release: one) builds
    tables of its own size, not the plan's.

    Cached per (slots, chunk size): the whole plan's for good, a subset's in a bounded cache
    (a mixture of experts' idle experts make a new subset at most steps: kept for good, each
    step's table stayed in device memory). Neither holds addresses, so unlike
    ``GroupPlan.chunk_table`` (keyed on every tensor's ``data_ptr()``) they are looked up
    without a per-tensor loop."""
    if full:
        return plan.cache(("triton_chunks", cs), lambda: plan.chunk_table(cs))
    lru = plan.cache(
        ("triton_chunk_tables", cs),
        # as many entries as the slot tables, and a few whole plans' chunks
        lambda: _TableCache(
            _table_cache_limits(len(plan.slots))[0],
            4 * (ceil_div(plan.total, cs) + len(plan.slots)) + 64,
        ),
    )
    key = tuple(slots)
    table = lru.get(key)
    if table is None:
        table = _to_device(plan.subset_chunk_table(cs, slots), plan.device)
        lru.put(key, table, int(table.shape[0]))
    return table


#: Columns of the slot table (int64 each; see :mod:`memopt_kernels_triton.kernels.tiles`).
_SLOT_COLUMNS = ("param address", "grad address", "grad kind", "tensor id", "index base")
#: Index bases stay below this bound including the tensor's padded length (int64 index arithmetic
#: in the kernels, with room to spare; core's random words take 64-bit indices).
_INDEX_LIMIT = 2**62


def _grad_kind(param: torch.dtype, grad: torch.dtype) -> int:
    """The slot table's grad kind (:func:`~memopt_kernels_triton.kernels.tiles.chunk_info`): 1
    for float32, 2 for float16 beside a float32 parameter, else 0 (bfloat16, or the parameter's
    16-bit dtype)."""
    if grad == torch.float32:
        return 1
    return 2 if param == torch.float32 and grad == torch.float16 else 0


def _slot_rows(pp, pd, gp, gd, tids, bases) -> Tensor:
    """The slot table: one row of :data:`_SLOT_COLUMNS` per tensor of the step, in the step's
    order (:func:`_chunk_table`'s slot column). ``bases`` are the tensors' index bases
    (validated by :func:`_check_bases`)."""
    kinds = map(_grad_kind, pd, gd)
    low_ids = (int(tid) & 0xFFFFFFFF for tid in tids)  # the low 32 bits, as core's words take
    # through an array: torch converts a Python list at about 0.4 us per number
    flat = array(
        "q", itertools.chain.from_iterable(zip(pp, gp, kinds, low_ids, bases, strict=True))
    )
    if not flat:
        return torch.zeros((0, len(_SLOT_COLUMNS)), dtype=torch.int64, device="cpu")
    return torch.frombuffer(flat, dtype=torch.int64).view(-1, len(_SLOT_COLUMNS))


def _check_bases(work: GroupStep, plan) -> list[int]:
    """``work``'s index bases, one per tensor (0s when ``index_bases`` is None), checked: ints
    (not bools), >= 0, and ``base + padded length < 2**62``; ConfigError naming the tensor."""
    n = len(work.slots)
    if work.index_bases is None:
        return [0] * n
    if not isinstance(work.index_bases, Sequence) or len(work.index_bases) != n:
        got = (
            f"{len(work.index_bases)} entries"
            if isinstance(work.index_bases, Sequence)
            else type(work.index_bases).__name__
        )
        raise ConfigError(
            f"index_bases holds {got} for a step over {n} tensors; give one per tensor of the "
            "step (or None)"
        )
    bases = list(work.index_bases)
    for k, (si, base) in enumerate(zip(work.slots, bases, strict=True)):
        shape = tuple(plan.slots[si].shape)
        what = f"index_bases[{k}] (for the parameter of shape {shape} in plan slot {si})"
        if not isinstance(base, int) or isinstance(base, bool):
            raise ConfigError(
                f"{what} must be an int, got {type(base).__name__} {base!r}: the index in the "
                "whole tensor of the tensor's first element"
            )
        if base < 0:
            raise ConfigError(
                f"{what} must be >= 0 (a shard's offset in its whole tensor), got {base}"
            )
        if base + plan.slots[si].padded >= _INDEX_LIMIT:
            raise ConfigError(
                f"{what} is {base}: base + padded length {plan.slots[si].padded} reaches 2**62, "
                "past the stochastic-rounding index range"
            )
    return [int(b) for b in bases]


def _step_extent(plan, slots: tuple) -> tuple[bool, int]:
    """(full, total) of a step over plan ``slots``: whether they are every slot in order (the
    plan-wide tables serve exactly those; anything else is partial) and the padded length."""
    full = slots == plan.cache("triton_all_slots", lambda: tuple(range(len(plan.slots))))
    return full, plan.total if full else _partial_total(plan, slots)


def _partial_total(plan, slots: tuple) -> int:
    """The padded length of a step over plan ``slots`` (not the whole plan); ConfigError unless
    they are distinct int indices into the plan (in any order)."""
    total, n = 0, len(plan.slots)
    for k, si in enumerate(slots):
        if not isinstance(si, int) or isinstance(si, bool) or not 0 <= si < n:
            raise ConfigError(
                f"slots[{k}] is {si!r}: slots are distinct int indices into the plan's {n} tensors"
            )
        total += plan.slots[si].padded
    if len(set(slots)) != len(slots):
        k = next(k for k, si in enumerate(slots) if si in slots[:k])
        raise ConfigError(f"slots[{k}] repeats slot {slots[k]}: slots are distinct indices")
    return total


def _validate(work: GroupStep, plan) -> None:
    """ConfigError naming the first parameter or gradient that does not fit its plan slot."""
    if not _tensors_fit(work, plan):
        _refuse_misfit(work, plan)
    # the kernel's programs write parameters and state while others read gradients: shared
    # memory would race (a gradient that is exactly its own parameter is read first, allowed).
    # Tensors apart (the common case) need no labels: two objects per tensor less.
    arena = list(work.arena.tensors())
    if not any_extents_overlap([*work.params, *work.grads, *arena]):
        return
    written: list[tuple[Tensor, Label]] = [
        (p, functools.partial("parameter {} (plan slot {})".format, k, si))
        for k, (si, p) in enumerate(zip(work.slots, work.params, strict=True))
    ]
    written += [(t, "a state tensor of the group") for t in arena]
    read: list[tuple[Tensor, Label]] = [
        (g, functools.partial("the gradient of parameter {} (plan slot {})".format, k, si))
        for k, (si, g) in enumerate(zip(work.slots, work.grads, strict=True))
    ]
    check_aliasing(written, read, list(zip(work.params, work.grads, strict=True)))


_LAYOUT = attrgetter("layout")
_DEVICE = attrgetter("device")
_SHAPE = attrgetter("shape")


def _tensors_fit(work: GroupStep, plan) -> bool:
    """Whether every parameter and gradient of ``work`` passes :func:`_refuse_misfit`'s checks
    (False also where unsure: it then looks at each), in C-level passes over all of them: that
    check's Python loop cost about 15 us per tensor, and a group whose tensors skip steps (a
    mixture of experts) validates a new set of them at every step."""
    params, grads = work.params, work.grads
    if len(params) != len(work.slots) or len(grads) != len(params):
        return False
    tensors = [*params, *grads]
    try:
        if not all(map(isinstance, tensors, itertools.repeat(Tensor))):
            return False
        devices = set(map(_DEVICE, tensors))
        if devices != {plan.device} or not (plan.device.type == "cuda" or interpreting()):
            return False
        numels = plan.cache("triton_numels", lambda: [s.numel for s in plan.slots])
        return (
            set(map(_LAYOUT, tensors)) == {torch.strided}
            and all(map(_DATA_PTR, tensors))  # 0: empty, or no memory (looked at one by one)
            and not any(map(Tensor.is_neg, tensors))
            and set(map(_DTYPE, params)) == {plan.param_dtype}
            and all(grad_dtype_ok(plan.param_dtype, d) for d in set(map(_DTYPE, grads)))
            and list(map(Tensor.numel, params)) == [numels[si] for si in work.slots]
            and list(map(_SHAPE, grads)) == list(map(_SHAPE, params))
        )
    except (RuntimeError, TypeError, IndexError):  # no storage, bad slots: looked at one by one
        return False


def _refuse_misfit(work: GroupStep, plan) -> None:
    """ConfigError naming the first parameter or gradient that does not fit its plan slot."""
    for k, (si, p, g) in enumerate(zip(work.slots, work.params, work.grads, strict=True)):
        what = f"parameter {k} (plan slot {si})"
        _check_device(p, what)
        refuse_negated(what, p)
        if isinstance(g, Tensor):  # anything else is named by _check_device(g) below
            refuse_negated(f"the gradient of {what}", g)
        if p.dtype != plan.param_dtype:
            raise ConfigError(f"the group holds {plan.param_dtype} parameters, got {p.dtype}")
        slot = plan.slots[si]
        if p.numel() != slot.numel:
            raise ConfigError(
                f"{what} has {p.numel()} elements but the plan slot has {slot.numel} (shape "
                f"{tuple(slot.shape)}); rebuild the plan after resizing a parameter"
            )
        _check_device(g, f"the gradient of {what}")
        if not grad_dtype_ok(p.dtype, g.dtype):
            raise ConfigError(
                f"the gradient of {what} is {g.dtype}: gradients must have the parameter's dtype "
                f"({p.dtype}) or float32 (float32 parameters also bfloat16 or float16)"
            )
        if g.device != p.device or g.shape != p.shape:
            raise ConfigError(
                f"the gradient of {what} has shape {tuple(g.shape)} on {g.device}; it must match "
                f"its parameter's shape {tuple(p.shape)} and device {p.device}"
            )


#: Order of the int32 words a ``HYPER`` Adam launch reads (:func:`adam_hyper_words`): eight fp32
#: scalars stored as their bits, the stochastic-rounding seed and the step (1-based), then the
#: AMP words every layout ends with: ``inv_scale`` (fp32 bits; the gradient factor of a launch
#: with ``unscale=True``) and ``skip`` (nonzero: the tensor is not updated; a GradScaler's
#: found-inf).
ADAM_HYPER_FIELDS = (
    "one_minus_beta1",
    "beta2",
    "one_minus_beta2",
    "eps",
    "step_size",
    "bc2_sqrt",
    "decay",
    "l2",
    "seed",
    "step",
    "inv_scale",
    "skip",
)
#: Order of the int32 words a ``HYPER`` Lion launch reads (:func:`lion_hyper_words`): six fp32
#: scalars stored as their bits, the seed, the step, ``inv_scale`` and ``skip``.
LION_HYPER_FIELDS = (
    "lr",
    "beta1",
    "one_minus_beta1",
    "beta2",
    "one_minus_beta2",
    "decay",
    "seed",
    "step",
    "inv_scale",
    "skip",
)
#: Order of the int32 words a ``HYPER`` SGD launch reads (:func:`sgd_hyper_words`): five fp32
#: scalars stored as their bits, the seed, the step, ``first_step`` (1 on the step whose
#: momentum buffer starts as the gradient, else 0: a runtime choice in the kernel, so one
#: captured launch serves the first step and the later ones), ``inv_scale`` and ``skip``.
SGD_HYPER_FIELDS = (
    "lr",
    "momentum",
    "one_minus_dampening",
    "decay",
    "l2",
    "seed",
    "step",
    "first_step",
    "inv_scale",
    "skip",
)
#: Backend rule -> the layout of its device words.
HYPER_FIELDS = {"adam": ADAM_HYPER_FIELDS, "lion": LION_HYPER_FIELDS, "sgd": SGD_HYPER_FIELDS}


def _f32_bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", round_to_float32(v)))[0]


_ONE_BITS = 0x3F800000  # fp32 1.0: the inv_scale word of a launch without AMP


def _scalar_words(fields: tuple[str, ...], scalars, seed: int, step: int) -> list[int]:
    n = fields.index("seed")
    try:
        words = [_f32_bits(getattr(scalars, name)) for name in fields[:n]]
    except AttributeError as e:
        raise ConfigError(
            f"the scalars ({type(scalars).__name__}) have no {e.name!r}: pass core's scalars of "
            "the step's rule (adam_scalars, lion_scalars or sgd_scalars)"
        ) from None
    return [*words, _i32(seed, "seed"), _i32(step, "step")]


def adam_hyper_words(scalars, seed: int, step: int) -> list[int]:
    """The :data:`ADAM_HYPER_FIELDS` words of one Adam step: each scalar rounded to fp32 exactly
    as the argument-passing launch rounds it, seed and step as int32 (bit-cast 32-bit values),
    ``inv_scale`` 1.0 and ``skip`` 0."""
    return [*_scalar_words(ADAM_HYPER_FIELDS, scalars, seed, step), _ONE_BITS, 0]


def lion_hyper_words(scalars, seed: int, step: int) -> list[int]:
    """The :data:`LION_HYPER_FIELDS` words of one Lion step (``scalars``: core's
    ``lion_scalars``), rounded as :func:`adam_hyper_words` rounds."""
    return [*_scalar_words(LION_HYPER_FIELDS, scalars, seed, step), _ONE_BITS, 0]


def sgd_hyper_words(scalars, seed: int, step: int, first_step: bool | None = None) -> list[int]:
    """The :data:`SGD_HYPER_FIELDS` words of one SGD step (``scalars``: core's ``sgd_scalars``),
    rounded as :func:`adam_hyper_words` rounds; ``first_step`` defaults to ``step == 1``, core's
    ``GroupStep.first_step``."""
    if first_step is not None:  # "False" or [False] would be truthy: a first step every time
        check_bool("first_step", first_step)
    first = step == 1 if first_step is None else first_step
    return [*_scalar_words(SGD_HYPER_FIELDS, scalars, seed, step), int(first), _ONE_BITS, 0]


def hyper_words(
    rule: str, scalars, seed: int, step: int, *, first_step: bool | None = None
) -> list[int]:
    """The device words of one step of backend rule ``rule`` (``"adam"``, ``"lion"``, ``"sgd"``;
    layout ``HYPER_FIELDS[rule]``): :func:`adam_hyper_words`, :func:`lion_hyper_words` or
    :func:`sgd_hyper_words`. ``first_step`` (default ``step == 1``) only matters for SGD; the
    other rules have no first-step case and ignore it."""
    if rule == "adam":
        return adam_hyper_words(scalars, seed, step)
    if rule == "lion":
        return lion_hyper_words(scalars, seed, step)
    if rule == "sgd":
        return sgd_hyper_words(scalars, seed, step, first_step)
    raise ConfigError(
        f"device-resident scalars exist for rules {tuple(HYPER_FIELDS)}, not {rule!r}"
    )


#: Kernel of each backend rule.
_KERNELS = {"adam": _adam.adam_kernel, "lion": _lion.lion_kernel, "sgd": _sgd.sgd_kernel}


#: Flags :meth:`PreparedStep.launch_hyper` needs per rule.
_HYPER_FLAGS = {
    "adam": ("maximize", "has_l2", "has_decay"),
    "lion": ("maximize", "has_decay"),
    "sgd": ("maximize", "has_l2", "has_decay", "nesterov"),
}


def _flag(value, rule: str, name: str, *, needed: bool) -> bool:
    """A compile-time flag of :meth:`PreparedStep.launch_hyper`: ``needed`` flags must be given
    (True or False); the others must be left out (None) or False, as the rule has no such term.
    Only bools: ``maximize="False"`` would be truthy and compile the ascending variant."""
    if needed:
        if value is None:
            raise ConfigError(
                f"launch_hyper of a {rule} step needs {name}=True/False (it chooses the compiled "
                "kernel variant)"
            )
        check_bool(name, value)
        return value
    if value is not None:
        check_bool(name, value)
    if value:
        raise ConfigError(
            f"{name}=True does not apply to the {rule} rule (its flags: "
            f"{', '.join(_HYPER_FLAGS[rule])})"
        )
    return False


class PreparedStep:
    """One group's fused step with everything but the scalars resolved: tables on the device,
    state and code pointers, launch geometry (:func:`prepare_step`).

    :meth:`launch` runs it with host scalars; :meth:`launch_hyper` reads them from a device
    tensor, which is what a captured CUDA graph replays. Reusing a prepared step is valid
    while every parameter and gradient keeps its storage (the caller checks: memopt_core's
    cached step compares addresses); gradients that moved are followed with
    :meth:`with_grads`. The tensor ids and index bases are those of the prepared
    ``GroupStep``. ``reusable`` is False when strided parameters or gradients ran through
    contiguous copies: such a step must be prepared again each time.

    A step prepared with ``hold=True`` (:func:`prepare_step`'s default) holds references to the
    parameters and gradients whose addresses its tables hold (no copies), so a launch never
    reads memory the caller let go; :meth:`with_grads` holds the new gradients instead of the
    old ones.
    """

    __slots__ = (
        "_copies",
        "_gdtypes",
        "_gnumels",
        "_grid",
        "_head",
        "_held",
        "_kw",
        "_rows",
        "_variant",
        "device",
        "n_slots",
        "reusable",
        "rule",
    )

    def __init__(
        self,
        rule,
        grid,
        head,
        kw,
        copies,
        device,
        n_slots,
        rows=None,
        gdtypes=(),
        gnumels=(),
        held=(),
        reusable=True,
    ) -> None:
        self.rule, self._grid, self._head, self._kw = rule, grid, head, kw
        self._copies = copies
        # the parameters, then the gradients (or their contiguous copies), at the addresses of
        # the slot table: a launch after the caller let them go would read freed memory
        self._held = held
        self.reusable = reusable and not copies
        self.device = device
        self.n_slots = n_slots  # rows of a per-tensor word table: the step's tensors
        self._rows = rows  # the slot table on the host (the device copy is head[2])
        self._gdtypes = gdtypes  # the gradients' dtypes and sizes, in the step's order
        self._gnumels = gnumels
        self._variant: tuple | None = None  # fused_steps' merge key of the compiled variant

    def with_grads(self, grads: Sequence[Tensor]) -> PreparedStep | None:
        """This step reading ``grads``: the same tensors' gradients at new addresses (what
        ``zero_grad(set_to_none=True)`` and the next backward make; memopt_core's cached step
        calls this), with the chunk table, state pointers and geometry kept and a new slot
        table (one host-to-device copy: O(1) launches, a C-level pass over the gradients).

        ``grads`` are in the step's order; each is its parameter's ``.grad`` (torch gives it
        the parameter's shape and device). ConfigError for another count, or another dtype or
        size than the prepared gradients'; None for a strided gradient (prepare the step again:
        it runs through contiguous copies), for a step that ran through copies, and for a gradient
        off the 16-byte alignment the prepared kernel was compiled for (prepare again: the
        unaligned variant)."""
        if self._grid is None or self._rows is None:
            return self if self._grid is None else None
        try:
            same = (
                len(grads) == self.n_slots
                and tuple(map(Tensor.numel, grads)) == self._gnumels
                and tuple(map(_DTYPE, grads)) == self._gdtypes
                and all(g.device == self.device for g in grads)  # a raw address of another device
            )
        except TypeError:  # not tensors
            same = False
        if not same:
            raise ConfigError(
                f"with_grads needs {self.n_slots} gradients of the prepared dtypes and sizes "
                f"(tensors on {self.device}), in the step's order; prepare the step again for "
                "other gradients"
            )
        if any(map(Tensor.is_neg, grads)):  # the kernel would read the opposite values
            k = next(k for k, g in enumerate(grads) if g.is_neg())
            refuse_negated(f"gradient {k} of the prepared step", grads[k])
        if not all(map(Tensor.is_contiguous, grads)):
            return None
        addresses = tuple(map(Tensor.data_ptr, grads))
        if self._kw.get("ALIGNED") and not _aligned(addresses):
            return None
        rows = self._rows.clone()
        rows[:, 1] = torch.tensor(addresses, dtype=torch.int64, device="cpu")
        head = (*self._head[:2], _to_device(rows, self.device), *self._head[3:])
        # the old gradients are let go: holding them would keep freed gradients alive
        held = (*self._held[: self.n_slots], *grads) if self._held else ()
        return PreparedStep(
            self.rule, self._grid, head, self._kw, [], self.device, self.n_slots, rows,
            self._gdtypes, self._gnumels, held,
        )  # fmt: skip

    @property
    def hyper_fields(self) -> tuple[str, ...]:
        """The layout of the words :meth:`launch_hyper` reads (``HYPER_FIELDS[self.rule]``)."""
        return HYPER_FIELDS[self.rule]

    def _finish(self) -> None:
        for dst, tmp in self._copies:  # detached: dst may be a parameter, grad mode on
            dst.detach().copy_(tmp)

    def launch(self, scalars, step: int, seed: int, first_step: bool) -> None:
        """Run the step with host ``scalars`` (core's ``adam_scalars``/``lion_scalars``/
        ``sgd_scalars``) for 1-based ``step``."""
        if self._grid is None:
            return
        s, kw = scalars, dict(self._kw)
        seed_, step_ = _i32(seed, "seed"), _i32(step, "step")
        no_hyper = _dummy(self.device, torch.int32)
        if self.rule == "adam":
            args: tuple[float, ...] = (
                round_to_float32(s.one_minus_beta1),
                round_to_float32(s.beta2),
                round_to_float32(s.one_minus_beta2),
                round_to_float32(s.eps),
                round_to_float32(s.step_size),
                round_to_float32(s.bc2_sqrt),
                round_to_float32(s.decay),
                round_to_float32(s.l2),
            )
            kw.update(MAXIMIZE=bool(s.maximize), HAS_L2=s.l2 != 0.0, HAS_DECAY=s.decay != 1.0)
        elif self.rule == "lion":
            args = (
                round_to_float32(s.lr),
                round_to_float32(s.beta1),
                round_to_float32(s.one_minus_beta1),
                round_to_float32(s.beta2),
                round_to_float32(s.one_minus_beta2),
                round_to_float32(s.decay),
            )
            kw.update(MAXIMIZE=bool(s.maximize), HAS_DECAY=s.decay != 1.0)
        else:
            has_momentum = kw.pop("_HAS_MOMENTUM")
            args = (
                round_to_float32(s.lr),
                round_to_float32(s.momentum),
                round_to_float32(s.one_minus_dampening),
                round_to_float32(s.decay),
                round_to_float32(s.l2),
            )
            kw.update(
                MAXIMIZE=bool(s.maximize),
                HAS_L2=s.l2 != 0.0,
                HAS_DECAY=s.decay != 1.0,
                NESTEROV=bool(s.nesterov) and has_momentum,
                FIRST=bool(first_step),
            )
        kw.update(HYPER=False, UNSCALE=False)
        _launch(
            _KERNELS[self.rule], self._grid, *self._head, *args, seed_, step_, no_hyper, 0, **kw
        )
        self._finish()

    def launch_device(self, work: GroupStep) -> None:
        """:func:`device_step` of ``work`` (a capturable step, ``work.device_step`` set) through
        this prepared launch, which must have been prepared for ``work``'s current gradients
        (core's cached step keeps one per work)."""
        device_step(work, prepared=self)

    def launch_hyper(
        self,
        hyper: Tensor,
        *,
        maximize: bool,
        has_decay: bool,
        has_l2: bool | None = None,
        nesterov: bool | None = None,
        unscale: bool = False,
    ) -> None:
        """Run the step reading its scalars, seed and step (and SGD's first-step flag) from
        ``hyper``: a contiguous int32 tensor on the parameters' device holding exactly the
        ``HYPER_FIELDS[rule]`` words (:data:`ADAM_HYPER_FIELDS`, :data:`LION_HYPER_FIELDS`,
        :data:`SGD_HYPER_FIELDS`; :func:`hyper_words` writes them), shared by every tensor, or a
        ``[n_slots, len(fields)]`` table with one row per tensor of the step, in its order
        (what :func:`device_step` computes). A row whose ``skip`` word is nonzero leaves its tensor untouched;
        ``unscale=True`` multiplies the gradients by the row's ``inv_scale`` word first.

        The flags choose the compiled variant. Every rule takes ``maximize`` and ``has_decay``
        (True whenever the decay factor may differ from 1: a factor of exactly 1 is harmless in
        it); Adam and SGD also need ``has_l2`` (True whenever the L2 coefficient may differ from
        0: a row whose coefficient is 0 leaves the gradient as it is), SGD needs
        ``nesterov`` (a no-op without a momentum buffer, as in :meth:`launch`). A flag a rule has
        no term for must be left out or False. Whether SGD keeps a momentum buffer was fixed by
        :func:`prepare_step` (momentum != 0); the momentum value itself is a device word.
        """
        rule = self.rule
        needs = _HYPER_FLAGS[rule]
        maximize = _flag(maximize, rule, "maximize", needed=True)
        has_decay = _flag(has_decay, rule, "has_decay", needed=True)
        l2 = _flag(has_l2, rule, "has_l2", needed="has_l2" in needs)
        nest = _flag(nesterov, rule, "nesterov", needed="nesterov" in needs)
        check_bool("unscale", unscale)
        fields = HYPER_FIELDS[rule]
        w = len(fields)
        if not isinstance(hyper, Tensor):
            raise ConfigError(
                f"hyper must be an int32 tensor of {w} words, got {type(hyper).__name__}"
            )
        shape_ok = hyper.dim() <= 1 and hyper.numel() == w
        per_slot = hyper.dim() == 2 and tuple(hyper.shape) == (self.n_slots, w)
        if hyper.dtype != torch.int32 or not (shape_ok or per_slot) or not hyper.is_contiguous():
            raise ConfigError(
                f"hyper of a {rule} step must be a contiguous int32 tensor of {w} words "
                f"({', '.join(fields)}), or of ({self.n_slots}, {w}) words (one row per tensor "
                f"of the step); got {hyper.dtype}{tuple(hyper.shape)}"
                + ("" if hyper.is_contiguous() else " (not contiguous)")
            )
        if hyper.device != self.device:
            raise ConfigError(f"hyper is on {hyper.device}; the group is on {self.device}")
        if self._grid is None:
            return
        kw = dict(self._kw)
        kw.update(MAXIMIZE=maximize, HAS_DECAY=has_decay, HYPER=True, UNSCALE=unscale)
        # an L2 coefficient read from the device may be 0 (a weight decay tensor): the kernel
        # then adds the term only where it is not, as the host step decides it (HAS_L2 == 2)
        l2_mode = 2 if l2 else False
        if rule == "adam":
            kw["HAS_L2"] = l2_mode
        elif rule == "sgd":
            has_momentum = kw.pop("_HAS_MOMENTUM")
            kw.update(HAS_L2=l2_mode, NESTEROV=nest and has_momentum, FIRST=False)
        n_scalars = fields.index("seed")
        _hold_for_graph(self._head[0], self._head[2], hyper)  # chunk and slot tables, words
        _launch(
            _KERNELS[rule],
            self._grid,
            *self._head,
            *(0.0,) * n_scalars,
            0,
            0,
            hyper,
            w if per_slot else 0,
            **kw,
        )
        self._finish()


def prepare_step(
    work: GroupStep, config: KernelConfig | None = None, *, hold: bool = True
) -> PreparedStep:
    """Resolve ``work`` (every tensor of its group) into a :class:`PreparedStep`: validation,
    the chunk and slot tables (cached on the tensors' addresses, dtypes and sizes, tensor ids
    and index bases; not for strided tensors, which run through copies), state pointers,
    geometry. The index bases (``work.index_bases``) are part of the slot table,
    so :meth:`PreparedStep.launch` and :meth:`PreparedStep.launch_hyper` honour them.

    ``hold`` (default True): the step holds references to ``work``'s parameters and gradients,
    whose addresses its tables hold, so it stays valid after the caller drops them. False for a
    caller that checks every address before each launch itself (memopt_core's cached step, which
    keeps the step between iterations: holding would keep a model's freed gradients alive until
    the next backward).

    Host work is a few C-level passes over the tensors (addresses, dtypes, sizes, contiguity);
    launching a prepared step is O(1)."""
    check_bool("hold", hold)
    plan, arena, spec = work.plan, work.arena, work.spec
    if work.rule not in RULES:
        raise ConfigError(f"the triton backend runs rules {RULES}, got {work.rule!r}")
    dev = plan.device
    mcodec = spec.master_for(plan.param_dtype)
    mid = master_id(mcodec.name, plan.param_dtype)
    cfg = config or kernel_config(blocked=plan.block_size == 32, rule=work.rule, master=mid)
    n = len(work.slots)
    empty = PreparedStep(work.rule, None, (), {}, [], dev, n)
    if not n:
        return empty
    if not len(work.params) == len(work.grads) == len(work.tensor_ids) == n:
        raise ConfigError(
            f"a step over {n} slots got {len(work.params)} parameters, {len(work.grads)} "
            f"gradients and {len(work.tensor_ids)} tensor ids"
        )
    if arena.plan is not plan:  # its fields would be read and written at this plan's offsets
        other = arena.plan
        raise ConfigError(
            f"the step's state arena was allocated for another plan ({len(other.slots)} tensors, "
            f"{other.total} elements) than the step's ({len(plan.slots)}, {plan.total})"
        )
    slots = tuple(work.slots)
    full, total = _step_extent(plan, slots)

    params, grads = work.params, work.grads
    copies: list[tuple[Tensor, Tensor]] = []
    try:
        strided = not (
            all(map(Tensor.is_contiguous, params)) and all(map(Tensor.is_contiguous, grads))
        )
        if strided:
            if _capturing():
                _refuse_strided_capture(work)
            # run on contiguous copies, write the parameters back afterwards; the copies live
            # only as long as the prepared step, so its tables are neither cached nor reusable
            params, grads = list(params), [g.contiguous() for g in grads]
            for i, p in enumerate(params):
                if not p.is_contiguous() and overlaps_itself(p):
                    raise ConfigError(
                        f"parameter {i} (slot {slots[i]}, shape {tuple(p.shape)}) has elements "
                        "that share memory (an expanded tensor?): it cannot be updated in place"
                    )
                if not p.is_contiguous():
                    tmp = p.detach().contiguous()
                    copies.append((p, tmp))
                    params[i] = tmp
        pp = tuple(map(Tensor.data_ptr, params))
        pd = tuple(map(_DTYPE, params))
        pn = tuple(map(Tensor.numel, params))
        gp = tuple(map(Tensor.data_ptr, grads))
        gd = tuple(map(_DTYPE, grads))
        gn = tuple(map(Tensor.numel, grads))
        negs = (*map(Tensor.is_neg, params), *map(Tensor.is_neg, grads))
    except (TypeError, AttributeError, RuntimeError):  # not tensors: validation says why
        _validate(work, plan)
        raise
    if total == 0:
        return empty
    cs = _chunk_size(cfg, plan, total)
    bases: Sequence[int] | None = work.index_bases
    if bases is not None:
        # 5.0 or True would equal a cached key's 5, 1
        if not isinstance(bases, Sequence) or not all(type(b) is int for b in bases):
            _check_bases(work, plan)  # raises, or accepts int subclasses
        bases = tuple(bases)
    lru = _slot_tables(plan)
    # what validation checks, so that a hit stands in for it: addresses (they imply devices),
    # dtypes, sizes and negative bits (a negated view shares its tensor's address; not the
    # gradients' shapes: a hit still stays within every tensor)
    key = (None if full else slots, cs, pp, pd, pn, gp, gd, gn, negs, tuple(work.tensor_ids), bases)
    tables = None if strided else lru.get(key)
    if tables is None:
        _validate(work, plan)
        checked = _check_bases(work, plan)
        chunks = _chunk_table(plan, work.slots, full, cs)
        rows = _slot_rows(pp, pd, gp, gd, work.tensor_ids, checked)
        slot_tab = _to_device(rows, dev)
        tables = _Tables(chunks, slot_tab, rows)
        if not strided:
            lru.put(key, tables, tables.rows)
    code = arena.master_code if arena.master_code is not None else _dummy(dev, torch.uint8)
    chunks, n_chunks, slot_table = tables.chunks, tables.n_chunks, tables.slots
    if n_chunks == 0:
        return empty
    programs = cfg.programs or _sm_count(dev) * cfg.waves
    grid = (min(n_chunks, programs),)
    sr = bool(spec.stochastic_rounding)
    bs = plan.block_size
    if bs not in (1, 32):
        raise ConfigError(f"the triton kernels handle blocks of 32 elements, got {bs}")
    rand_master = mid in (1, 2, 3)
    kw: dict = dict(
        MASTER=mid,
        SR=sr,
        BS=bs,
        ROWS=cfg.rows,
        ALIGNED=_aligned(pp) and _aligned(gp) and cs % 32 == 0,
        ARENA_ALIGNED=bs == 32 or plan.cache("triton_arena_aligned", lambda: _arena_aligned(plan)),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        maxnreg=cfg.maxnreg,
    )
    head: tuple = (chunks, n_chunks, slot_table, _kernel_view(code))
    if work.rule == "adam":
        f1, m, ms = _moment_args(arena, "exp_avg", dev)
        f2, v, vs = _moment_args(arena, "exp_avg_sq", dev)
        head += (m, ms, v, vs)
        kw.update(
            FMT1=f1,
            FMT2=f2,
            NEED_RAND=sr and (rand_master or f1 != 0 or f2 != 0),
            AHEAD=_loads_ahead("adam", bs, mid),
        )
    elif work.rule == "lion":
        f1, m, ms = _moment_args(arena, "exp_avg", dev)
        head += (m, ms)
        kw.update(
            FMT1=f1, NEED_RAND=sr and (rand_master or f1 != 0), AHEAD=_loads_ahead("lion", bs, mid)
        )
    else:
        has_momentum = work.scalars.momentum != 0.0
        f1, b, bsc = _moment_args(arena, "momentum_buffer" if has_momentum else None, dev)
        head += (b, bsc)
        kw.update(
            FMT1=f1,
            NEED_RAND=sr and (rand_master or (has_momentum and f1 != 0)),
            _HAS_MOMENTUM=has_momentum,
        )
    if strided:  # the slot table holds the copies' addresses: no with_grads either
        held = (*params, *grads)
        return PreparedStep(work.rule, grid, head, kw, copies, dev, n, held=held, reusable=False)
    held = (*params, *grads) if hold else ()
    return PreparedStep(work.rule, grid, head, kw, copies, dev, n, tables.host_slots, gd, gn, held)


def check_step(work: GroupStep) -> None:
    """Raise what :func:`fused_step` would raise for ``work``'s tensors, launching nothing:
    :func:`prepare_step` where every tensor is contiguous (its validated tables stay cached for
    the step), else the per-tensor validation alone (prepare_step would copy the strided
    tensors, only for the step to copy them again)."""
    try:
        contiguous = all(map(Tensor.is_contiguous, work.params)) and all(
            map(Tensor.is_contiguous, work.grads)
        )
    except (TypeError, AttributeError):  # not tensors: prepare_step says why
        contiguous = True
    if contiguous:
        prepare_step(work)
        return
    _validate(work, work.plan)
    _check_bases(work, work.plan)


def fused_step(work: GroupStep, config: KernelConfig | None = None) -> None:
    """One optimizer step of every tensor of ``work`` in one kernel launch (see module doc); a
    capturable step (``work.device_step``) goes through :func:`device_step`."""
    if work.device_step is not None:
        device_step(work, config)
        return
    prepare_step(work, config).launch(work.scalars, work.step, work.seed, work.first_step)


def fused_steps(
    works: Sequence[GroupStep],
    prepared: Sequence[PreparedStep | None] | None = None,
    done: Callable[[int], None] | None = None,
    config: KernelConfig | None = None,
) -> None:
    """Every step of ``works`` in as few launches as their arenas allow (the backend's
    ``step_all``): works whose arenas are views of one family arena (core's
    ``memopt_core.plan.family_arenas``: param groups that share a device, a parameter dtype and
    a spec) and that compile to the same kernel variant run in one launch, each tensor reading
    its own work's scalars from a per-tensor row (:meth:`PreparedStep.launch_hyper`): the same
    bits as one launch per work, for one launch's fixed cost. The others run alone.

    ``works`` are all host steps or all capturable ones (``device_step``; none with staging).
    Host works of one arena (a group's step counts, where parameters skipped steps) that update
    no tensor twice run as one, with one set of tables (:func:`_units`); such units of one
    family merge from :data:`MERGE_MIN_WORKS` units on, their rows uploaded from the host.
    Capturable steps merge from two on while a CUDA graph is being captured (see
    :data:`MERGE_DEVICE_STEPS_EAGERLY`): each work's device-words kernel writes its rows into
    one table, which the merged launch reads, so the merge costs no host-to-device copy and
    the graph holds it (after one eager step has cached its tables).

    ``prepared``: None, or aligned with ``works``: each work's :class:`PreparedStep` (for its
    current gradients) or None (prepared here). Every work is
    prepared, and so validated, before the first launch. ``done(i)`` is called once work
    ``i``'s launch is issued (also when a KeyboardInterrupt comes out of it: the launch ran)."""
    n = len(works)
    if prepared is None:
        prepared = [None] * n
    if len(prepared) != n:
        raise ConfigError(f"fused_steps got {len(prepared)} prepared steps for {n} works")
    if any(w.staging is not None for w in works):
        raise ConfigError("fused_steps runs steps without staging; those go through fused_step")
    on_device = sum(w.device_step is not None for w in works)
    if on_device and on_device < n:
        raise ConfigError(
            "fused_steps runs host steps or capturable steps (device_step), not both in one call"
        )
    if on_device:
        launches = _device_launches(works, config, prepared)
    else:
        launches = _host_launches(works, prepared, config)
    for run, launch in launches:
        launch_then_done(launch, run, done)


_Launches = list[tuple[list[int], Callable[[], None]]]


def _host_launches(
    works: Sequence[GroupStep],
    prepared: Sequence[PreparedStep | None],
    config: KernelConfig | None,
) -> _Launches:
    """:func:`fused_steps`' launches of host steps: (work indices, launch) pairs. The works of
    one arena at several step counts run as one :class:`_Unit` first (:func:`_units`); units
    of one family arena and variant merge from :data:`MERGE_MIN_WORKS` on."""
    units = _units(works, prepared, config)
    runs: dict[tuple, list[_Unit]] = {}
    for u in units:
        runs.setdefault(_merge_key(u.work, u.ready, u.members[0]), []).append(u)
    launches: _Launches = []
    for run in runs.values():
        if len(run) >= MERGE_MIN_WORKS:
            merged = _merged_step([u.work for u in run], [u.ready for u in run], config)
            members = [i for u in run for i in u.members]
            launches.append((members, _words_launch(merged, run, works)))
            continue
        for u in run:
            if u.owners is None:
                launches.append((u.members, _host_launch(u.work, u.ready)))
            else:
                launches.append((u.members, _words_launch(u.ready, [u], works)))
    return launches


class _Unit:
    """What :func:`fused_steps` launches as one work: a work of its ``works`` (``members``
    holds its index; ``owners`` None), or the works of one arena at different step counts
    (``members``, ascending), run as one ``work`` over their tensors in slot order, whose
    ``owners[r]`` is the position in ``members`` of the work that tensor ``r`` comes from:
    its row of words (its count's scalars, step and seed). ``ready``: ``work`` prepared."""

    __slots__ = ("members", "owners", "ready", "work")

    def __init__(
        self,
        members: list[int],
        work: GroupStep,
        ready: PreparedStep,
        owners: list[int] | None = None,
    ) -> None:
        self.members, self.work, self.ready, self.owners = members, work, ready, owners


def _units(
    works: Sequence[GroupStep],
    prepared: Sequence[PreparedStep | None],
    config: KernelConfig | None,
) -> list[_Unit]:
    """``works`` as :class:`_Unit` s, each prepared (and so validated), in the order of their
    first work. Core hands a param group whose tensors reached different step counts (a
    parameter without a gradient skips a step: a mixture of experts' idle experts) over as one
    work per count, and the set of tensors at each count changes from step to step: prepared
    one by one, each would build and upload new chunk and slot tables, host work that made
    the step several times torch's fused AdamW's on an H100
    (docs/benchmarks/2026-12-07-merged-step-counts.md). Run as one, a group builds one table
    per step (none while the stepping tensors stay the same) and launches once. Works merge
    where they share an arena and the compiled flags, hold tensors, and no tensor twice."""
    by_arena: dict[tuple, list[int]] = {}
    for i, w in enumerate(works):
        key = (id(w.arena), *_flags_key(w)) if w.slots else ("empty", i)
        by_arena.setdefault(key, []).append(i)
    units: list[_Unit] = []
    for members in by_arena.values():
        part = [works[i] for i in members]
        if len(members) > 1:
            slots = [si for w in part for si in w.slots]
            if len(set(slots)) == len(slots):
                units.append(_union_unit(members, part, [prepared[i] for i in members], config))
                continue
        for i in members:  # a tensor stepped twice runs its works one after the other
            p = prepared[i]
            units.append(
                _Unit([i], works[i], p if p is not None else prepare_step(works[i], config))
            )
    return sorted(units, key=lambda u: u.members[0])


def _union_unit(
    members: list[int],
    part: list[GroupStep],
    prepared: list[PreparedStep | None],
    config: KernelConfig | None,
) -> _Unit:
    """The works ``part`` (one arena, distinct slots) as one :class:`_Unit` over their tensors
    in slot order. Where each comes prepared (a cached step's replay) the union's prepared step
    is kept with them, holding no tensors (the cached step checks every address before it
    hands them over), else prepared afresh (its tables cached on the addresses, as any
    step's)."""
    rows = sorted((si, k, pos) for k, w in enumerate(part) for pos, si in enumerate(w.slots))
    pick = [(part[k], pos) for _, k, pos in rows]
    bases = None
    if any(w.index_bases is not None for w in part):
        bases = [w.index_base(pos) for w, pos in pick]
    union = dataclasses.replace(
        part[0],
        slots=[si for si, _, _ in rows],
        params=[w.params[pos] for w, pos in pick],
        grads=[w.grads[pos] for w, pos in pick],
        tensor_ids=[w.tensor_ids[pos] for w, pos in pick],
        index_bases=bases,
        owners=None,
    )
    if all(p is not None for p in prepared):
        ready = _merged_cached(
            union.plan, "union", tuple(prepared), lambda: prepare_step(union, config, hold=False)
        )
    else:
        ready = prepare_step(union, config)
    return _Unit(members, union, ready, [k for _, k, _ in rows])


def _words_launch(
    launched: PreparedStep, units: list[_Unit], works: Sequence[GroupStep]
) -> Callable[[], None]:
    """``launched`` (over the tensors of ``units``, in order) with each tensor reading its own
    work's scalars from a row of device words (:meth:`PreparedStep.launch_hyper`)."""
    rule = launched.rule
    own = [works[i] for u in units for i in u.members]
    rows = _work_rows(rule, own)
    parts: list[bytes] = []
    first = 0
    for u in units:
        if u.owners is None:
            parts.append(rows[first] * u.ready.n_slots)
        else:
            parts.extend(rows[first + k] for k in u.owners)
        first += len(u.members)
    words = _upload_words(bytearray(b"".join(parts)), len(HYPER_FIELDS[rule]), launched.device)
    s = own[0].scalars
    flags: dict = {
        "maximize": bool(s.maximize),
        "has_decay": any(w.scalars.decay != 1.0 for w in own),
    }
    if rule in ("adam", "sgd"):
        flags["has_l2"] = bool(s.l2 != 0.0)  # a numpy coefficient gives a numpy bool
    if rule == "sgd":
        flags["nesterov"] = bool(s.nesterov)
    return lambda: launched.launch_hyper(words, **flags)


def _host_launch(w: GroupStep, p: PreparedStep) -> Callable[[], None]:
    """``p``'s launch with ``w``'s scalars, step and seed as they are when it runs."""
    return lambda: p.launch(w.scalars, w.step, w.seed, w.first_step)


def _device_launches(
    works: Sequence[GroupStep],
    config: KernelConfig | None,
    prepared: Sequence[PreparedStep | None],
) -> _Launches:
    """:func:`fused_steps`' launches of capturable steps: each run of works that merge writes
    its device words into one table (a slice per work) and launches once."""
    # validates them all first
    ready = [_prepare_device_step(w, config, p) for w, p in zip(works, prepared, strict=True)]
    runs: dict[tuple, list[int]] = {}
    for i, (w, p) in enumerate(zip(works, ready, strict=True)):
        if p is None:  # no tensor: nothing to launch
            key: tuple = ("empty", i)
        else:  # the same AMP values (each group holds its own view of the scaler's tensors)
            ds = _device_step_of(w)
            amp = tuple(None if t is None else t.data_ptr() for t in (ds.grad_scale, ds.found_inf))
            key = (*_merge_key(w, p, i), amp)
        runs.setdefault(key, []).append(i)
    launches: _Launches = []
    for key, run in runs.items():
        if key[0] == "empty":
            launches.append((run, lambda: None))
            continue
        # not keyed "empty": every work of the run has a prepared step
        run_ready = cast(list[PreparedStep], [ready[i] for i in run])
        if len(run) >= 2:
            # built (and its tables cached) at an eager step too: a capture copies nothing
            merged = _merged_device_launch([works[i] for i in run], run_ready, config)
            if MERGE_DEVICE_STEPS_EAGERLY or _capturing():
                launches.append((run, merged))
                continue
        for i, p in zip(run, run_ready, strict=True):
            launches.append(([i], functools.partial(_device_launch, works[i], p)))
    return launches


def _merged_device_launch(
    works: list[GroupStep], ready: list[PreparedStep], config: KernelConfig | None
) -> Callable[[], None]:
    """The launch of capturable ``works`` together: each work's device-words kernel fills its
    rows of the merged launch's table, then the merged kernel runs."""
    merged = _merged_step(works, ready, config)
    width = len(HYPER_FIELDS[works[0].rule])
    table = _merged_cached(
        _family_of(works[0]).plan,
        "device_words",
        (merged,),
        lambda: torch.zeros((merged.n_slots, width), dtype=torch.int32, device=merged.device),
    )
    flags = _device_flags(works)

    def launch() -> None:
        first = 0
        for w in works:
            _device_words(w, table[first : first + len(w.slots)])
            first += len(w.slots)
        merged.launch_hyper(table, **flags)

    return launch


#: Whether capturable steps also merge outside a CUDA graph capture. Captured, a merged
#: launch is what every replay runs: the Qwen2.5-0.5B shapes in 25 param groups replayed in
#: 3.98 ms merged against 4.38 ms as 25 launches on the H200. Eager, a capturable step's host
#: work (about 0.3 ms per group there) comes before the one launch, where separate launches
#: let the GPU start on the first groups: merged, the step took 12.1-12.3 ms from an idle GPU
#: against 7.0-11.6 ms (docs/benchmarks/2026-12-02-merged-chunks.md). Tests set it to run
#: the merged launch under the interpreter.
MERGE_DEVICE_STEPS_EAGERLY = False


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _refuse_strided_capture(work: GroupStep) -> None:
    """ConfigError naming the first non-contiguous parameter or gradient of a captured step:
    such a step runs through contiguous copies at new addresses, whose table a capture cannot
    upload (the generic "not cached yet" advice, one eager step, could never be followed)."""
    for i, (p, g) in enumerate(zip(work.params, work.grads, strict=True)):
        for what, t in (("parameter", p), ("gradient", g)):
            if not t.is_contiguous():
                raise ConfigError(
                    f"the {what} of tensor {i} (slot {work.slots[i]}, shape {tuple(t.shape)}, "
                    f"strides {t.stride()}) is not contiguous (channels_last?): its step runs "
                    "through contiguous copies whose tables are made at every step, which a "
                    "CUDA graph capture cannot hold. Capture contiguous parameters and "
                    "gradients (model.to(memory_format=torch.contiguous_format)), or step "
                    "this one outside the graph"
                )


#: The fewest works :func:`fused_steps` launches together. A merged launch uploads its words
#: (two torch calls and a pinned block per step) and saves one launch per further work. On the
#: H200 with the Qwen2.5-0.5B shapes, back to back, merging was even at 2 param groups and
#: 1-3% faster from 3 to 12 (5-6% at 25); timed from an idle GPU it was mostly 1-6% slower,
#: since the one launch waits for every group's host work
#: (docs/benchmarks/2026-12-02-merged-chunks.md, 2026-12-02-merged-param-groups.md).
MERGE_MIN_WORKS = 4


def _merge_key(work: GroupStep, prepared: PreparedStep, i: int) -> tuple:
    """What works launched together share: one family arena, the rule, the compiled variant
    (every flag but the alignment ones, which a merged launch takes for all, and ``HAS_DECAY``,
    harmless where the decay factor is exactly 1). ``("alone", i)`` for a work without a family
    or a reusable launch."""
    fam = work.arena.family
    if fam is None or not prepared.reusable or prepared._grid is None:
        return ("alone", i)
    return (id(fam), *_flags_key(work), _variant(prepared))


def _flags_key(work: GroupStep) -> tuple:
    """``work``'s rule and the flags of its scalars that choose a compiled variant."""
    s = work.scalars
    if work.rule == "lion":
        flags: tuple = (bool(s.maximize),)
    elif work.rule == "adam":
        flags = (bool(s.maximize), s.l2 != 0.0)
    else:
        flags = (bool(s.maximize), s.l2 != 0.0, bool(s.nesterov))
    return (work.rule, flags)


def _family_of(work: GroupStep) -> StateArena:
    """The family arena of a work that merges with others (:func:`_merge_key` keeps works
    without one alone)."""
    return cast(StateArena, work.arena.family)


def _variant(prepared: PreparedStep) -> tuple:
    """``prepared``'s compile-time keywords but the alignment ones (which a merged launch takes
    for all its works), as a sorted tuple; computed once per prepared step (replays reuse it)."""
    kw = prepared._variant
    if kw is None:
        kw = prepared._variant = tuple(
            sorted((k, v) for k, v in prepared._kw.items() if k not in ("ALIGNED", "ARENA_ALIGNED"))
        )
    return kw


def _work_rows(rule: str, works: list[GroupStep]) -> list[bytes]:
    """Each work's device words (:func:`hyper_words`), as the bytes of one int32 row of
    ``len(HYPER_FIELDS[rule])`` words. The fp32 scalars of all works are rounded in one
    ``array`` conversion (the C double -> float cast that ``round_to_float32`` documents as its
    own): a step over many param groups costs no torch call per group."""
    fields = HYPER_FIELDS[rule]
    n = fields.index("seed")
    try:
        values = array("f", [getattr(w.scalars, f) for w in works for f in fields[:n]])
    except AttributeError as e:
        raise ConfigError(
            f"the scalars have no {e.name!r}: pass core's scalars of the step's rule "
            "(adam_scalars, lion_scalars or sgd_scalars)"
        ) from None
    tail = struct.Struct(f"<{len(fields) - n}i")
    rows = []
    for k, w in enumerate(works):
        words = [_i32(w.seed, "seed"), _i32(w.step, "step")]
        if rule == "sgd":
            words.append(int(bool(w.first_step)))
        rows.append(values[k * n : (k + 1) * n].tobytes() + tail.pack(*words, _ONE_BITS, 0))
    return rows


def _upload_words(blob: bytearray, width: int, device: torch.device) -> Tensor:
    """The ``[rows, width]`` int32 table whose bytes are ``blob``, on ``device``: written into
    a pinned block of torch's caching host allocator (which keeps it from reuse until the copy
    has run) and copied without blocking; two torch calls, since each costs tens of
    microseconds on a slow host. Refused during a CUDA graph capture (it would copy at
    capture only)."""
    if device.type != "cuda":
        return torch.frombuffer(blob, dtype=torch.int32).view(-1, width)
    if torch.cuda.is_current_stream_capturing():
        raise ConfigError(
            "a step over several param groups copies its scalars from the host, which a CUDA "
            "graph capture cannot hold: capture a capturable optimizer's step"
        )
    host = torch.empty(
        (len(blob) // (4 * width), width), dtype=torch.int32, pin_memory=True, device="cpu"
    )
    ctypes.memmove(host.data_ptr(), (ctypes.c_char * len(blob)).from_buffer(blob), len(blob))
    return host.to(device, non_blocking=True)


#: merged launches a family plan keeps (chunk tables, merged steps): a few steps' worth
_MERGED_CACHE = 8


def _merged_cached(plan, kind: str, parts: tuple, build: Callable[[], Any]) -> Any:
    """``build()`` for the family ``plan``, cached on the identity of ``parts`` (objects, and
    ints and tuples by value; the cached value holds the objects, so their ids stay theirs)."""
    lru = plan.cache(("triton_merged", kind), lambda: _TableCache(_MERGED_CACHE, sys.maxsize))
    key = tuple(p if type(p) in (int, tuple) else id(p) for p in parts)
    hit = lru.get(key)
    if hit is not None:
        return hit[0]
    value = build()
    lru.put(key, (value, parts), 0)  # bounded in entries only
    return value


def _merged_step(
    works: list[GroupStep], ready: list[PreparedStep], config: KernelConfig | None
) -> PreparedStep:
    """One prepared launch of ``works`` (one family, one variant: :func:`_merge_key`): their
    chunk tables, cut with the chunk size of the merged total, concatenated with each chunk's
    slot column moved past the rows of the works before it and its arena offset moved into the
    family's fields, their slot tables concatenated, the family's state pointers. Cached on the
    slot tables it merges (cached themselves while the gradients stay put), the offsets and
    the variant."""
    head0, dev, rule = works[0], ready[0].device, works[0].rule
    fam = _family_of(head0)
    offsets = [w.arena.family_offset for w in works]

    def build() -> PreparedStep:
        counts = [p.n_slots for p in ready]
        firsts = [sum(counts[:k]) for k in range(len(counts))]
        kw = dict(ready[0]._kw)
        cfg = config or kernel_config(blocked=kw["BS"] == 32, rule=rule, master=kw["MASTER"])
        # chunks sized for the merged launch, not for each work alone: a work's own size fills
        # the GPU with that work's chunks, so 25 groups took chunks 7x smaller than one group
        # of the same tensors, and the kernel 5% longer (per-chunk setup) on the H200
        extents = [_step_extent(w.plan, tuple(w.slots)) for w in works]
        cs = _chunk_size(cfg, head0.plan, sum(total for _, total in extents))
        chunk_parts = tuple(
            _chunk_table(w.plan, w.slots, full, cs)
            for w, (full, _) in zip(works, extents, strict=True)
        )
        n_chunks = sum(t.shape[0] for t in chunk_parts)

        def merge_chunks() -> Tensor:
            delta = torch.tensor(
                [[r, 0, 0, o] for r, o in zip(firsts, offsets, strict=True)],
                dtype=torch.int64,
                device="cpu",
            )
            rows = delta.repeat_interleave(
                torch.tensor([t.shape[0] for t in chunk_parts], device="cpu"), dim=0
            )
            return torch.cat(chunk_parts) + _to_device(rows, dev)

        # the chunk tables stay when gradients move (with_grads keeps them): merged once
        chunks = _merged_cached(fam.plan, "chunks", (*chunk_parts, *offsets), merge_chunks)
        slots = torch.cat([p._head[2] for p in ready])
        kw["ALIGNED"] = all(p._kw["ALIGNED"] for p in ready)
        kw["ARENA_ALIGNED"] = kw["BS"] == 32 or (
            all(p._kw["ARENA_ALIGNED"] for p in ready) and all(o % 8 == 0 for o in offsets)
        )
        code = fam.master_code if fam.master_code is not None else _dummy(dev, torch.uint8)
        head: tuple = (chunks, n_chunks, slots, _kernel_view(code))
        if rule == "adam":
            head += (
                *_moment_args(fam, "exp_avg", dev)[1:],
                *_moment_args(fam, "exp_avg_sq", dev)[1:],
            )
        elif rule == "lion":
            head += _moment_args(fam, "exp_avg", dev)[1:]
        else:
            name = "momentum_buffer" if kw["_HAS_MOMENTUM"] else None
            head += _moment_args(fam, name, dev)[1:]
        programs = cfg.programs or _sm_count(dev) * cfg.waves
        # holds no tensors: launched at once while the works hold them, then kept in the plan's
        # cache, where held gradients would outlive the step
        return PreparedStep(rule, (min(n_chunks, programs),), head, kw, [], dev, sum(counts))

    # keyed on what the merged launch is built from (a capturable step prepares new
    # PreparedStep objects every step, over the same cached tables)
    parts = (*(p._head[2] for p in ready), *offsets, ready[0]._grid, _variant(ready[0]))
    return _merged_cached(fam.plan, "step", parts, build)


_WORDS_BLOCK = 128
_RULE_IDS = {
    "adam": _words.RULE_ADAM.value,
    "lion": _words.RULE_LION.value,
    "sgd": _words.RULE_SGD.value,
}
#: (device, beta, last index, root) -> one bias-correction table on the device (bc1 float64,
#: bc2_sqrt float32 bits as int32), and (device, beta2, last index, "normalized") -> the int32
#: table of a decay-normalized step's words (:func:`_normalized_table`), the most recently used
#: last
_BIAS_TABLES: dict = {}
#: keys read inside a CUDA graph capture: the graph replays their addresses, so they stay
_BIAS_CAPTURED: set = set()
#: tables kept besides those: a scheduler that cycles beta1 (OneCycleLR) asks for a new one
#: at every step, and each kept table of beta2 0.999 holds 38,000 entries of device memory
_BIAS_KEEP = 8


def _bias_tables(
    device: torch.device, betas: tuple[float, float], normalized: bool = False
) -> tuple[Tensor, Tensor, int]:
    """The device tables of core's ``adam_bias_table(*betas)`` and their last index, each table
    cached under its own beta (a cycled beta1 rebuilds only its own table, whose pows stop
    where beta1 saturates). ``normalized``: the second table is beta2's
    :func:`_normalized_table` instead."""
    if not isinstance(betas, Sequence) or len(betas) != 2:  # a third value would be ignored
        raise ConfigError(f"device_step.betas must be a pair (beta1, beta2), got {betas!r}")
    beta1, beta2 = float(betas[0]), float(betas[1])
    try:
        last = adam_bias_last(beta1, beta2)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    bc1 = _bias_table(device, beta1, last, False)
    if normalized:
        return bc1, _normalized_table(device, beta2, last), last
    return bc1, _bias_table(device, beta2, last, True), last


def _bias_table(device: torch.device, beta: float, last: int, root: bool) -> Tensor:
    def build() -> Tensor:
        values = bias_correction_table(beta, last, root)
        # entries are 1.0 from the first one on (monotone): only those before it are converted
        n = values.index(1.0)
        if root:
            host = torch.full((last + 1,), _f32_bits(1.0), dtype=torch.int32, device="cpu")
            bits = [_f32_bits(v) for v in values[:n]]
            host[:n] = torch.tensor(bits, dtype=torch.int32, device="cpu")
        else:
            host = torch.ones(last + 1, dtype=torch.float64, device="cpu")
            host[:n] = torch.tensor(values[:n], dtype=torch.float64, device="cpu")
        return host

    return _cached_table((str(device), beta, last, root), device, build)


def _normalized_table(device: torch.device, beta2: float, last: int) -> Tensor:
    """The words of a decay-normalized Adam step (``DeviceStep.normalized``) that depend on the
    step ``k``, as float32 bits in one int32 table, each computed in double as core's
    ``adam_scalars(normalized=True)`` computes it and rounded once (``decay_norm_table``'s
    ``P``, ``N``, ``R``; ``r = k % P``): ``bc2_sqrt[k] / R[k % P]`` for ``k`` in ``0..last``
    (``bc2_sqrt`` of :func:`bias_correction_table`), then ``bc2_sqrt[last] / R[r]`` (1.0 /
    ``R[r]``: every step past ``last``) and ``(1 - beta2) / N[r]`` for ``r`` in ``0..P-1``.
    The ``beta2`` word (1.0, or ``beta2**P`` where ``r == 0``) takes no table."""

    def build() -> Tensor:
        period, norms, roots = decay_norm_table(beta2)
        bc2 = bias_correction_table(beta2, last, True)
        omb2 = 1.0 - beta2
        values = [b / roots[k % period] for k, b in enumerate(bc2)]
        values += [bc2[last] / r for r in roots]
        values += [omb2 / n for n in norms]
        # struct's float conversion: round_to_float32's, for all of them at once
        packed = struct.pack(f"<{len(values)}f", *values)
        return torch.tensor(
            struct.unpack(f"<{len(values)}i", packed), dtype=torch.int32, device="cpu"
        )

    return _cached_table((str(device), beta2, last, "normalized"), device, build)


def _cached_table(key: tuple, device: torch.device, build: Callable[[], Tensor]) -> Tensor:
    """The device copy of the host table ``build()`` under ``key`` in :data:`_BIAS_TABLES`,
    built and uploaded on a miss (evicting the oldest tables a capture did not read)."""
    hit = _BIAS_TABLES.pop(key, None)
    if hit is None:
        hit = (_to_device(build(), device), set())
        # only a new table can take the count past the bound: the oldest unread ones go
        evictable = [k for k in _BIAS_TABLES if k not in _BIAS_CAPTURED]
        for old in evictable[: max(0, len(evictable) + 1 - _BIAS_KEEP)]:
            del _BIAS_TABLES[old]
    _BIAS_TABLES[key] = hit  # the most recently used last
    table, streams = hit
    if _capturing():
        _BIAS_CAPTURED.add(key)
    elif table.is_cuda:
        # an evicted table's memory goes back to the caching allocator, which hands it out
        # again in the order of the streams recorded here: every stream that read it
        stream = torch.cuda.current_stream(table.device)
        if stream.cuda_stream not in streams:
            table.record_stream(stream)
            streams.add(stream.cuda_stream)
    return table


def _check_amp_tensor(t: Tensor | None, what: str, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor) or t.dtype != torch.float32 or t.numel() != 1:
        got = f"{t.dtype}{tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
        raise ConfigError(f"{what} must be a one-element float32 tensor, got {got}")
    if t.device != device:
        raise ConfigError(f"{what} is on {t.device}; the group is on {device}")


def device_step(
    work: GroupStep, config: KernelConfig | None = None, prepared: PreparedStep | None = None
) -> None:
    """A capturable step of ``work`` (``work.device_step``, core's ``DeviceStep``): the
    device-words kernel, then the rule kernel reading one row per tensor. No host
    synchronisation and, once the group's tables are cached (after one eager step with the same
    tensors), no host-to-device copy: the launches can be captured in a CUDA graph.
    ``prepared``: the work's :class:`PreparedStep` for its current gradients (a cached step's),
    else prepared here."""
    prepared = _prepare_device_step(work, config, prepared)
    if prepared is not None:
        _device_launch(work, prepared)


def _device_launch(work: GroupStep, prepared: PreparedStep) -> None:
    """A capturable step of ``work`` alone: its device words into the plan's table, then its
    launch."""
    plan = work.plan
    words = plan.cache(
        ("triton_device_words", work.rule),
        lambda: torch.zeros(
            (len(plan.slots), len(HYPER_FIELDS[work.rule])), dtype=torch.int32, device=plan.device
        ),
    )[: len(work.slots)]  # row i: the step's i-th tensor
    _device_words(work, words)
    prepared.launch_hyper(words, **_device_flags([work]))


def _prepare_device_step(
    work: GroupStep, config: KernelConfig | None, prepared: PreparedStep | None = None
) -> PreparedStep | None:
    """The prepared launch of a capturable step (``prepared`` where given), its
    ``device_step`` validated first (None for a step over no tensor)."""
    ds = _device_step_of(work)
    plan = work.plan
    dev = plan.device
    if not work.slots:
        return None
    for name in ("steps", "norm_steps"):
        steps = getattr(ds, name)
        if name == "norm_steps" and steps is None:
            continue
        if (
            not isinstance(steps, Tensor)
            or steps.dtype != torch.float32
            or steps.shape != (len(plan.slots),)
            or steps.device != dev
            or not steps.is_contiguous()
        ):
            got = (
                f"{steps.dtype}{tuple(steps.shape)} on {steps.device}"
                if isinstance(steps, Tensor)
                else type(steps).__name__
            )
            raise ConfigError(
                f"device_step.{name} must be a contiguous float32 tensor of {len(plan.slots)} "
                f"counts (one per plan slot) on {dev}, got {got}"
            )
    _check_amp_tensor(ds.grad_scale, "grad_scale", dev)
    _check_amp_tensor(ds.found_inf, "found_inf", dev)
    return prepared if prepared is not None else prepare_step(work, config)


def _device_words(work: GroupStep, words: Tensor) -> None:
    """Launch the device-words kernel of a capturable step: row i of ``words`` (a contiguous
    ``[len(work.slots), width]`` int32 view) receives the words of the step's i-th tensor, from
    its step counter, which the kernel advances."""
    ds = _device_step_of(work)
    plan = work.plan
    dev = plan.device
    n = len(work.slots)
    rule = work.rule
    slots = plan.cache(
        ("triton_device_slots", tuple(work.slots)),
        lambda: _to_device(torch.tensor(work.slots, dtype=torch.int32, device="cpu"), dev),
    )
    host = hyper_words(rule, work.scalars, work.seed, 1)[:9]
    lr_t = _device_scalar(ds.lr, "device_step.lr", dev)
    wd_t = _device_scalar(ds.weight_decay, "device_step.weight_decay", dev)
    # a decoupled decay factor follows a device lr or weight decay; with floats the host word
    # holds it. A coupled (L2) coefficient on the device is written as it is
    decay = ds.decoupled and (wd_t is not None or (lr_t is not None and ds.weight_decay != 0.0))
    l2 = wd_t is not None and not ds.decoupled
    ilr = ds.initial_lr if decay else None
    ilr_t = _device_scalar(ilr, "device_step.initial_lr", dev)
    lr_bits = _double_bits(0.0 if lr_t is not None else ds.lr)
    wd_bits = _double_bits(0.0 if wd_t is not None else ds.weight_decay)
    ilr_bits = _double_bits(0.0 if ilr is None or ilr_t is not None else ilr)
    dummy64 = _dummy(dev, torch.float64)
    # decay-normalized second moments (Adam): beta2, one_minus_beta2 and bc2_sqrt per step
    norm = rule == "adam" and bool(ds.normalized)
    period, b2p = 1, 0
    if rule == "adam":
        bc1, bc2, last = _bias_tables(dev, ds.betas, norm)
        if norm:
            beta2 = float(ds.betas[1])
            period = decay_norm_table(beta2)[0]
            b2p = _f32_bits(beta2**period)
    else:
        bc1, bc2, last = _dummy(dev, torch.float64), _dummy(dev, torch.int32), 0
    dummy = _dummy(dev, torch.float32)
    _launch(
        _words.device_words_kernel,
        (ceil_div(n, _WORDS_BLOCK),),
        words,
        ds.steps,
        dummy if ds.norm_steps is None else ds.norm_steps,
        slots,
        n,
        *host,
        _i32(lr_bits),
        _i32(lr_bits >> 32),
        bc1,
        bc2,
        last,
        dummy if ds.found_inf is None else ds.found_inf,
        dummy if ds.grad_scale is None else ds.grad_scale,
        dummy64 if lr_t is None else lr_t,
        dummy64 if wd_t is None else wd_t,
        _i32(wd_bits),
        _i32(wd_bits >> 32),
        dummy64 if ilr_t is None else ilr_t,
        _i32(ilr_bits),
        _i32(ilr_bits >> 32),
        period,
        b2p,
        RULE=_RULE_IDS[rule],
        W=words.shape[1],
        HAS_FOUND=ds.found_inf is not None,
        HAS_SCALE=ds.grad_scale is not None,
        LR_PTR=lr_t is not None,
        DECAY=decay,
        WD_PTR=wd_t is not None,
        L2=l2,
        ILR=ilr is not None,
        ILR_PTR=ilr_t is not None,
        NORM=norm,
        MIRROR=ds.norm_steps is not None,
        BLOCK=_WORDS_BLOCK,
    )


def _device_step_of(work: GroupStep) -> DeviceStep:
    """``work.device_step``, which every work these helpers see has: :func:`device_step` is for
    capturable steps only (``fused_step`` tests it), and :func:`fused_steps` takes all host or all
    capturable steps."""
    return cast(DeviceStep, work.device_step)


def _double_bits(value: float | Tensor) -> int:
    """The 64 bits of ``value`` (a float, or a one-element CPU tensor) as a double (the words
    kernel takes them as two int32 halves)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _device_scalar(value: float | Tensor | None, what: str, device: torch.device) -> Tensor | None:
    """A tensor ``value`` as the one-element float64 tensor the words kernel reads (its own
    memory where it is one already: a captured graph then reads the current value at each
    replay; else a cast, which a capture records), None for a float, None or a CPU tensor of a
    GPU group (read on the host, as a float). ConfigError for a tensor of more than one element,
    not floating point, or on another GPU."""
    if not isinstance(value, Tensor):
        return None
    if value.device.type == "cpu" and device.type != "cpu":
        return None
    if value.numel() != 1 or not value.is_floating_point():
        raise ConfigError(
            f"{what} must be a float or a one-element floating-point tensor, got "
            f"{value.dtype}{tuple(value.shape)}"
        )
    if value.device != device:
        raise ConfigError(f"{what} is a tensor on {value.device}; the group is on {device}")
    return value.detach().reshape(1).to(torch.float64)


def _device_flags(works: list[GroupStep]) -> dict:
    """The variant flags of a launch of capturable ``works`` (one rule; one step's AMP
    tensors): :meth:`PreparedStep.launch_hyper`'s keywords."""
    s = works[0].scalars
    flags: dict = {
        "maximize": bool(s.maximize),
        "has_decay": any(w.scalars.decay != 1.0 for w in works),
        "unscale": _device_step_of(works[0]).grad_scale is not None,
    }
    if works[0].rule in ("adam", "sgd"):
        flags["has_l2"] = bool(s.l2 != 0.0)  # a numpy coefficient gives a numpy bool
    if works[0].rule == "sgd":
        flags["nesterov"] = bool(s.nesterov)
    return flags
