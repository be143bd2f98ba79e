"""The ``cpu`` backend object and its registration with memopt-core's registry."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import memopt_kernels_cpu
from memopt_core import MemOptimizer, backends
from memopt_core.backends import KERNEL_API
from memopt_core.errors import BackendUnavailableError
from memopt_core.formats import StateSpec
from memopt_kernels_cpu.backend import BACKEND, CpuBackend

SPEC = StateSpec(master="ecc24", moments="q8")


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    backends.refresh_backends()
    yield
    backends.refresh_backends()


def test_backend_object():
    assert BACKEND.name == "cpu"
    assert BACKEND.KERNEL_API == KERNEL_API
    assert isinstance(BACKEND, backends.Backend)
    assert memopt_kernels_cpu.BACKEND is BACKEND
    assert repr(BACKEND) == "CpuBackend()"


def test_entry_point_is_registered():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group=backends.ENTRY_POINT_GROUP)}
    assert "cpu" in eps, "pip install packages/memopt-kernels-cpu registers the entry point"
    assert eps["cpu"].value == "memopt_kernels_cpu.backend:BACKEND"
    assert eps["cpu"].load() is BACKEND


def test_registry_finds_the_backend():
    status = backends.refresh_backends()["cpu"]
    assert status.usable, status.reason
    assert status.backend is BACKEND
    assert status.reason == BACKEND.available()[1]
    assert status.reason.startswith("C++ kernels, instruction set ")


def test_automatic_choice_for_cpu_tensors():
    assert backends.select_backend("adam", SPEC, "cpu", torch.bfloat16) is BACKEND
    # what the cpu backend cannot run goes to the torch backend, what none runs is refused
    assert backends.select_backend("adam", SPEC, "meta", torch.bfloat16).name == "torch"
    with pytest.raises(BackendUnavailableError, match="no memopt backend supports rule 'adam'"):
        backends.select_backend("adam", SPEC, "cpu", torch.float64)


def test_memopt_backend_env_selects_cpu(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "cpu")
    assert backends.select_backend("lion", SPEC, "cpu", torch.bfloat16) is BACKEND
    with pytest.raises(BackendUnavailableError, match=r"'cpu' .* does not support .* on meta"):
        backends.select_backend("lion", SPEC, "meta", torch.bfloat16)
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    assert backends.select_backend("lion", SPEC, "cpu", torch.bfloat16).name == "torch"


@pytest.mark.parametrize("rule", ["sgd", "adam", "lion"])
@pytest.mark.parametrize(
    ("master", "dtype"),
    [
        ("fp32", torch.float32),
        ("none", torch.bfloat16),
        ("none", torch.float16),
        ("ecc24", torch.bfloat16),
        ("ecc32", torch.bfloat16),
    ],
)
@pytest.mark.parametrize("moments", ["fp32", "bf16", "fp8", "q8"])
@pytest.mark.parametrize("sr", [False, True])
def test_supports_every_format_on_cpu(rule, master, dtype, moments, sr):
    spec = StateSpec(master=master, moments=moments, stochastic_rounding=sr)
    assert BACKEND.supports(rule, spec, torch.device("cpu"), dtype)
    assert BACKEND.supports(rule, spec, "cpu", dtype)
    assert not BACKEND.supports(rule, spec, torch.device("meta"), dtype)
    assert not BACKEND.supports(rule, spec, torch.device("cuda"), dtype)
    assert not BACKEND.supports(rule, spec, torch.device("cuda", 1), dtype)


def test_supports_refuses():
    cpu = torch.device("cpu")
    assert not CpuBackend().supports("adagrad", SPEC, cpu, torch.bfloat16)
    assert not BACKEND.supports("adamw", SPEC, cpu, torch.bfloat16)  # core passes "adam"
    assert not BACKEND.supports("adam", SPEC, cpu, torch.float16)  # ECC needs bf16 params
    assert not BACKEND.supports("adam", SPEC, cpu, torch.float64)
    assert not BACKEND.supports("adam", StateSpec(master="fp32"), cpu, torch.bfloat16)
    assert not BACKEND.supports("adam", StateSpec(master="none"), cpu, torch.float32)


def test_optimizer_steps_through_the_cpu_backend(monkeypatch):
    """MemOptimizer with backend='cpu' hands its groups to ops.fused_step."""
    from memopt_kernels_cpu import ops

    calls = []
    real = ops.fused_step
    monkeypatch.setattr(
        ops, "fused_step", lambda work, staging=None: calls.append(work) or real(work)
    )
    params = [torch.nn.Parameter(torch.randn(33, dtype=torch.bfloat16)) for _ in range(3)]
    opt = MemOptimizer(params, rule="adamw", master="ecc24", moments="q8", backend="cpu")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert len(calls) == 1
    assert calls[0].rule == "adam"
    assert len(calls[0].params) == 3
    assert all(int(opt.state[p]["step"]) == 1 for p in params)
