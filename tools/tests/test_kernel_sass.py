"""kernel_sass.py compiles the fused AdamW kernel for sm_90 without a GPU and counts its tile
loop: the figures docs/benchmarks/2026-11-30-q8-codecs.md and 2026-11-30-vector-tiles.md quote."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
_CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("memopt_kernels_triton") is None or not _CUOBJDUMP.exists(),
    reason="needs memopt-kernels-triton and Triton's bundled NVIDIA tools",
)


def test_counts_the_tile_loop(tmp_path) -> None:
    import kernel_sass

    counts = {}
    for name in ("fp32m", "q8m"):
        k = kernel_sass.compile_kernel("adam", name, 90, rows=16, warps=8)
        cubin = tmp_path / f"{name}.cubin"
        cubin.write_bytes(k.asm["cubin"])
        body = kernel_sass.inner_loop(kernel_sass.sass_lines(cubin))
        assert body[-1] == "BRA"
        assert any(op.startswith("LDG") for op in body)
        counts[name] = len(body)
    # q8 moments (codecs, stochastic-rounding words) cost about twice fp32 moments' tile
    # (16 x 8: 199 against 395 instructions since the vectorized tiles)
    assert 1.5 * counts["fp32m"] < counts["q8m"]


def test_fast_path_skips_the_slow_calls(tmp_path) -> None:
    import kernel_sass

    from memopt_kernels_triton.kernels import division

    k = kernel_sass.compile_kernel("adam", "fp32m", 90, rows=16, warps=8)
    cubin = tmp_path / "fp32m.cubin"
    cubin.write_bytes(k.asm["cubin"])
    ins = kernel_sass.sass_lines(cubin)
    static, fast = kernel_sass.inner_loop(ins), kernel_sass.fast_path(ins)
    assert "CALL.REL.NOINC" in static
    assert "CALL.REL.NOINC" not in fast
    assert fast[-1] == "BRA"
    assert any(op.startswith("LDG") for op in fast)
    assert any(op.startswith("STG") for op in fast)
    assert len(fast) < len(static)
    if division.FAST_SCALAR_DIVISION:
        # 2 elements per thread at 16 x 8: one reciprocal each for m / d, none for the division
        # by bc2_sqrt (its reciprocal is computed once per chunk, outside the tile loop)
        assert fast.count("MUFU.RCP") == 2
        assert fast.count("MUFU.RSQ") == 2


def test_counts_lion(tmp_path) -> None:
    import kernel_sass

    k = kernel_sass.compile_kernel("lion", "ecc24q8", 90, rows=8, warps=4)
    cubin = tmp_path / "lion.cubin"
    cubin.write_bytes(k.asm["cubin"])
    body = kernel_sass.inner_loop(kernel_sass.sass_lines(cubin))
    assert body[-1] == "BRA"
    assert any(op.startswith("LDG") for op in body)
    with pytest.raises(ValueError, match="adam or lion"):
        kernel_sass.compile_kernel("sgd", "q8m", 90, rows=8, warps=4)
