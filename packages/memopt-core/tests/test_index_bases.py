"""``GroupStep.index_bases``: a shard stepped with its offset in the whole tensor as index base
draws the whole tensor's stochastic-rounding words, so shards give the whole tensor's bits.

This is what makes a sharded (FSDP2) step equal one process's step: the torch backend is checked
here against an unsharded group; the kernel packages check theirs against the torch backend.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from memopt_core.formats import StateSpec
from memopt_core.testing import bits, make_grads, make_group, step_group
from memopt_core.torch_backend import TorchBackend

# (master, moments, parameter dtype): every one draws stochastic-rounding words
CONFIGS = {
    "ecc24-bf16": ("ecc24", "bf16", torch.bfloat16),
    "fp32-q8": ("fp32", "q8", torch.float32),
    "none-fp8": ("none", "fp8", torch.bfloat16),
}


def _shards(whole, cuts):
    """The whole group's single tensor cut at ``cuts``: one one-tensor group per shard, each
    with the whole group's tensor id, state and master codes copied from the shard's range."""
    (p,) = whole.params
    flat = p.detach().reshape(-1)
    bounds = [0, *cuts, flat.numel()]
    groups = []
    for a, b in itertools.pairwise(bounds):
        g = make_group(
            whole.rule, whole.spec, p.dtype, [b - a], p.device, seed=whole.seed,
            index_bases=[a], **whole.hyper,
        )  # fmt: skip
        g.tensor_ids = list(whole.tensor_ids)
        g.params[0].copy_(flat[a:b].view(g.params[0].shape))
        if g.arena.master_code is not None:
            g.arena.master_code[: b - a].copy_(whole.arena.master_code[a:b])
        groups.append(g)
    return groups


def _state(groups):
    """Parameter, master codes and moment fields of ``groups`` concatenated (real elements of
    per-element fields, every block of blocked ones) as raw bits."""
    out = {"param": bits(torch.cat([g.params[0].detach().reshape(-1) for g in groups]))}
    if groups[0].arena.master_code is not None:
        out["master_code"] = torch.cat(
            [bits(g.arena.master_code[: g.plan.slots[0].numel]) for g in groups]
        )
    for name, codec in groups[0].arena.codecs.items():
        for suffix, f in codec.fields.items():
            parts = []
            for g in groups:
                t = g.arena.fields[name][suffix]
                parts.append(bits(t if f.per_block else t[: g.plan.slots[0].numel]))
            out[f"{name}[{suffix}]"] = torch.cat(parts)
    return out


def _assert_same(shards, whole):
    got, want = _state(shards), _state([whole])
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"shards differ from the whole tensor in {bad}"


@pytest.mark.parametrize("rule", ["adamw", "sgd", "lion"])
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("cuts", [[64], [32, 96, 160]], ids=["2-shards", "4-shards"])
def test_block_aligned_shards_give_the_whole_tensors_bits(rule, cfg, cuts):
    master, moments, dtype = CONFIGS[cfg]
    spec = StateSpec(master=master, moments=moments, stochastic_rounding=True)
    hyper = dict(lr=1e-2, weight_decay=0.1, momentum=0.9)
    whole = make_group(rule, spec, dtype, [200], "cpu", seed=7, **hyper)
    shards = _shards(whole, cuts)
    backend = TorchBackend()
    for step in range(1, 6):
        (g,) = make_grads(whole, step)
        step_group(backend, whole, [g], step)
        flat = g.reshape(-1)
        bounds = [0, *cuts, flat.numel()]
        for shard, a, b in zip(shards, bounds, bounds[1:], strict=False):
            step_group(backend, shard, [flat[a:b].view(shard.params[0].shape)], step)
    _assert_same(shards, whole)


def test_without_bases_shards_draw_other_words():
    """The control: the same shards without their bases (each from index 0) differ, so the
    test above can fail."""
    spec = StateSpec(master="ecc24", moments="bf16", stochastic_rounding=True)
    whole = make_group("adamw", spec, torch.bfloat16, [200], "cpu", seed=7, lr=1e-2)
    shards = _shards(whole, [64])
    shards[1].index_bases = None
    backend = TorchBackend()
    (g,) = make_grads(whole, 1)
    step_group(backend, whole, [g], 1)
    flat = g.reshape(-1)
    step_group(backend, shards[0], [flat[:64]], 1)
    step_group(backend, shards[1], [flat[64:]], 1)
    with pytest.raises(AssertionError, match="differ"):
        _assert_same(shards, whole)
