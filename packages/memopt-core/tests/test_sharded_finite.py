"""``check_numerics`` on sharded parameters (2 ranks, gloo): a NaN in one rank's shard makes
every rank refuse the step with nothing changed. Each rank used to decide from its own shard, so
the rank without the NaN stepped its half while the other raised; now each shard's flag is
maximized over the mesh (``memopt_core.sharding.max_over_shards``) first."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist
from sharded_finite import worker

from memopt_core.testing import json_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return json_ranks(worker, tmp_path_factory.mktemp("sharded-finite"))


def test_rows_of_sharded_owners_take_the_maximum_over_ranks(ranks):
    for rank, result in enumerate(ranks):
        (a0, a1), plain, (c0, c1) = result["maxima"]
        assert (a0, a1) == (1.0, 0.0)  # max over ranks of (rank, -rank)
        assert plain == [10.0 + rank, 0.0]  # an unsharded owner's row is its own
        assert c0 == 0.0
        assert math.isnan(c1)  # a NaN on one rank reaches every rank


def test_every_rank_refuses_a_nan_in_one_shard(ranks):
    for rank, result in enumerate(ranks):
        raised = result["nan"]["raised"]
        assert raised is not None, f"rank {rank} stepped"
        assert "non-finite gradient" in raised, raised
        assert not result["nan"]["changed"], f"rank {rank} changed a parameter"
