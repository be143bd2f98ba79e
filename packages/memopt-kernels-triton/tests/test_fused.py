"""Fused step kernels vs memopt-core's torch backend: the same bits for every rule x format.

Both backends step identical copies of one group (plan, arena, parameters as ``MemOptimizer``
builds them) with the same gradients; after every step every parameter, master code and moment
field must be bit-identical. CPU runs use Triton's interpreter on small odd sizes; ``gpu`` runs
use larger ones.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from memopt_core.formats import StateSpec
from memopt_core.testing import (
    MASTER_IDS,
    MASTERS,
    PRESETS,
    VARIANTS,
    diff_report,
    make_grads,
    make_group,
    step_group,
)
from memopt_core.torch_backend import TorchBackend
from memopt_kernels_triton.backend import BACKEND

TORCH = TorchBackend()
#: variants of this package's matrix beyond core's :data:`VARIANTS`: SGDW without momentum
#: (decoupled weight decay, no state)
LOCAL_VARIANTS = {"sgdw-nomom": ("sgdw", dict(lr=0.05, weight_decay=0.1))}
ALL_VARIANTS = {**VARIANTS, **LOCAL_VARIANTS}
CPU_SIZES = [0, 1, 33, 65]
GPU_SIZES = [0, 1, 31, 33, 1023, 1025, 4095, 65537, 2**20 + 1, 3 * 2**20 - 1]


def sizes_for(device) -> list[int]:
    return CPU_SIZES if device.type == "cpu" else GPU_SIZES


def run_compare(
    variant,
    preset,
    master,
    dtype,
    sr,
    device,
    *,
    sizes,
    steps=2,
    grad_dtype=None,
    slots=None,
    nan_equal=False,
    grad_fn=None,
):
    rule, hyper = ALL_VARIANTS[variant]
    spec = StateSpec(master=master, moments=preset, stochastic_rounding=sr)
    a = make_group(rule, spec, dtype, sizes, device, seed=2**32 - 5, **hyper)
    b = a.clone()
    for step in range(1, steps + 1):
        grads = grad_fn(a, step) if grad_fn else make_grads(a, step, grad_dtype=grad_dtype)
        step_group(TORCH, a, grads, step, slots)
        step_group(BACKEND, b, grads, step, slots)
        bad = diff_report(a, b, nan_equal=nan_equal)
        assert not bad, f"step {step}: " + "; ".join(bad)
    return a, b


# Every (master, preset, rounding) for AdamW; every (master, preset) with SR for the other rules.
ALL = [
    pytest.param(v, p, m, d, sr, id=f"{v}-{p}-{mid}-{'sr' if sr else 'rne'}")
    for v in VARIANTS
    for p in PRESETS
    for (m, d), mid in zip(MASTERS, MASTER_IDS, strict=True)
    for sr in ((False, True) if v == "adamw" else (True,))
] + [
    # SGDW without momentum keeps no moment, so the preset only sets the plan's block size (an
    # unblocked and a blocked preset give every kernel variant), with every master
    pytest.param("sgdw-nomom", p, m, d, True, id=f"sgdw-nomom-{p}-{mid}-sr")
    for p in ("fp32", "q8")
    for (m, d), mid in zip(MASTERS, MASTER_IDS, strict=True)
]


@pytest.mark.parametrize(("variant", "preset", "master", "dtype", "sr"), ALL)
def test_rule_format_matrix(device, variant, preset, master, dtype, sr):
    run_compare(variant, preset, master, dtype, sr, device, sizes=sizes_for(device))


@pytest.mark.parametrize("variant", ["adam-l2-max", "sgd-nesterov", "lion"])
def test_rne_other_rules(device, variant):
    run_compare(variant, "q8", "ecc24", torch.bfloat16, False, device, sizes=sizes_for(device))


@pytest.mark.parametrize("variant", ["adamw", "sgd-mom-damp-l2", "lion"])
def test_powers_of_two_and_chunk_edges(device, variant):
    if device.type == "cpu":
        sizes = [2, 32, 127, 128, 129, 255, 256, 257, 511, 513]
    else:
        sizes = [2**k + d for k in (5, 10, 15, 16, 17, 20) for d in (-1, 0, 1)]
    run_compare(variant, "q8", "ecc24", torch.bfloat16, True, device, sizes=sizes, steps=3)


@pytest.mark.parametrize(("master", "dtype"), [("ecc24", torch.bfloat16), ("none", torch.float16)])
def test_fp32_and_mixed_gradients(device, master, dtype):
    run_compare(
        "adamw",
        "q8",
        master,
        dtype,
        True,
        device,
        sizes=sizes_for(device),
        grad_dtype=torch.float32,
    )

    def mixed(group, step):  # fp32 gradients for some tensors, param-dtype for the others
        gs = make_grads(group, step)
        return [g.float() if i % 2 else g for i, g in enumerate(gs)]

    run_compare(
        "sgdw-mom", "bf16", master, dtype, True, device, sizes=sizes_for(device), grad_fn=mixed
    )


@pytest.mark.parametrize("variant", ["adamw", "sgd-mom-damp-l2", "lion"])
@pytest.mark.parametrize("preset", ["fp32", "q8"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_gradients_of_float32_parameters(device, variant, preset, grad_dtype):
    """A float32 master takes 16-bit gradients, widened exactly (grad kinds 0 and 2), through
    every loading path: an unblocked preset loads in the tile loop, a blocked one first."""
    run_compare(
        variant, preset, "fp32", torch.float32, True, device, sizes=sizes_for(device),
        grad_dtype=grad_dtype,
    )  # fmt: skip


def test_partial_steps(device):
    """A step over some of the plan's tensors (gradient release) touches only those."""
    sizes = sizes_for(device)
    slots = [1, 3] if device.type == "cpu" else [1, 3, 4, 7]
    a, b = run_compare(
        "adamw", "q8", "ecc24", torch.bfloat16, True, device, sizes=sizes, slots=slots, steps=2
    )
    fresh = make_group("adamw", a.spec, torch.bfloat16, sizes, device, seed=2**32 - 5)
    for i in set(range(len(sizes))) - set(slots):
        assert torch.equal(b.params[i], fresh.params[i])


