"""Multi-tensor planning: grouping, padding, arenas and their views, chunk tables."""

from __future__ import annotations

import random

import pytest
import torch

from memopt_core.errors import ConfigError
from memopt_core.formats import StateSpec
from memopt_core.plan import (
    GroupPlan,
    StateArena,
    clear_chunk_cache,
    family_arenas,
    make_plans,
    own_storage,
    round_up,
)

Q8 = StateSpec(master="ecc24", moments="q8")
FP32 = StateSpec(master="fp32", moments="fp32")


def spec_for(dtype):
    return FP32 if dtype == torch.float32 else Q8


def test_round_up():
    assert [round_up(n, 32) for n in (0, 1, 31, 32, 33)] == [0, 32, 32, 32, 64]


def test_own_storage_copies_only_views_that_share_memory():
    whole = torch.arange(64.0)
    assert own_storage(whole) is whole
    assert own_storage(whole.view(8, 8)).data_ptr() == whole.data_ptr()  # all of its storage
    for view in (whole[:60], whole[4:], whole.view(8, 8).t()):
        copy = own_storage(view)
        assert copy.data_ptr() != whole.data_ptr()
        assert copy.is_contiguous()
        assert copy.untyped_storage().nbytes() == copy.nbytes
        assert torch.equal(copy, view)
    empty = torch.empty(0)
    assert own_storage(empty) is empty


def test_grouping_by_dtype_and_spec_keeps_order(device):
    a, b, c, d = (
        torch.zeros(3, device=device),
        torch.zeros(4, dtype=torch.bfloat16, device=device),
        torch.zeros(5, device=device),
        torch.zeros(6, dtype=torch.bfloat16, device=device),
    )
    plans = make_plans([a, b, c, d], spec_for, group_index=2)
    assert [len(p) for p in plans] == [2, 2]
    assert plans[0].params[0] is a
    assert plans[0].params[1] is c
    assert plans[1].params == [b, d]
    assert plans[0].key == (a.device, torch.float32, FP32, 2)
    assert plans[1].key == (b.device, torch.bfloat16, Q8, 2)


def test_slots_are_padded_to_the_block():
    ts = [torch.zeros(s, dtype=torch.bfloat16) for s in [(0,), (1,), (31,), (33,), (4, 8), ()]]
    plan = GroupPlan(ts, Q8)
    assert plan.block_size == 32
    assert [(s.numel, s.padded, s.offset) for s in plan.slots] == [
        (0, 0, 0),
        (1, 32, 0),
        (31, 32, 32),
        (33, 64, 64),
        (32, 32, 128),
        (1, 32, 160),
    ]
    assert plan.total == 192
    fp32 = GroupPlan([torch.zeros(3), torch.zeros(())], FP32)
    assert fp32.block_size == 1
    assert fp32.total == 4


def test_plan_refuses_mixed_dtypes():
    with pytest.raises(ConfigError, match=r"got a torch\.bfloat16 tensor of shape"):
        GroupPlan([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)], FP32)


