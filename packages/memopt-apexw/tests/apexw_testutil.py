"""Helpers of memopt-apexw's tests: parameters, gradients and the reference twin.

The reference is ``MemOptimizer(rule="adamw", backend="torch")`` with ApexW's formats: core's
pure-torch backend, which memopt-core's tests hold bit-exact to ``reference.adamw`` and the
format codecs. Every ApexW mode and backend must give its bits.
"""

from __future__ import annotations

import importlib.util

import torch

from memopt_core import MemOptimizer, backends

SIZES = [0, 1, 31, 33, 127, 129, 1025]
SHAPES = [(0,), (1,), (31,), (3, 11), (127,), (129,), (5, 205)]


def fused_backend_for(device: torch.device) -> str | None:
    """Name of a usable fused backend for ``device`` here (None: none installed)."""
    name = "triton" if device.type == "cuda" else "cpu"
    status = backends.available_backends().get(name)
    return name if status is not None and status.usable else None


def set_cpu_backend(monkeypatch, reason: str | None) -> None:
    """Core's registry, for this test, with memopt-kernels-cpu installed but unusable for
    ``reason`` (as under ``MEMOPT_CPU_ISA=neon``), or not installed (None)."""
    reg = backends.available_backends()
    if reason is None:
        reg.pop("cpu", None)
    else:
        reg["cpu"] = backends.BackendStatus("cpu", False, reason, "tests")
    monkeypatch.setattr(backends, "_registry", reg)


def triton_interpreter_ready() -> bool:
    import os

    return (
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        and importlib.util.find_spec("triton") is not None
        and importlib.util.find_spec("numpy") is not None
        and importlib.util.find_spec("memopt_kernels_triton") is not None
    )


def make_params(device, dtype=torch.float32, shapes=SHAPES, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        v = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
        out.append(v.reshape(s).to(dtype).to(device).requires_grad_())
    return out


def twin(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone().requires_grad_() for p in params]


def set_grads(params, step: int, *, in_place: bool = True, scale: float = 1.0) -> None:
    """Deterministic gradients of ``step`` (a few exact zeros), in place where one exists."""
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        n = p.numel()
        v = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g)) * scale
        if n > 3:
            v[::7] = 0.0
        v = v.reshape(p.shape).to(p.dtype).to(p.device)
        if in_place and p.grad is not None:
            p.grad.copy_(v)
        else:
            p.grad = v


def step_both(a, b, opt, ref, step: int, **grad_kw) -> None:
    """One step of ApexW ``opt`` over ``a`` and of the reference ``ref`` over its twin ``b``, on
    the same gradients (``grad_kw`` goes to ``a``'s :func:`set_grads`)."""
    set_grads(a, step, **grad_kw)
    set_grads(b, step)
    opt.step()
    ref.step()


def reference_for(params, *, state="bf16", master="ecc24", **kw) -> MemOptimizer:
    kw.setdefault("weight_decay", 1e-2)
    return MemOptimizer(params, rule="adamw", moments=state, master=master, backend="torch", **kw)


def assert_same(a_params, b_params, a_opt, b_opt, where: str = "") -> None:
    for i, (x, y) in enumerate(zip(a_params, b_params, strict=True)):
        assert torch.equal(x, y), f"{where} param {i} differs"
        sa, sb = a_opt.state.get(x, {}), b_opt.state.get(y, {})
        assert sorted(sa) == sorted(sb), (
            f"{where} param {i}: state keys {sorted(sa)} vs {sorted(sb)}"
        )
        for k in sb:
            va, vb = sa[k], sb[k]
            if va.dtype.is_floating_point and va.dtype.itemsize == 1:
                va, vb = va.view(torch.uint8), vb.view(torch.uint8)
            if va.device != vb.device:  # a step count kept on the device (a GradScaler's steps)
                va, vb = va.cpu(), vb.cpu()
            assert torch.equal(va, vb), f"{where} param {i}: state {k!r} differs"
