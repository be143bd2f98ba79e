"""A default device other than the parameters' (``torch.set_default_device``, e.g. "cuda" in a
script that keeps some parameters on the CPU) changes nothing: every tensor memopt makes for
itself (state, slot tables, scratch) is placed explicitly. "meta" stands in for the foreign
device, so CPU-only CI covers it; a tensor made there has no memory, and the kernels refuse it."""

from __future__ import annotations

import contextlib

import pytest
import test_cached_step as t
import torch

from memopt_core.testing import assert_same_optimizers


@contextlib.contextmanager
def default_device(device):
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("cfg_name", list(t.CONFIGS))
def test_steps_and_state_dicts_under_a_foreign_default_device(cfg_name):
    for backend in t.backend_names():
        a, b, opt, ref = t.pair(cfg_name, backend)
        for step in range(1, 6):  # the first step builds the state, later ones replay
            t.set_grads(a, step, in_place=step % 2 == 0)
            t.set_grads(b, step, in_place=False)
            with default_device("meta"):
                opt.step()
            ref.step()
        with default_device("meta"):
            sd = opt.state_dict()
            opt.load_state_dict(sd)
        assert_same_optimizers(a, b, opt, ref, f"{backend} backend")
        assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())


@contextlib.contextmanager
def default_dtype(dtype):
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("cfg_name", list(t.CONFIGS))
def test_steps_and_state_dicts_under_a_foreign_default_dtype(cfg_name, dtype):
    """The same for ``torch.set_default_dtype``: scratch and tables made without a dtype would
    hand the kernels float64 (or bfloat16) memory read as float32; every configuration keeps
    the bits of steps under the default float32 (checked 2026-12-05 for each optimizer
    family, this keeps it so)."""
    for backend in t.backend_names():
        a, b, opt, ref = t.pair(cfg_name, backend)
        for step in range(1, 6):
            t.set_grads(a, step, in_place=step % 2 == 0)
            t.set_grads(b, step, in_place=False)
            with default_dtype(dtype):
                opt.step()
            ref.step()
        with default_dtype(dtype):
            opt.load_state_dict(opt.state_dict())
        assert_same_optimizers(a, b, opt, ref, f"{backend} backend")


def _cuda_pair(cfg_name):
    cfg = dict(t.CONFIGS[cfg_name])
    dtype = cfg.pop("dtype")
    a = [p.detach().cuda().requires_grad_() for p in t.make_params(dtype)]
    b = t.twin(a)
    return a, b, t.MemOptimizer(a, lr=1e-2, **cfg), t.Uncached(b, lr=1e-2, **cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("default", ["cuda", "meta"])
@pytest.mark.parametrize("cfg_name", list(t.CONFIGS))
def test_cpu_and_cuda_parameters_under_a_default_device(cfg_name, default):
    """CPU parameters under a default of "cuda" (the C++ kernels once got device pointers), and
    CUDA parameters (Triton) under a default of "cuda" or "meta"."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pairs = [_cuda_pair(cfg_name)]
    if default == "cuda":
        pairs.append(t.pair(cfg_name, None))
    for a, b, opt, ref in pairs:
        for step in range(1, 6):
            for ps in (a, b):
                for p, g in zip(ps, t.grads_for(ps, step), strict=True):
                    p.grad = g.to(p.device)
            with default_device(default):
                opt.step()
            ref.step()
        assert_same_optimizers(a, b, opt, ref, f"parameters on {a[0].device}")
