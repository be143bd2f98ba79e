"""Atomic replacement of a file: write a temporary file beside it, fsync, rename, fsync the folder.

Until :meth:`AtomicFile.commit` has renamed the file, the file at ``path`` is the previous one
(or absent); afterwards it is the new one, complete and on disk. A failure before the rename
(disk full, permission, a crash) leaves the previous file untouched, and :meth:`AtomicFile.abort`
(or leaving an :func:`atomic_file` block with an exception) removes the temporary file. An error
fsyncing the folder after the rename propagates with the new file already in place (file
systems that cannot fsync a folder, ``EINVAL``/``ENOTSUP``, are tolerated).

As ``open(path, "wb")`` would, a symlink at ``path`` is written through (its target is
replaced, the link stays), a file that exists keeps its permission bits (a private 0600
checkpoint stays private, also while the new one is written), and a read-only file, a directory
or a missing folder at ``path`` is refused before anything is written. Unlike ``open``, so is
anything else that is not a regular file (a device such as ``/dev/null``, a FIFO, a socket):
the rename would replace it with a regular file.

What memopt-checkpoint writes checkpoints with, and :mod:`memopt_core.cache_files` its caches.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["AtomicFile", "atomic_file", "fsync_directory"]


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened)."""
    if not hasattr(os, "O_DIRECTORY"):  # Windows: no fsync of directories
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:  # file systems that do not support it say EINVAL
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


#: bytes of the target's name kept in the temporary file's: with ``.`` + ``.tmp-`` + 12 hex digits
#: (18 bytes) it stays within the 255-byte name limit of common file systems for every target
#: name that fits itself
_TEMP_STEM_BYTES = 237


def _temp_stem(name: str) -> str:
    """``name`` cut to at most :data:`_TEMP_STEM_BYTES` bytes (whole characters)."""
    while len(os.fsencode(name)) > _TEMP_STEM_BYTES:
        name = name[:-1]
    return name


class AtomicFile:
    """An unbuffered binary temporary file ``.<name>.tmp-<12 hex>`` (the name cut to 237 bytes)
    in the folder of ``path``
    (of its target for a symlink) that :meth:`commit` renames over it. ``state`` is ``"open"``,
    ``"committed"`` or ``"aborted"``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(os.path.realpath(path))  # a symlink's target, replaced beside it
        self.state = "unopened"
        directory = self.path.parent
        if not directory.is_dir():  # else open() names the hidden temporary file, not the folder
            raise FileNotFoundError(
                errno.ENOENT, f"the folder of {os.fspath(path)!r} does not exist", str(directory)
            )
        # refused as open(path, "wb") refuses them: a rename would replace a read-only file
        # (a checkpoint protected with chmod) and fail only at the end for a folder
        if self.path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(self.path))
        if self.path.exists() and not self.path.is_file():
            raise OSError(errno.EEXIST, "exists and is not a regular file", str(self.path))
        if self.path.exists() and not os.access(self.path, os.W_OK):
            raise PermissionError(errno.EACCES, "the file is not writable", str(self.path))
        stem = _temp_stem(self.path.name)
        for _ in range(100):
            tmp = directory / f".{stem}.tmp-{secrets.token_hex(6)}"
            try:
                # closed by commit() or abort(); mode 0o666 less the umask, as open() does
                self.file: Any = open(tmp, "xb", buffering=0)  # noqa: SIM115
            except FileExistsError:
                continue
            except PermissionError as e:  # else the message names the hidden temporary file
                raise PermissionError(
                    e.errno,
                    f"cannot create a file in the folder of {os.fspath(path)!r}: a save writes "
                    "a temporary file there and renames it over the target, so the folder must "
                    "be writable",
                    str(directory),
                ) from e
            break
        else:  # pragma: no cover - 100 collisions of 48 random bits
            raise FileExistsError(errno.EEXIST, "no free temporary file name", str(directory))
        self.temp_path = tmp
        self.state = "open"
        try:
            with contextlib.suppress(FileNotFoundError):  # a new file keeps open()'s mode
                os.fchmod(self.file.fileno(), stat.S_IMODE(os.stat(self.path).st_mode))
        except BaseException:
            self.abort()
            raise

    def commit(self) -> None:
        """fsync and close the file, rename it over ``path``, fsync the folder."""
        try:
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.temp_path, self.path)
        except BaseException:
            self.abort()
            raise
        self.state = "committed"
        fsync_directory(self.path.parent)

    def abort(self) -> None:
        """Close and remove the temporary file; ``path`` is untouched. No-op unless open."""
        if self.state != "open":
            return
        self.state = "aborted"
        try:
            self.file.close()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.temp_path)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """``with atomic_file(p) as f: f.write(...)``: ``p`` is replaced when the block ends
    normally, untouched when it raises."""
    af = AtomicFile(path)
    try:
        yield af.file
    except BaseException:
        af.abort()
        raise
    af.commit()
