"""The capture checks of a GPU tensor lr (``MemOptimizer._refuse_unready_capture``), on the
CPU: a ``meta`` tensor stands for a tensor outside host memory. Every rule reads a tensor lr on
its parameters' device (the Triton tests check the bits); on another device a captured step
would read it on the host, which a capture cannot hold: refused, naming it."""

from __future__ import annotations

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
