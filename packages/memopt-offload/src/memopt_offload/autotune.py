"""Measured machine settings for AdamBridge: kernel threads, chunk size, host and link bandwidth.

:meth:`AutoTuneConfig.measure` times, on this machine:

- **thread count and chunk size** of the fused C++ CPU kernels (:mod:`memopt_kernels_cpu.ops`)
  on the real AdamBridge workload: one AdamW :func:`~memopt_kernels_cpu.ops.fused_step` over a
  scratch group of 4M parameters (1M with ``quick=True``) in tensors of mixed sizes, with fp32
  master weights, bf16 gradients, bf16 moments with stochastic rounding and a bf16 staging
  copy: 20 B per parameter through host memory. Every candidate thread count (1, 2,
  4, ... up to the usable CPUs, that count itself and half of it) runs with every candidate chunk
  size (16K, 64K, 256K elements); a candidate's time is the median of a few steps after a
  warm-up. The fastest wins, except that fewer threads within 3 % of the fastest time are
  preferred (the cores left idle serve the data loader and the thread driving the GPU).
  ``quick=True`` times threads {1, half, all} at 64K elements only. The kernels' previous
  settings are restored afterwards.
- **host memory bandwidth**: a ``Tensor.copy_`` of 256 MiB, or twice the last-level cache where
  that is larger (at most 1 GiB; quick: 128 MiB or one cache size), with torch running the tuned
  thread count; bytes read plus written per second, median of several copies after warm-up ones.
- **link bandwidth**, only where CUDA is available: pinned 256 MiB device-to-host,
  host-to-device, and both at once on two streams (total of both directions), timed with CUDA
  events, median of several.

``quick=True`` (0.5-0.6 s on two cores, against 2.3-3.0 s without it) uses a smaller
kernel workload and grid, a smaller host copy and fewer repeats.

:meth:`AutoTuneConfig.load_or_measure` caches the result as JSON in
``<cache dir>/autotune-<sha1 of the machine key>.json``; the cache directory is the
``cache_dir`` argument, else ``$MEMOPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/memopt``, else
``~/.cache/memopt`` (no home directory: measured, not kept, with a ``RuntimeWarning``). The
machine key (:func:`machine_key`) names the CPU model, the logical and usable core counts, the kernels'
instruction set, the torch version and the CUDA device, so a different machine, build or
container size gets its own file. A file that cannot be read, is corrupt, has another ``schema``
version or another machine key is measured again and overwritten, never an error (a path that
is not a regular file, a FIFO say, is neither read nor replaced); files are
written atomically (temporary file + ``os.replace``) under a lock file, so of several processes
starting together on one host the first measures and the others read its file. A file written by
a ``quick`` measurement serves only ``quick`` requests; a full one serves both.

Force a new measurement with ``AutoTuneConfig.load_or_measure(refresh=True)``, by deleting the
file, or from a shell: ``python -m memopt_offload.autotune --refresh`` (prints the result).
:meth:`AutoTuneConfig.apply` sets the kernels' thread count and chunk size.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

import torch

from memopt_core import cache_files, reference
from memopt_core.backends import GroupStep
from memopt_core.errors import ConfigError
from memopt_core.formats import StateSpec
from memopt_core.optimizer import real_as_float
from memopt_core.plan import GroupPlan, StateArena, round_up
from memopt_kernels_cpu import ops

__all__ = [
    "CACHE_DIR_ENV",
    "CHUNK_CANDIDATES",
    "SCHEMA_VERSION",
    "AutoTuneConfig",
    "cache_path",
    "default_cache_dir",
    "machine_key",
    "main",
]

#: Version of the cache file layout; a file with another version is measured again.
SCHEMA_VERSION = 1
#: Environment variable naming the cache directory (default ``$XDG_CACHE_HOME/memopt``, else
#: ``~/.cache/memopt``).
CACHE_DIR_ENV = cache_files.CACHE_DIR_ENV
#: Kernel chunk sizes (elements) a full measurement tries; ``quick`` tries the middle one.
CHUNK_CANDIDATES = (16384, 65536, 262144)
_QUICK_CHUNK = 65536
#: A candidate with fewer threads within this factor of the fastest time wins.
_TIE = 1.03
#: Largest thread count and chunk size the kernels take (``ops.set_num_threads``: 1 to 4096;
#: ``ops.set_chunk_size``: an int64): checked here so that a bad cache file is measured again
#: rather than failing in :meth:`AutoTuneConfig.apply`.
_MAX_THREADS = 4096
_MAX_CHUNK = 2**63 - 1

_MiB = 1 << 20


# ----------------------------------------------------------------------------------- machine
def _usable_cpus() -> int:
    """CPUs this process may run on (the kernels' default thread count), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def _cuda_name() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(torch.cuda.current_device())


def machine_key() -> str:
    """What a measurement depends on: CPU model, logical and usable cores, kernel instruction
    set, torch version, CUDA device name (or ``cpu``)."""
    return (
        f"{_cpu_model()} | {os.cpu_count() or 1} logical cpus, {_usable_cpus()} usable | "
        f"isa {ops.get_isa()} | torch {torch.__version__} | {_cuda_name()}"
    )


#: memopt's cache folder, shared with ApexW's decision cache
#: (:func:`memopt_core.cache_files.cache_dir`).
default_cache_dir = cache_files.cache_dir


def cache_path(cache_dir: str | os.PathLike | None = None, machine: str | None = None) -> Path:
    """The cache file of ``machine`` (default: this one) in ``cache_dir`` (default:
    :func:`default_cache_dir`)."""
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise ConfigError(
            f"cache_dir must be a path (str or os.PathLike) or None, got {cache_dir!r}"
        )
    directory = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = machine_key() if machine is None else machine
    return directory / f"autotune-{hashlib.sha1(key.encode()).hexdigest()}.json"


# ----------------------------------------------------------------------------------- timing
def _median_s(
    fn: Callable[[], object], repeats: int, warmup: int = 1, min_warmup_s: float = 0.0
) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` calls, after at least
    ``warmup`` calls and ``min_warmup_s`` seconds of calls (thread pools, clocks, page tables)."""
    t_end = time.perf_counter() + min_warmup_s
    done = 0
    while done < warmup or time.perf_counter() < t_end:
        fn()
        done += 1
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _thread_candidates(cpus: int, quick: bool) -> list[int]:
    """Thread counts to try: 1, 2, 4, ... up to ``cpus``, ``cpus`` and ``cpus // 2``
    (``quick``: 1, ``cpus // 2`` and ``cpus``)."""
    out = {1, cpus, max(1, cpus // 2)}
    if not quick:
        p = 2
        while p <= cpus:
            out.add(p)
            p *= 2
    return sorted(out)


def _pick(times: Mapping[tuple[int, int], float]) -> tuple[int, int]:
    """The ``(threads, chunk)`` to use given median step times: the fewest threads whose best
    time is within 3 % of the fastest, with that thread count's fastest chunk size."""
    if not times:
        raise ConfigError("no kernel timings to pick from")
    best = min(times.values())
    ok = [(threads, t, chunk) for (threads, chunk), t in times.items() if t <= best * _TIE]
    threads, _, chunk = min(ok)
    return threads, chunk


def _workload_sizes(n: int) -> list[int]:
    """Tensor sizes summing to ``n``: halves (n/2, n/4, n/8, n/16) and 4096-element tensors."""
    sizes = [n // 2, n // 4, n // 8, n // 16]
    rest = n - sum(sizes)
    sizes += [4096] * (rest // 4096)
    if rest % 4096:
        sizes.append(rest % 4096)
    return [s for s in sizes if s > 0]


def _adamw_workload(
    n: int, grad_dtype: torch.dtype = torch.bfloat16
) -> tuple[GroupStep, list[torch.Tensor]]:
    """One AdamW step of ``n`` fp32 parameters (``grad_dtype`` gradients, bf16 moments with
    stochastic rounding) and its bf16 staging buffers: AdamBridge's host-side work."""
    spec = StateSpec(master="fp32", moments="bf16", stochastic_rounding=True)
    gen = torch.Generator().manual_seed(0)
    sizes = _workload_sizes(n)
    params = [torch.randn(s, generator=gen, dtype=torch.float32, device="cpu") for s in sizes]
    grads = [
        (torch.randn(s, generator=gen, dtype=torch.float32, device="cpu") * 1e-3).to(grad_dtype)
        for s in sizes
    ]
    staging = [torch.empty(s, dtype=torch.bfloat16, device="cpu") for s in sizes]
    plan = GroupPlan(params, spec, device=torch.device("cpu"), param_dtype=torch.float32)
    arena = StateArena(
        plan, {"exp_avg": spec.first, "exp_avg_sq": spec.second}, spec.master_for(torch.float32)
    )
    step = 10
    scalars = reference.adam_scalars(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=step, decoupled=True
    )
    work = GroupStep(
        rule="adam",
        spec=spec,
        plan=plan,
        slots=list(range(len(sizes))),
        params=params,
        grads=grads,
        arena=arena,
        scalars=scalars,
        step=step,
        seed=0,
        tensor_ids=list(range(len(sizes))),
        first_step=False,
    )
    return work, staging


def _tune_kernels(quick: bool) -> tuple[int, int]:
    """Time the fused AdamW step over the candidate grid; the best ``(threads, chunk)``."""
    n = (1 << 20) if quick else (1 << 22)
    repeats = 3 if quick else 5
    cpus = _usable_cpus()
    chunks = (_QUICK_CHUNK,) if quick else CHUNK_CANDIDATES
    work, staging = _adamw_workload(n)
    times: dict[tuple[int, int], float] = {}
    for threads in _thread_candidates(cpus, quick):
        ops.set_num_threads(threads)
        for chunk in chunks:
            ops.set_chunk_size(chunk)
            times[threads, chunk] = _median_s(lambda: ops.fused_step(work, staging), repeats)
    return _pick(times)


def _last_level_cache_bytes() -> int:
    """Size of cpu0's largest level-3+ cache from sysfs (Linux), 0 when unknown."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            value = int(size.rstrip("KMG")) * scale
        except (OSError, ValueError):
            continue
        if level >= 3:
            best = max(best, value)
    return best


def _host_copy_bytes(quick: bool) -> int:
    """Bytes of each buffer of the host copy: 256 MiB and at least twice the last-level cache
    (128 MiB and one cache size ``quick``), at most 1 GiB, so the copy runs from DRAM."""
    llc = _last_level_cache_bytes()
    want = max(128 * _MiB, llc) if quick else max(256 * _MiB, 2 * llc)
    return min(round_up(want, _MiB), 1024 * _MiB)


def _host_gbs(threads: int, quick: bool) -> float:
    """Read+write GB/s of a large ``copy_`` (:func:`_host_copy_bytes`) with torch at
    ``threads`` threads."""
    nbytes = _host_copy_bytes(quick)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32, device="cpu")
        dst = torch.zeros_like(src)
        t = _median_s(
            lambda: dst.copy_(src), 3 if quick else 9, warmup=2, min_warmup_s=0.1 if quick else 0.3
        )
    finally:
        torch.set_num_threads(before)
    return 2 * nbytes / t / 1e9


def _link_gbs(quick: bool) -> tuple[float, float, float]:
    """Pinned ``(d2h, h2d, duplex)`` GB/s on the current CUDA device (duplex: both directions
    at once on two streams, total bytes of both)."""
    nbytes = 256 * _MiB  # a power of two: the pinned allocator's own size
    repeats = 3 if quick else 5
    dev = torch.device("cuda", torch.cuda.current_device())
    d_src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    d_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True, device="cpu")
    h_src = torch.ones(nbytes, dtype=torch.uint8, device="cpu").pin_memory()
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    torch.cuda.synchronize(dev)

    def timed(copies: Sequence[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]]) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(s1)
        done = []
        for stream, dst, src in copies:
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            done.append(ev)
        for ev in done:
            s1.wait_event(ev)
        end.record(s1)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def median(copies) -> float:
        timed(copies)  # warm-up
        return statistics.median(timed(copies) for _ in range(repeats))

    d2h = nbytes / median([(s1, h_dst, d_src)]) / 1e9
    h2d = nbytes / median([(s1, d_dst, h_src)]) / 1e9
    duplex = 2 * nbytes / median([(s1, h_dst, d_src), (s2, d_dst, h_src)]) / 1e9
    torch.cuda.synchronize(dev)
    del d_src, d_dst, h_dst, h_src
    _release_pinned_cache()
    return d2h, h2d, duplex


def _release_pinned_cache() -> None:
    """Hand the 512 MiB of pinned scratch back to the system: torch's caching host allocator
    would keep it (private entry points, named differently across torch versions)."""
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            with contextlib.suppress(RuntimeError):
                fn()
            return


# ----------------------------------------------------------------------------------- config
def _check_positive(name: str, v: object, *, optional: bool = False) -> float | None:
    if v is None and optional:
        return None
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not math.isfinite(real_as_float(v))
        or v <= 0
    ):
        want = "a finite number > 0" + (" or None" if optional else "")
        raise ConfigError(f"AutoTuneConfig field {name!r} must be {want}, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class AutoTuneConfig:
    """Settings measured on one machine (see the module docstring for how)."""

    #: best CPU-kernel thread count measured (1 to 4096, the kernels' limit)
    num_threads: int
    #: best kernel chunk size (elements, a multiple of 32) measured
    chunk_size: int
    #: host memory bandwidth, GB/s (bytes read + written by a large copy at ``num_threads``)
    host_gbs: float
    #: pinned device-to-host GB/s (None without CUDA)
    d2h_gbs: float | None
    #: pinned host-to-device GB/s (None without CUDA)
    h2d_gbs: float | None
    #: both directions at once, total GB/s (None without CUDA)
    duplex_gbs: float | None
    #: the cache key: :func:`machine_key` of the machine measured
    machine: str

    def __post_init__(self) -> None:
        for name, most in (("num_threads", _MAX_THREADS), ("chunk_size", _MAX_CHUNK)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most:
                raise ConfigError(
                    f"AutoTuneConfig field {name!r} must be an int in [1, {most}], got {v!r}"
                )
        if self.chunk_size % 32:
            raise ConfigError(
                f"AutoTuneConfig field 'chunk_size' must be a multiple of 32 elements (the "
                f"kernels' block), got {self.chunk_size}"
            )
        object.__setattr__(self, "host_gbs", _check_positive("host_gbs", self.host_gbs))
        for name in ("d2h_gbs", "h2d_gbs", "duplex_gbs"):
            object.__setattr__(
                self, name, _check_positive(name, getattr(self, name), optional=True)
            )
        if not isinstance(self.machine, str) or not self.machine:
            raise ConfigError(
                f"AutoTuneConfig field 'machine' must be a non-empty string, got {self.machine!r}"
            )

    # ------------------------------------------------------------------------------- measuring
    @classmethod
    def measure(cls, *, quick: bool = False) -> AutoTuneConfig:
        """Measure this machine now (a few seconds; ``quick``: a smaller grid and buffers,
        about half a second on two cores). Restores the kernel settings."""
        threads_before, chunk_before = ops.get_num_threads(), ops.get_chunk_size()
        try:
            threads, chunk = _tune_kernels(quick)
        finally:
            ops.set_num_threads(threads_before)
            ops.set_chunk_size(chunk_before)
        host = _host_gbs(threads, quick)
        link: tuple[float | None, float | None, float | None] = (None, None, None)
        if torch.cuda.is_available():
            link = _link_gbs(quick)
        return cls(threads, chunk, host, *link, machine=machine_key())

    @classmethod
    def load_or_measure(
        cls,
        cache_dir: str | os.PathLike | None = None,
        *,
        refresh: bool = False,
        quick: bool = False,
    ) -> AutoTuneConfig:
        """The cached config of this machine, or a new measurement (then cached).

        ``refresh``: measure even when a valid cache file exists. A missing, corrupt,
        other-schema or other-machine file is measured again and overwritten; a file written by
        a ``quick`` measurement serves only ``quick`` requests. If the file cannot be written
        the measurement is still returned, with a ``RuntimeWarning``."""
        key = machine_key()
        try:
            path = cache_path(cache_dir, key)
        except RuntimeError as e:  # no home directory for the default, or a ~user without one
            warnings.warn(
                f"memopt autotune: no cache directory ({e}); the measurement is used but not "
                f"kept (set {CACHE_DIR_ENV} to a writable directory)",
                RuntimeWarning,
                stacklevel=2,
            )
            return cls.measure(quick=quick)
        if not refresh:
            cached = _read_cache(path, key, quick)
            if cached is not None:
                return cached
        with _file_lock(path):
            if not refresh:  # another process may have measured while we waited
                cached = _read_cache(path, key, quick)
                if cached is not None:
                    return cached
            config = cls.measure(quick=quick)
            _write_cache(path, config, quick)
        return config

    # ------------------------------------------------------------------------------- using
    def apply(self) -> None:
        """Set the CPU kernels' thread count and chunk size to the measured ones."""
        ops.set_num_threads(self.num_threads)
        ops.set_chunk_size(self.chunk_size)

    def step_lower_bound_ms(
        self, n_params: int, host_bytes_per_param: float, link_bytes_per_param: float
    ) -> float:
        """Lower bound of one offloaded step in ms: ``max(host time, link time)``.

        Host time: ``n_params * host_bytes_per_param`` bytes through host memory at
        ``host_gbs``. Link time: ``n_params * link_bytes_per_param`` bytes, both directions
        counted together (e.g. 2 B of bf16 gradient down + 2 B of bf16 weight up), at
        ``duplex_gbs``; 0 when no link was measured (no CUDA)."""
        if isinstance(n_params, bool) or not isinstance(n_params, int) or n_params < 0:
            raise ConfigError(f"n_params must be an int >= 0, got {n_params!r}")
        # the products below are floats: an int beyond float's range raised OverflowError
        if not math.isfinite(real_as_float(n_params)):
            raise ConfigError("n_params must be an int within float's range, got a larger one")
        for name, v in (
            ("host_bytes_per_param", host_bytes_per_param),
            ("link_bytes_per_param", link_bytes_per_param),
        ):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ConfigError(f"{name} must be a number >= 0, got {v!r}")
            if not math.isfinite(real_as_float(v)):
                raise ConfigError(
                    f"{name} must be finite (within float's range), got {real_as_float(v)}"
                )
        host_ms = n_params * host_bytes_per_param / (self.host_gbs * 1e6)
        link_ms = 0.0
        if self.duplex_gbs is not None:
            link_ms = n_params * link_bytes_per_param / (self.duplex_gbs * 1e6)
        return max(host_ms, link_ms)

    # --------------------------------------------------------------------------- (de)serializing
    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (the inverse of :meth:`from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> AutoTuneConfig:
        """A config from :meth:`to_dict`'s output; :class:`ConfigError` naming the field that
        is missing, unknown or of the wrong type or range."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"an AutoTuneConfig dict must be a mapping, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise ConfigError(f"AutoTuneConfig dict lacks field(s) {missing}")
        unknown = sorted(str(k) for k in d if k not in names)
        if unknown:
            raise ConfigError(f"AutoTuneConfig dict has unknown field(s) {unknown}")
        return cls(**{n: d[n] for n in names})


# ----------------------------------------------------------------------------------- cache
def _read_cache(path: Path, key: str, quick: bool) -> AutoTuneConfig | None:
    """The config in ``path`` when it is valid for ``key`` (and, unless ``quick``, came from a
    full measurement); None otherwise, whatever is wrong with the file."""
    data = cache_files.read_json(path)
    if not isinstance(data, dict) or type(data.get("schema")) is not int:
        return None
    if data["schema"] != SCHEMA_VERSION:
        return None
    if data.get("quick") is not False and not quick:
        return None
    try:
        config = AutoTuneConfig.from_dict(data["config"])
    except (ValueError, TypeError, KeyError, OverflowError):  # ConfigError is a ValueError
        return None
    return config if config.machine == key else None


def _write_cache(path: Path, config: AutoTuneConfig, quick: bool) -> None:
    """Write ``config`` to ``path`` atomically; a ``RuntimeWarning`` when that fails."""
    data = {
        "schema": SCHEMA_VERSION,
        "quick": bool(quick),
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": config.to_dict(),
    }
    try:
        cache_files.write_json(path, data)
    except OSError as e:
        warnings.warn(
            f"memopt autotune: could not write the cache file {path} ({e}); the measurement is "
            f"used but not kept (set {CACHE_DIR_ENV} to a writable directory)",
            RuntimeWarning,
            stacklevel=3,
        )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``<path>.lock`` where possible (POSIX, writable directory), so
    processes on one host do not measure at the same time; no lock otherwise."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 - held across the yield
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------------- command
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m memopt_offload.autotune [--refresh] [--quick] [--cache-dir DIR]``: print
    this machine's config as JSON (measuring when there is no valid cache file)."""
    parser = argparse.ArgumentParser(
        prog="python -m memopt_offload.autotune", description=main.__doc__
    )
    parser.add_argument("--refresh", action="store_true", help="measure even if cached")
    parser.add_argument("--quick", action="store_true", help="small buffers, small grid")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help=f"default: ${CACHE_DIR_ENV}, $XDG_CACHE_HOME/memopt or ~/.cache/memopt",
    )
    args = parser.parse_args(argv)
    config = AutoTuneConfig.load_or_measure(args.cache_dir, refresh=args.refresh, quick=args.quick)
    print(json.dumps(config.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
