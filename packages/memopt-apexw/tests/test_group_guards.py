"""ApexW guards that no test pinned (audit round 6, mutation testing round 2): groups edited or
added with round-to-nearest, another master or their own capturable, the graph step seeing a
flipped maximize or L2, decision-cache entries of another version or an unknown mode."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from memopt_apexw import ApexW, auto_mode
from memopt_apexw.graph_step import GraphStep
from memopt_core.errors import ConfigError


def _opt():
    p = torch.zeros(8, dtype=torch.bfloat16, requires_grad=True)
    return p, ApexW([p], lr=1e-3, mode="torch", mode_cache=None)


def test_a_group_edited_to_round_to_nearest_is_refused():
    p, opt = _opt()
    opt.param_groups[0]["stochastic_rounding"] = False
    p.grad = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="stochastic"):
        opt.step()


def test_an_added_group_with_round_to_nearest_is_refused():
    _p, opt = _opt()
    q = torch.zeros(8, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ConfigError, match="stochastic"):
        opt.add_param_group({"params": [q], "stochastic_rounding": False})


def test_an_added_group_with_another_master_is_refused():
    _p, opt = _opt()
    q = torch.zeros(8, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ConfigError, match="master"):
        opt.add_param_group({"params": [q], "master": "none"})


@pytest.mark.parametrize("how", ["added", "edited"])
@pytest.mark.parametrize(
    ("key", "value"),
    [("decouple_lr", True), ("momentum", 0.9), ("dampening", 0.5), ("nesterov", True)],
)
def test_a_group_setting_another_rules_key_is_refused(how, key, value):
    """ApexW's groups carry core's keys of its other rules (printed, saved in state dicts): a
    group with decouple_lr=True decayed by weight_decay instead of lr * weight_decay (a weight
    at 0.349 after 10 steps of decay where torch's AdamW leaves 0.999), momentum and dampening
    were ignored (a helper's review). Refused now, naming the key."""
    p, opt = _opt()
    q = torch.zeros(8, dtype=torch.bfloat16, requires_grad=True)
    refused = pytest.raises(ConfigError, match=rf"sets {key}={value!r}: ApexW is torch's AdamW")
    if how == "added":
        with refused:
            opt.add_param_group({"params": [q], key: value})
        assert len(opt.param_groups) == 1
    else:
        opt.param_groups[0][key] = value
        p.grad = torch.ones(8, dtype=torch.bfloat16)
        with refused:
            opt.step()
        assert not p.any()  # nothing stepped
    opt.param_groups[0][key] = {"nesterov": False, "decouple_lr": False}.get(key, 0.0)
    p.grad = torch.ones(8, dtype=torch.bfloat16)
    opt.step()


@pytest.mark.parametrize("how", ["added", "edited"])
def test_a_group_asking_for_another_mode_is_refused(how):
    """A group's mode key was ignored silently (a helper's hunt, 2026-12-07): the whole ApexW
    runs one mode."""
    p, opt = _opt()
    q = torch.zeros(8, dtype=torch.bfloat16, requires_grad=True)
    refused = pytest.raises(ConfigError, match=r"sets mode='fused', but mode is a constructor")
    if how == "added":
        with refused:
            opt.add_param_group({"params": [q], "mode": "fused"})
        assert len(opt.param_groups) == 1
    else:
        opt.param_groups[0]["mode"] = "fused"
        p.grad = torch.ones(8, dtype=torch.bfloat16)
        with refused:
            opt.step()
        assert not p.any()  # nothing stepped
    opt.param_groups[0]["mode"] = opt.mode  # the mode it runs with is fine
    p.grad = torch.ones(8, dtype=torch.bfloat16)
    opt.step()


@pytest.mark.parametrize("how", ["added", "edited"])
def test_a_group_asking_for_another_capturable_is_refused(how):
    """ApexW's capturable is the whole optimizer's CUDA graph: a group's own key was ignored
    silently (FlashAdamW refuses it; adversarial round 4)."""
    p, opt = _opt()
    q = torch.zeros(8, dtype=torch.bfloat16, requires_grad=True)
    refused = pytest.raises(ConfigError, match="capturable is a constructor argument of the whole")
    if how == "added":
        with refused:
            opt.add_param_group({"params": [q], "capturable": True})
    else:
        opt.param_groups[0]["capturable"] = True
        p.grad = torch.ones(8, dtype=torch.bfloat16)
        with refused:
            opt.step()
    opt.param_groups[0]["capturable"] = False  # the value it runs with is fine
    p.grad = torch.ones(8, dtype=torch.bfloat16)
    opt.step()


def test_variant_matches_sees_maximize_flip():
    gs = GraphStep.__new__(GraphStep)
    gs._flags = [{"maximize": False, "has_l2": False, "has_decay": True}]
    assert gs.variant_matches([SimpleNamespace(maximize=False, l2=0.0, decay=0.99)])
    assert not gs.variant_matches([SimpleNamespace(maximize=True, l2=0.0, decay=0.99)])
    assert not gs.variant_matches([SimpleNamespace(maximize=False, l2=0.1, decay=0.99)])


def test_cache_entries_of_another_version_or_mode_are_ignored(tmp_path):
    path = tmp_path / "c.json"
    good = {"mode": "fused", "timings_ms": {"fused": 1.0}}
    path.write_text(json.dumps({"version": auto_mode._CACHE_VERSION, "entries": {"k": good}}))
    assert auto_mode.load_decision(path, "k").mode == "fused"
    path.write_text(json.dumps({"version": auto_mode._CACHE_VERSION + 1, "entries": {"k": good}}))
    assert auto_mode.load_decision(path, "k") is None
    bad = dict(good, mode="bogus")
    path.write_text(json.dumps({"version": auto_mode._CACHE_VERSION, "entries": {"k": bad}}))
    assert auto_mode.load_decision(path, "k") is None
