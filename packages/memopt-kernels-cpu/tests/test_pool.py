"""The thread pool: thread count, chunk size, first_touch, the part -> thread mapping, errors
raised inside workers, concurrent callers, fork, and results that do not depend on threads."""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
import time

import pytest
import torch

import memopt_kernels_cpu
from memopt_kernels_cpu import _core

HAS_AFFINITY = hasattr(os, "sched_getaffinity")


@pytest.mark.skipif(not HAS_AFFINITY, reason="needs os.sched_getaffinity (Linux)")
def test_default_is_the_affinity_mask(run_py):
    assert _core.default_num_threads() == len(os.sched_getaffinity(0))
    out = run_py("import memopt_kernels_cpu as m; print(m.get_num_threads())")
    assert int(out.stdout) == len(os.sched_getaffinity(0))
    cpu = min(os.sched_getaffinity(0))
    code = f"import os; os.sched_setaffinity(0, {{{cpu}}})\n" + (
        "import memopt_kernels_cpu as m; print(m.get_num_threads(), m.ops.get_num_threads())"
    )
    assert run_py(code).stdout.split() == ["1", "1"]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 16])
def test_set_num_threads(n):
    _core.set_num_threads(n)
    assert _core.get_num_threads() == n
    ids = _core._pool_probe()
    assert len(ids) == n
    if n > 1:
        assert len(set(ids)) == n  # every part ran on its own pool thread
        assert _core._pool_probe() == ids  # part p always runs on thread p


@pytest.mark.parametrize("n", [0, -1, 4097, 10**6])
def test_bad_thread_counts(n):
    before = _core.get_num_threads()
    with pytest.raises(ValueError, match=f"n must be between 1 and 4096, got {n}"):
        _core.set_num_threads(n)
    assert _core.get_num_threads() == before


def test_thread_count_type():
    with pytest.raises(TypeError):
        _core.set_num_threads(2.5)


@pytest.mark.parametrize(
    ("setter", "n", "error", "pattern"),
    [
        ("set_num_threads", True, TypeError, r"set_num_threads: n must be an int, got bool True"),
        ("set_num_threads", 2.0, TypeError, r"n must be an int, got float 2.0"),
        ("set_num_threads", 2**31, ValueError, r"set_num_threads: n = 2147483648 is out of range"),
        ("set_num_threads", 0, ValueError, r"n must be between 1 and 4096, got 0"),
        ("set_chunk_size", 2**64, ValueError, r"set_chunk_size: n = 18446744073709551616 is out"),
        ("set_chunk_size", 64.0, TypeError, r"set_chunk_size: n must be an int, got float"),
        ("set_chunk_size", 33, ValueError, r"positive multiple of 32 elements, got 33"),
    ],
)
def test_setters_name_the_argument(setter, n, error, pattern):
    """The public setters (not pybind's generic "incompatible function arguments")."""
    before = (memopt_kernels_cpu.get_num_threads(), memopt_kernels_cpu.get_chunk_size())
    with pytest.raises(error, match=pattern):
        getattr(memopt_kernels_cpu, setter)(n)
    assert (memopt_kernels_cpu.get_num_threads(), memopt_kernels_cpu.get_chunk_size()) == before


def test_resize_starts_new_threads():
    _core.set_num_threads(3)
    first = _core._pool_probe()
    _core.set_num_threads(2)
    second = _core._pool_probe()
    assert len(second) == 2
    _core.set_num_threads(3)
    assert len(_core._pool_probe()) == 3
    assert len(first) == 3


@pytest.mark.parametrize("n", [32, 64, 4096, 65536, 2**30])
def test_chunk_size(n):
    _core.set_chunk_size(n)
    assert _core.get_chunk_size() == n


def test_the_largest_chunk_size_still_steps():
    """A chunk size near the int64 maximum: ceil(total / chunk) once overflowed to 0 parts, and
    the step did nothing."""
    from memopt_core.formats import StateSpec
    from memopt_core.testing import group_step, make_grads, make_group
    from memopt_core.torch_backend import TorchBackend
    from memopt_kernels_cpu import ops

    before = _core.get_chunk_size()
    spec = StateSpec(master="fp32", moments="fp32", stochastic_rounding=False)
    try:
        _core.set_chunk_size(2**63 - 32)
        mine, ref = (make_group("adam", spec, torch.float32, [100], "cpu", lr=1e-2) for _ in "ab")
        grads = make_grads(mine, 1)
        ops.fused_step(group_step(mine, grads, 1))
        TorchBackend().step(group_step(ref, grads, 1))
        assert torch.equal(mine.params[0], ref.params[0])
        assert not torch.equal(
            mine.params[0], make_group("adam", spec, torch.float32, [100], "cpu", lr=1e-2).params[0]
        )
    finally:
        _core.set_chunk_size(before)