def test_non_contiguous_parameters(device):
    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master="ecc32", moments="fp8", stochastic_rounding=True)
    base = torch.randn(24, 24).to(torch.bfloat16).to(device)
    a = make_group(rule, spec, torch.bfloat16, [24, 23], device, **hyper)
    b = a.clone()
    # a parameter that requires grad, stepped with grad mode on (a thread's default): the
    # strided views are written back without autograd seeing an in-place op on a leaf's view
    big_b = torch.nn.Parameter(base.clone())
    with torch.no_grad():
        b.plan.params[0] = big_b[:, 3]  # strided view standing in for the plan's tensor
        b.plan.params[0].copy_(a.params[0])
        b.plan.params[1] = big_b[:23, 5]
        b.plan.params[1].copy_(a.params[1])
    assert not b.params[0].is_contiguous()
    assert torch.is_grad_enabled()
    for step in (1, 2):
        grads = make_grads(a, step)
        step_group(TORCH, a, grads, step)
        step_group(BACKEND, b, grads, step)
        assert not diff_report(a, b)
    untouched = torch.ones(24, 24, dtype=torch.bool)
    untouched[:, 3] = False
    untouched[:23, 5] = False
    assert torch.equal(big_b.detach().cpu()[untouched], base.cpu()[untouched])


@pytest.mark.parametrize("preset", ["fp32", "q8"])
def test_non_finite_gradients(device, preset):
    """NaN/inf in a gradient: same state as the torch backend (NaN payloads aside) and the other
    elements of the quantization block keep their values."""

    def bad_grads(group, step):
        gs = make_grads(group, step)
        g = gs[-1].reshape(-1)
        g[3] = float("nan")
        g[40] = float("inf")
        g[41] = float("-inf")
        return gs

    run_compare(
        "adamw",
        preset,
        "ecc24",
        torch.bfloat16,
        True,
        device,
        sizes=[65, 70],
        grad_fn=bad_grads,
        nan_equal=True,
    )
    run_compare(
        "lion",
        preset,
        "none",
        torch.bfloat16,
        True,
        device,
        sizes=[65, 70],
        grad_fn=bad_grads,
        nan_equal=True,
    )


def test_many_tiny_tensors(device):
    n = 48 if device.type == "cpu" else 3000
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(0, 70, (n,), generator=g).tolist()
    run_compare("adamw", "q8", "ecc24", torch.bfloat16, True, device, sizes=sizes, steps=2)


class _EntryPoint:
    name, value, group = "triton", "memopt_kernels_triton.backend:BACKEND", "memopt.kernels"

    def load(self):
        return BACKEND


@pytest.fixture
def registered(monkeypatch):
    """The triton backend in core's registry (also from a source tree: nox -s gpu_tests uses
    PYTHONPATH), dropped again afterwards."""
    import importlib.metadata

    from memopt_core import backends

    real = importlib.metadata.entry_points
    if not any(ep.name == "triton" for ep in real(group="memopt.kernels")):

        def entry_points(**kw):
            return [_EntryPoint()] if kw == {"group": "memopt.kernels"} else real(**kw)

        monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    backends.refresh_backends()
    status = backends.available_backends().get("triton")
    assert status is not None
    assert status.usable, status.reason
    yield
    monkeypatch.undo()
    backends.refresh_backends()


