"""memopt_offload.autotune: one real quick measurement, the cache (round trip, refresh, corrupt
and stale files, environment variable), validation, the tie rule and the lower-bound arithmetic.

Only the first fixture measures; every cache test replaces ``AutoTuneConfig.measure`` with a
counting fake, so the file runs in about a second on two cores.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from memopt_core.errors import ConfigError
from memopt_kernels_cpu import ops
from memopt_offload import autotune
from memopt_offload.autotune import (
    CACHE_DIR_ENV,
    CHUNK_CANDIDATES,
    SCHEMA_VERSION,
    AutoTuneConfig,
    cache_path,
    machine_key,
)


@pytest.fixture
def kernel_settings():
    """Restore the kernels' thread count and chunk size after the test."""
    before = ops.get_num_threads(), ops.get_chunk_size()
    yield before
    ops.set_num_threads(before[0])
    ops.set_chunk_size(before[1])


@pytest.fixture(scope="module")
def measured():
    """One real ``measure(quick=True)``, started from unusual kernel settings: the config, the
    settings found afterwards, the seconds it took."""
    before = ops.get_num_threads(), ops.get_chunk_size()
    try:
        ops.set_num_threads(1)
        ops.set_chunk_size(96)
        t0 = time.perf_counter()
        config = AutoTuneConfig.measure(quick=True)
        seconds = time.perf_counter() - t0
        after = ops.get_num_threads(), ops.get_chunk_size()
    finally:
        ops.set_num_threads(before[0])
        ops.set_chunk_size(before[1])
    return config, after, seconds


def make_config(**kw) -> AutoTuneConfig:
    base = dict(
        num_threads=1,
        chunk_size=65536,
        host_gbs=10.0,
        d2h_gbs=None,
        h2d_gbs=None,
        duplex_gbs=None,
        machine=machine_key(),
    )
    return AutoTuneConfig(**{**base, **kw})


class FakeMeasure:
    """Stands in for ``AutoTuneConfig.measure``: counts calls, returns ``config``."""

    def __init__(self, config: AutoTuneConfig) -> None:
        self.config = config
        self.calls: list[bool] = []

    def __call__(self, cls, *, quick: bool = False) -> AutoTuneConfig:
        self.calls.append(quick)
        return self.config


@pytest.fixture
def fake(monkeypatch) -> FakeMeasure:
    f = FakeMeasure(make_config(num_threads=3, host_gbs=12.5))
    monkeypatch.setattr(AutoTuneConfig, "measure", classmethod(f))
    return f


def forbid_measure(monkeypatch) -> None:
    def boom(cls, *, quick=False):
        raise AssertionError("measured although a valid cache file exists")

    monkeypatch.setattr(AutoTuneConfig, "measure", classmethod(boom))


# ----------------------------------------------------------------------------------- measuring
def test_quick_measure_is_sane(measured):
    config, _, seconds = measured
    cpus = os.cpu_count() or 1
    assert 1 <= config.num_threads <= cpus
    assert config.num_threads in autotune._thread_candidates(autotune._usable_cpus(), True)
    assert config.chunk_size in CHUNK_CANDIDATES
    assert math.isfinite(config.host_gbs)
    assert config.host_gbs > 0
    if torch.cuda.is_available():
        assert all(v > 0 for v in (config.d2h_gbs, config.h2d_gbs, config.duplex_gbs))
    else:
        assert (config.d2h_gbs, config.h2d_gbs, config.duplex_gbs) == (None, None, None)
    assert config.machine == machine_key()
    assert seconds < 5.0, f"quick measurement took {seconds:.2f} s"


def test_measure_restores_kernel_settings(measured):
    assert measured[1] == (1, 96)


def test_machine_key_names_the_machine():
    key = machine_key()
    assert f"isa {ops.get_isa()}" in key
    assert f"torch {torch.__version__}" in key
    assert f"{os.cpu_count()} logical cpus" in key
    assert key.endswith("cpu") or torch.cuda.is_available()


def test_apply_sets_kernel_settings(kernel_settings):
    threads = 2 if kernel_settings[0] == 1 else 1
    chunk = 4096 if kernel_settings[1] != 4096 else 8192
    make_config(num_threads=threads, chunk_size=chunk).apply()
    assert (ops.get_num_threads(), ops.get_chunk_size()) == (threads, chunk)


