"""The demo's corpus: the Python standard library's own source, as bytes, split by file."""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

# Directories whose files are left out: installed packages, and test suites (huge, repetitive data).
SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


@dataclass(frozen=True)
class Corpus:
    """Train and validation byte streams (uint8) and the files each came from (relative paths)."""

    train: Tensor
    val: Tensor
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]


def _digest(rel: str) -> bytes:
    return hashlib.sha256(rel.encode()).digest()


def is_val_file(rel: str, val_percent: int = 10) -> bool:
    """Whether a file (path relative to the stdlib root) belongs to validation; stable everywhere."""
    return int.from_bytes(_digest(rel)[:4], "little") % 100 < val_percent


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative paths of the stdlib's ``.py`` files, skipping packages and tests, in hash order.

    Hash order mixes the modules, so a size cap still samples the whole library rather than
    its alphabetically first packages.
    """
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    rels = [
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    return sorted(rels, key=_digest)


def load_corpus(
    max_train_bytes: int = 4_000_000,
    max_val_bytes: int = 400_000,
    val_percent: int = 10,
    root: Path | None = None,
) -> Corpus:
    """Read stdlib source files into byte tensors until each split reaches its cap."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    splits: dict[bool, list[bytes]] = {False: [], True: []}
    names: dict[bool, list[str]] = {False: [], True: []}
    caps = {False: max_train_bytes, True: max_val_bytes}
    sizes = {False: 0, True: 0}
    for rel in stdlib_files(root):
        val = is_val_file(rel, val_percent)
        if sizes[val] >= caps[val]:
            if all(sizes[s] >= caps[s] for s in caps):
                break
            continue
        data = (root / rel).read_bytes()[: caps[val] - sizes[val]]
        splits[val].append(data)
        names[val].append(rel)
        sizes[val] += len(data)
    if not splits[False] or not splits[True]:
        raise RuntimeError(f"no Python source found under {root} for one of the splits")

    def as_tensor(parts: list[bytes]) -> Tensor:
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)

    return Corpus(
        train=as_tensor(splits[False]),
        val=as_tensor(splits[True]),
        train_files=tuple(names[False]),
        val_files=tuple(names[True]),
    )


def random_batches(
    data: Tensor, batch_size: int, seq_len: int, count: int, seed: int
) -> list[tuple[Tensor, Tensor]]:
    """``count`` batches of (inputs, next-byte targets) at random offsets, the same for a seed."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq_len - 1, (count, batch_size), generator=gen)
    return [_windows(data, s, seq_len) for s in starts]


def fixed_batches(
    data: Tensor, batch_size: int, seq_len: int, count: int
) -> list[tuple[Tensor, Tensor]]:
    """``count`` batches of windows spread evenly over ``data`` (for validation)."""
    n = count * batch_size
    starts = torch.linspace(0, len(data) - seq_len - 1, n).long().view(count, batch_size)
    return [_windows(data, s, seq_len) for s in starts]


def _windows(data: Tensor, starts: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    idx = starts[:, None] + torch.arange(seq_len + 1)
    chunk = data[idx].long()  # embedding indices must be int64
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
