"""``mode="auto"``: ApexW picks its step implementation from timed trial steps, cached per model
signature, never from size thresholds.

Candidates: ``"fused"`` (a kernel backend: Triton on CUDA, memopt-kernels-cpu on CPU; with
``capturable=True`` the CUDA-graph replay) and ``"torch"`` (core's pure-torch backend). Both
compute the same bits (core's exactness rule), so the trial steps are ordinary training steps:
trying a mode changes nothing but the time taken.

Trial schedule (:class:`Trial`): each candidate first runs :data:`WARMUP_STEPS` untimed steps
(resolution, kernel compilation), then :data:`TIMED_ROUNDS` rounds in which each candidate runs
one untimed re-entry step and then one timed step: a switch between candidates has costs that
never recur once decided (a CUDA graph captured, step counters moving between host and device),
and they land in the untimed step. A step is timed from a device synchronization to the next,
so host and device work both count. The decision is the candidate with the lowest median; once
every candidate has 2 timed samples, one slower than :data:`DROP_FACTOR` times the best is not
timed again. The decision, with every median, is stored under the signature (:func:`signature`:
device name (CPU: the processor, torch's thread count and memopt_kernels_cpu's with its
instruction set), torch / triton / memopt-core / memopt-kernels-triton / memopt-kernels-cpu /
memopt-apexw versions, the usable backends, ``capturable``, ``check_numerics``, and per group
the parameter dtype, state format, every shape and ``requires_grad``) in a JSON file
(:func:`default_cache_path`); an ApexW built for the same signature reads it and runs no trial.
A backend forced by ``backend=`` or ``MEMOPT_BACKEND`` is the only candidate: no trial, no cache.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memopt_core import backends, cache_files

__all__ = [
    "CACHE_ENV",
    "DROP_FACTOR",
    "TIMED_ROUNDS",
    "WARMUP_STEPS",
    "ModeDecision",
    "Trial",
    "cache_file",
    "default_cache_path",
    "load_decision",
    "save_decision",
    "signature",
]

CACHE_ENV = "MEMOPT_APEXW_CACHE"
WARMUP_STEPS = 2
TIMED_ROUNDS = 3
DROP_FACTOR = 4.0
_CACHE_VERSION = 1


@dataclass(frozen=True)
class ModeDecision:
    """What ``mode="auto"`` chose and why (``ApexW.mode_decision``).

    ``source``: ``"fixed"`` (mode given), ``"forced"`` (``backend=`` or ``MEMOPT_BACKEND``
    names the one backend), ``"measured"`` (trial steps in this process), ``"cache"`` (read from
    ``cache_path``) or ``"only candidate"``. ``timings_ms``: median step time per candidate
    (measured now or when the cache entry was written)."""

    mode: str
    source: str
    timings_ms: dict[str, float] = field(default_factory=dict)
    signature: str = ""
    cache_path: str | None = None


#: the file name of the mode cache in a folder
_CACHE_NAME = "apexw-modes.json"


def default_cache_path() -> Path:
    """``$MEMOPT_APEXW_CACHE`` (``~`` expanded; a folder, named with a trailing separator or
    existing, holds ``apexw-modes.json``), else ``apexw-modes.json`` in memopt's cache folder
    (:func:`memopt_core.cache_files.cache_dir`: ``$MEMOPT_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/memopt``, else ``~/.cache/memopt``). ``RuntimeError`` when that needs a
    home directory and there is none."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return cache_file(Path(env).expanduser(), env)
    return cache_files.cache_dir() / _CACHE_NAME


def cache_file(path: Path, given: str) -> Path:
    """The decision cache's file for ``path`` (``given``: as the user wrote it): a folder,
    named with a trailing separator or existing, holds ``apexw-modes.json``."""
    # Path() drops a trailing "/": "dir/" (meant as a folder) became a file named "dir"
    folder = given.endswith(("/", os.sep)) or path.is_dir()
    return path / _CACHE_NAME if folder else path


def _versions() -> dict[str, str]:
    from memopt_apexw import __version__

    out = {"torch": torch.__version__, "memopt_apexw": __version__}
    # the step's code: core's torch backend and the kernels (an upgrade may change their speed)
    for name in ("memopt_core", "triton", "memopt_kernels_triton", "memopt_kernels_cpu"):
        try:
            out[name] = str(importlib.import_module(name).__version__)
        except Exception:  # not installed, or a build that fails to import
            out[name] = "none"
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    # the torch step runs on torch's threads, the fused one on memopt_kernels_cpu's pool
    # and on its instruction set (MEMOPT_CPU_ISA can force a slower one)
    try:
        import memopt_kernels_cpu

        pool = f"{memopt_kernels_cpu.get_num_threads()} threads on {memopt_kernels_cpu.get_isa()}"
    except Exception:
        pool = "none"
    return f"cpu:{_cpu_model()}, {torch.get_num_threads()} threads, kernel pool {pool}"


