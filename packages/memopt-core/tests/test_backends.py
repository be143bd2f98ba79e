"""The backend registry: entry points, KERNEL_API checks, capability queries, forced selection."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from fake_backends import FakeEntryPoint, OldBackend, RecordingBackend, install

from memopt_core import MemOptimizer, backends
from memopt_core.backends import KERNEL_API, GroupStep
from memopt_core.errors import BackendUnavailableError, ConfigError
from memopt_core.formats import StateSpec
from memopt_core.reference import AdamScalars, SGDScalars
from memopt_core.torch_backend import TorchBackend

SPEC = StateSpec(master="fp32", moments="fp32")


def test_kernel_api_level_and_torch_always_there(fresh_backends):
    assert KERNEL_API == 8
    reg = backends.available_backends()
    assert reg["torch"].usable
    assert isinstance(reg["torch"].backend, TorchBackend)
    assert isinstance(reg["torch"].backend, backends.Backend)  # satisfies the protocol


def test_registry_reports_unusable_entry_points(monkeypatch, fresh_backends):
    with pytest.warns(RuntimeWarning) as caught:  # install() discovers the entry points
        install(
            monkeypatch,
            FakeEntryPoint("old", OldBackend("old")),
            FakeEntryPoint(
                "broken", error=ImportError("libmemopt_cpu.so: cannot open shared object")
            ),
            FakeEntryPoint("nogpu", RecordingBackend("nogpu", usable=False)),
            FakeEntryPoint("junk", object()),
            FakeEntryPoint("cpu", RecordingBackend("cpu")),
        )
    # installed but broken: one warning each; unusable on this machine (nogpu): none
    assert sorted(str(w.message).split("'")[1] for w in caught) == ["broken", "junk", "old"]
    assert "reinstall the kernel package" in str(caught[0].message)
    reg = backends.available_backends()
    assert not reg["old"].usable
    assert (
        f"built for KERNEL_API 0 but memopt-core needs KERNEL_API {KERNEL_API}" in reg["old"].reason
    )
    assert not reg["broken"].usable
    assert "failed to import: ImportError: libmemopt_cpu.so" in reg["broken"].reason
    assert not reg["nogpu"].usable
    assert reg["nogpu"].reason == "no AVX2 on this CPU"
    assert not reg["junk"].usable
    assert "KERNEL_API None" in reg["junk"].reason
    assert reg["cpu"].usable
    assert reg["cpu"].origin == "entry point cpu = fake_cpu:backend"


def test_entry_point_listing_failure_does_not_break(monkeypatch, fresh_backends):
    real = importlib.metadata.entry_points

    def boom(**kw):
        if kw != {"group": "memopt.kernels"}:
            return real(**kw)
        raise RuntimeError("corrupt metadata")

    monkeypatch.setattr(importlib.metadata, "entry_points", boom)
    reg = backends.refresh_backends()
    assert reg["torch"].usable
    assert "corrupt metadata" in reg["<entry points>"].reason


def test_entry_point_factories_are_called(monkeypatch, fresh_backends):
    install(monkeypatch, FakeEntryPoint("cpu", RecordingBackend))  # a class: instantiated
    assert backends.available_backends()["cpu"].usable


def test_capabilities_say_why(monkeypatch, fresh_backends):
    with pytest.warns(RuntimeWarning, match="'old' cannot be used"):
        install(
            monkeypatch,
            FakeEntryPoint("cpu", RecordingBackend("cpu", rules=("adam",))),
            FakeEntryPoint("old", OldBackend("old")),
        )
    caps = backends.backend_capabilities("lion", SPEC, "cpu", torch.float32)
    assert caps["torch"] == (True, "supported")
    assert caps["cpu"][0] is False
    assert "does not support rule 'lion' with master 'fp32', moments 'fp32'" in caps["cpu"][1]
    assert "torch.float32 parameters on cpu" in caps["cpu"][1]
    assert caps["old"][0] is False
    assert "KERNEL_API" in caps["old"][1]
    assert backends.backend_capabilities("adam", SPEC, "cpu", torch.float32)["cpu"] == (
        True,
        "supported",
    )


def test_default_selection_order(monkeypatch, fresh_backends):
    cpu = RecordingBackend("cpu", rules=("adam",))
    install(monkeypatch, FakeEntryPoint("cpu", cpu))
    monkeypatch.delenv("MEMOPT_BACKEND", raising=False)
    assert backends.select_backend("adam", SPEC, "cpu", torch.float32) is cpu
    assert isinstance(backends.select_backend("lion", SPEC, "cpu", torch.float32), TorchBackend)
    assert isinstance(backends.select_backend("adam", SPEC, "meta", torch.float32), TorchBackend)
    assert backends.default_order("cuda") == ("triton", "torch")
    assert backends.default_order("cpu") == ("cpu", "torch")


def test_no_backend_supports_the_group(monkeypatch, fresh_backends):
    # the torch backend is the last resort only for groups it runs
    install(monkeypatch)
    monkeypatch.delenv("MEMOPT_BACKEND", raising=False)
    for rule, spec, dtype in [
        ("adamw", SPEC, torch.float32),  # an optimizer's rule name, not a backend rule
        ("adam", SPEC, torch.float64),
        ("adam", StateSpec("ecc24", "q8"), torch.float32),
    ]:
        with pytest.raises(
            BackendUnavailableError, match=f"no memopt backend supports rule '{rule}'"
        ):
            backends.select_backend(rule, spec, "cpu", dtype)
    with pytest.raises(
        ConfigError, match=r"backend must be a backend name \(str\) or None, got int 5"
    ):
        backends.select_backend("adam", SPEC, "cpu", torch.float32, backend=5)


def test_an_empty_backend_argument_is_refused_and_an_empty_variable_unsets(
    monkeypatch, fresh_backends
):
    """``backend=""`` is a name that went missing (an unset config field), not "auto"; an empty
    ``MEMOPT_BACKEND=`` is the shell's way to unset the variable."""
    install(monkeypatch)
    monkeypatch.setenv("MEMOPT_BACKEND", "")
    assert backends.forced_backend() is None
    for name in ("", "  "):
        with pytest.raises(ConfigError, match=f"backend={name!r} names no backend: pass None"):
            MemOptimizer([torch.nn.Parameter(torch.ones(3))], backend=name)
    assert backends.forced_backend(" Auto ") is None


