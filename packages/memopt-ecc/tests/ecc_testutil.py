"""Helpers shared by memopt-ecc's tests (conftest puts this folder on sys.path)."""

from __future__ import annotations

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (so ``torch.equal`` compares bits: -0 vs 0, NaN payloads, fp8)."""
    t = t.detach().cpu().contiguous()
    if t.dtype.is_floating_point:
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_state(opt_a, params_a, opt_b, params_b) -> None:
    """Parameters and every optimizer state tensor equal bit for bit."""
    for i, (p, q) in enumerate(zip(params_a, params_b, strict=True)):
        assert same_bits(p, q), f"parameter {i} differs"
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert sorted(sa) == sorted(sb), (
            f"state keys of parameter {i}: {sorted(sa)} vs {sorted(sb)}"
        )
        for k in sa:
            assert same_bits(sa[k], sb[k]), f"state {k!r} of parameter {i} differs"
