"""ApexW's side of ``capturable=True`` checked on CPU: capturable is set after construction (CUDA
only there) and a stand-in replaces the CUDA graph. The GPU variants are in test_graph_gpu.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from apexw_testutil import fused_backend_for, make_params, set_cpu_backend, set_grads

from memopt_apexw import ApexW, auto_mode
from memopt_core.errors import ConfigError


class _NoGraph:
    """GraphStep's interface; launches nothing (only the counting around it is under test)."""

    def __init__(self, cached, device) -> None:
        self.cached = cached
        self.runs = 0

    def variant_matches(self, scalars) -> bool:
        return True

    def run(self, scalars, seed, steps) -> None:
        self.runs += 1


needs_cpu_kernels = pytest.mark.skipif(
    fused_backend_for(torch.device("cpu")) is None, reason="needs memopt-kernels-cpu"
)


@needs_cpu_kernels
def test_replayed_graph_steps_warn_past_2_24(monkeypatch):
    """``_launch_cached`` counts a replay's steps itself, and did not warn where the eager step
    does (audit F5)."""
    monkeypatch.setattr("memopt_apexw.apexw.GraphStep", _NoGraph)
    monkeypatch.setattr(ApexW, "_refuse_uncapturable", lambda self, fused: None)
    ps = [torch.randn(64, requires_grad=True) for _ in range(2)]
    opt = ApexW(ps, mode="fused", mode_cache=None)
    opt.capturable = True  # CUDA only at construction; the stand-in needs no device
    for p in ps:
        p.grad = torch.randn(64)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        st["step"] = torch.full_like(st["step"], 2**24 - 3)
    opt.load_state_dict(sd)
    opt.step()  # an ordinary step (the load dropped the cached one): to 2**24 - 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):  # replays, to 2**24 + 2
            opt.step()
    assert opt._graph.runs == 4
    assert [float(opt.state[p]["step"]) for p in ps] == [2.0**24] * 2  # float32 stops there
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(messages) == 1
    assert messages[0].startswith("step counts reached 2**24")


@pytest.mark.parametrize("cache", ["none", "torch-cached"])
def test_auto_capturable_without_a_kernel_backend_is_refused(monkeypatch, tmp_path, cache):
    """It ran core's torch step without a graph, silently, where mode='torch' is refused
    (audit F4); a cached decision must not get around it."""
    set_cpu_backend(monkeypatch, "simulated: kernels unusable here")
    a = make_params("cpu")
    path = tmp_path / "modes.json"
    opt = ApexW(a, mode_cache=path)
    opt.capturable = True
    if cache == "torch-cached":
        key, about = auto_mode.signature(opt.param_groups, True)
        auto_mode.save_decision(path, key, auto_mode.ModeDecision("torch", "measured"), about)
    set_grads(a, 1)
    before = [p.detach().clone() for p in a]
    for _ in range(2):  # at every step, before any change
        with pytest.raises(
            ConfigError,
            match=r"capturable=True captures the fused Triton step.*"
            r"simulated: kernels unusable here",
        ):
            opt.step()
    assert opt.mode_decision is None
    assert all(torch.equal(p, b) for p, b in zip(a, before, strict=True))


@needs_cpu_kernels
def test_a_torch_decision_releases_the_graph(monkeypatch):
    """The fused trial steps' graph (and its pinned ring) stayed alive after auto decided torch
    (audit F9)."""
    monkeypatch.setattr("memopt_apexw.apexw.GraphStep", _NoGraph)
    monkeypatch.setattr(ApexW, "_refuse_uncapturable", lambda self, fused: None)
    monkeypatch.setattr(auto_mode.Trial, "decide", lambda self: "torch")
    a = make_params("cpu")
    opt = ApexW(a, mode_cache=None)
    opt.capturable = True
    step = 0
    while opt.mode_decision is None:
        step += 1
        set_grads(a, step)
        opt.step()
        if step == 2 * auto_mode.WARMUP_STEPS:
            assert isinstance(opt._graph, _NoGraph)  # the fused steps replayed it
    assert opt.mode_decision.mode == "torch"
    assert opt._graph is None