@pytest.mark.parametrize(
    ("cpus", "quick", "want"),
    [
        (1, False, [1]),
        (2, True, [1, 2]),
        (12, False, [1, 2, 4, 6, 8, 12]),
        (16, False, [1, 2, 4, 8, 16]),
        (16, True, [1, 8, 16]),
    ],
)
def test_thread_candidates(cpus, quick, want):
    assert autotune._thread_candidates(cpus, quick) == want


def test_pick_prefers_fewer_threads_within_three_percent():
    # 1 thread is 2 % slower than the best: it wins; its fastest chunk is taken
    assert autotune._pick({(1, 16384): 1.04, (1, 65536): 1.02, (2, 65536): 1.0}) == (1, 65536)
    # 5 % slower: the faster, larger thread count wins
    assert autotune._pick({(1, 65536): 1.05, (2, 16384): 1.01, (2, 65536): 1.0}) == (2, 65536)
    assert autotune._pick({(4, 262144): 1.0, (8, 262144): 1.03, (2, 262144): 1.031}) == (4, 262144)


@pytest.mark.parametrize(
    ("llc_mib", "quick_mib", "full_mib"),
    [(0, 128, 256), (32, 128, 256), (300, 300, 600), (4096, 1024, 1024)],
)
def test_host_copy_outgrows_the_last_level_cache(monkeypatch, llc_mib, quick_mib, full_mib):
    monkeypatch.setattr(autotune, "_last_level_cache_bytes", lambda: llc_mib << 20)
    assert autotune._host_copy_bytes(True) == quick_mib << 20
    assert autotune._host_copy_bytes(False) == full_mib << 20


def test_last_level_cache_is_read_or_zero():
    llc = autotune._last_level_cache_bytes()
    assert llc >= 0
    if Path("/sys/devices/system/cpu/cpu0/cache/index3/size").exists():
        assert llc > 0


def test_workload_sizes_cover_n():
    for n in (1 << 20, (1 << 22) + 5):
        sizes = autotune._workload_sizes(n)
        assert sum(sizes) == n
        assert min(sizes) > 0
        assert len(sizes) > 4  # large and small tensors


# ----------------------------------------------------------------------------------- cache
def test_cache_round_trip(tmp_path, monkeypatch, fake):
    first = AutoTuneConfig.load_or_measure(tmp_path)
    assert fake.calls == [False]
    path = cache_path(tmp_path)
    assert path.name.startswith("autotune-")
    assert path.name.endswith(".json")
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA_VERSION
    assert data["config"] == first.to_dict()
    assert not list(tmp_path.glob("*.tmp")), "temporary file left behind"

    forbid_measure(monkeypatch)
    assert AutoTuneConfig.load_or_measure(tmp_path) == first
    assert AutoTuneConfig.load_or_measure(str(tmp_path), quick=True) == first  # full serves quick


def test_refresh_measures_again(tmp_path, monkeypatch, fake):
    AutoTuneConfig.load_or_measure(tmp_path)
    fake.config = make_config(num_threads=2)
    again = AutoTuneConfig.load_or_measure(tmp_path, refresh=True)
    assert fake.calls == [False, False]
    assert again.num_threads == 2
    forbid_measure(monkeypatch)
    assert AutoTuneConfig.load_or_measure(tmp_path) == again  # the new result was written


def test_quick_file_does_not_serve_full_request(tmp_path, fake):
    AutoTuneConfig.load_or_measure(tmp_path, quick=True)
    AutoTuneConfig.load_or_measure(tmp_path, quick=True)
    assert fake.calls == [True]
    AutoTuneConfig.load_or_measure(tmp_path)
    assert fake.calls == [True, False]


def _good_file() -> dict:
    return {"schema": SCHEMA_VERSION, "quick": False, "config": make_config().to_dict()}