@pytest.mark.parametrize("n", [0, -32, 1, 33, 48, 65537])
def test_bad_chunk_sizes(n):
    before = _core.get_chunk_size()
    with pytest.raises(ValueError, match=f"positive multiple of 32 elements, got {n}"):
        _core.set_chunk_size(n)
    assert _core.get_chunk_size() == before


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize(
    ("start", "n"), [(0, 1), (0, 4095), (7, 4097), (100, 3 * 4096 + 5), (1, 2**20 + 3)]
)
def test_first_touch_zero_fills_exactly_the_buffer(ops, threads, start, n):
    _core.set_num_threads(threads)
    base = torch.full((start + n + 64,), 0xAB, dtype=torch.uint8)
    view = base[start : start + n]
    assert ops.first_touch(view) is view
    assert int(view.count_nonzero()) == 0
    assert bool((base[:start] == 0xAB).all())
    assert bool((base[start + n :] == 0xAB).all())


def test_first_touch_other_dtypes(ops):
    t = torch.full((1000, 3), 5.0)
    ops.first_touch(t)
    assert bool((t == 0).all())
    ops.first_touch(torch.empty(0))  # nothing to do


def test_first_touch_rejects(ops, core):
    with pytest.raises(Exception, match=r"first_touch needs a contiguous tensor"):
        ops.first_touch(torch.zeros(8, 8).t())
    with pytest.raises(Exception, match=r"t is on meta"):
        ops.first_touch(torch.empty(8, device="meta"))
    with pytest.raises(Exception, match=r"t must be a torch.Tensor, got list"):
        ops.first_touch([0, 0])
    with pytest.raises(ValueError, match=r"addr is required here but the address is 0"):
        core.first_touch(0, 16)
    with pytest.raises(ValueError, match=r"nbytes must be >= 0"):
        core.first_touch(16, -1)


def test_worker_exceptions_propagate_and_the_pool_survives():
    for threads in (1, 2, 3):
        _core.set_num_threads(threads)
        for part in range(threads):
            with pytest.raises(RuntimeError, match=f"pool probe: part {part} failed"):
                _core._pool_probe(part)
        assert len(_core._pool_probe()) == threads  # still works


def test_concurrent_callers_do_not_deadlock(ops):
    _core.set_num_threads(3)
    _core.set_chunk_size(64)
    idx = torch.arange(10_000)
    errors: list[BaseException] = []

    def caller(k: int) -> None:
        try:
            for i in range(30):
                ops.stream_words(k, i, idx, 1)
                _core._pool_probe()
                if k == 0 and i % 10 == 0:
                    _core.set_num_threads(2 + i % 3)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a pool call hung"
    assert not errors, errors


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_pool_works_after_fork(run_py):
    code = (
        "import os, signal, torch\n"
        "import memopt_kernels_cpu as m\n"
        "m.set_num_threads(3); m.set_chunk_size(32)\n"
        "m.ops.stream_words(1, 2, torch.arange(5000), 3)\n"  # the parent's pool is running
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.alarm(30)\n"
        "    m.ops.stream_words(1, 2, torch.arange(5000), 3)\n"
        "    ids = m._core._pool_probe()\n"
        "    os._exit(0 if len(ids) == 3 and m.get_chunk_size() == 32 else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
    )
    out = run_py(code)
    assert out.stdout.strip().splitlines()[-1] == "0", out.stdout + out.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX resource limits")
def test_threads_that_cannot_start_are_named(run_py):
    """Under an address-space limit 4096 threads cannot all start: the error names the pool,
    the counts and the setting (it was a bare "Resource temporarily unavailable"), no kernel
    runs, and a smaller pool works again."""
    code = (
        "import resource, torch\n"
        "import memopt_kernels_cpu as m\n"
        "x = torch.randn(1 << 20)\n"
        "want = m.ops.encode_moment('bf16', x)['']\n"
        "used = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), resource.RLIM_INFINITY))\n"
        "m.set_num_threads(4096); m.set_chunk_size(32)\n"  # enough parts for every thread
        "try:\n"
        "    m.ops.encode_moment('bf16', x)\n"
        "    print('no error')\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
        "m.set_num_threads(2)\n"
        "print(torch.equal(m.ops.encode_moment('bf16', x)[''], want))\n"
    )
    out = run_py(code).stdout.strip().splitlines()
    assert re.fullmatch(
        r"memopt-kernels-cpu could start only \d+ of the 4096 threads asked for \(.+\); lower "
        r"memopt_kernels_cpu.set_num_threads",
        out[0],
    ), out
    assert out[1] == "True"