def _cpu_model() -> str:
    """The processor's model name (Linux), else its architecture: hosts of one shared home
    folder (a cluster's) may differ."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.machine()


def signature(
    groups: list[dict[str, Any]], capturable: bool, check_numerics: bool = False
) -> tuple[str, dict[str, Any]]:
    """The cache key of a model (sha256 hex) and a short readable description of it. It holds
    what changes the step's work: which tensors train (``requires_grad``) and ``check_numerics``
    too."""
    described = []
    devices: set[torch.device] = set()
    total = 0
    tensors = 0
    for g in groups:
        params = list(g["params"])
        devices.update(p.device for p in params)
        described.append(
            {
                "state": g["moments"],
                "master": g["master"],
                "tensors": [
                    [str(p.dtype), str(p.device.type), list(p.shape), p.requires_grad]
                    for p in params
                ],
            }
        )
        total += sum(p.numel() for p in params)
        tensors += len(params)
    names = sorted(_device_name(d) for d in devices)
    # a decision holds for the backends it was measured with (a "fused" one needs its kernels)
    usable = sorted(n for n, s in backends.available_backends().items() if s.usable)
    full = {
        "devices": names,
        "versions": _versions(),
        "backends": usable,
        "capturable": capturable,
        "check_numerics": check_numerics,
        "groups": described,
    }
    key = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()
    about = {"devices": names, "backends": usable, "tensors": tensors, "parameters": total}
    return key, {**about, **_versions()}


def _entries(path: Path) -> dict[str, Any]:
    """The entries of the cache at ``path`` (empty when absent, unreadable, not a regular file,
    larger than any cache, of another version or of another shape)."""
    data = cache_files.read_json(path)
    if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def load_decision(path: Path, key: str) -> ModeDecision | None:
    """The cached decision for ``key`` in ``path`` (None if absent or unreadable)."""
    entry = _entries(path).get(key)
    if not isinstance(entry, dict) or entry.get("mode") not in ("fused", "torch"):
        return None
    timings = entry.get("timings_ms", {})
    if not isinstance(timings, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in timings.values()
    ):
        return None
    try:
        ms = {k: float(v) for k, v in timings.items()}
    except OverflowError:  # an int beyond float's range
        return None
    return ModeDecision(entry["mode"], "cache", ms, key, str(path))


def save_decision(path: Path, key: str, decision: ModeDecision, about: dict[str, Any]) -> None:
    """Add ``decision`` under ``key`` to the JSON cache at ``path``, atomically (temporary file and
    rename; a concurrent writer loses at most its own entry)."""
    data: dict[str, Any] = {"version": _CACHE_VERSION, "entries": _entries(path)}
    data["entries"][key] = {
        "mode": decision.mode,
        "timings_ms": decision.timings_ms,
        "about": about,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    cache_files.write_json(path, data)


class Trial:
    """The schedule of trial steps over ``candidates`` and their timings (see the module doc)."""

    def __init__(self, candidates: list[str]) -> None:
        self.candidates = list(candidates)
        self.times: dict[str, list[float]] = {c: [] for c in candidates}
        self._queue: list[tuple[str, bool]] = [
            (c, False) for c in candidates for _ in range(WARMUP_STEPS)
        ]
        self._round = 0
        self._last: tuple[str, int] | None = None  # the last timed step: candidate, its times

    def next(self) -> tuple[str, bool] | None:
        """The next (candidate, timed) step, or None when the trial is over. A timed step that
        recorded no time (it raised) is taken again: a trial whose timed steps all raised
        decided from no timing at all, and cached that."""
        last, self._last = self._last, None
        if last is not None and len(self.times[last[0]]) == last[1]:
            self._queue.insert(0, (last[0], True))
        if not self._queue:
            if self._round >= TIMED_ROUNDS:
                return None
            alive = self._alive()
            if len(alive) < 2 and self._round > 0:
                return None
            self._round += 1
            # an untimed re-entry step before each timed one: a switch's one-time costs (a
            # graph's capture, step counters moving between host and device) never recur once
            # decided, so they must not be timed
            self._queue = [(c, timed) for c in alive for timed in (False, True)]
        candidate, is_timed = self._queue.pop(0)
        if is_timed:
            self._last = (candidate, len(self.times[candidate]))
        return candidate, is_timed

    def _alive(self) -> list[str]:
        """The candidates still in the trial: within DROP_FACTOR of the best median, judged
        only once every candidate has 2 timed samples (one sample may hold a one-time cost)."""
        med = self.medians()
        if any(len(t) < 2 for t in self.times.values()):
            return self.candidates
        best = min(med.values())
        return [c for c in self.candidates if med[c] <= DROP_FACTOR * best]

    def record(self, candidate: str, ms: float) -> None:
        self.times[candidate].append(ms)

    def medians(self) -> dict[str, float]:
        return {c: statistics.median(t) for c, t in self.times.items() if t}

    def decide(self) -> str:
        med = self.medians()
        return min(med, key=med.__getitem__) if med else self.candidates[-1]  # "torch"


def timed(devices: set[torch.device]):
    """A context timing a block in milliseconds, synchronizing each CUDA device of
    ``devices`` before and after (the parameters' GPUs, not only the current one)."""
    return _Timer(sorted({d for d in devices if d.type == "cuda"}, key=str))


class _Timer:
    def __init__(self, cuda: list[torch.device]) -> None:
        self.cuda = cuda
        self.ms = 0.0

    def _sync(self) -> None:
        for d in self.cuda:
            torch.cuda.synchronize(d)

    def __enter__(self) -> _Timer:
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sync()
        self.ms = (time.perf_counter() - self._t0) * 1e3
