"""The checkpoint container: round trips, the documented byte layout, bad files, atomic saves.

Fault injection replaces one step of a save (a write, ``os.fsync``, ``os.replace``, opening
the temporary file) with one that fails, then checks that the error reaches the caller, the
previous checkpoint is byte-identical and no temporary file is left in the directory.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import stat
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from memopt_checkpoint import container
from memopt_checkpoint.container import (
    FORMAT_VERSION,
    SUPPORTED_DTYPES,
    CheckpointReader,
    CheckpointWriter,
    read_meta,
    write_checkpoint,
)
from memopt_core import atomic_write
from memopt_core.errors import CheckpointError, ConfigError

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as a signed int tensor of the same element size (NaN-safe)."""
    flat = t.reshape(-1)
    if t.dtype == torch.bool:
        return flat.to(torch.int8)
    return flat.view(_INT_OF_SIZE[t.element_size()])


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert a.device == b.device
    assert torch.equal(bits(a.cpu()), bits(b.cpu()))


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Every bit pattern is fair game: random bytes reinterpreted (NaNs, infs, -0.0, subnormals)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def listing(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def save_previous(path: Path) -> bytes:
    """A valid checkpoint at ``path`` that a failed save must leave byte-identical."""
    write_checkpoint(path, {"old": torch.arange(10, dtype=torch.float32)}, meta={"step": 1})
    return path.read_bytes()


def assert_previous_intact(path: Path, before: bytes) -> None:
    assert path.read_bytes() == before
    assert listing(path.parent) == {path.name}, "a temporary file was left behind"
    with CheckpointReader(path) as r:
        assert r.meta == {"step": 1}
        assert torch.equal(r.load("old"), torch.arange(10, dtype=torch.float32))


def parse_layout(data: bytes) -> tuple[int, dict]:
    """Decode a file by the module docstring's layout table alone: (version, index)."""
    magic, version, reserved = struct.unpack_from("<8sI52s", data, 0)
    assert magic == b"MEMOPTCK"
    assert reserved == bytes(52)
    index_offset, index_len, index_crc, end = struct.unpack_from("<QQI12s", data, len(data) - 32)
    assert end == b"MEMOPTEND\0\0\0"
    assert index_offset + index_len + 32 == len(data)
    raw = data[index_offset : index_offset + index_len]
    assert zlib.crc32(raw) == index_crc
    return version, json.loads(raw.decode("utf-8"))


# --------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("dtype_name", list(SUPPORTED_DTYPES))
def test_round_trip_every_dtype_bit_exact(tmp_path, dtype_name):
    dtype = SUPPORTED_DTYPES[dtype_name]
    tensors = {
        "matrix": random_tensor(dtype, (7, 13), seed=1),
        "odd": random_tensor(dtype, (3,), seed=2),  # 3 elements: the next payload needs padding
        "scalar": random_tensor(dtype, (), seed=3),
    }
    path = tmp_path / "ck.bin"
    write_checkpoint(path, tensors)
    with CheckpointReader(path) as r:
        assert r.keys() == ["matrix", "odd", "scalar"]
        for key, t in tensors.items():
            assert r.entry(key) == (dtype, tuple(t.shape), t.numel() * t.element_size())
            assert_same(r.load(key), t)


def test_special_bit_patterns_survive(tmp_path):
    nan_payload = torch.tensor([0x7FC1, 0xFFFF, 0x8000, 0x7F80, 0x0001], dtype=torch.int32)
    tensors = {
        "bf16": nan_payload.to(torch.int16).view(torch.bfloat16),  # NaNs with payload, -0, inf
        "f32": torch.tensor([-0.0, float("inf"), float("-inf"), 1e-45, float("nan")]),
        "e4m3": torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn),
        "e5m2": torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e5m2),
    }
    path = tmp_path / "ck.bin"
    write_checkpoint(path, tensors)
    with CheckpointReader(path) as r:
        for key, t in tensors.items():
            assert_same(r.load(key), t)


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("0-d", lambda: torch.tensor(3.25, dtype=torch.float64)),
        ("empty-1d", lambda: torch.empty(0, dtype=torch.bfloat16)),
        ("empty-3d", lambda: torch.empty(3, 0, 2, dtype=torch.int32)),
        ("transposed", lambda: torch.arange(24, dtype=torch.float32).reshape(4, 6).t()),
        ("strided", lambda: torch.arange(100, dtype=torch.int16)[3::7]),
        ("expanded", lambda: torch.arange(3, dtype=torch.int64).reshape(3, 1).expand(3, 5)),
        ("offset-view", lambda: torch.arange(50, dtype=torch.float16)[17:29].reshape(3, 4)),
        ("parameter", lambda: torch.nn.Parameter(torch.randn(4, 4))),
    ],
)
def test_round_trip_shapes_and_layouts(tmp_path, name, make):
    t = make()
    path = tmp_path / "ck.bin"
    write_checkpoint(path, [(name, t)])
    with CheckpointReader(path) as r:
        loaded = r.load(name)
    assert loaded.is_contiguous()
    assert not loaded.requires_grad
    assert_same(loaded, t.detach())