def _with_config(**kw) -> dict:
    d = _good_file()
    d["config"].update(kw)
    return d


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\xffnot json",
        b'{"schema": 1, "config": {',  # truncated
        json.dumps([1, 2]).encode(),
        json.dumps({**_good_file(), "schema": SCHEMA_VERSION + 1}).encode(),
        json.dumps({k: v for k, v in _good_file().items() if k != "schema"}).encode(),
        json.dumps(_with_config(machine="another machine")).encode(),
        json.dumps(_with_config(host_gbs="fast")).encode(),
        json.dumps({**_good_file(), "config": None}).encode(),
        json.dumps(_with_config(num_threads=5000)).encode(),
        # json reads it as an int too large for a float: a raw OverflowError
        json.dumps(_with_config(host_gbs=10**400)).encode(),
    ],
    ids=[
        "binary",
        "truncated",
        "list",
        "wrong-schema",
        "no-schema",
        "other-machine",
        "bad-field",
        "null-config",
        "too-many-threads",
        "huge-int",
    ],
)
def test_bad_cache_file_is_measured_again(tmp_path, monkeypatch, fake, content):
    path = cache_path(tmp_path)
    path.write_bytes(content)
    config = AutoTuneConfig.load_or_measure(tmp_path)
    assert fake.calls == [False]
    assert config == fake.config
    forbid_measure(monkeypatch)
    assert AutoTuneConfig.load_or_measure(tmp_path) == fake.config  # overwritten with a good one


def test_good_file_written_by_hand_is_used(tmp_path, monkeypatch):
    cache_path(tmp_path).write_text(json.dumps(_with_config(num_threads=7)))
    forbid_measure(monkeypatch)
    assert AutoTuneConfig.load_or_measure(tmp_path).num_threads == 7


def test_cache_dir_from_environment(tmp_path, monkeypatch, fake):
    env_dir = tmp_path / "env" / "nested"
    monkeypatch.setenv(CACHE_DIR_ENV, str(env_dir))
    AutoTuneConfig.load_or_measure()
    assert cache_path(env_dir).is_file()
    assert autotune.default_cache_dir() == env_dir


def test_default_cache_dir_is_under_home(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert autotune.default_cache_dir() == tmp_path / ".cache" / "memopt"
    monkeypatch.setenv(CACHE_DIR_ENV, "")  # empty: unset
    assert autotune.default_cache_dir() == tmp_path / ".cache" / "memopt"
    # as ApexW's decision cache: XDG_CACHE_HOME first (autotune had ignored it)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert autotune.default_cache_dir() == tmp_path / "xdg" / "memopt"


def test_no_home_directory_measures_without_a_cache(monkeypatch, fake):
    """A uid without a passwd entry and no HOME (docker --user 12345): Path.home() raises
    RuntimeError, which reached AdamBridge(autotune=True) as a crash. Now a warning that names
    the variable to set, and the measurement."""
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(autotune.Path, "home", staticmethod(no_home))
    with pytest.warns(RuntimeWarning, match=f"no cache directory .* \\(set {CACHE_DIR_ENV}"):
        assert AutoTuneConfig.load_or_measure() == fake.config
    assert fake.calls == [False]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_a_cache_path_that_is_no_regular_file_is_never_read_or_replaced(tmp_path, fake):
    """A FIFO at the cache path blocked load_or_measure forever; it is neither read nor
    replaced (a warning says the measurement is not kept)."""
    path = cache_path(tmp_path)
    os.mkfifo(path)
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        assert AutoTuneConfig.load_or_measure(tmp_path) == fake.config
    assert stat.S_ISFIFO(os.stat(path).st_mode)


@pytest.mark.parametrize(
    "content",
    [
        "[" * 100_000 + "]" * 100_000,  # RecursionError in json: uncaught before
        json.dumps({**_with_config(), "schema": True}),  # True == 1
    ],
    ids=["deeply-nested", "bool-schema"],
)
def test_pathological_cache_files_are_measured_again(tmp_path, fake, content):
    cache_path(tmp_path).write_text(content)
    assert AutoTuneConfig.load_or_measure(tmp_path) == fake.config
    assert fake.calls == [False]


def test_unwritable_cache_warns_and_returns_measurement(tmp_path, fake):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="could not write the cache file"):
        config = AutoTuneConfig.load_or_measure(blocker / "cache")
    assert config == fake.config


def test_command_line(tmp_path, capsys, fake):
    assert autotune.main(["--cache-dir", str(tmp_path), "--quick"]) == 0
    assert json.loads(capsys.readouterr().out) == fake.config.to_dict()
    assert fake.calls == [True]
    autotune.main(["--cache-dir", str(tmp_path), "--quick", "--refresh"])
    assert fake.calls == [True, True]


