"""``mode="auto"``: a decision from timed trial steps, written to and reproduced from its cache,
inspectable, and never a change to the computed bits."""

from __future__ import annotations

import copy
import json
import os
import pickle
import stat
import warnings
from typing import Any

import pytest
import torch
from apexw_testutil import (
    assert_same,
    fused_backend_for,
    make_params,
    reference_for,
    set_cpu_backend,
    set_grads,
    step_both,
    triton_interpreter_ready,
    twin,
)

from memopt_apexw import ApexW, ModeDecision, auto_mode
from memopt_apexw.auto_mode import TIMED_ROUNDS, WARMUP_STEPS, Trial
from memopt_core.errors import ConfigError, NumericsError


def train(opt, params, steps):
    for step in range(1, steps + 1):
        set_grads(params, step)
        opt.step()


# two candidates: warm-up steps, then per round an untimed re-entry and a timed step each
TRIAL_STEPS = 2 * WARMUP_STEPS + 2 * 2 * TIMED_ROUNDS
needs_two_candidates = pytest.mark.skipif(
    fused_backend_for(torch.device("cpu")) is None,
    reason="a trial needs a fused CPU backend next to core's torch one (memopt-kernels-cpu)",
)


def test_trial_schedule_and_decision():
    t = Trial(["fused", "torch"])
    seen = []
    while (nxt := t.next()) is not None:
        seen.append(nxt)
        mode, timed = nxt
        if timed:
            t.record(mode, 1.0 if mode == "fused" else 2.0)
    assert (
        seen[: 2 * WARMUP_STEPS]
        == [("fused", False)] * WARMUP_STEPS + [("torch", False)] * WARMUP_STEPS
    )
    assert (
        seen[2 * WARMUP_STEPS :]
        == [("fused", False), ("fused", True), ("torch", False), ("torch", True)] * TIMED_ROUNDS
    )
    assert len(seen) == TRIAL_STEPS
    assert t.decide() == "fused"
    assert t.medians() == {"fused": 1.0, "torch": 2.0}


def _run_trial(cost):
    """Run a Trial; ``cost(candidate, previous candidate, its timed count)`` is a step's time."""
    t = Trial(["fused", "torch"])
    seen, prev = [], None
    while (nxt := t.next()) is not None:
        seen.append(nxt)
        mode, is_timed = nxt
        if is_timed:
            t.record(mode, cost(mode, prev, len(t.times[mode])))
        prev = mode
    return t, seen


def test_a_switch_cost_is_never_timed():
    """A switch between candidates has one-time costs (a CUDA graph captured at the fused
    candidate's 3rd step, counters moving between host and device under a GradScaler). Timed,
    they made fused look 100x slower and torch was picked and cached (audit F1, F2)."""

    def cost(mode, prev, _):
        return (1.0 if mode == "fused" else 2.0) + (100.0 if prev != mode else 0.0)

    t, seen = _run_trial(cost)
    for i, (mode, is_timed) in enumerate(seen):
        if is_timed:
            assert seen[i - 1] == (mode, False)  # the same candidate ran just before
    assert t.times == {"fused": [1.0] * TIMED_ROUNDS, "torch": [2.0] * TIMED_ROUNDS}
    assert t.decide() == "fused"


def test_one_slow_sample_does_not_drop_a_candidate():
    """A candidate was dropped on its first timed sample alone (audit F1)."""
    t, _ = _run_trial(lambda mode, prev, n: (100.0 if n == 0 else 1.0) if mode == "fused" else 20.0)
    assert t.times == {"fused": [100.0, 1.0, 1.0], "torch": [20.0] * TIMED_ROUNDS}
    assert t.decide() == "fused"


def test_trial_stops_timing_a_far_slower_candidate():
    t = Trial(["fused", "torch"])
    timed = []
    while (nxt := t.next()) is not None:
        if nxt[1]:
            timed.append(nxt[0])
            t.record(nxt[0], 1.0 if nxt[0] == "fused" else 100.0)
    # dropped once both have 2 samples, which ends the trial after 2 rounds
    assert timed == ["fused", "torch", "fused", "torch"]
    assert t.decide() == "fused"