def test_round_trip_on_device(tmp_path, device):
    t = random_tensor(torch.bfloat16, (33, 17), seed=4).to(device)
    path = tmp_path / "ck.bin"
    write_checkpoint(path, {"w": t})
    with CheckpointReader(path) as r:
        assert_same(r.load("w", device=device), t)
        assert r.load("w").device.type == "cpu"


def test_loaded_tensors_are_independent(tmp_path):
    path = tmp_path / "ck.bin"
    write_checkpoint(path, {"a": torch.ones(4)})
    with CheckpointReader(path) as r:
        first = r.load("a")
        first.add_(1)
        assert torch.equal(r.load("a"), torch.ones(4))


def test_large_tensor_is_written_in_chunks_of_at_most_64_mib(tmp_path, monkeypatch):
    n = 70_000_000  # crosses the 64 MiB chunk size
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    sizes: list[int] = []
    real_write_all = container._write_all

    def recording_write_all(file, data):
        sizes.append(memoryview(data).nbytes)
        real_write_all(file, data)

    monkeypatch.setattr(container, "_write_all", recording_write_all)
    path = tmp_path / "big.bin"
    with CheckpointWriter(path) as w:
        sizes.clear()  # the header
        w.add("big", t)
        payload_writes = list(sizes)
    assert payload_writes == [64 << 20, n - (64 << 20)]
    with CheckpointReader(path) as r:
        assert torch.equal(r.load("big"), t)


def test_small_chunk_size_streams_and_round_trips(tmp_path, monkeypatch):
    """With 1000-byte chunks, no write is larger and every payload still reads back exactly."""
    monkeypatch.setattr(container, "_CHUNK_BYTES", 1000)
    sizes: list[int] = []
    real_write_all = container._write_all

    def recording_write_all(file, data):
        sizes.append(memoryview(data).nbytes)
        real_write_all(file, data)

    monkeypatch.setattr(container, "_write_all", recording_write_all)
    tensors = {
        "f32": random_tensor(torch.float32, (1001,), seed=6),  # 4004 bytes: 5 chunks
        "bf16-t": random_tensor(torch.bfloat16, (40, 30), seed=7).t(),  # non-contiguous
        "u8": random_tensor(torch.uint8, (1000,), seed=8),  # exactly one chunk
    }
    path = tmp_path / "ck.bin"
    with CheckpointWriter(path) as w:
        for key, t in tensors.items():
            sizes.clear()
            w.add(key, t)
            assert sizes, key
            assert max(sizes) <= 1000, (key, sizes)
    with CheckpointReader(path) as r:
        for key, t in tensors.items():
            assert_same(r.load(key), t)


def test_layout_matches_the_documented_format(tmp_path):
    tensors = {
        "a": torch.arange(3, dtype=torch.uint8),
        "b": torch.arange(5, dtype=torch.float64),
        "empty": torch.empty(0, 2),
        "c": torch.tensor(True),
    }
    path = tmp_path / "ck.bin"
    write_checkpoint(path, tensors, meta={"step": 7})
    data = path.read_bytes()
    version, index = parse_layout(data)
    assert version == FORMAT_VERSION == index["format_version"] == 1
    assert index["meta"] == {"step": 7}
    assert [e["key"] for e in index["tensors"]] == list(tensors)
    end = 64
    for e, t in zip(index["tensors"], tensors.values(), strict=True):
        assert e["dtype"] == str(t.dtype).removeprefix("torch.")
        assert e["shape"] == list(t.shape)
        assert e["offset"] % 64 == 0
        assert e["offset"] >= end
        payload = data[e["offset"] : e["offset"] + e["nbytes"]]
        assert e["nbytes"] == t.numel() * t.element_size() == len(payload)
        assert zlib.crc32(payload) == e["crc32"]
        assert payload == bytes(t.reshape(-1).view(torch.uint8).tolist())  # raw, C order
        end = e["offset"] + e["nbytes"]
    assert data[:64] == b"MEMOPTCK" + struct.pack("<I", 1) + bytes(52)


# --------------------------------------------------------------------------------------------
# meta and the API


def test_meta_round_trip(tmp_path):
    meta = {
        "step": 12345,
        "lr": 3e-4,
        "betas": (0.9, 0.999),  # a tuple comes back as a list
        "name": "adamw-bf16 ✓",
        "flags": {"fused": True, "capturable": False, "clip": None},
        "nested": [[1, 2], {"x": -0.0}],
        "big": 2**70,
    }
    path = tmp_path / "ck.bin"
    write_checkpoint(path, {}, meta=meta)
    expected = json.loads(json.dumps(meta))
    assert read_meta(path) == expected
    assert read_meta(path)["betas"] == [0.9, 0.999]
    with CheckpointReader(path) as r:
        assert r.meta == expected
        assert r.keys() == []
        assert len(r) == 0