def test_registered_optimizer_matches_torch_backend(device, registered):
    """Through MemOptimizer: backend='triton' and backend='torch' give the same bits."""
    from memopt_core import MemOptimizer, backends

    torch.manual_seed(0)
    shapes = [(33,), (7, 5), (1,), (64, 3)]
    p0 = [torch.randn(s).to(torch.bfloat16).to(device) for s in shapes]
    runs = {}
    for name in ("torch", "triton"):
        ps = [p.clone().requires_grad_() for p in p0]
        opt = MemOptimizer(
            ps, rule="adamw", lr=1e-2, weight_decay=0.1, master="ecc24", moments="q8", backend=name
        )
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype).to(device)
            opt.step()
        runs[name] = (ps, opt)
    (pa, oa), (pb, ob) = runs["torch"], runs["triton"]
    for x, y in zip(pa, pb, strict=True):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    for x, y in zip(pa, pb, strict=True):
        for key, va in oa.state[x].items():
            vb = ob.state[y][key]
            va, vb = va.detach().cpu().reshape(-1), vb.detach().cpu().reshape(-1)
            assert torch.equal(va.view(torch.uint8), vb.view(torch.uint8)), key
    if device.type == "cuda":
        assert (
            backends.select_backend(
                "adam", StateSpec(master="ecc24", moments="q8"), device, torch.bfloat16
            )
            is BACKEND
        )


def test_strided_gradient_at_one_address(device, registered):
    """``p.grad = buf.t()`` re-using one buffer: the optimizer's cached step sees the same
    addresses every step, yet each step reads the gradient's current values (the prepared step
    ran through a contiguous copy, so it is not reused)."""
    from memopt_core import MemOptimizer

    torch.manual_seed(0)
    p0 = torch.randn(8, 8, device=device)
    grads = [torch.randn(8, 8, device=device) for _ in range(5)]
    runs = {}
    for name in ("torch", "triton"):
        p = p0.clone().requires_grad_()
        opt = MemOptimizer([p], rule="adamw", lr=1e-2, master="fp32", moments="fp32", backend=name)
        buf = torch.zeros(8, 8, device=device)
        for g in grads:
            buf.copy_(g)
            p.grad = buf.t()
            opt.step()
            torch.full((64,), 1e3, device=device)  # may take a freed copy's memory
        runs[name] = p.detach()
    assert torch.equal(runs["torch"], runs["triton"])


def test_matrix_is_complete():
    rules = {VARIANTS[v][0] for v in VARIANTS}
    assert rules == {"adamw", "adam", "sgd", "sgdw", "lion"}
    assert not set(LOCAL_VARIANTS) & set(VARIANTS)  # a local name would shadow core's variant
    # SGDW without momentum (decoupled decay) over every master, blocked and unblocked plans
    cases = [x.values for x in ALL]
    nomom = {
        (p, m, str(d))
        for v, p, m, d, _ in cases
        if ALL_VARIANTS[v][0] == "sgdw"
        and ALL_VARIANTS[v][1].get("momentum", 0.0) == 0.0
        and ALL_VARIANTS[v][1].get("weight_decay", 0.0) != 0.0
    }
    assert {(m, str(d)) for _, m, d in nomom} == {(m, str(d)) for m, d in MASTERS}
    assert {p for p, _, _ in nomom} == {"fp32", "q8"}
    combos = {(ALL_VARIANTS[v][0], p, m, str(d)) for v, p, m, d, _ in (x.values for x in ALL)}
    assert len({c[1:] for c in combos}) == len(PRESETS) * len(MASTERS)
    assert len(list(itertools.product(PRESETS, MASTERS))) == 20


@pytest.mark.parametrize(
    ("rule", "kw"),
    [
        ("adamw", {"eps": 1e-40}),
        ("adamw", {"eps": 1e-45}),
        ("adamw", {"lr": 1e-45}),
        ("lion", {"lr": 1e-45, "weight_decay": 1e-41}),
        ("sgd", {"lr": 1e-45, "momentum": 1e-40}),
    ],
)
def test_subnormal_scalars_match_the_torch_backend(device, registered, rule, kw):
    """Scalars below 2**-126 (an fp32 subnormal eps or lr): the interpreter typed Python
    floats there as fp64 and the kernel failed ("Expected dtype ['fp32'] but got fp64"); the
    compiler passes every float as fp32, and so does the interpreter now."""
    from memopt_core import MemOptimizer

    torch.manual_seed(0)
    p0 = torch.randn(40, device=device)
    runs = {}
    for name in ("torch", "triton"):
        p = p0.clone().to(torch.bfloat16).requires_grad_()
        opt = MemOptimizer([p], rule=rule, master="ecc24", moments="fp32", backend=name, **kw)
        for step in range(2):
            p.grad = torch.randn(40, generator=torch.Generator().manual_seed(step)).to(p)
            opt.step()
        runs[name] = p.detach().view(torch.int16)
    assert torch.equal(runs["torch"], runs["triton"])