@needs_two_candidates
def test_decision_is_measured_cached_and_reproduced(tmp_path, monkeypatch):
    cache = tmp_path / "modes.json"
    a = make_params("cpu")
    opt = ApexW(a, mode_cache=cache)
    train(opt, a, TRIAL_STEPS)
    assert opt.mode_decision is None or opt.mode_decision.source == "measured"
    train(opt, a, 1)
    d = opt.mode_decision
    assert d is not None
    assert d.source == "measured"
    assert d.mode in ("fused", "torch")
    assert set(d.timings_ms) <= {"fused", "torch"}
    assert d.mode == min(d.timings_ms, key=d.timings_ms.__getitem__)
    entry = json.loads(cache.read_text())["entries"][d.signature]
    assert entry["mode"] == d.mode
    assert entry["about"]["tensors"] == len(a)

    def no_trial(*args, **kwargs):
        raise AssertionError("a cached signature must not run trial steps")

    monkeypatch.setattr(auto_mode, "Trial", no_trial)
    monkeypatch.setattr("memopt_apexw.apexw.Trial", no_trial)
    b = make_params("cpu")
    again = ApexW(b, mode_cache=cache)
    train(again, b, 2)
    assert again.mode_decision.mode == d.mode
    assert again.mode_decision.source == "cache"
    assert again.mode_decision.timings_ms == d.timings_ms


def test_signature_depends_on_shapes_dtypes_and_state():
    def key(params, state="bf16", capturable=False):
        opt = ApexW(params, state=state, mode_cache=None)
        return auto_mode.signature(opt.param_groups, capturable)[0]

    base = key([torch.zeros(4, 4, requires_grad=True)])
    assert base == key([torch.zeros(4, 4, requires_grad=True)])
    assert base != key([torch.zeros(16, requires_grad=True)])
    assert base != key([torch.zeros(4, 4, dtype=torch.bfloat16, requires_grad=True)])
    assert base != key([torch.zeros(4, 4, requires_grad=True)], state="q8")
    assert base != key([torch.zeros(4, 4, requires_grad=True)], capturable=True)


@pytest.mark.parametrize("change", ["frozen", "check_numerics"])
def test_a_decision_is_not_reused_when_the_step_does_other_work(tmp_path, change):
    """The signature ignored which tensors train and check_numerics, both of which change the
    step's work: a decision measured under one was read back under the other (audit F7)."""
    cache = tmp_path / "modes.json"
    a = make_params("cpu")
    plain = ApexW(a, mode_cache=cache)
    key, about = auto_mode.signature(plain.param_groups, False)
    auto_mode.save_decision(cache, key, ModeDecision("torch", "measured", {"torch": 1.0}), about)
    control = ApexW(a, mode_cache=cache)
    train(control, a, 1)
    assert control.mode_decision.source == "cache"  # the entry is read
    b = make_params("cpu")
    if change == "frozen":
        b[-1].requires_grad_(False)
    opt = ApexW(b, mode_cache=cache, check_numerics=change == "check_numerics")
    train(opt, b, 1)
    assert opt.mode_decision is None or opt.mode_decision.source != "cache"
    assert auto_mode.signature(opt.param_groups, False, opt.check_numerics)[0] != key


@needs_two_candidates
def test_corrupt_cache_is_remeasured_and_rewritten(tmp_path):
    cache = tmp_path / "modes.json"
    cache.write_text("{not json")
    a = make_params("cpu")
    opt = ApexW(a, mode_cache=cache)
    train(opt, a, TRIAL_STEPS + 1)
    assert opt.mode_decision.source == "measured"
    assert json.loads(cache.read_text())["version"] == 1


@needs_two_candidates
@pytest.mark.parametrize("case", ["deeply-nested", "int-beyond-float"])
def test_a_cache_that_broke_every_step_is_remeasured(tmp_path, case):
    """RecursionError and OverflowError escaped the cache read at every step (audit round 4)."""
    a = make_params("cpu")
    key = auto_mode.signature(ApexW(a, mode_cache=None).param_groups, False)[0]
    cache = tmp_path / "modes.json"
    if case == "deeply-nested":
        cache.write_text("[" * 200000)
    else:  # an int JSON reads exactly and float() cannot convert
        entry = '{"mode": "fused", "timings_ms": {"fused": 1' + "0" * 400 + "}}"
        cache.write_text(f'{{"version": 1, "entries": {{"{key}": {entry}}}}}')
    opt = ApexW(a, mode_cache=cache)
    train(opt, a, TRIAL_STEPS + 1)
    assert opt.mode_decision.source == "measured"


