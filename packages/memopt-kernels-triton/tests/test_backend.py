"""The package without triton or a GPU, the backend object, and its registration with core."""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import memopt_kernels_triton
from memopt_core import backends
from memopt_core.backends import KERNEL_API
from memopt_core.formats import StateSpec
from memopt_kernels_triton.backend import BACKEND, TritonBackend

ROOT = Path(__file__).resolve().parents[1]


def run_py(code: str, **env) -> str:
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(env)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_version_matches_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', text, re.M).group(1)
    assert memopt_kernels_triton.__version__ == version == "0.1.0"


def test_import_does_not_import_triton():
    out = run_py(
        "import sys, memopt_kernels_triton as m; "
        "print('triton' in sys.modules, m.BACKEND.name, m.BACKEND.KERNEL_API)"
    )
    assert out == f"False triton {KERNEL_API}"


def test_kernel_api_is_the_level_of_its_words():
    """The backend declares the level whose bits it computes (8), a literal: a core at another
    level lists the package as stale instead of using it."""
    assert TritonBackend.KERNEL_API == 8
    assert KERNEL_API == 8, "core moved past 8: port the kernels, then raise the literal"


def test_unavailable_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import memopt_kernels_triton as m\n"
        "ok, why = m.BACKEND.available(); print(ok); print(why)\n"
        "from memopt_core import backends\n"
        "s = backends.available_backends().get('triton')\n"
        "print(s is None or not s.usable)"
    )
    ok, why, not_usable = run_py(code, TRITON_INTERPRET="1").splitlines()
    assert ok == "False"
    assert "triton is not installed" in why
    assert not_usable == "True"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given without CUDA")
def test_unavailable_without_cuda():
    ok, why = run_py(
        "from memopt_kernels_triton import BACKEND as b; ok, why = b.available(); print(ok); print(why)"
    ).splitlines()
    assert ok == "False"
    assert "no CUDA device" in why


def test_supports():
    b = TritonBackend()
    spec = StateSpec(master="ecc24", moments="q8")
    cuda = torch.device("cuda")
    assert b.supports("adam", spec, cuda, torch.bfloat16)
    assert b.supports("sgd", StateSpec(master="none", moments="bf16"), cuda, torch.float16)
    assert b.supports("lion", StateSpec(master="fp32", moments="fp8"), cuda, torch.float32)
    assert not b.supports("adam", spec, cuda, torch.float16)  # ECC needs bf16 parameters
    assert not b.supports("adam", spec, cuda, torch.float64)
    assert not b.supports("adagrad", spec, cuda, torch.bfloat16)
    assert not b.supports("adam", spec, torch.device("meta"), torch.bfloat16)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    assert b.supports("adam", spec, torch.device("cpu"), torch.bfloat16) == interpreting


def test_entry_point_is_registered():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group=backends.ENTRY_POINT_GROUP)}
    assert "triton" in eps, (
        "pip install -e packages/memopt-kernels-triton registers the entry point"
    )
    assert eps["triton"].value == "memopt_kernels_triton.backend:BACKEND"
    assert eps["triton"].load() is BACKEND


def test_registry_sees_the_backend():
    reg = backends.refresh_backends()
    status = reg["triton"]
    assert status.backend is BACKEND or isinstance(status.backend, TritonBackend)
    ok, why = BACKEND.available()
    assert status.usable == ok
    assert status.reason == why
    spec = StateSpec(master="ecc24", moments="q8")
    if ok:
        chosen = backends.select_backend(
            "adam", spec, "cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16, "triton"
        )
        assert chosen is status.backend
    # CPU tensors are never routed to triton automatically (core's order: cpu, torch)
    assert backends.select_backend("adam", spec, "cpu", torch.bfloat16, "auto").name != "triton"
    if torch.cuda.is_available() and ok:
        assert (
            backends.select_backend("adam", spec, "cuda", torch.bfloat16, "auto") is status.backend
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_groups_route_to_triton_through_the_registry():
    # fails when the package is importable but its entry point is not registered (a source
    # folder on PYTHONPATH without .dist-info): optimizers would silently run core's torch backend
    reg = backends.refresh_backends()
    assert reg["triton"].usable, reg["triton"].reason
    spec = StateSpec(master="ecc24", moments="q8")
    chosen = backends.select_backend("adam", spec, "cuda", torch.bfloat16, "auto")
    assert chosen.name == "triton"


def _set_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    if hasattr(p, "grad_dtype"):  # torch 2.12+ refuses another gradient dtype unless told
        p.grad_dtype = None
    p.grad = g


@pytest.mark.parametrize("moments", ["fp32", "q8"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_float32_parameters_take_16bit_gradients(device, grad_dtype, moments):
    """A float32 parameter (its own master) takes a bfloat16 or float16 gradient, widened
    exactly, as core's other backends do: the torch backend's bits, beside float32 gradients
    in the same launch. With a GradScaler's scale and found-inf flag on the device (the kernel
    unscales), a scale that is not a power of two rounds the unscaled gradient in its own
    dtype, as ``GradScaler.unscale_`` (the torch backend's host path) does. Until 2026-12-05
    these kernels refused the pair, so the same step raised on CUDA and ran on CPU."""
    from memopt_core import MemOptimizer

    gen = torch.Generator().manual_seed(5)
    sizes = (1, 31, 33, 257)
    init = [torch.randn(n, generator=gen) for n in sizes]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    mine = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    opts = [
        MemOptimizer(ps, lr=1e-2, weight_decay=0.1, moments=moments, seed=3, backend=b)
        for ps, b in ((ref, "torch"), (mine, "triton"))
    ]
    for step in range(1, 7):
        scaled = step > 3
        for i, n in enumerate(sizes):
            g = torch.randn(n, generator=gen) * (3.0 if scaled else 1.0)
            g = g.to(grad_dtype if i % 2 == 0 else torch.float32)
            if step == 5 and i == 2:
                g[0] = math.inf  # found-inf: the step is skipped
            _set_grad(ref[i], g.clone())
            _set_grad(mine[i], g.clone().to(device))
        for opt, dev in zip(opts, ("cpu", device), strict=True):
            if scaled:  # what GradScaler.step sets before calling step()
                opt.grad_scale = torch.full((1,), 3.0, device=dev)
                opt.found_inf = torch.full((1,), float(step == 5), device=dev)
            opt.step()
        for i, (a, b) in enumerate(zip(ref, mine, strict=True)):
            assert torch.equal(a.detach(), b.detach().cpu()), f"step {step}, parameter {i}"
            for k, v in opts[0].state[a].items():
                assert torch.equal(v, opts[1].state[b][k].cpu()), f"step {step}, {i}: {k}"