def test_meta_is_snapshotted_at_open(tmp_path):
    meta = {"step": 1}
    path = tmp_path / "ck.bin"
    with CheckpointWriter(path, meta):
        meta["step"] = 2
    assert read_meta(path) == {"step": 1}


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ([1, 2], "dict"),
        ({"x": {1, 2}}, r"meta\['x'\] is a set"),
        ({"x": [float("nan")]}, r"meta\['x'\]\[0\]"),
        ({"x": {3: "a"}}, "keys must be str"),
        ({"t": torch.ones(1)}, "Tensor"),
        # lone surrogates (os.fsdecode of a file name that is not UTF-8): a bare
        # UnicodeEncodeError at the commit, after every tensor was written
        (
            {"src": ["data_\udcff.bin"]},
            r"meta\['src'\]\[0\] \('data_\\udcff.bin'\) is not valid UTF-8",
        ),
        ({"x": {"\udcff": 1}}, r"meta\['x'\] key .* is not valid UTF-8"),
    ],
)
def test_bad_meta_is_a_config_error_before_any_file_is_made(tmp_path, meta, match):
    with pytest.raises(ConfigError, match=match):
        CheckpointWriter(tmp_path / "ck.bin", meta)
    assert listing(tmp_path) == set()


def test_keys_contains_entry_and_missing_key(tmp_path):
    path = tmp_path / "ck.bin"
    write_checkpoint(path, [("z", torch.zeros(2, 3, dtype=torch.int16)), ("a", torch.ones(1))])
    with CheckpointReader(path) as r:
        assert r.keys() == ["z", "a"]  # written order, not sorted
        assert list(r) == ["z", "a"]
        assert len(r) == 2
        assert "z" in r
        assert "nope" not in r
        dtype, shape, nbytes = r.entry("z")
        assert (dtype, shape, nbytes) == (torch.int16, (2, 3), 12)
        with pytest.raises(KeyError, match="nope"):
            r.load("nope")
        with pytest.raises(KeyError, match="nope"):
            r.entry("nope")


def test_write_checkpoint_takes_a_generator(tmp_path):
    path = tmp_path / "ck.bin"
    write_checkpoint(path, ((f"t{i}", torch.full((i,), float(i))) for i in range(4)))
    with CheckpointReader(path) as r:
        assert r.keys() == ["t0", "t1", "t2", "t3"]
        assert torch.equal(r.load("t3"), torch.full((3,), 3.0))


def test_temp_file_lives_beside_the_target_until_commit(tmp_path):
    path = tmp_path / "ck.bin"
    w = CheckpointWriter(path)
    w.add("a", torch.ones(3))
    (name,) = listing(tmp_path)
    assert name.startswith(".ck.bin.tmp-")
    assert not path.exists()
    w.commit()
    assert listing(tmp_path) == {"ck.bin"}


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_a_rewrite_keeps_the_files_permission_bits(tmp_path):
    """As ``open(path, "wb")`` would: a private checkpoint stays private (while the new one is
    written too); a new file gets open()'s mode."""
    path = tmp_path / "ck.bin"
    write_checkpoint(path, {"a": torch.ones(3)})
    os.chmod(path, 0o600)
    w = CheckpointWriter(path)
    w.add("b", torch.zeros(2))
    (temp,) = (tmp_path / n for n in listing(tmp_path) if n.startswith(".ck.bin.tmp-"))
    assert stat.S_IMODE(os.stat(temp).st_mode) == 0o600
    w.commit()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with CheckpointReader(path) as r:
        assert r.keys() == ["b"]
    umask = os.umask(0o022)
    os.umask(umask)
    write_checkpoint(tmp_path / "new.bin", {"a": torch.ones(3)})
    assert stat.S_IMODE(os.stat(tmp_path / "new.bin").st_mode) == 0o666 & ~umask


def test_a_missing_folder_is_named(tmp_path):
    """open() named the hidden temporary file (``run/.ck.bin.tmp-...``), not the missing folder;
    nothing is created."""
    path = tmp_path / "run" / "ck.bin"
    with pytest.raises(FileNotFoundError, match=r"the folder of '.*run/ck\.bin' does not exist"):
        write_checkpoint(path, {"a": torch.ones(3)})
    assert listing(tmp_path) == set()


def test_a_directory_at_the_path_is_refused_before_writing(tmp_path):
    """open(path, "wb") refuses a directory at once; the rename refused it only after every
    tensor was written."""
    (tmp_path / "ck.bin").mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory"):
        write_checkpoint(tmp_path / "ck.bin", {"a": torch.ones(3)})
    assert listing(tmp_path) == {"ck.bin"}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_a_path_that_is_no_regular_file_is_refused_before_writing(tmp_path):
    """The rename replaced whatever the path named with a regular file: a FIFO here, and run as
    root, a device such as /dev/null."""
    os.mkfifo(tmp_path / "ck.bin")
    with pytest.raises(OSError, match="not a regular file"):
        write_checkpoint(tmp_path / "ck.bin", {"a": torch.ones(3)})
    assert stat.S_ISFIFO(os.stat(tmp_path / "ck.bin").st_mode)
    assert listing(tmp_path) == {"ck.bin"}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_reading_a_fifo_is_refused_without_waiting(tmp_path):
    """open(path, "rb") of a FIFO waits for a writer: load() and read_meta() froze on a stale
    pipe at a checkpoint's path. An alarm turns a wait into this test's failure."""
    import signal

    os.mkfifo(tmp_path / "ck.bin")

    def waited(*_):
        raise TimeoutError("the reader waited on the FIFO")

    old = signal.signal(signal.SIGALRM, waited)
    signal.alarm(10)
    try:
        with pytest.raises(CheckpointError, match=r"ck\.bin: not a regular file"):
            CheckpointReader(tmp_path / "ck.bin")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError, match="Is a directory"):
        CheckpointReader(tmp_path / "dir")