@needs_two_candidates
def test_a_cache_path_that_is_no_regular_file_is_left_alone(tmp_path):
    """The rename replaced whatever the path named (a device such as /dev/null became a regular
    file), and a FIFO blocked the read forever; a symlink was replaced instead of followed."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    a = make_params("cpu")
    opt = ApexW(a, mode_cache=fifo)
    with pytest.warns(UserWarning, match="is not a regular file"):
        train(opt, a, TRIAL_STEPS + 1)
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    shared = tmp_path / "shared.json"
    link = tmp_path / "link.json"
    link.symlink_to(shared)
    b = make_params("cpu")
    opt = ApexW(b, mode_cache=link)
    train(opt, b, TRIAL_STEPS + 1)
    assert link.is_symlink()
    assert json.loads(shared.read_text())["entries"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600


@needs_two_candidates
def test_a_timed_step_that_raises_leaves_the_trial_going():
    """A NumericsError in a timed trial step left its candidate without a time, and every later
    step raised StatisticsError (audit round 4)."""
    a = make_params("cpu")
    opt = ApexW(a, mode_cache=None, check_numerics=True)
    train(opt, a, 2 * WARMUP_STEPS + 1)  # warm-up and the first re-entry step
    p = next(p for p in a if p.numel() and p.grad is not None)
    p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(NumericsError):
        opt.step()  # the first timed step
    train(opt, a, TRIAL_STEPS + 1)
    assert opt.mode_decision.source == "measured"


def test_a_timed_step_without_a_time_is_taken_again():
    """A trial whose timed steps all raised ended with no timing, "decided" torch (labelled
    measured) and cached it: a timed slot that recorded nothing is handed out again."""
    t = Trial(["fused", "torch"])
    seen, raised = [], 0
    while (nxt := t.next()) is not None:
        seen.append(nxt)
        if nxt[1]:
            if raised < 3:  # the first three timed steps raise
                raised += 1
                continue
            t.record(nxt[0], 1.0 if nxt[0] == "fused" else 2.0)
    timed = [c for c, is_timed in seen if is_timed]
    assert timed[:4] == ["fused", "fused", "fused", "fused"]  # taken again until it ran
    assert t.medians() == {"fused": 1.0, "torch": 2.0}
    assert t.decide() == "fused"


@needs_two_candidates
def test_a_trial_of_raising_steps_caches_a_measured_decision(tmp_path):
    a = make_params("cpu")
    opt = ApexW(a, mode_cache=tmp_path / "modes.json", check_numerics=True)
    p = next(p for p in a if p.numel())
    for step in range(1, 2 * WARMUP_STEPS + 2 * TIMED_ROUNDS + 1):  # every trial step raises
        set_grads(a, step)
        p.grad = torch.full_like(p, float("nan"))
        with pytest.raises(NumericsError):
            opt.step()
    assert opt.mode_decision is None  # no decision from no timing
    train(opt, a, TRIAL_STEPS + 1)
    assert set(opt.mode_decision.timings_ms) == {"fused", "torch"}


@needs_two_candidates
def test_a_group_added_during_the_trial_starts_it_over(tmp_path):
    """The decision was stored under the signature of the model before the group came."""
    a = make_params("cpu")
    opt = ApexW(a, mode_cache=tmp_path / "modes.json")
    train(opt, a, WARMUP_STEPS + 1)
    extra = torch.nn.Parameter(torch.randn(64))
    opt.add_param_group({"params": [extra]})
    for step in range(1, TRIAL_STEPS + 2):
        set_grads(a, step)
        extra.grad = torch.ones(64)
        opt.step()
    decision = opt.mode_decision
    assert decision is not None
    assert decision.source == "measured"
    assert decision.signature == auto_mode.signature(opt.param_groups, False)[0]


def test_mode_torch_ignores_memopt_backend(monkeypatch):
    """mode="torch" runs core's torch step whatever MEMOPT_BACKEND says, as documented; a
    name that cannot run here refused the construction."""
    for env in ("bogus", "triton" if not torch.cuda.is_available() else "bogus"):
        monkeypatch.setenv("MEMOPT_BACKEND", env)
        a = make_params("cpu")
        b = twin(a)
        opt, ref = ApexW(a, mode="torch"), reference_for(b)
        assert opt.mode_decision == ModeDecision("torch", "fixed")
        for step in range(1, 3):
            step_both(a, b, opt, ref, step)
        assert_same(a, b, opt, ref)


def test_a_cache_path_with_a_nul_byte_is_refused():
    """It was accepted, and every step after the trial raised ValueError writing it."""
    with pytest.raises(ConfigError, match="mode_cache must be"):
        ApexW(make_params("cpu"), mode_cache="/tmp/modes\0.json")


@needs_two_candidates
@pytest.mark.parametrize("nothing", ["scaler-skips", "no-gradients"])
def test_a_step_that_updates_nothing_is_not_timed(nothing):
    """A GradScaler's skipped step (found inf) and a step without gradients update nothing in
    either mode; timed, they made the trial pick the faster way of doing nothing and cache it
    (the torch mode, 25-50x slower at its real steps on a 1M-element CPU parameter)."""
    a = make_params("cpu")
    opt = ApexW(a, mode_cache=None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
    for _ in range(3 * TRIAL_STEPS):  # well past a whole trial
        if nothing == "scaler-skips":
            opt.zero_grad(set_to_none=True)
            scaler.scale(sum(p.sum() for p in a) * float("inf")).backward()
            scaler.step(opt)  # skipped: found inf
            scaler.update(2.0**10)  # keep the scale
        else:
            opt.zero_grad(set_to_none=True)
            opt.step()
    assert opt.mode_decision is None  # no timed slot was spent
    assert not any(opt._trial.times.values())
    train(opt, a, TRIAL_STEPS)
    assert opt.mode_decision.source == "measured"
    assert set(opt.mode_decision.timings_ms) == {"fused", "torch"}


def test_an_only_candidate_decision_is_made_again_after_unpickling(monkeypatch):
    """ "only candidate" holds for the process that made it (no kernel backend there): an
    unpickled copy decides again, as docs/apexw.md says of every auto decision."""
    with monkeypatch.context() as m:
        m.setattr(ApexW, "_fused_names", lambda self: {"torch"})
        a = make_params("cpu")
        opt = ApexW(a, mode_cache=None)
        train(opt, a, 1)
        assert opt.mode_decision.source == "only candidate"
        blob = pickle.dumps(opt)
    clone = pickle.loads(blob)
    assert clone.mode_decision is None
    assert copy.deepcopy(opt).mode_decision is None


@needs_two_candidates
def test_an_unpickled_optimizer_decides_again():
    """A measured decision belongs to the process that made it: pickled with it, "fused" raised
    where the kernels could not run. The copy decides again (the same bits either way)."""
    a = make_params("cpu")
    opt = ApexW(a, mode_cache=None)
    train(opt, a, TRIAL_STEPS + 1)
    assert opt.mode_decision.source == "measured"
    clone = pickle.loads(pickle.dumps(opt))
    assert clone.mode_decision is None
    assert copy.deepcopy(opt).mode_decision is None
    assert ApexW.__getstate__(clone)["mode"] == "auto"


@needs_two_candidates
def test_unwritable_cache_warns_and_keeps_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    a = make_params("cpu")
    opt = ApexW(a, mode_cache=blocker / "modes.json")  # a folder that cannot exist
    with pytest.warns(UserWarning, match="could not write its mode cache"):
        train(opt, a, TRIAL_STEPS + 1)
    assert opt.mode_decision.source == "measured"


@needs_two_candidates
def test_no_cache_measures_in_memory(tmp_path):
    a = make_params("cpu")
    opt = ApexW(a, mode_cache=None)
    train(opt, a, TRIAL_STEPS + 1)
    assert opt.mode_decision.source == "measured"
    assert opt.mode_decision.cache_path is None
    assert not list(tmp_path.iterdir())


def test_a_cache_variable_naming_a_folder_puts_the_file_in_it(tmp_path, monkeypatch):
    """MEMOPT_APEXW_CACHE="dir/" (a folder meant, not yet there) made a file named "dir":
    Path() drops the trailing separator. A trailing separator, or an existing folder, now
    holds apexw-modes.json; anything else is the file itself."""
    monkeypatch.setenv(auto_mode.CACHE_ENV, f"{tmp_path}/new{os.sep}")
    assert auto_mode.default_cache_path() == tmp_path / "new" / "apexw-modes.json"
    (tmp_path / "there").mkdir()
    monkeypatch.setenv(auto_mode.CACHE_ENV, str(tmp_path / "there"))
    assert auto_mode.default_cache_path() == tmp_path / "there" / "apexw-modes.json"
    monkeypatch.setenv(auto_mode.CACHE_ENV, str(tmp_path / "modes.json"))
    assert auto_mode.default_cache_path() == tmp_path / "modes.json"


@needs_two_candidates
@pytest.mark.parametrize("how", ["existing", "trailing separator"])
def test_a_mode_cache_naming_a_folder_puts_the_file_in_it(tmp_path, how):
    """ApexW(mode_cache=<a folder>) was never written (each trial warned that the write
    failed), while MEMOPT_APEXW_CACHE=<a folder> holds apexw-modes.json: the same rule now."""
    if how == "existing":
        (tmp_path / "modes").mkdir()
        given: Any = tmp_path / "modes"
    else:
        given = f"{tmp_path}/modes{os.sep}"
    a = make_params("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = ApexW(a, mode_cache=given)
        train(opt, a, TRIAL_STEPS + 1)
    d = opt.mode_decision
    assert d is not None
    assert d.source == "measured"
    saved = json.loads((tmp_path / "modes" / "apexw-modes.json").read_text())
    assert saved["entries"][d.signature]["mode"] == d.mode


def test_no_home_directory_decides_without_a_cache(monkeypatch):
    """The default cache with no HOME and no passwd entry (docker --user 12345): Path.home()
    raised RuntimeError at the first step. Now one warning naming the variable to set, and the
    decision is made in memory."""
    monkeypatch.delenv(auto_mode.CACHE_ENV, raising=False)
    monkeypatch.delenv("MEMOPT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(auto_mode.Path, "home", staticmethod(no_home))
    a = make_params("cpu")
    opt = ApexW(a)  # the default cache
    with pytest.warns(RuntimeWarning, match=f"no default decision cache .* {auto_mode.CACHE_ENV}"):
        train(opt, a, TRIAL_STEPS + 1)
    assert opt.mode_decision.source in ("measured", "only candidate")
    assert opt.mode_decision.cache_path is None


def test_fixed_modes_report_themselves():
    assert ApexW(make_params("cpu"), mode="torch").mode_decision.source == "fixed"


def test_a_single_candidate_needs_no_trial(tmp_path, monkeypatch):
    # where no kernel backend is installed, core's torch backend is the only candidate
    monkeypatch.setattr(ApexW, "_fused_names", lambda self: {"torch"})
    a = make_params("cpu")
    opt = ApexW(a, mode_cache=tmp_path / "modes.json")
    train(opt, a, 2)
    assert opt.mode_decision.mode == "torch"
    assert opt.mode_decision.source == "only candidate"
    assert not (tmp_path / "modes.json").exists()


@needs_two_candidates
def test_a_cached_fused_decision_needs_its_kernel_backend(tmp_path, monkeypatch):
    cache = tmp_path / "modes.json"
    a = make_params("cpu")
    key = auto_mode.signature(ApexW(a, mode_cache=None).param_groups, False)[0]
    entry = {"mode": "fused", "timings_ms": {"fused": 1.0, "torch": 2.0}}
    cache.write_text(json.dumps({"version": 1, "entries": {key: entry}}))
    opt = ApexW(a, mode_cache=cache)
    train(opt, a, 1)
    assert opt.mode_decision.source == "cache"
    set_cpu_backend(monkeypatch, "failed to import: ImportError: MEMOPT_CPU_ISA='neon'")
    b = make_params("cpu")
    opt = ApexW(b, mode_cache=cache)
    train(opt, b, 2)  # the cached "fused" was measured with kernels this process cannot run
    assert (opt.mode_decision.mode, opt.mode_decision.source) == ("torch", "only candidate")


@pytest.mark.parametrize(
    "entries",
    [
        lambda key: [],
        lambda key: {key: []},
        lambda key: {key: {"mode": "fused", "timings_ms": [1, 2]}},
        lambda key: {key: {"mode": "fused", "timings_ms": {"fused": "x"}}},
    ],
    ids=["entries-list", "entry-list", "timings-list", "timing-str"],
)
def test_cache_of_another_shape_is_remeasured_and_rewritten(tmp_path, entries):
    cache = tmp_path / "modes.json"
    a = make_params("cpu")
    key = auto_mode.signature(ApexW(a, mode_cache=None).param_groups, False)[0]
    cache.write_text(json.dumps({"version": 1, "entries": entries(key)}))
    assert auto_mode.load_decision(cache, key) is None
    opt = ApexW(a, mode_cache=cache)
    train(opt, a, TRIAL_STEPS + 1)
    assert opt.mode_decision.source in ("measured", "only candidate")
    decision = auto_mode.ModeDecision("torch", "measured", {"torch": 1.5}, key)
    cache.write_text(json.dumps({"version": 1, "entries": entries(key)}))
    auto_mode.save_decision(cache, key, decision, {})
    assert auto_mode.load_decision(cache, key).timings_ms == {"torch": 1.5}


@pytest.mark.parametrize(
    ("env", "mode", "ran"),
    [("torch", "auto", "torch"), ("torch", "fused", "torch"), ("cpu", "auto", "cpu")]
    + [("triton", "auto", "triton")] * triton_interpreter_ready(),
)
def test_memopt_backend_forces_the_only_candidate(env, mode, ran, monkeypatch):
    if fused_backend_for(torch.device("cpu")) is None:
        pytest.skip("the automatic choice would be core's torch backend anyway")
    monkeypatch.setenv("MEMOPT_BACKEND", env)
    monkeypatch.setattr("memopt_apexw.apexw.Trial", None)  # a forced backend is not measured
    a = make_params("cpu")
    b = twin(a)
    opt, ref = ApexW(a, mode=mode), reference_for(b)
    assert opt.mode_decision == ModeDecision("torch" if ran == "torch" else "fused", "forced")
    for step in range(1, 4):
        step_both(a, b, opt, ref, step)
    assert_same(a, b, opt, ref)
    assert {e.backend.name for c in opt._cached_steps.values() for e in c.entries} == {ran}
    assert ApexW(a, backend="auto").mode_decision is None  # core's rule: "auto" ignores it
    if env == "torch":
        with pytest.raises(ConfigError, match="MEMOPT_BACKEND=torch forces core's torch step"):
            ApexW(a, capturable=True)


def test_signature_follows_the_kernel_thread_pool():
    mk = pytest.importorskip("memopt_kernels_cpu")
    groups = ApexW(make_params("cpu"), mode_cache=None).param_groups
    threads = mk.get_num_threads()
    before = auto_mode.signature(groups, False)[0]
    mk.set_num_threads(2 if threads == 1 else 1)  # the fused step's pool, not torch's threads
    try:
        after = auto_mode.signature(groups, False)[0]
    finally:
        mk.set_num_threads(threads)
    assert after != before


def test_signature_follows_the_kernels_isa_and_versions():
    """A decision measured on one instruction set (MEMOPT_CPU_ISA) or with other kernel
    packages is not reused: they set the fused step's speed."""
    mk = pytest.importorskip("memopt_kernels_cpu")
    isas = mk.supported_isas()
    if len(isas) < 2:
        pytest.skip("needs a host with two instruction sets")
    groups = ApexW(make_params("cpu"), mode_cache=None).param_groups
    isa = mk.get_isa()
    before, about = auto_mode.signature(groups, False)
    mk.set_isa(next(i for i in isas if i != isa))
    try:
        after = auto_mode.signature(groups, False)[0]
    finally:
        mk.set_isa(isa)
    assert after != before
    assert about["memopt_kernels_cpu"] == mk.__version__
    assert about["memopt_core"] != "none"


