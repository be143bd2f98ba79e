"""The on-disk container of a memopt checkpoint: one file of named tensors plus a JSON ``meta``.

Writes are **streamed** and **atomic**. :class:`CheckpointWriter` writes each tensor's bytes
as soon as :meth:`~CheckpointWriter.add` is called, in chunks of at most 64 MiB taken straight
from the tensor's memory (a tensor on another device is copied to the host one chunk at a
time), so a save never holds more than one tensor's bytes, let alone an fp32 copy of every
state. Everything goes to a temporary file in the destination's directory
(``.<name>.tmp-<random>``); :meth:`~CheckpointWriter.commit` writes the index, ``fsync``\\ s the
file, renames it over the destination with :func:`os.replace` and ``fsync``\\ s the directory.
Until that rename the previous file at the destination is untouched, so a crash, a full disk
or a permission error at any point leaves either the old checkpoint or the new one, never a
mix; a failed save removes its temporary file and re-raises the error.

Reads are checked. :class:`CheckpointReader` validates the header (magic, format version),
the trailer and the index checksum when it opens a file, and each tensor's CRC-32 when it is
loaded. A file that is truncated, corrupted, of a newer format version or not a checkpoint
at all raises :class:`~memopt_core.errors.CheckpointError` and nothing is returned from it;
bad arguments (an unsupported dtype, a duplicate key, a closed writer) raise
:class:`~memopt_core.errors.ConfigError`. Errors of the operating system (a missing file, a
full disk) propagate as the :class:`OSError` they are.

File layout (format version 1; every integer little-endian)
-----------------------------------------------------------

========================  =========  ==========================================================
offset                    size       content
========================  =========  ==========================================================
0                         8          magic ``b"MEMOPTCK"``
8                         4          uint32: format version (``1``)
12                        52         reserved, zero (the header is 64 bytes)
64                        ...        tensor payloads, in the order they were added: each the
                                     tensor's raw bytes in C (row-major) order, starting at a
                                     64-byte aligned offset; zero padding between payloads
``index_offset``          ``L``      index: a UTF-8 JSON object (below)
``size - 32``             8          uint64: ``index_offset``
``size - 24``             8          uint64: ``L``, the index's length in bytes
``size - 16``             4          uint32: CRC-32 (:func:`zlib.crc32`) of the index bytes
``size - 12``             12         end magic ``b"MEMOPTEND"`` + 3 zero bytes
========================  =========  ==========================================================

The trailer (the last 32 bytes) ends the file exactly: ``index_offset + L + 32 == size``.
The index is::

    {"format_version": 1,
     "meta": {...},                          # the writer's meta dict, as JSON
     "tensors": [{"key": "state.0.exp_avg",  # unique str
                  "dtype": "bfloat16",       # a name of SUPPORTED_DTYPES
                  "shape": [4096, 1024],
                  "offset": 64,              # a multiple of 64
                  "nbytes": 8388608,         # numel * element size
                  "crc32": 2857172161},      # zlib.crc32 of the payload bytes
                 ...]}

Payload bytes are covered by their ``crc32``, the index by the trailer's; the reserved header
bytes must be zero; the padding between payloads is not checked. A reader refuses a header
version newer than :data:`FORMAT_VERSION` before looking at anything else, so a later version
may change everything after the first 12 bytes.

Beyond its checksum, the index must be what the writer writes, checked per tensor when the file
is opened (so a crafted or edited index is a ``CheckpointError`` too, before any payload is
read): ``format_version`` the int of the header; each entry's ``key`` a unique UTF-8 str,
``dtype`` a name above, ``shape`` a list of ints below 2**63 whose product, zeros taken as 1,
is below 2**63 too (what torch can build; the writer refuses an empty tensor beyond that),
``nbytes`` its element count times the dtype's size, ``crc32`` below 2**32, ``offset`` 64-byte
aligned; the payloads lie between the header and the index, in the index's order, none
starting before the previous one ends (no two keys share bytes, so a load reads at most the
file's size). The JSON holds only finite numbers (no ``NaN``, ``Infinity`` or ``1e999``) and
is not nested beyond what :func:`json.loads` reads without recursing too deep.

Supported dtypes: float32, float64, bfloat16, float16, float8_e4m3fn, float8_e5m2, uint8,
int8, int16, int32, int64, bool. Bit patterns round-trip exactly (NaN payloads, ``-0.0``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import stat
import struct
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import torch

from memopt_core.atomic_write import AtomicFile
from memopt_core.errors import CheckpointError, ConfigError

__all__ = [
    "FORMAT_VERSION",
    "SUPPORTED_DTYPES",
    "CheckpointReader",
    "CheckpointWriter",
    "TensorEntry",
    "read_meta",
    "write_checkpoint",
]

FORMAT_VERSION = 1
"""The container format version this module writes and the newest it reads."""

MAGIC = b"MEMOPTCK"
END_MAGIC = b"MEMOPTEND"
HEADER_SIZE = 64
ALIGNMENT = 64
_HEADER = struct.Struct("<8sI52s")  # magic, version, reserved
_PREAMBLE_SIZE = 12  # magic + version: what every format version keeps
_TRAILER = struct.Struct("<QQI12s")  # index offset, index length, index crc32, end magic
TRAILER_SIZE = _TRAILER.size  # 32

_CHUNK_BYTES = 64 << 20
"""Largest piece of a tensor written, checksummed or read at once (64 MiB)."""

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
"""The dtypes a checkpoint can hold, by the name the index records."""

_DTYPE_NAMES = {dtype: name for name, dtype in SUPPORTED_DTYPES.items()}
_ITEMSIZE = {name: dtype.itemsize for name, dtype in SUPPORTED_DTYPES.items()}

_INT64_MAX = (1 << 63) - 1
"""The largest size, stride or element count a torch tensor has (sizes are int64)."""


def _shape_problem(shape: list[int] | tuple[int, ...]) -> str | None:
    """Why a tensor of ``shape`` (non-negative ints) cannot be rebuilt by torch, or None.

    Each size and the product of the sizes with zeros taken as 1 (the largest stride, and every
    partial element count) must fit int64: a size of 2**63 made the load's ``reshape`` raise a
    bare TypeError, and an empty ``[2**62, 2**62, 0]`` a RuntimeError. Constant work per
    dimension: the product stops growing once it passes the limit.
    """
    span = 1
    for d in shape:
        if d > _INT64_MAX:
            return f"size {d} does not fit int64 (torch's sizes are at most 2**63 - 1)"
        span *= max(d, 1)
        if span > _INT64_MAX:
            return "its sizes (zeros taken as 1) multiply past 2**63 - 1, which torch cannot index"
    return None


def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for messages about edited indexes."""
    text = repr(value)
    return (
        text if len(text) <= limit else f"{text[: limit - 20]}...{text[-12:]} ({len(text)} chars)"
    )