@pytest.mark.skipif(
    os.name != "posix" or os.geteuid() == 0, reason="POSIX permissions, not enforced for root"
)
def test_a_read_only_checkpoint_is_not_replaced(tmp_path):
    """A checkpoint made read-only to protect it was replaced by the rename, where
    open(path, "wb") (torch.save) refuses."""
    path = tmp_path / "ck.bin"
    write_checkpoint(path, {"a": torch.ones(3)})
    os.chmod(path, 0o444)
    with pytest.raises(PermissionError, match="not writable"):
        write_checkpoint(path, {"b": torch.zeros(2)})
    with CheckpointReader(path) as r:
        assert r.keys() == ["a"]


@pytest.mark.skipif(os.name != "posix", reason="symlinks")
def test_a_symlink_is_written_through_to_its_target(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    target = store / "ck.bin"
    write_checkpoint(target, {"old": torch.ones(3)})
    link = tmp_path / "latest"
    link.symlink_to(target)
    write_checkpoint(link, {"new": torch.zeros(2)})
    assert link.is_symlink()
    assert os.readlink(link) == str(target)
    with CheckpointReader(target) as r:
        assert r.keys() == ["new"]
    assert listing(store) == {"ck.bin"}  # the temp file was made (and renamed) beside it
    assert listing(tmp_path) == {"store", "latest"}
    # a dangling link: its target is created, as open() would
    (tmp_path / "dangling").symlink_to(store / "later.bin")
    write_checkpoint(tmp_path / "dangling", {"x": torch.ones(1)})
    assert (tmp_path / "dangling").is_symlink()
    with CheckpointReader(store / "later.bin") as r:
        assert r.keys() == ["x"]


def test_commit_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync-file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("replace")
        real_replace(src, dst)

    if not Path("/proc/self/fd").is_dir() or not hasattr(os, "O_DIRECTORY"):
        pytest.skip("needs /proc/self/fd and O_DIRECTORY (Linux)")
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_checkpoint(tmp_path / "ck.bin", {"a": torch.ones(2)})
    assert events == ["fsync-file", "replace", "fsync-dir"]


def test_duplicate_key_is_a_config_error_and_the_writer_stays_usable(tmp_path):
    path = tmp_path / "ck.bin"
    with CheckpointWriter(path) as w:
        w.add("a", torch.ones(2))
        with pytest.raises(ConfigError, match="duplicate checkpoint key 'a'"):
            w.add("a", torch.zeros(2))
        w.add("b", torch.zeros(1))
    with CheckpointReader(path) as r:
        assert r.keys() == ["a", "b"]
        assert torch.equal(r.load("a"), torch.ones(2))


@pytest.mark.parametrize(
    ("key", "tensor", "match"),
    [
        ("c", torch.zeros(2, dtype=torch.complex64), "'c': dtype torch.complex64"),
        ("u", torch.zeros(2, dtype=torch.float8_e4m3fnuz), "'u': dtype torch.float8_e4m3fnuz"),
        ("s", torch.eye(3).to_sparse(), "dense"),
        ("m", torch.empty(3, device="meta"), "meta device"),
        ("n", [1.0, 2.0], "expected a torch.Tensor"),
        (3, torch.zeros(1), "keys must be str"),
        ("\ud800", torch.zeros(1), "UTF-8"),
    ],
)
def test_bad_add_is_a_config_error_and_writes_nothing(tmp_path, key, tensor, match):
    path = tmp_path / "ck.bin"
    w = CheckpointWriter(path)
    size = os.path.getsize(next(tmp_path.iterdir()))
    with pytest.raises(ConfigError, match=match):
        w.add(key, tensor)
    assert os.path.getsize(next(tmp_path.iterdir())) == size
    w.commit()
    with CheckpointReader(path) as r:
        assert r.keys() == []


def test_writer_is_closed_after_commit_and_after_abort(tmp_path):
    path = tmp_path / "ck.bin"
    w = CheckpointWriter(path)
    w.add("a", torch.ones(1))
    w.commit()
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="already committed"):
        w.add("b", torch.ones(1))
    with pytest.raises(ConfigError, match="already committed"):
        w.commit()
    w.abort()  # a no-op: a committed checkpoint is not taken back
    assert path.read_bytes() == before

    w2 = CheckpointWriter(path)
    w2.abort()
    w2.abort()  # idempotent
    with pytest.raises(ConfigError, match="already aborted"):
        w2.add("b", torch.ones(1))
    assert path.read_bytes() == before
    assert listing(tmp_path) == {"ck.bin"}


def test_commit_inside_the_with_block_is_not_repeated(tmp_path):
    path = tmp_path / "ck.bin"
    with CheckpointWriter(path) as w:
        w.add("a", torch.ones(1))
        w.commit()
    assert read_meta(path) == {}