@needs_two_candidates
@pytest.mark.parametrize("missing_at", [3, 4, TRIAL_STEPS + 2])
def test_a_parameter_without_a_gradient_keeps_the_bits(tmp_path, missing_at):
    """A parameter without a gradient at one step (unused in that forward) advances its
    neighbours' step counts and not its own; the other mode's cached step, which updates them in
    one work, must not replay them at one count (steps 3 and 4 fall in the trial, where the
    modes alternate; the last one after the decision)."""
    a = make_params(torch.device("cpu"))
    b = twin(a)
    opt = ApexW(a, lr=1e-2, mode="auto", mode_cache=tmp_path / "modes.json")
    ref = reference_for(b, lr=1e-2)
    for step in range(1, TRIAL_STEPS + 5):
        set_grads(a, step)
        set_grads(b, step)
        if step == missing_at:
            a[0].grad = b[0].grad = None
        opt.step()
        ref.step()
        assert_same(a, b, opt, ref, f"step {step}")
    assert opt.mode_decision is not None


@needs_two_candidates
@pytest.mark.parametrize("source", ["measured", "cache"])
def test_a_group_added_after_the_decision_looks_up_the_new_model(tmp_path, source):
    """The decision of the model before the group was kept: its signature named a model that no
    longer existed, and an ApexW over the final model found no cache entry (audit F3)."""
    cache = tmp_path / "modes.json"
    if source == "cache":
        first = make_params("cpu")
        train(ApexW(first, mode_cache=cache), first, TRIAL_STEPS + 1)
    a = make_params("cpu")
    opt = ApexW(a, mode_cache=cache)
    train(opt, a, 1 if source == "cache" else TRIAL_STEPS + 1)
    assert opt.mode_decision.source == source
    old_signature = opt.mode_decision.signature
    extra = torch.nn.Parameter(torch.randn(64))
    opt.add_param_group({"params": [extra]})
    assert opt.mode_decision is None  # decided again on the next step
    a.append(extra)
    train(opt, a, TRIAL_STEPS + 1)
    d = opt.mode_decision
    assert d.source == "measured"
    assert d.signature == auto_mode.signature(opt.param_groups, False)[0] != old_signature
    b = make_params("cpu")
    fresh = ApexW(b, mode_cache=cache)
    fresh.add_param_group({"params": [torch.nn.Parameter(torch.randn(64))]})
    b.append(fresh.param_groups[1]["params"][0])
    train(fresh, b, 1)
    assert (fresh.mode_decision.source, fresh.mode_decision.mode) == ("cache", d.mode)
    assert fresh.mode_decision.signature == d.signature


