"""The capture checks of a GPU tensor lr (``MemOptimizer._refuse_unready_capture``), on the
CPU: a ``meta`` tensor stands for a tensor outside host memory. Adam and Lion read a tensor lr
on their parameters' device (the Triton tests check the bits); elsewhere, and for SGD, a
captured step would read it on the host, which a capture cannot hold: refused, naming it."""

from __future__ import annotations

import pytest
import torch

from memopt_core import MemOptimizer
from memopt_core.errors import ConfigError


def _opt(rule, **kw):
    return MemOptimizer([torch.nn.Parameter(torch.ones(4))], rule=rule, capturable=True, **kw)


def _off_host(value=1e-3):
    return torch.tensor(value, device="meta")


def test_an_lr_on_another_device_than_the_parameters_is_refused():
    opt = _opt("adamw")
    opt.param_groups[0]["lr"] = _off_host()
    with pytest.raises(ConfigError, match=r"param group 0: lr is a tensor on meta and param"):
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


@pytest.mark.parametrize("rule", ["sgd", "sgdw"])
def test_sgd_refuses_any_lr_off_the_host(rule):
    opt = _opt(rule, momentum=0.9, decouple_lr=rule == "sgdw", weight_decay=0.1)
    opt.param_groups[0]["lr"] = _off_host()
    with pytest.raises(ConfigError, match="lr is a tensor on a GPU, which a captured SGD step"):
        opt._refuse_unready_capture()
    assert not opt._reads_lr_on_device
    assert _opt("adamw")._reads_lr_on_device
    assert _opt("lion")._reads_lr_on_device