def test_reader_after_close(tmp_path):
    path = tmp_path / "ck.bin"
    write_checkpoint(path, {"a": torch.ones(1)})
    r = CheckpointReader(path)
    r.close()
    r.close()
    with pytest.raises(ConfigError, match="closed"):
        r.load("a")


# --------------------------------------------------------------------------------------------
# bad files


@pytest.fixture
def sample(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {
        "first": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "second": random_tensor(torch.bfloat16, (5, 7), seed=9),
        "flag": torch.tensor(True),
    }
    path = tmp_path / "ck.bin"
    write_checkpoint(path, tensors, meta={"step": 3})
    return path, tensors


def _cut_points(size: int, index_offset: int) -> list[int]:
    return sorted(
        {1, 4, 8, 10, 12, 40, 63, 64, 65, 100, index_offset - 1, index_offset}
        | {index_offset + 5, size - 32, size - 31, size - 12, size - 1}
    )


def test_truncated_file_at_every_cut_point_is_a_checkpoint_error(sample):
    path, _ = sample
    data = path.read_bytes()
    index_offset = struct.unpack_from("<Q", data, len(data) - 32)[0]
    cuts = _cut_points(len(data), index_offset)
    assert len(cuts) >= 15
    for cut in cuts:
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated") as info:
            CheckpointReader(path)
        assert str(path) in str(info.value), cut


def test_empty_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        CheckpointReader(path)


def test_file_truncated_after_open_fails_on_load(sample):
    path, _ = sample
    with CheckpointReader(path) as r:
        os.truncate(path, 64 + 20)  # inside the first payload
        with pytest.raises(CheckpointError, match=r"truncated.*'first'"):
            r.load("first")


@pytest.mark.parametrize(
    "content",
    [
        b"PK\x03\x04" + bytes(range(256)) * 4,  # a zip, e.g. torch.save output
        b"not a checkpoint\n",
        bytes(i % 256 for i in range(7, 1000 + 7)),
        b"MEMOPTCX" + bytes(200),
    ],
)
def test_not_a_checkpoint(tmp_path, content):
    path = tmp_path / "other.bin"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="not a memopt checkpoint"):
        CheckpointReader(path)


def test_random_bytes_are_not_a_checkpoint(tmp_path):
    g = torch.Generator().manual_seed(10)
    for n in (3, 50, 5000):
        path = tmp_path / f"rand{n}.bin"
        path.write_bytes(bytes(torch.randint(0, 256, (n,), generator=g).tolist()))
        with pytest.raises(CheckpointError):
            CheckpointReader(path)


def test_a_torch_save_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "pt.bin"
    torch.save({"a": torch.ones(2)}, path)
    with pytest.raises(CheckpointError, match="not a memopt checkpoint"):
        CheckpointReader(path)


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        CheckpointReader(tmp_path / "nope.bin")


def test_flipped_payload_byte_names_the_key_on_load(sample):
    path, tensors = sample
    data = bytearray(path.read_bytes())
    _, index = parse_layout(bytes(data))
    second = next(e for e in index["tensors"] if e["key"] == "second")
    data[second["offset"] + 11] ^= 0x10
    path.write_bytes(bytes(data))
    with CheckpointReader(path) as r:  # opening checks only the index
        assert torch.equal(r.load("first"), tensors["first"])
        with pytest.raises(CheckpointError, match="'second' is corrupt: CRC-32"):
            r.load("second")
        assert r.load("flag").item() is True


def test_flipped_index_byte_fails_at_open(sample):
    path, _ = sample
    data = bytearray(path.read_bytes())
    index_offset = struct.unpack_from("<Q", data, len(data) - 32)[0]
    data[index_offset + 3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="index is corrupt: its CRC-32"):
        CheckpointReader(path)


def test_every_single_byte_flip_is_detected_outside_padding(sample):
    """Flip each byte of a small file in turn: open + load of every key must fail, unless the
    byte is alignment padding between payloads (documented as unchecked) and nothing changes."""
    path, tensors = sample
    data = path.read_bytes()
    _, index = parse_layout(data)
    covered = set(range(64))
    for e in index["tensors"]:
        covered |= set(range(e["offset"], e["offset"] + e["nbytes"]))
    index_offset = struct.unpack_from("<Q", data, len(data) - 32)[0]
    covered |= set(range(index_offset, len(data)))
    undetected = []
    for pos in range(len(data)):
        flipped = bytearray(data)
        flipped[pos] ^= 0x04
        path.write_bytes(bytes(flipped))
        try:
            with CheckpointReader(path) as r:
                loaded = {key: r.load(key) for key in r}
        except CheckpointError:
            continue
        undetected.append(pos)
        assert loaded.keys() == tensors.keys()
        for key, t in tensors.items():
            assert_same(loaded[key], t)
    assert undetected
    assert not covered & set(undetected), sorted(covered & set(undetected))


def test_newer_format_version_is_refused_naming_both_versions(sample):
    path, _ = sample
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, FORMAT_VERSION + 1)
    path.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError,
        match=r"format version 2 is newer .* \(format version 1\); upgrade memopt-checkpoint",
    ):
        CheckpointReader(path)


