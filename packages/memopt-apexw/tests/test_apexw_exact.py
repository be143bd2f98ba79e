"""ApexW gives core's reference bits in every mode, on every backend, over 100+ steps: fp32 and
bf16 (ECC-24/32) parameters, bf16 and q8 state, odd sizes (0, 1, 31, 33, 2^k +- 1)."""

from __future__ import annotations

import pytest
import torch
from apexw_testutil import (
    assert_same,
    fused_backend_for,
    make_params,
    reference_for,
    step_both,
    triton_interpreter_ready,
    twin,
)

from memopt_apexw import ApexW

CONFIGS = [
    pytest.param(torch.float32, "bf16", "ecc24", id="fp32-bf16state"),
    pytest.param(torch.float32, "q8", "ecc24", id="fp32-q8state"),
    pytest.param(torch.bfloat16, "bf16", "ecc24", id="bf16ecc24-bf16state"),
    pytest.param(torch.bfloat16, "q8", "ecc24", id="bf16ecc24-q8state"),
    pytest.param(torch.bfloat16, "q8", "ecc32", id="bf16ecc32-q8state"),
]


def run_pair(device, dtype, state, master, steps, **apexw_kw):
    a = make_params(device, dtype)
    b = twin(a)
    opt = ApexW(a, lr=3e-3, state=state, master=master, weight_decay=0.05, **apexw_kw)
    ref = reference_for(b, state=state, master=master, lr=3e-3, weight_decay=0.05)
    for step in range(1, steps + 1):
        step_both(a, b, opt, ref, step)
        if step in (1, 2, 3, steps):
            assert_same(a, b, opt, ref, f"step {step}")
    return opt


@pytest.mark.parametrize("mode", ["fused", "torch", "auto"])
@pytest.mark.parametrize(("dtype", "state", "master"), CONFIGS)
def test_modes_equal_reference(device, dtype, state, master, mode):
    if mode == "fused" and fused_backend_for(device) is None:
        pytest.skip(f"no fused backend for {device} installed (memopt-kernels-cpu / -triton)")
    opt = run_pair(device, dtype, state, master, 120, mode=mode)
    assert opt.mode_decision is not None
    assert opt.mode_decision.mode in ("fused", "torch")


@pytest.mark.skipif(
    not triton_interpreter_ready(),
    reason="needs memopt-kernels-triton, triton and numpy with TRITON_INTERPRET=1",
)
@pytest.mark.parametrize(("dtype", "state", "master"), CONFIGS[:4])
def test_triton_prepared_launches_equal_reference_on_cpu(dtype, state, master):
    # Triton's interpreter runs the cached prepared launches on CPU tensors: small and few steps
    run_pair(torch.device("cpu"), dtype, state, master, 6, mode="fused", backend="triton")


def test_step_counts_match_reference(device):
    a = make_params(device)
    b = twin(a)
    opt = ApexW(a, mode="torch")
    ref = reference_for(b)
    for step in range(1, 6):
        step_both(a, b, opt, ref, step)
    steps = [float(opt.state[p]["step"]) for p in a]
    assert steps == [5.0] * len(a)
    sd, rd = opt.state_dict(), ref.state_dict()
    assert [float(s["step"]) for s in sd["state"].values()] == [
        float(s["step"]) for s in rd["state"].values()
    ]
