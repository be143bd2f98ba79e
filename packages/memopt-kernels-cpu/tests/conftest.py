"""Shared fixtures of memopt-kernels-cpu's tests.

The tests import the installed package (``--import-mode=importlib``): the compiled ``_core``
exists only in an installed copy. Every test gets the instruction set, thread count and chunk
size restored afterwards (``_restore_settings``), so tests that change them stay independent.

``make_work`` builds one group (plan, arena, parameters, gradients) the way ``MemOptimizer``
does and returns the :class:`memopt_core.backends.GroupStep` of one step; ``run_py`` runs code in
a fresh interpreter (for what happens at import: ``MEMOPT_CPU_ISA``, a stale build).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from memopt_core.backends import GroupStep
from memopt_core.formats import StateSpec
from memopt_core.testing import bits, group_step, make_grads, make_group
from memopt_kernels_cpu import _core


@pytest.fixture(autouse=True)
def _restore_settings():
    isa, threads, chunk = _core.get_isa(), _core.get_num_threads(), _core.get_chunk_size()
    yield
    _core.set_isa(isa)
    _core.set_num_threads(threads)
    _core.set_chunk_size(chunk)


@pytest.fixture
def core():
    """The compiled module ``memopt_kernels_cpu._core``."""
    return _core


@pytest.fixture
def ops():
    """``memopt_kernels_cpu.ops``."""
    from memopt_kernels_cpu import ops as module

    return module


def build_work(
    rule: str = "adamw",
    master: str = "ecc24",
    moments: str = "q8",
    dtype: torch.dtype = torch.bfloat16,
    sizes: tuple[int, ...] = (33, 64, 1, 0, 100),
    *,
    sr: bool = True,
    step: int = 1,
    seed: int = 1234,
    grad_dtype: torch.dtype | None = None,
    slots: list[int] | None = None,
    **hyper,
) -> GroupStep:
    """A one-group step as ``MemOptimizer`` builds it (:mod:`memopt_core.testing`)."""
    spec = StateSpec(master=master, moments=moments, stochastic_rounding=sr)
    group = make_group(rule, spec, dtype, list(sizes), "cpu", seed=seed, **hyper)
    return group_step(group, make_grads(group, step, grad_dtype=grad_dtype), step, slots)


@pytest.fixture
def make_work() -> Callable[..., GroupStep]:
    """``build_work`` (see the module doc)."""
    return build_work


def state_bits(work: GroupStep) -> dict[str, torch.Tensor]:
    """Every tensor a step may write, as raw bits (parameters, master code, arena fields)."""
    out = {f"param{i}": bits(p) for i, p in enumerate(work.plan.params)}
    for t_i, t in enumerate(work.arena.tensors()):
        out[f"arena{t_i}"] = bits(t)
    return out


@pytest.fixture(name="bits")
def bits_fixture() -> Callable[[GroupStep], dict[str, torch.Tensor]]:
    """``state_bits``: the raw bits of everything a step may write."""
    return state_bits


def _run_py(code: str, *, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("MEMOPT_CPU_ISA", "MEMOPT_BACKEND")}
    full.update(env)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=full,
        check=False,
        timeout=120,
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out


@pytest.fixture
def run_py() -> Callable[..., subprocess.CompletedProcess]:
    """Run ``code`` in a fresh interpreter with extra environment variables."""
    return _run_py