class _NonFiniteNumber(ValueError):
    """A JSON number the writer never writes (NaN, Infinity, or a float beyond float's range)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFiniteNumber(text if len(text) <= 40 else f"{text[:30]}...")
    return value


def _no_constant(text: str) -> float:
    raise _NonFiniteNumber(text)


class TensorEntry(NamedTuple):
    """What the index says about one tensor (unpacks as ``dtype, shape, nbytes``)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


# --------------------------------------------------------------------------------------------
# raw bytes of tensors without numpy


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous, non-empty CPU tensor's memory; no copy is made.

    The view does not keep ``t`` alive: the caller holds ``t`` while using the view.
    """
    array = (ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr())
    return memoryview(array).cast("B")


def _tensor_chunks(tensor: torch.Tensor) -> Iterator[memoryview]:
    """The bytes of ``tensor`` in C order, as views of at most ``_CHUNK_BYTES`` bytes each.

    A contiguous CPU tensor is read in place. A non-contiguous one is made contiguous first
    (one copy of this tensor); one on another device is copied to the host a chunk at a time.
    """
    t = tensor.detach().resolve_conj().resolve_neg()
    if t.numel() == 0:
        return
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    chunk = _CHUNK_BYTES
    for start in range(0, flat.numel(), chunk):
        piece = flat[start : start + chunk]
        if piece.device.type != "cpu":
            piece = piece.to("cpu")
        yield _byte_view(piece)  # the generator's frame keeps ``piece`` alive meanwhile


def _write_all(file: Any, data: memoryview | bytes) -> None:
    """Write every byte of ``data`` to the unbuffered ``file`` (retrying short writes)."""
    view = memoryview(data)
    while view.nbytes:
        written = file.write(view)
        if not written:
            raise OSError(errno.EIO, "write() wrote nothing", getattr(file, "name", None))
        view = view[written:]


def _read_exact(file: Any, out: memoryview, what: str) -> None:
    """Fill ``out`` from the unbuffered ``file``; a short read means the file is truncated."""
    pos = 0
    while pos < out.nbytes:
        got = file.readinto(out[pos : pos + _CHUNK_BYTES])
        if not got:
            raise CheckpointError(
                f"{file.name}: file is truncated: it ends inside {what} "
                f"({out.nbytes - pos} of {out.nbytes} bytes missing)"
            )
        pos += got


def _check_utf8(text: str, where: str) -> None:
    """ConfigError unless ``text`` encodes as UTF-8: a lone surrogate (what ``os.fsdecode``
    gives for a file name that is not UTF-8) failed the commit, after every tensor was written,
    with a bare UnicodeEncodeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{where} ({text!r}) is not valid UTF-8 text: {e}") from None