# ----------------------------------------------------------------------------------- validation
def test_dict_round_trip():
    config = make_config(d2h_gbs=50.0, h2d_gbs=51.5, duplex_gbs=90.0)
    d = json.loads(json.dumps(config.to_dict()))
    assert AutoTuneConfig.from_dict(d) == config
    assert isinstance(AutoTuneConfig.from_dict({**d, "host_gbs": 12}).host_gbs, float)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_threads": 0}, "num_threads"),
        ({"num_threads": True}, "num_threads"),
        ({"num_threads": 2.0}, "num_threads"),
        ({"num_threads": 4097}, "num_threads"),  # past the kernels' pool limit
        ({"chunk_size": 2**64}, "chunk_size"),  # past the kernels' int64
        ({"chunk_size": 100}, "chunk_size"),
        ({"host_gbs": "fast"}, "host_gbs"),
        ({"host_gbs": float("nan")}, "host_gbs"),
        ({"host_gbs": None}, "host_gbs"),
        ({"d2h_gbs": -1.0}, "d2h_gbs"),
        ({"duplex_gbs": float("inf")}, "duplex_gbs"),
        ({"duplex_gbs": 10**400}, "duplex_gbs"),
        ({"machine": ""}, "machine"),
        ({"extra": 1}, "extra"),
    ],
)
def test_from_dict_names_the_bad_field(change, field):
    d = {**make_config().to_dict(), **change}
    with pytest.raises(ConfigError, match=field):
        AutoTuneConfig.from_dict(d)


@pytest.mark.parametrize("missing", ["chunk_size", "h2d_gbs", "machine"])
def test_from_dict_names_a_missing_field(missing):
    d = make_config().to_dict()
    del d[missing]
    with pytest.raises(ConfigError, match=missing):
        AutoTuneConfig.from_dict(d)


def test_from_dict_needs_a_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        AutoTuneConfig.from_dict([("num_threads", 1)])


# ----------------------------------------------------------------------------------- lower bound
def test_step_lower_bound_host_bound():
    config = make_config(host_gbs=100.0, d2h_gbs=55.0, h2d_gbs=55.0, duplex_gbs=50.0)
    n = 494_032_768
    # host: n * 24 B at 100 GB/s = 118.57 ms; link: n * 4 B at 50 GB/s = 39.52 ms
    assert config.step_lower_bound_ms(n, 24, 4) == pytest.approx(n * 24 / 100e9 * 1e3)
    assert config.step_lower_bound_ms(n, 24, 4) == pytest.approx(118.567864, rel=1e-6)


def test_step_lower_bound_link_bound():
    config = make_config(host_gbs=400.0, d2h_gbs=55.0, h2d_gbs=55.0, duplex_gbs=95.0)
    # host: 1e9 * 12 B at 400 GB/s = 30 ms; link: 1e9 * 4 B at 95 GB/s = 42.1 ms
    assert config.step_lower_bound_ms(10**9, 12, 4) == pytest.approx(4e9 / 95e9 * 1e3)
    assert config.step_lower_bound_ms(0, 12, 4) == 0.0


def test_step_lower_bound_without_link_counts_host_only():
    config = make_config(host_gbs=20.0)
    assert config.step_lower_bound_ms(10**6, 20.0, 1000.0) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((-1, 1.0, 1.0), "n_params"),
        ((1.5, 1.0, 1.0), "n_params"),
        ((10, -1.0, 1.0), "host_bytes_per_param"),
        ((10, 1.0, float("nan")), "link_bytes_per_param"),
        ((10, float("inf"), 1.0), "host_bytes_per_param"),
        # ints beyond float's range: a bare OverflowError before
        ((10**400, 1.0, 1.0), "n_params must be an int within float's range"),
        ((10, 10**400, 1.0), r"host_bytes_per_param must be finite \(within float's range\)"),
        ((10, 1.0, 10**400), r"link_bytes_per_param must be finite \(within float's range\)"),
    ],
)
def test_step_lower_bound_rejects_bad_arguments(args, name):
    with pytest.raises(ConfigError, match=name):
        make_config().step_lower_bound_ms(*args)