def _step_all(ops, make_work, bits, threads: int, chunk: int):
    _core.set_num_threads(threads)
    _core.set_chunk_size(chunk)
    sizes = (1, 31, 33, 64, 1000, 4099, 0, 70_001)
    state = None
    work = None
    for step in (1, 2):
        w = make_work("adamw", "ecc24", "q8", sizes=sizes, step=step, weight_decay=0.1)
        if work is not None:  # carry the state of step 1 into step 2
            for a, b in zip(w.plan.params, work.plan.params, strict=True):
                a.copy_(b)
            for a, b in zip(w.arena.tensors(), work.arena.tensors(), strict=True):
                a.copy_(b)
        ops.fused_step(w)
        work = w
        state = bits(w)
    return state


def test_results_do_not_depend_on_threads_or_chunks(ops, make_work, bits):
    want = _step_all(ops, make_work, bits, 1, 65536)
    for threads, chunk in [(2, 32), (3, 64), (5, 4096), (7, 65536)]:
        got = _step_all(ops, make_work, bits, threads, chunk)
        bad = [k for k in want if not torch.equal(want[k], got[k])]
        assert not bad, f"{threads} threads, chunks of {chunk}: {bad} differ"


def test_gil_is_released(ops):
    """A long C++ call lets another Python thread run."""
    _core.set_num_threads(1)
    t = torch.empty(64 * 2**20, dtype=torch.uint8)  # 64 MiB: a few ms of memset
    ticks = 0
    done = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1

    th = threading.Thread(target=spin)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # the spinner gets no forced turn during the test
    during = []
    try:
        th.start()
        # on a loaded machine the OS may not run the spinner within one call: calls for up to
        # 0.5 s, less than the switch interval, so a call that held the GIL lets it tick in none
        deadline = time.perf_counter() + 0.5
        while not any(during) and time.perf_counter() < deadline:
            before = ticks
            ops.first_touch(t)
            during.append(ticks - before)
    finally:
        done.set()
        th.join()
        sys.setswitchinterval(interval)
    assert max(during) > 0, during


@pytest.mark.parametrize(
    ("padded", "chunk", "threads", "want"),
    [
        ([64] * 8, 65536, 16, [0, 8]),  # 512 elements: one part, in the caller, no pool wake-up
        ([32] * 5000, 65536, 16, [0, 5000]),  # 160K elements in 5000 chunks: 3 parts at most
        ([65536] * 8, 65536, 16, list(range(9))),  # one chunk per part
        ([65536] * 8, 65536, 2, [0, 4, 8]),
        ([3 * 65536, 32], 65536, 2, [0, 2, 4]),  # balanced by elements, not by chunks
        ([100000], 65536, 4, [0, 1, 2]),  # two chunks of 65536 elements at most: two parts
        ([], 65536, 4, []),
        ([0, 0], 65536, 4, []),
    ],
)
def test_step_partition(padded, chunk, threads, want):
    """A step is cut into at most one part per chunk of elements of the whole step: a step over
    many small tensors does not wake every pool thread for a few microseconds of work."""
    first = _core._step_partition(padded, chunk, threads)
    if padded == [32] * 5000:
        assert len(first) - 1 == 3
        assert (first[0], first[-1]) == (0, 5000)
    else:
        assert first == want


def test_step_partition_invariants():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        padded = (torch.randint(0, 9000, (n,), generator=gen) * 32).tolist()
        chunk = 32 * int(torch.randint(1, 300, (1,), generator=gen))
        threads = int(torch.randint(1, 9, (1,), generator=gen))
        first = _core._step_partition(padded, chunk, threads)
        chunks = sum(-(-p // chunk) for p in padded)
        if chunks == 0:
            assert first == []
            continue
        parts = len(first) - 1
        assert (first[0], first[-1]) == (0, chunks)
        assert all(a <= b for a, b in itertools.pairwise(first))
        assert 1 <= parts <= min(threads, -(-sum(padded) // chunk), chunks)


def test_step_partition_rejects():
    with pytest.raises(ValueError, match="positive"):
        _core._step_partition([64], 0, 2)
    with pytest.raises(ValueError, match=">= 0"):
        _core._step_partition([-32], 64, 2)
