"""The package without triton or a GPU, the backend object, and its registration with core."""

from __future__ import annotations

import importlib.metadata
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
    """The backend declares the level whose bits it computes (7), a literal: a core at another
    level lists the package as stale instead of using it."""
    assert TritonBackend.KERNEL_API == 7
    assert KERNEL_API == 7, "core moved past 7: port the kernels, then raise the literal"


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


def test_a_group_the_kernels_refuse_fails_before_any_group_runs(device):
    """core takes a bf16 gradient for an fp32 parameter (its own master); these kernels refuse
    it. With a bf16 group first, that group was updated before the fp32 one raised: the
    backend's check() now refuses the step before any launch, changing nothing."""
    from memopt_core import ConfigError, MemOptimizer

    gen = torch.Generator().manual_seed(0)
    half = torch.nn.Parameter(torch.randn(33, generator=gen).to(torch.bfloat16).to(device))
    full = torch.nn.Parameter(torch.randn(31, generator=gen).to(device))
    opt = MemOptimizer([half, full], lr=1e-2, backend="triton")
    half.grad = torch.randn(33, generator=gen).to(torch.bfloat16).to(device)
    full.grad = torch.randn(31, generator=gen).to(device)
    opt.step()  # state exists
    if hasattr(full, "grad_dtype"):  # torch 2.12+ refuses another gradient dtype unless told
        full.grad_dtype = None
    full.grad = full.grad.to(torch.bfloat16)
    before = [t.clone() for t in (half.detach(), full.detach())]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in (half, full)]
    with pytest.raises(ConfigError, match="gradients must have the parameter's dtype or float32"):
        opt.step()
    assert torch.equal(half.detach(), before[0])
    assert torch.equal(full.detach(), before[1])
    for p, saved in zip((half, full), states, strict=True):
        for k, v in saved.items():
            assert torch.equal(opt.state[p][k], v), k