def test_newer_format_is_refused_before_its_layout_is_checked(tmp_path):
    """A future version may change everything after the preamble: the message stays 'newer'."""
    path = tmp_path / "future.bin"
    path.write_bytes(b"MEMOPTCK" + struct.pack("<I", 7) + b"anything")
    with pytest.raises(CheckpointError, match="version 7 is newer"):
        CheckpointReader(path)
    with pytest.raises(CheckpointError, match="version 7 is newer"):
        read_meta(path)


def test_version_zero_is_corrupt(sample):
    path, _ = sample
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, 0)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="unknown checkpoint format version 0"):
        CheckpointReader(path)


@pytest.mark.parametrize("junk", [b"\0" * 10, b"junk"])
def test_trailing_garbage_is_detected(sample, junk):
    path, _ = sample
    data = path.read_bytes()
    path.write_bytes(data + junk)
    with pytest.raises(CheckpointError, match="truncated"):  # the end magic is gone
        CheckpointReader(path)
    path.write_bytes(data[:-32] + junk + data[-32:])  # a valid trailer, but not where it says
    with pytest.raises(CheckpointError, match="trailer is corrupt"):
        CheckpointReader(path)


def _rewrite_index(path: Path, edit) -> None:
    """Replace the index with ``edit(index)``, keeping the checksums right (a writer bug)."""
    data = path.read_bytes()
    _, index = parse_layout(data)
    index_offset = struct.unpack_from("<Q", data, len(data) - 32)[0]
    raw = json.dumps(edit(index)).encode()
    trailer = struct.pack("<QQI12s", index_offset, len(raw), zlib.crc32(raw), b"MEMOPTEND")
    path.write_bytes(data[:index_offset] + raw + trailer)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda ix: [], "expected an object"),
        (lambda ix: {**ix, "format_version": 2}, "format_version 2 != header version 1"),
        (lambda ix: {**ix, "tensors": ix["tensors"] * 2}, "duplicate key"),
        (
            lambda ix: {**ix, "tensors": [{**ix["tensors"][0], "dtype": "complex64"}]},
            "unknown dtype",
        ),
        (lambda ix: {**ix, "tensors": [{**ix["tensors"][0], "nbytes": 4}]}, "does not match"),
        (lambda ix: {**ix, "tensors": [{**ix["tensors"][0], "offset": 65}]}, "out of place"),
        (lambda ix: {**ix, "tensors": [{**ix["tensors"][0], "offset": 10**9}]}, "out of place"),
        (lambda ix: {**ix, "tensors": [{**ix["tensors"][0], "shape": [-3, -4]}]}, "non-negative"),
        # a bad-input hunt (2026-12-08): a dtype that is a list or a dict was a bare TypeError
        # (unhashable); the rest were taken
        (lambda ix: {**ix, "tensors": [{**ix["tensors"][0], "dtype": []}]}, r"unknown dtype \[\]"),
        (lambda ix: {**ix, "tensors": [{**ix["tensors"][0], "dtype": {}}]}, r"unknown dtype \{\}"),
        (lambda ix: {**ix, "format_version": True}, "format_version True != header version 1"),
        (lambda ix: {**ix, "format_version": 1.0}, "format_version 1.0 != header version 1"),
        (
            lambda ix: {**ix, "tensors": [{**ix["tensors"][0], "crc32": 1 << 32}]},
            "crc32 4294967296 is no 32-bit checksum",
        ),
        (
            lambda ix: {**ix, "tensors": [{**ix["tensors"][0], "key": "a\ud800"}]},
            r"key 'a\\ud800' is not valid UTF-8",
        ),
    ],
)
def test_malformed_index_is_a_checkpoint_error(sample, edit, match):
    path, _ = sample
    _rewrite_index(path, edit)
    with pytest.raises(CheckpointError, match=match):
        CheckpointReader(path)


def _open_and_load_all(path: Path) -> None:
    with CheckpointReader(path) as r:
        for key in r:
            r.load(key)


@pytest.mark.parametrize(
    "shape",
    [[1 << 63, 0], [0, 1 << 63], [1 << 64, 0], [1 << 62, 1 << 62, 0], [0, (1 << 63) - 1, 2]],
)
def test_a_shape_torch_cannot_build_is_a_checkpoint_error(sample, shape):
    """An empty tensor's sizes are not bounded by the file: a size of 2**63 passed the index
    checks and the load's reshape raised a bare TypeError, a product of sizes past int64 a
    RuntimeError (a bad-input hunt, 2026-12-08). Now the index is refused when it is read."""
    path, _ = sample

    def edit(ix):
        ix["tensors"][0].update(shape=shape, nbytes=0)
        return ix

    _rewrite_index(path, edit)
    with pytest.raises(CheckpointError, match=r"'first': shape \[.*\] is no tensor's: "):
        _open_and_load_all(path)
    with pytest.raises(CheckpointError, match="is no tensor's"):
        read_meta(path)


def test_the_largest_empty_shape_torch_builds_round_trips(tmp_path):
    big = torch.empty(((1 << 63) - 1, 0), dtype=torch.float32, device="cpu")
    write_checkpoint(tmp_path / "ck.bin", {"big": big})
    with CheckpointReader(tmp_path / "ck.bin") as r:
        assert r.load("big").shape == big.shape