def test_arena_fields_and_views():
    ts = [torch.zeros(s, dtype=torch.bfloat16) for s in [(3, 5), (40,), ()]]
    plan = GroupPlan(ts, Q8)
    arena = StateArena(
        plan, {"exp_avg": Q8.first, "exp_avg_sq": Q8.second}, Q8.master_for(torch.bfloat16)
    )
    total = plan.total
    assert total == 32 + 64 + 32
    assert arena.fields["exp_avg"][""].shape == (total,)
    assert arena.fields["exp_avg"]["scale"].shape == (total // 32,)
    assert arena.master_code.shape == (total,)
    assert arena.master_code.dtype == torch.uint8
    views = arena.views(plan.slots[1])
    assert set(views) == {
        "exp_avg",
        "exp_avg_scale",
        "exp_avg_sq",
        "exp_avg_sq_scale",
        "master_code",
    }
    assert views["exp_avg"].shape == (64,)  # blocked: flat and padded
    assert views["exp_avg_scale"].shape == (2,)
    assert views["master_code"].shape == (40,)  # codes: shaped like the parameter
    assert arena.views(plan.slots[0])["master_code"].shape == (3, 5)
    assert arena.views(plan.slots[2])["master_code"].shape == ()
    # views alias the arena
    views["exp_avg_sq_scale"].fill_(7)
    assert arena.fields["exp_avg_sq"]["scale"].tolist() == [0, 7, 7, 0]
    views["master_code"][0] = 9
    assert arena.master_code[32].item() == 9
    expected = sum(t.numel() * t.element_size() for t in arena.tensors())
    assert arena.nbytes() == expected == 2 * (total + total // 32) + total


@pytest.mark.parametrize("spec", [Q8, FP32], ids=["blocked", "unblocked"])
def test_family_arenas_are_views_of_one_arena(spec):
    """Each member's arena has the fields and views a separate arena would, zeroed, and lies
    at its offset in the family's fields: a chunk table of the family plan addresses it."""
    dtype = torch.bfloat16 if spec is Q8 else torch.float32
    groups = [[(3, 5), (40,)], [(1,)], [(), (33,), (0,)]]
    plans = [
        GroupPlan([torch.zeros(s, dtype=dtype) for s in shapes], spec, group_index=gi)
        for gi, shapes in enumerate(groups)
    ]
    codecs = {"exp_avg": spec.first, "exp_avg_sq": spec.second}
    master = spec.master_for(dtype)
    members = family_arenas(plans, codecs, master)
    family = members[0].family
    assert family is not None
    assert all(a.family is family for a in members)
    assert family.plan.params == [t for plan in plans for t in plan.params]
    assert family.plan.total == sum(plan.total for plan in plans)  # nothing between members
    assert family.nbytes() == sum(a.nbytes() for a in members)
    slot = 0
    for plan, arena in zip(plans, members, strict=True):
        alone = StateArena(plan, codecs, master)
        assert arena.family_slot == slot
        assert arena.family_offset == family.plan.slots[slot].offset
        for s in plan.slots:
            whole = family.plan.slots[arena.family_slot + s.index]
            assert whole.offset == arena.family_offset + s.offset
            mine, theirs = arena.views(s), alone.views(s)
            assert {k: (v.shape, v.dtype) for k, v in mine.items()} == {
                k: (v.shape, v.dtype) for k, v in theirs.items()
            }
            assert all(not v.any() for v in mine.values())
            # a write through a member's view lands in the family at the family slot's place
            for key, view in mine.items():
                view.fill_(5)
                got = family.views(whole)[key]
                assert torch.equal(
                    got.reshape(-1).view(torch.uint8), view.reshape(-1).view(torch.uint8)
                )
        slot += len(plan.slots)
    assert family_arenas([], codecs, master) == []


def test_family_arenas_refuse_plans_of_another_kind():
    a = GroupPlan([torch.zeros(3)], FP32)
    b = GroupPlan([torch.zeros(3, dtype=torch.bfloat16)], Q8)
    with pytest.raises(ConfigError, match="one device, parameter dtype and spec"):
        family_arenas([a, b], {"exp_avg": FP32.first}, None)


def test_unblocked_views_are_shaped_like_the_param():
    ts = [torch.zeros(2, 3), torch.zeros(())]
    plan = GroupPlan(ts, FP32)
    arena = StateArena(plan, {"momentum_buffer": FP32.first}, FP32.master_for(torch.float32))
    v = arena.views(plan.slots[0])
    assert set(v) == {"momentum_buffer"}
    assert v["momentum_buffer"].shape == (2, 3)
    assert arena.views(plan.slots[1])["momentum_buffer"].shape == ()
    assert arena.master_code is None


def test_chunk_table_boundaries(device):
    ts = [torch.zeros(n, dtype=torch.bfloat16, device=device) for n in (100, 0, 64, 1, 129)]
    plan = GroupPlan(ts, Q8)
    table = plan.chunk_table(64)
    assert table.dtype == torch.int64
    assert table.device == plan.device
    rows = table.cpu().tolist()
    assert rows == [
        [0, 0, 64, 0],
        [0, 64, 36, 64],  # tensor 0: 100 elements in 2 chunks
        [2, 0, 64, 128],  # tensor 1 is empty: no chunk
        [3, 0, 1, 192],
        [4, 0, 64, 224],
        [4, 64, 64, 288],
        [4, 128, 1, 352],
    ]
    # chunks never cross a tensor and cover every element once
    for slot, start, length, off in rows:
        s = plan.slots[slot]
        assert 0 < length <= 64
        assert start + length <= s.numel
        assert off == s.offset + start
    assert sum(r[2] for r in rows) == sum(t.numel() for t in ts)
    sub = plan.chunk_table(64, slots=[3, 4]).cpu().tolist()
    assert sub == rows[3:]


def _chunk_rows(plan, slots, chunk_size, ids):
    """A chunk table written out element by element, the definition the tables must meet."""
    rows = []
    for i, si in zip(ids, slots, strict=True):
        s = plan.slots[si]
        for start in range(0, s.numel, chunk_size):
            rows.append([i, start, min(chunk_size, s.numel - start), s.offset + start])
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_chunk_tables_meet_their_definition(seed):
    """Random sizes (empty, 1, 2^k +- 1, blocks straddled) and chunk sizes: every table, and a
    subset's table in any order numbered by position (subset_chunk_table), equals the table
    written out chunk by chunk."""
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 31, 32, 33, 63, 64, 65, 127, 1000, 4097]) for _ in range(12)]
    plan = GroupPlan([torch.zeros(n, dtype=torch.bfloat16) for n in sizes], Q8)
    cs = 32 * rng.choice([1, 2, 3, 7])
    every = list(range(len(sizes)))
    assert plan.chunk_table(cs).tolist() == _chunk_rows(plan, every, cs, every)
    subset = rng.sample(every, rng.randint(1, len(every)))
    got = plan.subset_chunk_table(cs, subset)
    assert got.dtype == torch.int64
    assert got.device == torch.device("cpu")
    assert got.tolist() == _chunk_rows(plan, subset, cs, range(len(subset)))
    assert plan.subset_chunk_table(cs, []).shape == (0, 4)
    with pytest.raises(ConfigError, match="multiple of the block size 32"):
        plan.subset_chunk_table(48, subset)


