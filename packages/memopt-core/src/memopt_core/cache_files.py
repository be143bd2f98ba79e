"""The JSON files memopt keeps between runs (ApexW's ``mode="auto"`` decisions, AdamBridge's
autotune results): where they live, and how they are read and replaced.

A cache is only ever an optimization: reading one that is absent, unreadable or malformed gives
None (the caller measures again), and a cache is never allowed to hang or crash a run: a FIFO is
not read (it would block), a file larger than any cache is not parsed, JSON nested too deeply
for the parser counts as malformed. Writes replace the file atomically through
:mod:`memopt_core.atomic_write` (a symlink written through, an existing file's mode kept, a
device or a FIFO never replaced).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from memopt_core.atomic_write import atomic_file

__all__ = ["CACHE_DIR_ENV", "cache_dir", "read_json", "write_json"]

#: Environment variable naming the folder of every memopt cache file.
CACHE_DIR_ENV = "MEMOPT_CACHE_DIR"

_MAX_BYTES = 16 << 20


def cache_dir() -> Path:
    """``$MEMOPT_CACHE_DIR`` when set and not empty (``~`` expanded), else
    ``$XDG_CACHE_HOME/memopt`` where that is an absolute path (the XDG spec says to ignore a
    relative one, which would put the cache wherever the process runs), else
    ``~/.cache/memopt``. ``RuntimeError`` when the answer needs a home directory and there is
    none (a uid without a passwd entry, in some containers)."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "memopt"


def read_json(path: str | os.PathLike[str], max_bytes: int = _MAX_BYTES) -> Any | None:
    """The JSON value in the file at ``path``; None when it is absent, not a regular file,
    larger than ``max_bytes``, unreadable, not UTF-8 JSON, or nested too deeply to parse."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return None
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Replace the file at ``path`` with ``data`` as JSON (sorted keys, indented), atomically;
    its folder is created. ``OSError`` when that fails (a read-only folder, a full disk, a
    directory or a device at ``path``), with ``path`` untouched."""
    Path(os.path.realpath(path)).parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        f.write((json.dumps(data, indent=1, sort_keys=True) + "\n").encode("utf-8"))