def test_the_writer_refuses_an_empty_tensor_the_reader_would_refuse(tmp_path):
    t = torch.empty(0, dtype=torch.uint8, device="cpu").reshape(0, 1 << 62, 1 << 62)
    with (
        CheckpointWriter(tmp_path / "ck.bin") as w,
        pytest.raises(ConfigError, match=r"'t' of shape .* multiply past 2\*\*63 - 1"),
    ):
        w.add("t", t)  # (the writer stays usable: the commit writes an empty file)
    with CheckpointReader(tmp_path / "ck.bin") as r:
        assert r.keys() == []


def test_a_shape_of_many_dims_is_refused_without_multiplying_them_all(sample):
    """20,000 sizes of 2**62: the check multiplied them all (a product of 1.2 million bits: a
    second here, 10 s at 60,000 sizes, quadratic in the index size) and put the whole shape in
    its message. It stops at the first size that passes int64 and shows a few."""
    path, _ = sample
    _rewrite_index(
        path, lambda ix: {**ix, "tensors": [{**ix["tensors"][0], "shape": [1 << 62] * 20000}]}
    )
    with pytest.raises(CheckpointError, match="multiply past") as info:
        CheckpointReader(path)
    assert len(str(info.value)) < 400


def test_payloads_that_overlap_or_are_out_of_order_are_refused(tmp_path):
    """Two keys of one size, their offsets and checksums swapped (or both pointing at one
    payload): every check passed and each loaded the other's values, silently (a bad-input
    hunt, 2026-12-08). The writer lays payloads out in the index's order, so an index whose
    payloads go back is refused."""
    path = tmp_path / "ck.bin"
    write_checkpoint(path, {"a": torch.zeros(16, device="cpu"), "b": torch.ones(16, device="cpu")})

    def swapped(ix):
        a, b = ix["tensors"]
        a["offset"], b["offset"] = b["offset"], a["offset"]
        a["crc32"], b["crc32"] = b["crc32"], a["crc32"]
        return ix

    def shared(ix):
        a, b = ix["tensors"]
        b.update(offset=a["offset"], crc32=a["crc32"])
        return ix

    original = path.read_bytes()
    for edit in (swapped, shared):
        path.write_bytes(original)
        _rewrite_index(path, edit)
        with pytest.raises(CheckpointError, match=r"'b': payload .* starts before the previous"):
            _open_and_load_all(path)


def test_an_index_nested_too_deeply_is_a_checkpoint_error(sample):
    """json's parser recurses per level: a bare RecursionError (a bad-input hunt, 2026-12-08)."""
    path, _ = sample
    data = path.read_bytes()
    index_offset = struct.unpack_from("<Q", data, len(data) - 32)[0]
    raw = b"[" * 100_000 + b"]" * 100_000
    trailer = struct.pack("<QQI12s", index_offset, len(raw), zlib.crc32(raw), b"MEMOPTEND")
    path.write_bytes(data[:index_offset] + raw + trailer)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        read_meta(path)


@pytest.mark.parametrize("number", [b"NaN", b"-Infinity", b"1e999"])
def test_a_number_the_writer_never_writes_is_a_checkpoint_error(sample, number):
    """The writer refuses inf and NaN in its meta, and JSON has none: an index edited to hold
    one handed it on (1e999 reads as inf)."""
    path, _ = sample
    data = path.read_bytes()
    _, index = parse_layout(data)
    index["meta"] = {"lr": 12345.5}
    index_offset = struct.unpack_from("<Q", data, len(data) - 32)[0]
    raw = json.dumps(index).encode().replace(b"12345.5", number)
    trailer = struct.pack("<QQI12s", index_offset, len(raw), zlib.crc32(raw), b"MEMOPTEND")
    path.write_bytes(data[:index_offset] + raw + trailer)
    with pytest.raises(CheckpointError, match=f"holds the number {number.decode()}, which is no"):
        read_meta(path)


# --------------------------------------------------------------------------------------------
# atomic saves under faults


def test_enospc_in_the_middle_of_add_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ck.bin"
    before = save_previous(path)
    monkeypatch.setattr(container, "_CHUNK_BYTES", 256)
    real_write_all = container._write_all
    calls = {"n": 0}

    def filling_disk(file, data):
        calls["n"] += 1
        if calls["n"] == 6:  # header, "a"'s payload, padding, 2 chunks of "b", then full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write_all(file, data)

    monkeypatch.setattr(container, "_write_all", filling_disk)

    def save():
        with CheckpointWriter(path) as w:
            w.add("a", torch.ones(3))
            w.add("b", torch.zeros(1000))  # 4000 bytes: fails after 512 of them

    with pytest.raises(OSError, match="No space") as info:
        save()
    assert info.value.errno == errno.ENOSPC
    assert calls["n"] == 6
    assert_previous_intact(path, before)