def test_chunk_table_is_cached_on_data_ptrs():
    clear_chunk_cache()
    ts = [torch.zeros(n, dtype=torch.bfloat16) for n in (100, 70)]
    plan = GroupPlan(ts, Q8)
    t1 = plan.chunk_table(64)
    assert plan.chunk_table(64) is t1
    assert GroupPlan(ts, Q8).chunk_table(64) is t1  # same tensors, new plan: same table
    assert plan.chunk_table(128) is not t1
    other = GroupPlan([torch.zeros(n, dtype=torch.bfloat16) for n in (100, 70)], Q8)
    assert other.chunk_table(64) is not t1
    assert torch.equal(other.chunk_table(64), t1)


def test_chunk_size_must_cover_whole_blocks():
    plan = GroupPlan([torch.zeros(10, dtype=torch.bfloat16)], Q8)
    with pytest.raises(ConfigError, match="multiple of the block size 32"):
        plan.chunk_table(48)
    with pytest.raises(ConfigError, match="positive int"):
        plan.chunk_table(0)


def test_empty_group_needs_device_and_dtype():
    with pytest.raises(ConfigError, match="explicit device"):
        GroupPlan([], FP32)
    plan = GroupPlan([], FP32, device="cpu", param_dtype=torch.float32)
    assert plan.total == 0
    assert plan.chunk_table(8).shape == (0, 4)
