"""The capture checks (``MemOptimizer._refuse_invalid_capture``), on the CPU: a capture faked
by a fixture, and a ``meta`` tensor standing for a GPU tensor lr outside host memory. Every rule reads a tensor lr on
its parameters' device (the Triton tests check the bits); on another device a captured step
would read it on the host, which a capture cannot hold: refused, naming it."""

from __future__ import annotations

import warnings

import pytest
import torch

from memopt_core import MemOptimizer
from memopt_core.errors import ConfigError

RULES = ["adamw", "lion", "sgd", "sgdw"]


def _opt(rule, device="cpu", **kw):
    if rule.startswith("sgd"):
        kw.setdefault("momentum", 0.9)
    param = torch.nn.Parameter(torch.ones(4, device=device))
    return MemOptimizer([param], rule=rule, capturable=True, **kw)


def _off_host(value=1e-3):
    return torch.tensor(value, device="meta")


@pytest.mark.parametrize("key", ["lr", "weight_decay"])
@pytest.mark.parametrize("rule", RULES)
def test_an_lr_on_another_device_than_the_parameters_is_refused(rule, key):
    opt = _opt(rule)
    opt.param_groups[0][key] = _off_host()
    with pytest.raises(ConfigError, match=rf"param group 0: {key} is a tensor on meta and param"):
        opt._refuse_unready_capture()


def test_a_device_initial_lr_beside_a_float_lr_is_refused():
    opt = _opt("adamw", decouple_lr=True, weight_decay=0.1)
    opt.param_groups[0]["initial_lr"] = _off_host()
    with pytest.raises(ConfigError, match="initial_lr is a tensor on meta but lr is not"):
        opt._refuse_unready_capture()
    # without decouple_lr it is never read
    opt = _opt("adamw", weight_decay=0.1)
    opt.param_groups[0]["initial_lr"] = _off_host()
    opt._refuse_unready_capture()


@pytest.mark.parametrize("rule", RULES)
def test_an_lr_on_the_parameters_device_is_accepted(rule):
    # SGD too: the words kernel computes its lr word on the device, as Lion's
    opt = _opt(rule, device="meta", weight_decay=0.1, decouple_lr=rule in ("sgdw", "adamw"))
    opt.param_groups[0]["lr"] = _off_host()
    opt.param_groups[0]["initial_lr"] = _off_host()
    opt.param_groups[0]["weight_decay"] = _off_host(0.1)
    opt._refuse_unready_capture()
    # their values are never read on the host (a meta tensor has none); shapes are checked
    opt._check_group(opt.param_groups[0], "(param group 0)")
    opt.param_groups[0]["weight_decay"] = torch.zeros(2, device="meta")
    with pytest.raises(ConfigError, match=r"weight_decay \(param group 0\) must be a float or"):
        opt._check_group(opt.param_groups[0], "(param group 0)")


@pytest.fixture
def _capturing(monkeypatch):
    """Every step runs as if inside a CUDA graph capture."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


@pytest.mark.usefixtures("_capturing")
@pytest.mark.parametrize("what", ["step", "step_parameters"])
def test_a_captured_step_without_capturable_is_refused(what):
    """step_parameters (gradient release's step) was captured without a check: the graph froze
    the host step count, and every replay repeated the captured step."""
    param = torch.nn.Parameter(torch.ones(4))
    opt = MemOptimizer([param], rule="adamw", capturable=False)
    param.grad = torch.ones(4)
    run = opt.step if what == "step" else lambda: opt.step_parameters([param])
    with pytest.raises(ConfigError, match=rf"\.{what}\(\) is being captured .* capturable=False"):
        run()
    assert torch.equal(param, torch.ones(4))
    assert not opt.state


@pytest.mark.usefixtures("_capturing")
def test_a_first_step_of_step_parameters_inside_a_capture_is_refused():
    """Only the parameters it steps count: one without a gradient may have no state yet."""
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = MemOptimizer([a, b], rule="adamw", capturable=True)
    with pytest.raises(ConfigError, match="first step inside a CUDA graph capture"):
        opt.step_parameters([a], grads={a: torch.ones(4)})
    assert torch.equal(a, torch.ones(4))
    assert not opt.state
    opt.step_parameters([b])  # no gradient: nothing to capture, nothing refused


def test_load_state_dict_after_a_capture_warns(monkeypatch):
    """The load moves the state to new memory: a graph captured before replays freed addresses
    (an illegal address on an H100), so the load says to capture again, once."""
    opt = MemOptimizer([torch.nn.Parameter(torch.ones(4))], rule="adamw", capturable=True)
    saved = opt.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(saved)  # nothing captured yet
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert opt._refuse_invalid_capture("step")  # what a captured step() checks first
    monkeypatch.undo()
    with pytest.warns(RuntimeWarning, match="capture the step again"):
        opt.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(saved)  # warned once: the next capture sets it again