def test_a_failed_add_aborts_the_writer_without_a_with_block(tmp_path, monkeypatch):
    path = tmp_path / "ck.bin"
    before = save_previous(path)
    w = CheckpointWriter(path)
    w.add("a", torch.ones(3))

    def full(file, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(container, "_write_all", full)
    with pytest.raises(OSError, match="No space"):
        w.add("b", torch.ones(3))
    assert_previous_intact(path, before)  # the temp file is gone already
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="already aborted"):
        w.add("c", torch.ones(3))
    with pytest.raises(ConfigError, match="already aborted"):
        w.commit()
    assert_previous_intact(path, before)


def test_fsync_failure_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ck.bin"
    before = save_previous(path)

    def failing_fsync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        write_checkpoint(path, {"new": torch.ones(5)}, meta={"step": 2})
    monkeypatch.undo()
    assert_previous_intact(path, before)


@pytest.mark.parametrize(
    "error",
    [PermissionError(errno.EACCES, "Permission denied"), OSError(errno.EXDEV, "Cross-device")],
)
def test_replace_failure_keeps_the_previous_checkpoint(tmp_path, monkeypatch, error):
    path = tmp_path / "ck.bin"
    before = save_previous(path)

    def failing_replace(src, dst):
        assert Path(src).parent == Path(dst).parent == tmp_path
        raise error

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(type(error)) as info:
        write_checkpoint(path, {"new": torch.ones(5)}, meta={"step": 2})
    assert info.value is error
    monkeypatch.undo()
    assert_previous_intact(path, before)


def test_permission_error_opening_the_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "ck.bin"
    before = save_previous(path)
    real_open = open

    def guarded_open(file, *args, **kwargs):
        if ".tmp-" in os.fspath(file):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(atomic_write, "open", guarded_open, raising=False)
    # the message named the hidden temporary file (``.ck.bin.tmp-...``), not the folder
    with pytest.raises(PermissionError, match=r"cannot create a file in the folder of .*ck\.bin"):
        write_checkpoint(path, {"new": torch.ones(5)})
    monkeypatch.undo()
    assert_previous_intact(path, before)


@pytest.mark.parametrize("name", ["c" * 250, "ü" * 127])
def test_names_up_to_the_file_systems_limit(tmp_path, name):
    """The temporary name was the target's plus 18 bytes, so names of 238-255 bytes, which
    torch.save writes, failed with 'File name too long'."""
    path = tmp_path / name
    write_checkpoint(path, {"a": torch.ones(3)})
    write_checkpoint(path, {"b": torch.zeros(2)})  # and replaced
    with CheckpointReader(path) as r:
        assert r.keys() == ["b"]
    assert listing(tmp_path) == {name}


def test_read_only_directory(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    path = directory / "ck.bin"
    before = save_previous(path)
    directory.chmod(0o555)
    try:
        probe = directory / "probe"
        try:
            probe.write_bytes(b"")
        except PermissionError:
            pass
        else:
            probe.unlink()
            pytest.skip("chmod does not stop writes here (running as root?)")
        with pytest.raises(PermissionError):
            write_checkpoint(path, {"new": torch.ones(5)})
    finally:
        directory.chmod(0o755)
    assert_previous_intact(path, before)


def test_exception_inside_the_with_block_aborts(tmp_path):
    path = tmp_path / "ck.bin"
    before = save_previous(path)

    def save():
        with CheckpointWriter(path) as w:
            w.add("new", torch.ones(5))
            raise RuntimeError("training blew up")

    with pytest.raises(RuntimeError, match="training blew up"):
        save()
    assert_previous_intact(path, before)


def test_error_in_a_generator_aborts_the_first_save(tmp_path):
    def tensors():
        yield "a", torch.ones(2)
        raise RuntimeError("producer failed")

    path = tmp_path / "ck.bin"
    with pytest.raises(RuntimeError, match="producer failed"):
        write_checkpoint(path, tensors())
    assert listing(tmp_path) == set()


def test_a_dropped_writer_removes_its_temp_file(tmp_path):
    w = CheckpointWriter(tmp_path / "ck.bin")
    w.add("a", torch.ones(2))
    assert len(listing(tmp_path)) == 1
    del w
    gc.collect()
    assert listing(tmp_path) == set()


_FSIZE_SCRIPT = """
import errno, resource, signal, sys, torch
from memopt_checkpoint.container import write_checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    write_checkpoint(sys.argv[1], {"a": torch.ones(1000), "b": torch.zeros(1 << 20)})
except OSError as e:  # the checkpoint's path is named (a bare "File too large" before)
    named = any(sys.argv[1] in note for note in getattr(e, "__notes__", ())) or (
        sys.version_info < (3, 11) and e.filename == sys.argv[1]  # no notes before 3.11
    )
    sys.exit(0 if e.errno == errno.EFBIG and named else 3)
sys.exit(4)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE/SIGXFSZ: Linux")
def test_a_real_write_failure_keeps_the_previous_checkpoint(tmp_path):
    """No monkeypatching: the kernel refuses writes past 256 KiB (EFBIG) mid-payload."""
    path = tmp_path / "ck.bin"
    before = save_previous(path)
    src = str(Path(container.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-B", "-W", "ignore", "-c", _FSIZE_SCRIPT, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert_previous_intact(path, before)
