"""Guards of MemOptimizer that no test pinned (audit round 6, mutation testing round 2: each
test fails on the mutant that removed or shifted its guard): step counts of partial steps, the
seed and step of a loaded state dict, refused state dicts, capturable refusals, check_numerics on
an ordinary first step, the 2**24 step-limit warning."""

from __future__ import annotations

import warnings

import pytest
import torch

from memopt_core import MemOptimizer
from memopt_core.errors import StateDictError


def _opt(n, **kw):
    ps = [torch.zeros(5, requires_grad=True) for _ in range(n)]
    return ps, MemOptimizer(ps, rule="adamw", lr=1e-2, master="none", moments="fp32", **kw)


def test_partial_step_over_many_slots_counts_once():
    ps, opt = _opt(12)
    for p in ps[:10]:
        p.grad = torch.ones(5)
    opt.step()
    assert [int(opt.state[p]["step"]) for p in ps[:10]] == [1] * 10
    for p in ps:
        p.grad = torch.ones(5)
    opt.step()
    assert [int(opt.state[p]["step"]) for p in ps] == [2] * 10 + [1, 1]


def test_partial_step_over_few_slots_counts_its_own():
    ps, opt = _opt(3)
    ps[0].grad = torch.ones(5)
    ps[1].grad = torch.ones(5)
    ps[2].grad = torch.ones(5)
    opt.step()
    ps[0].grad = None
    opt.step()
    assert [int(opt.state[p]["step"]) for p in ps] == [1, 2, 2]


def test_load_state_dict_restores_the_seed():
    ps, opt = _opt(1, seed=7)
    ps[0].grad = torch.ones(5)
    opt.step()
    sd = opt.state_dict()
    _ps2, opt2 = _opt(1, seed=99)
    opt2.load_state_dict(sd)
    assert opt2.seed == 7


def test_negative_saved_step_refused():
    ps, opt = _opt(1)
    ps[0].grad = torch.ones(5)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["step"] = torch.tensor(-3.0)
    with pytest.raises(StateDictError, match="step"):
        opt.load_state_dict(sd)


def test_transposed_param_shape_refused():
    p = torch.zeros(4, 2, requires_grad=True)
    opt = MemOptimizer([p], rule="adamw", lr=1e-2, master="none", moments="q8")
    p.grad = torch.ones(4, 2)
    opt.step()
    sd = opt.state_dict()
    q = torch.zeros(2, 4, requires_grad=True)
    opt2 = MemOptimizer([q], rule="adamw", lr=1e-2, master="none", moments="q8")
    with pytest.raises(StateDictError, match="shape"):
        opt2.load_state_dict(sd)


def test_capturable_and_check_numerics_exclude_each_other():
    from memopt_core.errors import ConfigError

    with pytest.raises(ConfigError, match="capturable"):
        MemOptimizer(
            [torch.zeros(3, requires_grad=True)],
            rule="adamw",
            lr=1e-2,
            capturable=True,
            check_numerics=True,
        )


def test_capturable_on_a_host_backend_is_refused():
    from memopt_core.errors import ConfigError

    p = torch.zeros(3, requires_grad=True)
    opt = MemOptimizer([p], rule="adamw", lr=1e-2, master="none", moments="fp32", capturable=True)
    p.grad = torch.ones(3)
    with pytest.raises(ConfigError, match="capturable"):
        opt.step()


def test_duplicate_index_in_saved_groups_refused():
    ps, opt = _opt(2)
    for p in ps:
        p.grad = torch.ones(5)
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0]["params"] = [0, 0]
    with pytest.raises(StateDictError, match="twice"):
        opt.load_state_dict(sd)


def test_nonfinite_gradient_refused_at_the_first_step():
    from memopt_core.errors import NumericsError

    p = torch.zeros(3, requires_grad=True)
    opt = MemOptimizer(
        [p], rule="adamw", lr=1e-2, master="none", moments="fp32", check_numerics=True
    )
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    with pytest.raises(NumericsError):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(3))


def test_sgd_momentum_second_step_uses_the_buffer():
    # an ordinary (not replayed) step where one parameter is at its second step
    p = torch.zeros(1, requires_grad=True)
    q = torch.zeros(1, requires_grad=True)
    opt = MemOptimizer([p, q], rule="sgd", lr=1.0, momentum=0.5, master="none", moments="fp32")
    p.grad = torch.ones(1)
    opt.step()  # p: buf = 1, p = -1
    q.grad = torch.ones(1)
    p.grad = torch.ones(1)
    opt.step()  # p: buf = 1.5, p = -2.5
    assert p.item() == -2.5
    assert q.item() == -1.0


def test_step_limit_warns_when_the_count_reaches_2_24():
    p = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    opt = MemOptimizer([p], rule="adamw", lr=1e-3, master="ecc24", moments="bf16")
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["step"] = torch.tensor(float(2**24 - 1))
    opt.load_state_dict(sd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # count 2**24
    assert opt.state[p]["step"].item() == 2**24
    assert any("2**24" in str(w.message) for w in caught)