def test_env_var_forces_torch(monkeypatch, fresh_backends):
    cpu = RecordingBackend("cpu")
    install(monkeypatch, FakeEntryPoint("cpu", cpu))
    monkeypatch.setenv("MEMOPT_BACKEND", "torch")
    assert isinstance(backends.select_backend("adam", SPEC, "cpu", torch.float32), TorchBackend)
    p = torch.nn.Parameter(torch.ones(3))
    opt = MemOptimizer([p])
    p.grad = torch.ones(3)
    opt.step()
    assert cpu.calls == []
    # an explicit backend= wins over the variable
    opt = MemOptimizer([p], backend="cpu")
    opt.step()
    assert len(cpu.calls) == 1


def test_env_var_forcing_a_missing_backend(monkeypatch, fresh_backends):
    install(monkeypatch)
    monkeypatch.setenv("MEMOPT_BACKEND", "triton")
    with pytest.raises(
        BackendUnavailableError,
        match=r"memopt backend 'triton' is not installed \(from a checkout: pip install packages/memopt-kernels-triton.*\); installed backends: torch \(forced by MEMOPT_BACKEND='triton'\)",
    ):
        backends.select_backend("adam", SPEC, "cpu", torch.float32)
    monkeypatch.setenv("MEMOPT_BACKEND", " Auto ")
    assert isinstance(backends.select_backend("adam", SPEC, "cpu", torch.float32), TorchBackend)