def test_a_cache_dir_that_is_no_path_is_refused():
    """A bare TypeError from pathlib before."""
    match = r"cache_dir must be a path \(str or os.PathLike\) or None, got 5"
    with pytest.raises(ConfigError, match=match):
        cache_path(5)
    with pytest.raises(ConfigError, match=match):
        AutoTuneConfig.load_or_measure(5, quick=True)


def test_config_is_frozen():
    config = make_config()
    with pytest.raises(AttributeError):
        config.num_threads = 4  # type: ignore[misc]
    assert replace(config, num_threads=4).num_threads == 4


def test_cache_path_depends_on_machine(tmp_path):
    a, b = cache_path(tmp_path, "machine a"), cache_path(tmp_path, "machine b")
    assert a != b
    assert a.parent == Path(tmp_path)
    assert cache_path(tmp_path) == cache_path(tmp_path, machine_key())


def test_measure_under_a_float64_default_dtype():
    """Its workload's tensors took ``torch.set_default_dtype``'s float64: a ConfigError from the
    plan ("plan group of torch.float32 tensors ... got a torch.float64 tensor")."""
    torch.set_default_dtype(torch.float64)
    try:
        cfg = AutoTuneConfig.measure(quick=True)
    finally:
        torch.set_default_dtype(torch.float32)
    assert cfg.num_threads >= 1
    assert cfg.host_gbs > 0


def test_a_failed_construction_leaves_the_kernel_settings_as_they_were():
    """The config is applied before the host state is allocated (its pages are first-touched by
    the pool's threads); a constructor that then raised (a bad lr, no parameters) left the
    process-wide thread count and chunk size changed."""
    from memopt_core.errors import ConfigError
    from memopt_offload import AdamBridge

    before = (ops.get_num_threads(), ops.get_chunk_size())
    tuned = make_config(num_threads=before[0] + 1, chunk_size=before[1] * 2)
    try:
        with pytest.raises(ConfigError, match="learning rate"):
            AdamBridge([torch.nn.Parameter(torch.zeros(4))], lr=-1.0, autotune=tuned)
        assert (ops.get_num_threads(), ops.get_chunk_size()) == before
        AdamBridge([torch.nn.Parameter(torch.zeros(4))], autotune=tuned, pin_memory=False)
        assert (ops.get_num_threads(), ops.get_chunk_size()) == (before[0] + 1, before[1] * 2)
    finally:
        ops.set_num_threads(before[0])
        ops.set_chunk_size(before[1])


def test_a_config_of_another_machine_warns():
    from memopt_offload import AdamBridge

    before = (ops.get_num_threads(), ops.get_chunk_size())
    try:
        with pytest.warns(UserWarning, match="measured on 'another machine'"):
            AdamBridge(
                [torch.nn.Parameter(torch.zeros(4))],
                autotune=make_config(machine="another machine"),
                pin_memory=False,
            )
    finally:
        ops.set_num_threads(before[0])
        ops.set_chunk_size(before[1])


@pytest.mark.parametrize(
    ("update", "backend"),
    [("host", None), ("host", "torch"), ("device", None), ("device", "torch")],
    ids=["host", "host-torch", "device", "device-torch"],
)
def test_autotune_where_no_update_runs_the_cpu_kernels_warns(
    device, update, backend, kernel_settings
):
    """autotune sets the C++ CPU kernels' threads and chunk size: with backend="torch" (core's
    reference), or update="device" on a GPU (Triton), no update runs those kernels, and the
    config (or a measurement, autotune=True) was silently of no use. Still applied, as asked."""
    from memopt_offload import AdamBridge

    tuned = make_config(num_threads=kernel_settings[0] + 1, chunk_size=kernel_settings[1] * 2)
    params = [torch.nn.Parameter(torch.zeros(64, device=device, dtype=torch.bfloat16))]
    kw = dict(precision="bf16-ecc24", update=update, backend=backend, autotune=tuned)
    if backend == "torch" or (update == "device" and device.type == "cuda"):
        with pytest.warns(UserWarning, match="autotune has no effect") as record:
            AdamBridge(params, **kw)
        found = [w for w in record if "autotune has no effect" in str(w.message)]
        assert len(found) == 1, [str(w.message) for w in record]
        assert found[0].filename == __file__  # the user's line
    else:  # the CPU kernels run the updates
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            AdamBridge(params, **kw)
    assert (ops.get_num_threads(), ops.get_chunk_size()) == (tuned.num_threads, tuned.chunk_size)
