"""memopt_core.cached_step: what makes a cached step stop replaying (audit round 6, mutation
testing round 2: a moved gradient under fixed_grads, other resolution keys, a replaced param group
dict, a work split by a partial step)."""

from __future__ import annotations

import torch

from memopt_core.cached_step import CachedStep


def _groups():
    p = torch.nn.Parameter(torch.zeros(4))
    q = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(4)
    q.grad = torch.ones(3)
    return [{"params": [p, q]}]


def test_fixed_grads_moved_gradient_invalidates():
    groups = _groups()
    cs = CachedStep([], groups, ("k",))
    assert cs.current_grads(groups, ("k",)) is not None
    p = groups[0]["params"][0]
    p.grad = torch.ones(4) * 2  # a new gradient tensor: a new address
    cs.fixed_grads = True
    assert cs.current_grads(groups, ("k",)) is None
    cs.fixed_grads = False
    assert cs.current_grads(groups, ("k",)) is not None


def test_other_resolution_keys_invalidate():
    groups = _groups()
    cs = CachedStep([], groups, ("k",))
    assert cs.current_grads(groups, ("other",)) is None


def test_replaced_group_dict_invalidates():
    groups = _groups()
    cs = CachedStep([], groups, ("k",))
    assert cs.current_grads([dict(groups[0])], ("k",)) is None


class _W:
    def __init__(self, owners):
        self.param_owners = owners


class _E:
    def __init__(self, owners):
        self.work = _W(owners)


def test_splits_detects_a_partial_work():
    a, b, c = (torch.zeros(1) for _ in range(3))
    cs = CachedStep([_E([a, b]), _E([c])], [], ())
    assert cs.splits({id(a)})
    assert not cs.splits({id(a), id(b)})
    assert not cs.splits({id(c)})
