"""Checks on sharded parameters (2 ranks, gloo). ``check_numerics`` decides from the whole
sharded tensor on every rank.

Each rank used to decide from its own shard: where one rank's shard alone held the largest
weight or a NaN gradient, that rank raised ``NumericsError`` ("no parameter or state was
modified") while the other updated its shard, so the tensor was half stepped; under gradient
release the other rank then waited in the next reduce-scatter until its timeout. Now each shard's
statistics are maximized over the ranks (``memopt_core.sharding.max_over_shards``) first. (Core's
own non-finite check on shards is tested in memopt-core's ``test_sharded_finite.py``.)
And a one-process state dict loaded into a sharded optimizer says how it loads instead."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from sharded_checks import _gradient, _weights, worker

import memopt_ecc
from memopt_core import NumericsError
from memopt_core.testing import json_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return json_ranks(worker, tmp_path_factory.mktemp("sharded-checks"))


def test_one_process_refuses_these_steps():
    """The premise: unsharded, each case raises."""
    for lr, nan_at in ((1e-5, None), (1e-2, 40)):
        p = torch.nn.Parameter(_weights())
        opt = memopt_ecc.FlashAdamW([p], lr=lr, check_numerics=True, stochastic_rounding=False)
        p.grad = _gradient(nan_at)
        with pytest.raises(NumericsError):
            opt.step()


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("resolution", "below the master format's resolution"),
        ("nan-flash", "non-finite gradient"),
    ],
)
def test_every_rank_refuses_and_keeps_its_shard(ranks, case, says):
    for r, result in enumerate(ranks):
        assert result[case]["raised"] is not None, f"rank {r} stepped"
        assert says in result[case]["raised"], result[case]["raised"]
        assert not result[case]["changed"], f"rank {r} changed its shard"


def test_gradient_release_raises_on_every_rank(ranks):
    for r, result in enumerate(ranks):
        assert result["released"]["raised"] is not None, f"rank {r} went on"
        assert "below the master format's resolution" in result["released"]["raised"]


def test_a_whole_tensors_state_names_the_resharding_load(ranks):
    """The refusal said only that the shapes differ (96 codes where the shard takes 64)."""
    for result in ranks:
        raised = result["whole-state"]["raised"]
        assert raised is not None
        assert "of shape (96,)" in raised
        assert "shape (64,) for this process's shard" in raised
        assert "torch.distributed.checkpoint (dcp.load" in raised
