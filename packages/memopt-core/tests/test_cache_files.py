"""memopt_core.cache_files: where memopt's cache files live, and reads that never hang or raise
and writes that never replace what is not a regular file (ApexW's and AdamBridge's caches both
go through it)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from memopt_core import cache_files

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")


def test_cache_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv(cache_files.CACHE_DIR_ENV, raising=False)
    assert cache_files.cache_dir() == tmp_path / "home" / ".cache" / "memopt"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_files.cache_dir() == tmp_path / "xdg" / "memopt"
    monkeypatch.setenv(cache_files.CACHE_DIR_ENV, "~/mine")
    assert cache_files.cache_dir() == tmp_path / "home" / "mine"
    monkeypatch.setenv(cache_files.CACHE_DIR_ENV, "")  # empty: as if unset
    assert cache_files.cache_dir() == tmp_path / "xdg" / "memopt"
    # a relative XDG_CACHE_HOME is ignored (the XDG spec): it named a folder under the cwd
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache_files.cache_dir() == tmp_path / "home" / ".cache" / "memopt"


def test_cache_dir_without_a_home_raises_runtime_error(monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv(cache_files.CACHE_DIR_ENV, raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.raises(RuntimeError, match="home directory"):
        cache_files.cache_dir()


def test_round_trip_creates_the_folder(tmp_path):
    path = tmp_path / "a" / "b" / "c.json"
    cache_files.write_json(path, {"k": [1, 2.5, "x"]})
    assert cache_files.read_json(path) == {"k": [1, 2.5, "x"]}
    assert [p.name for p in path.parent.iterdir()] == ["c.json"]  # no temporary file left


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b"\xff\xfe not utf-8", b"[" * 100_000 + b"]" * 100_000, b"null"],
    ids=["empty", "truncated", "not-utf8", "deeply-nested", "null"],
)
def test_malformed_files_read_as_none(tmp_path, content):
    path = tmp_path / "c.json"
    path.write_bytes(content)
    assert cache_files.read_json(path) is None


def test_absent_too_large_and_directory_read_as_none(tmp_path):
    assert cache_files.read_json(tmp_path / "absent.json") is None
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"x": "y" * 100}))
    assert cache_files.read_json(big, max_bytes=50) is None
    assert cache_files.read_json(big) == {"x": "y" * 100}
    assert cache_files.read_json(tmp_path) is None


@needs_fifo
def test_a_fifo_is_neither_read_nor_replaced(tmp_path):
    fifo = tmp_path / "c.json"
    os.mkfifo(fifo)
    assert cache_files.read_json(fifo) is None  # would block forever if opened
    with pytest.raises(OSError, match="not a regular file"):
        cache_files.write_json(fifo, {"k": 1})
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]


def test_a_symlink_is_written_through_and_modes_follow_open(tmp_path):
    target = tmp_path / "target.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)
    cache_files.write_json(link, {"k": 1})
    assert link.is_symlink()
    assert json.loads(target.read_text()) == {"k": 1}
    old = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh.json"
        cache_files.write_json(fresh, {})
        assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o644  # open()'s 0666 less the umask
        os.chmod(fresh, 0o600)
        cache_files.write_json(fresh, {"k": 2})
        assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o600  # a private file stays private
    finally:
        os.umask(old)