def test_forcing_an_unusable_or_unsupporting_backend(monkeypatch, fresh_backends):
    with pytest.warns(RuntimeWarning, match="'old' cannot be used: built for KERNEL_API 0"):
        install(  # discovers the entry points
            monkeypatch,
            FakeEntryPoint("old", OldBackend("old")),
            FakeEntryPoint("cpu", RecordingBackend("cpu", rules=("sgd",))),
        )
    with pytest.raises(
        BackendUnavailableError, match=r"'old' cannot run here: built for KERNEL_API 0"
    ):
        backends.select_backend("adam", SPEC, "cpu", torch.float32, backend="old")
    with pytest.raises(
        BackendUnavailableError,
        match=r"'cpu' \(forced by backend='cpu'\) does not support rule 'adam'",
    ):
        backends.select_backend("adam", SPEC, "cpu", torch.float32, backend="cpu")
    # the optimizer reports it at step time, before changing anything
    p = torch.nn.Parameter(torch.ones(3))
    opt = MemOptimizer([p], backend="cpu")
    p.grad = torch.ones(3)
    with pytest.raises(BackendUnavailableError, match="does not support rule 'adam'"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))
    assert p not in opt.state  # the state the refused first step built was taken back


class RefusingBackend(RecordingBackend):
    """Refuses, in ``check`` and in ``step``, a work holding the parameter ``refused``."""

    def __init__(self, refused):
        super().__init__("cpu")
        self.refused, self.checked = refused, []

    def check(self, work):
        self.checked.append(work)
        if any(p is self.refused for p in work.params):
            raise ConfigError("refused")

    def step(self, work):
        self.check(work)
        super().step(work)


@pytest.mark.parametrize("steps_before", [0, 3])  # 3: the refused step is a cached replay
def test_a_step_refused_in_a_later_group_changes_nothing(monkeypatch, fresh_backends, steps_before):
    refusing = RefusingBackend(refused=None)
    install(monkeypatch, FakeEntryPoint("cpu", refusing))
    monkeypatch.delenv("MEMOPT_BACKEND", raising=False)
    torch.manual_seed(0)
    runs = []
    for refuse_once in (True, False):  # the second run is the twin that was never refused
        a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(6))
        opt = MemOptimizer([{"params": [a]}, {"params": [b], "lr": 0.5}], rule="adamw")
        for p in (a, b):
            p.grad = torch.full_like(p, 0.25)
        for _ in range(steps_before):
            opt.step()
        if refuse_once:
            before = [a.detach().clone(), b.detach().clone()]
            refusing.refused, refusing.checked = b, []
            with pytest.raises(ConfigError, match="refused"):
                opt.step()
            assert torch.equal(a, before[0])
            assert torch.equal(b, before[1])
            # the first work is validated by its own step, the later ones beforehand (all of
            # them at a first step, whose state is taken back when one is refused)
            first = [[a]] if steps_before == 0 else []
            assert [w.params for w in refusing.checked] == [*first, [b]]
            assert (a in opt.state) == (steps_before > 0)
            refusing.refused = None
        opt.step()
        runs.append((a, b, opt.state_dict()["state"]))
        torch.manual_seed(0)
    (a1, b1, s1), (a2, b2, s2) = runs
    assert torch.equal(a1, a2)
    assert torch.equal(b1, b2)
    for i in (0, 1):  # the refused step advanced no step counter and no moment
        assert s1[i].keys() == s2[i].keys()
        assert all(torch.equal(s1[i][k], s2[i][k]) for k in s1[i])


def test_backend_receives_a_group_step(monkeypatch, fresh_backends):
    cpu = RecordingBackend("cpu")
    install(monkeypatch, FakeEntryPoint("cpu", cpu))
    monkeypatch.delenv("MEMOPT_BACKEND", raising=False)
    a, b, c = (torch.nn.Parameter(torch.randn(n)) for n in (5, 6, 7))
    opt = MemOptimizer(
        [{"params": [a]}, {"params": [b, c], "lr": 0.5}], rule="sgdw", momentum=0.9, seed=11
    )
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt.step()
    c.grad = None
    opt.step()
    first, second, a_again, third = cpu.calls
    assert (first.rule, first.step, first.first_step, first.tensor_ids, first.slots) == (
        "sgd",
        1,
        True,
        [0],
        [0],
    )
    assert second.tensor_ids == [1, 2]
    assert second.slots == [0, 1]
    assert second.full
    assert isinstance(second.scalars, SGDScalars)
    assert second.scalars.lr == 0.5
    assert second.scalars.decay == 1 - 0.5 * 0.0  # weight_decay 0
    assert second.seed == 11
    assert second.spec == StateSpec("fp32", "fp32", True)
    assert second.arena.plan is second.plan
    assert "momentum_buffer" in second.arena.codecs
    assert (third.step, third.first_step, third.slots, third.tensor_ids) == (2, False, [0], [1])
    assert not third.full
    assert third.params == [b]
    assert (a_again.step, a_again.tensor_ids) == (2, [0])
    cpu.calls.clear()
    opt = MemOptimizer([a], rule="adam")
    opt.step()
    assert isinstance(cpu.calls[0].scalars, AdamScalars)
    assert cpu.calls[0].rule == "adam"