@pytest.mark.parametrize("mode", ["fused", "torch"])
def test_a_group_added_to_a_fixed_mode_keeps_it(mode):
    if mode == "fused" and fused_backend_for(torch.device("cpu")) is None:
        pytest.skip("needs memopt-kernels-cpu")
    a = make_params("cpu")
    opt = ApexW(a, mode=mode, mode_cache=None)
    train(opt, a, 1)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(64))]})
    assert opt.mode_decision == ModeDecision(mode, "fixed")


def test_a_parameter_holding_state_without_a_gradient_counts_in_the_decision(monkeypatch):
    """A parameter with state (``init_state()``) but no gradient at auto mode's first step will
    step later: if no kernel backend runs it, "fused" is no candidate (it was one, and its trial
    step raised BackendUnavailableError once that parameter got a gradient)."""
    from memopt_core import backends

    real = backends.select_backend

    def select(kind, spec, device, dtype, name):  # no kernel backend for bfloat16 (simulated)
        return real(kind, spec, device, dtype, "torch" if dtype == torch.bfloat16 else name)

    monkeypatch.setattr(backends, "select_backend", select)
    pf = torch.nn.Parameter(torch.randn(64, device="cpu"))
    pb = torch.nn.Parameter(torch.randn(64, device="cpu", dtype=torch.bfloat16))
    opt = ApexW([pf, pb], mode="auto", mode_cache=None)
    opt.init_state()
    pf.grad = torch.randn(64, device="cpu")
    opt.step()
    assert opt.mode_decision is not None
    assert opt.mode_decision.mode == "torch"
    assert opt.mode_decision.source == "only candidate"
    for _ in range(6):  # every parameter stepping: the decided mode runs them all
        pf.grad = torch.randn(64, device="cpu")
        pb.grad = torch.randn(64, device="cpu", dtype=torch.bfloat16)
        opt.step()
    assert float(opt.state[pb]["step"]) == 6.0