def _check_json_value(value: Any, where: str) -> None:
    """Raise ConfigError unless ``value`` round-trips through JSON (str dict keys, finite floats)."""
    if isinstance(value, str):
        _check_utf8(value, where)
        return
    if value is None or isinstance(value, (bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{where} is {value}: JSON (the checkpoint meta) has no inf/nan")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json_value(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise ConfigError(
                    f"{where} has key {k!r} of type {type(k).__name__}: meta dict keys must be str"
                )
            _check_utf8(k, f"{where} key")
            _check_json_value(item, f"{where}[{k!r}]")
        return
    raise ConfigError(
        f"{where} is a {type(value).__name__}: meta must hold only JSON values "
        "(None, bool, int, float, str, list, tuple, dict with str keys)"
    )


# --------------------------------------------------------------------------------------------
# writing


class CheckpointWriter:
    """Stream tensors into a new checkpoint at ``path``; nothing appears there before commit.

    ``meta`` is a JSON-serializable dict stored in the index (tuples come back as lists).
    Used as a context manager the writer commits on a clean exit and aborts on an exception.
    Any error while writing aborts the writer (its temporary file is removed) and propagates;
    the file previously at ``path``, if any, is never modified.
    """

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any] | None = None) -> None:
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise ConfigError(f"meta must be a dict or None, got {type(meta).__name__}")
        _check_json_value(meta, "meta")
        self.path = Path(os.fspath(path))
        self._meta = json.loads(json.dumps(meta))  # a snapshot: later changes are not saved
        self._entries: list[dict[str, Any]] = []
        self._keys: set[str] = set()
        self._atomic = AtomicFile(self.path)
        self._file: Any = self._atomic.file
        self._pos = 0
        self._guarded(self._write, _HEADER.pack(MAGIC, FORMAT_VERSION, b""))

    # -- internals ---------------------------------------------------------------------------

    def _write(self, data: memoryview | bytes) -> None:
        _write_all(self._file, data)
        self._pos += memoryview(data).nbytes

    def _guarded(self, fn: Any, *args: Any) -> Any:
        """Run ``fn``; on any error remove the temporary file and re-raise."""
        try:
            return fn(*args)
        except BaseException as e:
            self.abort()
            # a full disk: say which file (a note from Python 3.11; on 3.10 the error's
            # filename, which its message then names)
            if isinstance(e, OSError) and e.filename is None:
                if hasattr(e, "add_note"):
                    e.add_note(f"while writing the checkpoint {str(self.path)!r} (not written)")
                else:
                    e.filename = str(self.path)
            raise

    @property
    def _state(self) -> str:
        return self._atomic.state if hasattr(self, "_atomic") else "unopened"

    def _check_open(self, action: str) -> None:
        if self._state != "open":
            raise ConfigError(
                f"cannot {action}: the checkpoint writer for {str(self.path)!r} is already "
                f"{self._state}; open a new CheckpointWriter"
            )

    # -- public ------------------------------------------------------------------------------

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` under ``key`` now (its bytes, C order, at the next aligned offset)."""
        self._check_open(f"add {key!r}")
        if not isinstance(key, str):
            raise ConfigError(f"checkpoint keys must be str, got {type(key).__name__} {key!r}")
        _check_utf8(key, "checkpoint key")
        if key in self._keys:
            raise ConfigError(f"duplicate checkpoint key {key!r}: each key can be added once")
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"{key!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            # a subclass's bytes are not at data_ptr() (a DTensor's is 0: its shard is local)
            raise ConfigError(
                f"{key!r} is a {type(tensor).__name__}, a tensor subclass whose bytes this file "
                "cannot read: save sharded (DTensor) models and optimizers with "
                "torch.distributed.checkpoint (memopt_checkpoint.check_dcp_load checks them), "
                "or pass plain tensors (DTensor.full_tensor())"
            )
        name = _DTYPE_NAMES.get(tensor.dtype)
        if name is None:
            raise ConfigError(
                f"{key!r}: dtype {tensor.dtype} cannot be stored in a checkpoint; supported: "
                + ", ".join(SUPPORTED_DTYPES)
            )
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise ConfigError(f"{key!r}: only dense tensors can be stored, not {tensor.layout}")
        if tensor.device.type == "meta":
            raise ConfigError(f"{key!r}: a tensor on the meta device has no data to store")
        problem = _shape_problem(tuple(tensor.shape))
        if problem is not None:  # an empty tensor only; the reader refuses it
            raise ConfigError(f"{key!r} of shape {tuple(tensor.shape)} cannot be stored: {problem}")
        self._guarded(self._add, key, name, tensor)

    def _add(self, key: str, name: str, tensor: torch.Tensor) -> None:
        pad = -self._pos % ALIGNMENT
        if pad:
            self._write(bytes(pad))
        offset = self._pos
        crc = 0
        for chunk in _tensor_chunks(tensor):
            crc = zlib.crc32(chunk, crc)
            self._write(chunk)
        nbytes = self._pos - offset
        expected = tensor.numel() * _ITEMSIZE[name]
        if nbytes != expected:  # pragma: no cover - an internal invariant
            raise RuntimeError(f"{key!r}: wrote {nbytes} bytes, expected {expected}")
        self._entries.append(
            {
                "key": key,
                "dtype": name,
                "shape": list(tensor.shape),
                "offset": offset,
                "nbytes": nbytes,
                "crc32": crc,
            }
        )
        self._keys.add(key)

    def commit(self) -> None:
        """Write the index and trailer, fsync, rename over ``path``, fsync the directory.

        An error before the rename aborts (the previous file stays); an error fsyncing the
        directory propagates with the new checkpoint already in place at ``path``.
        """
        self._check_open("commit")
        self._guarded(self._finish_file)
        self._atomic.commit()

    def _finish_file(self) -> None:
        index = {"format_version": FORMAT_VERSION, "meta": self._meta, "tensors": self._entries}
        data = json.dumps(index, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        offset = self._pos
        self._write(data)
        self._write(_TRAILER.pack(offset, len(data), zlib.crc32(data), END_MAGIC))

    def abort(self) -> None:
        """Discard the temporary file; the file at ``path`` is untouched. No-op after commit."""
        if hasattr(self, "_atomic"):
            self._atomic.abort()

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            if self._state == "open":
                self.commit()
        else:
            self.abort()

    def __del__(self) -> None:
        # A writer dropped without commit() never publishes anything: remove its temp file.
        try:
            if getattr(self, "_state", None) == "open":
                self.abort()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def write_checkpoint(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    meta: dict[str, Any] | None = None,
) -> None:
    """Write ``tensors`` (a mapping, or ``(key, tensor)`` pairs, e.g. a generator) to ``path``.

    Atomic: on any error the file previously at ``path`` is left as it was.
    """
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    with CheckpointWriter(path, meta) as writer:
        for key, tensor in items:
            writer.add(key, tensor)


# --------------------------------------------------------------------------------------------
# reading


def _open_regular(path: Path) -> Any:
    """``path`` opened for unbuffered binary reading, refused unless it is a regular file: a
    FIFO left at a checkpoint's path made ``open`` wait for a writer forever (it is opened
    without blocking, then checked), and a device is no checkpoint."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):  # what open() raised
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise CheckpointError(
                f"{path}: not a regular file (a FIFO, a socket or a device): not a memopt "
                "checkpoint"
            )
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


class CheckpointReader:
    """Open a checkpoint, validate its header, trailer and index; load tensors by key.

    Raises :class:`CheckpointError` for a file that is truncated, corrupt, of a newer format
    version or not a checkpoint. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(os.fspath(path))
        self._file: Any = _open_regular(self.path)
        try:
            self._open()
        except BaseException:
            self._file.close()
            raise

    def _error(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {msg}")

    def _read_at(self, offset: int, n: int, what: str) -> bytes:
        self._file.seek(offset)
        buf = bytearray(n)
        _read_exact(self._file, memoryview(buf), what)
        return bytes(buf)

    def _open(self) -> None:
        size = os.fstat(self._file.fileno()).st_size
        head = self._read_at(0, min(size, HEADER_SIZE), "the header")
        if size == 0:
            raise self._error("file is empty (0 bytes): not a memopt checkpoint")
        if not head.startswith(MAGIC):
            if MAGIC.startswith(head):
                raise self._error(f"file is truncated: only {size} bytes, inside the header")
            raise self._error(
                f"not a memopt checkpoint: it starts with {head[:8]!r}, expected magic {MAGIC!r}"
            )
        if size < _PREAMBLE_SIZE:
            raise self._error(f"file is truncated: only {size} bytes, inside the header")
        (version,) = struct.unpack_from("<I", head, len(MAGIC))
        if version > FORMAT_VERSION:
            raise self._error(
                f"checkpoint format version {version} is newer than this memopt-checkpoint "
                f"supports (format version {FORMAT_VERSION}); upgrade memopt-checkpoint to read it"
            )
        if version < 1:
            raise self._error(f"unknown checkpoint format version {version}: the header is corrupt")
        if size < HEADER_SIZE + TRAILER_SIZE:
            raise self._error(
                f"file is truncated: {size} bytes is shorter than the {HEADER_SIZE}-byte header "
                f"plus the {TRAILER_SIZE}-byte trailer"
            )
        _, _, reserved = _HEADER.unpack(head)
        if any(reserved):
            raise self._error("the header is corrupt: its reserved bytes are not zero")
        trailer = self._read_at(size - TRAILER_SIZE, TRAILER_SIZE, "the trailer")
        index_offset, index_len, index_crc, end = _TRAILER.unpack(trailer)
        if end != END_MAGIC.ljust(12, b"\0"):
            raise self._error(
                "file is truncated or was not completely written: it does not end with the "
                f"trailer (end magic {END_MAGIC!r})"
            )
        if index_offset < HEADER_SIZE or index_offset + index_len + TRAILER_SIZE != size:
            raise self._error(
                f"the trailer is corrupt: index at {index_offset} of length {index_len} does not "
                f"end where the {size}-byte file's trailer begins"
            )
        raw = self._read_at(index_offset, index_len, "the index")
        if zlib.crc32(raw) != index_crc:
            raise self._error("the index is corrupt: its CRC-32 does not match the trailer's")
        try:
            index = json.loads(
                raw.decode("utf-8"), parse_float=_finite_float, parse_constant=_no_constant
            )
        except RecursionError:  # '[' * 100000: json's parser recurses per level
            raise self._error(
                "the index is malformed: its JSON is nested too deeply to read"
            ) from None
        except _NonFiniteNumber as e:
            raise self._error(
                f"the index is malformed: it holds the number {e}, which is no finite float "
                "(the writer never writes NaN or Infinity)"
            ) from None
        except ValueError as e:
            raise self._error(f"the index is corrupt: not UTF-8 JSON ({e})") from None
        self._parse_index(index, version, index_offset)
        self.version = version

    def _parse_index(self, index: Any, version: int, limit: int) -> None:
        def bad(msg: str) -> CheckpointError:
            return self._error(f"the index is malformed: {msg}")

        if not isinstance(index, dict) or not {"format_version", "meta", "tensors"} <= set(index):
            raise bad("expected an object with format_version, meta and tensors")
        saved_version = index["format_version"]
        if type(saved_version) is not int or saved_version != version:  # not True, not 1.0
            raise bad(f"format_version {_show(saved_version)} != header version {version}")
        if not isinstance(index["meta"], dict) or not isinstance(index["tensors"], list):
            raise bad("meta must be an object and tensors a list")
        entries: dict[str, tuple[TensorEntry, int, int]] = {}
        end = HEADER_SIZE  # where the previous payload ended
        for i, e in enumerate(index["tensors"]):
            fields = ("key", "dtype", "shape", "offset", "nbytes", "crc32")
            if not isinstance(e, dict) or not set(fields) <= set(e):
                raise bad(f"tensor #{i} lacks one of {', '.join(fields)}")
            key, dtype, shape = e["key"], e["dtype"], e["shape"]
            offset, nbytes, crc = e["offset"], e["nbytes"], e["crc32"]
            if not isinstance(key, str) or key in entries:
                raise bad(f"tensor #{i} has a non-string or duplicate key {_show(key)}")
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate, escaped in the JSON
                raise bad(f"tensor #{i}'s key {_show(key)} is not valid UTF-8 text") from None
            # (a list or dict for the dtype was a bare TypeError: unhashable)
            if not isinstance(dtype, str) or dtype not in SUPPORTED_DTYPES:
                raise bad(f"{_show(key)} has unknown dtype {_show(dtype)}")
            ints = [offset, nbytes, crc, *shape] if isinstance(shape, list) else None
            if ints is None or any(type(v) is not int or v < 0 for v in ints):
                raise bad(
                    f"{_show(key)}: shape, offset, nbytes and crc32 must be non-negative ints"
                )
            if crc > 0xFFFFFFFF:
                raise bad(f"{_show(key)}: crc32 {crc} is no 32-bit checksum")
            problem = _shape_problem(shape)
            if problem is not None:
                raise bad(f"{_show(key)}: shape {_show(shape)} is no tensor's: {problem}")
            numel = 0 if 0 in shape else math.prod(shape)  # < 2**63: no big-int cost
            if nbytes != numel * _ITEMSIZE[dtype]:
                raise bad(
                    f"{_show(key)}: nbytes {nbytes} does not match {dtype} of shape {_show(shape)}"
                )
            if offset % ALIGNMENT or offset < HEADER_SIZE or offset + nbytes > limit:
                raise bad(f"{_show(key)}: payload [{offset}, {offset + nbytes}) is out of place")
            # the writer lays payloads out in the index's order: one that starts before the
            # previous one ended shares its bytes (two keys read the same tensor, and a load
            # read a payload once per key: more memory than the file holds)
            if offset < end:
                raise bad(
                    f"{_show(key)}: payload [{offset}, {offset + nbytes}) starts before the "
                    f"previous tensor's ended (at {end}): payloads overlap or are out of order"
                )
            end = offset + nbytes
            entries[key] = (TensorEntry(SUPPORTED_DTYPES[dtype], tuple(shape), nbytes), offset, crc)
        self.meta: dict[str, Any] = index["meta"]
        self._entries = entries

    def keys(self) -> list[str]:
        """The tensor keys, in the order they were written (also ``iter(reader)``)."""
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def _lookup(self, key: str) -> tuple[TensorEntry, int, int]:  # KeyError if absent
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {key!r} in this checkpoint") from None

    def entry(self, key: str) -> TensorEntry:
        """``(dtype, shape, nbytes)`` of ``key``, without reading its payload."""
        return self._lookup(key)[0]

    def load(self, key: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Read ``key`` into a new tensor on ``device``, after checking its CRC-32."""
        if self._file is None:
            raise ConfigError(f"{self.path}: the checkpoint reader is closed")
        (dtype, shape, nbytes), offset, crc = self._lookup(key)
        out = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        if nbytes:
            view = _byte_view(out)
            self._file.seek(offset)
            _read_exact(self._file, view, f"the payload of {key!r}")
            actual = 0
            for start in range(0, nbytes, _CHUNK_BYTES):
                actual = zlib.crc32(view[start : start + _CHUNK_BYTES], actual)
            del view
            if actual != crc:
                raise self._error(
                    f"tensor {key!r} is corrupt: CRC-32 {actual:#010x} of its {nbytes} bytes does "
                    f"not match the index's {crc:#010x}"
                )
        tensor = out.view(dtype).reshape(shape)
        return tensor if torch.device(device).type == "cpu" else tensor.to(device)

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``meta`` dict of the checkpoint at ``path`` (the file is validated, not loaded)."""
    with CheckpointReader(path) as reader:
        return reader.meta