class CountMergingBackend(RecordingBackend):
    """A backend with ``merges_step_counts``: records each ``step_all`` call's works (run by
    the torch backend) and every ``check``."""

    merges_step_counts = True

    def __init__(self):
        super().__init__("cpu")
        self.runs: list[list[int]] = []
        self.checked: list[GroupStep] = []

    def check(self, work):
        self.checked.append(work)

    def step_all(self, works, prepared=None, done=None):
        self.runs.append([w.step for w in works])
        for i, w in enumerate(works):
            TorchBackend().step(w)
            done(i)


@pytest.mark.parametrize("merges", [True, False])
def test_step_counts_of_one_group_reach_step_all_together(monkeypatch, fresh_backends, merges):
    """A group whose parameters skipped steps is stepped as one work per count: a backend with
    ``merges_step_counts`` gets them in one ``step_all`` call (which validates them itself, so
    core checks none of them first); another gets one ``step`` per count, the later ones
    checked before the first runs. Both give the torch backend's values and counts. (The first
    step, which builds the state, checks its first work too: a refusal takes the state back.)"""
    backend = CountMergingBackend()
    if not merges:
        monkeypatch.setattr(CountMergingBackend, "merges_step_counts", False)
    install(monkeypatch, FakeEntryPoint("cpu", backend))
    ps = [torch.nn.Parameter(torch.full((3,), float(k))) for k in range(3)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref = MemOptimizer(ps, backend="cpu"), MemOptimizer(qs, backend="torch")
    for skip in [(), (0,), (0, 1), ()]:  # counts then 2, 3, 4
        for k, (p, q) in enumerate(zip(ps, qs, strict=True)):
            p.grad = None if k in skip else torch.full((3,), 0.5 + k)
            q.grad = None if k in skip else torch.full((3,), 0.5 + k)
        opt.step()
        ref.step()
    assert [opt.state[p]["step"].item() for p in ps] == [2, 3, 4]
    for p, q in zip(ps, qs, strict=True):
        assert torch.equal(p, q)
    # the first three steps take one count each (steps 1, 2, 3), the last the three counts
    # 1, 2 and 3 (steps 2, 3 and 4)
    if merges:
        assert backend.runs == [[2, 3, 4]]
        assert [w.step for w in backend.checked] == [1]
        assert [w.step for w in backend.calls] == [1, 2, 3]  # a single work: step()
    else:
        assert backend.runs == []
        assert [w.step for w in backend.calls] == [1, 2, 3, 2, 3, 4]
        assert [w.step for w in backend.checked] == [1, 3, 4]


def test_launch_then_done_reports_works_that_ran():
    """``launch_then_done`` reports each work after its launch, also when a KeyboardInterrupt
    comes out of it (the kernel ran), and none when the launch raised anything else (validation
    refused it before the kernel)."""
    from memopt_core.backends import launch_then_done

    seen: list[int] = []
    launch_then_done(lambda: seen.append(-1), [3, 5], seen.append)
    assert seen == [-1, 3, 5]

    def interrupted() -> None:
        seen.append(-2)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch_then_done(interrupted, (7,), seen.append)
    assert seen[3:] == [-2, 7]

    def refused() -> None:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        launch_then_done(refused, (9,), seen.append)
    assert 9 not in seen
    launch_then_done(lambda: seen.append(-3), (1,), None)  # no bookkeeping asked for
    assert seen[-1] == -3
