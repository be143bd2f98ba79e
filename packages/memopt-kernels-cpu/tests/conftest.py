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

from memopt_core import reference
from memopt_core.backends import GroupStep
from memopt_core.formats import StateSpec
from memopt_core.plan import GroupPlan, StateArena
from memopt_kernels_cpu import _core

#: optimizer rule -> (backend rule, decoupled)
RULE_KINDS = {
    "sgd": ("sgd", False),
    "sgdw": ("sgd", True),
    "adam": ("adam", False),
    "adamw": ("adam", True),
    "lion": ("lion", True),
}


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


def _scalars(rule: str, step: int, hyper: dict):
    kind, decoupled = RULE_KINDS[rule]
    lr = hyper.get("lr", 1e-2)
    wd = hyper.get("weight_decay", 0.0)
    maximize = hyper.get("maximize", False)
    if kind == "adam":
        return reference.adam_scalars(
            lr=lr,
            betas=hyper.get("betas", (0.9, 0.999)),
            eps=hyper.get("eps", 1e-8),
            weight_decay=wd,
            step=step,
            decoupled=decoupled,
            maximize=maximize,
        )
    if kind == "lion":
        return reference.lion_scalars(
            lr=lr, betas=hyper.get("betas", (0.9, 0.99)), weight_decay=wd, maximize=maximize
        )
    return reference.sgd_scalars(
        lr=lr,
        momentum=hyper.get("momentum", 0.0),
        dampening=hyper.get("dampening", 0.0),
        nesterov=hyper.get("nesterov", False),
        weight_decay=wd,
        decoupled=decoupled,
        maximize=maximize,
    )


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
    """A one-group step as ``MemOptimizer`` builds it (shapes 1-D, or 2-D where size % 4 == 0)."""
    kind, _ = RULE_KINDS[rule]
    spec = StateSpec(master=master, moments=moments, stochastic_rounding=sr)
    g = torch.Generator().manual_seed(0)
    params = []
    for i, n in enumerate(sizes):
        shape = (n // 4, 4) if n % 4 == 0 and n and i % 2 else (n,)
        params.append(torch.randn(n, generator=g).to(dtype).view(shape))
    plan = GroupPlan(params, spec, device=torch.device("cpu"), param_dtype=dtype)
    mcodec = spec.master_for(dtype)
    if kind == "adam":
        names = ("exp_avg", "exp_avg_sq")
    elif kind == "lion":
        names = ("exp_avg",)
    else:
        names = ("momentum_buffer",) if hyper.get("momentum", 0.0) != 0.0 else ()
    codecs = {n: (spec.second if n == "exp_avg_sq" else spec.first) for n in names}
    arena = StateArena(plan, codecs, mcodec)
    grads = [torch.randn(p.shape, generator=g).to(grad_dtype or dtype) for p in params]
    slots = list(range(len(params))) if slots is None else slots
    tensor_ids = [1000 + 7 * i for i in range(len(params))]
    return GroupStep(
        rule=kind,
        spec=spec,
        plan=plan,
        slots=slots,
        params=[params[i] for i in slots],
        grads=[grads[i] for i in slots],
        arena=arena,
        scalars=_scalars(rule, step, hyper),
        step=step,
        seed=seed,
        tensor_ids=[tensor_ids[i] for i in slots],
        first_step=step == 1,
    )


@pytest.fixture
def make_work() -> Callable[..., GroupStep]:
    """``build_work`` (see the module doc)."""
    return build_work


def state_bits(work: GroupStep) -> dict[str, torch.Tensor]:
    """Every tensor a step may write, as raw bits (parameters, master code, arena fields)."""
    out = {f"param{i}": _bits(p) for i, p in enumerate(work.plan.params)}
    for t_i, t in enumerate(work.arena.tensors()):
        out[f"arena{t_i}"] = _bits(t)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1).contiguous()
    return t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


@pytest.fixture
def bits() -> Callable[[GroupStep], dict[str, torch.Tensor]]:
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
