"""Prepared launches (``ops.prepare_step``): one resolution reused over many steps, with scalars
from the host or from a device tensor (the CUDA-graph path), gives the bits of a fresh
``fused_step`` per step, i.e. of core's torch backend."""

from __future__ import annotations

import pytest
import torch

from memopt_core.errors import ConfigError
from memopt_core.formats import StateSpec
from memopt_core.testing import VARIANTS, diff_report, group_step, make_grads, make_group
from memopt_core.torch_backend import TorchBackend

TORCH = TorchBackend()

CASES = [
    pytest.param("fp32", "fp32", torch.float32, id="fp32-master-fp32-moments"),
    pytest.param("bf16", "fp32", torch.float32, id="fp32-master-bf16-moments"),
    pytest.param("q8", "fp32", torch.float32, id="fp32-master-q8"),
    pytest.param("q8", "ecc24", torch.bfloat16, id="ecc24-q8"),
    pytest.param("bf16", "ecc32", torch.bfloat16, id="ecc32-bf16-moments"),
]


def _sizes(device) -> list[int]:
    return [0, 1, 33, 65] if device.type == "cpu" else [0, 1, 31, 33, 4095, 65537]


@pytest.mark.parametrize("hyper_on_device", [False, True], ids=["host-scalars", "device-scalars"])
@pytest.mark.parametrize(("preset", "master", "dtype"), CASES)
def test_prepared_adamw_equals_reference(ops, device, preset, master, dtype, hyper_on_device):
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master=master, moments=preset, stochastic_rounding=True)
    ref = make_group(rule, spec, dtype, _sizes(device), device, seed=2**32 - 3, **hyper)
    mine = ref.clone()
    grads = [torch.empty_like(p) for p in mine.params]  # stable buffers, refilled every step
    prepared = None
    hyper_t = torch.zeros(len(ops.ADAM_HYPER_FIELDS), dtype=torch.int32, device=device)
    for step in range(1, 5):
        new = make_grads(ref, step)
        work = group_step(ref, new, step)
        TORCH.step(work)
        for g, n in zip(grads, new, strict=True):
            g.copy_(n)
        mine_work = group_step(mine, grads, step)
        if prepared is None:
            prepared = ops.prepare_step(mine_work)
            assert prepared.reusable
        if hyper_on_device:
            words = ops.adam_hyper_words(mine_work.scalars, mine_work.seed, step)
            hyper_t.copy_(torch.tensor(words, dtype=torch.int32))
            prepared.launch_hyper(
                hyper_t,
                maximize=bool(mine_work.scalars.maximize),
                has_l2=mine_work.scalars.l2 != 0.0,
                has_decay=True,  # a factor of exactly 1 would be harmless
            )
        else:
            prepared.launch(mine_work.scalars, step, mine_work.seed, step == 1)
        bad = diff_report(ref, mine)
        assert not bad, f"step {step}: " + "; ".join(bad)


def test_hyper_words_layout(ops):
    from memopt_core.reference import adam_scalars

    s = adam_scalars(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, step=3, decoupled=True
    )
    words = ops.adam_hyper_words(s, seed=2**32 - 1, step=3)
    assert len(words) == len(ops.ADAM_HYPER_FIELDS) == 10
    floats = torch.tensor(words[:8], dtype=torch.int32).view(torch.float32).tolist()
    expect = [
        torch.tensor(float(getattr(s, f)), dtype=torch.float32).item()
        for f in ops.ADAM_HYPER_FIELDS[:8]
    ]
    assert floats == expect
    assert words[8:] == [-1, 3]


def test_launch_hyper_refuses_bad_input(ops, device):
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master="fp32", moments="bf16", stochastic_rounding=True)
    g = make_group(rule, spec, torch.float32, [33], device, **hyper)
    prepared = ops.prepare_step(group_step(g, make_grads(g, 1), 1))
    with pytest.raises(ConfigError, match="int32 tensor of 10 words"):
        prepared.launch_hyper(
            torch.zeros(10, dtype=torch.float32, device=device),
            maximize=False,
            has_l2=False,
            has_decay=True,
        )
    rule, hyper = VARIANTS["lion"]
    lion = make_group(rule, spec, torch.float32, [33], device, **hyper)
    p2 = ops.prepare_step(group_step(lion, make_grads(lion, 1), 1))
    with pytest.raises(ConfigError, match="adam rule"):
        p2.launch_hyper(
            torch.zeros(10, dtype=torch.int32, device=device),
            maximize=False,
            has_l2=False,
            has_decay=True,
        )


def test_scalar_rounding_matches_torch(ops):
    # launches round every scalar to fp32 without tensors; it must be torch's rounding exactly
    import math
    import random

    rng = random.Random(0)
    values = [rng.uniform(-1, 1) * 10 ** rng.uniform(-50, 45) for _ in range(20000)]
    values += [3.4028235677973366e38, 3.4028236e38, -1e39, 1e-46, 7.006e-46, 1.4e-45, 0.0, -0.0]
    for v in values:
        got = ops._f32(v)
        want = torch.tensor(v, dtype=torch.float32).item()
        assert got == want, v
        assert math.copysign(1.0, got) == math.copysign(1.0, want), v
