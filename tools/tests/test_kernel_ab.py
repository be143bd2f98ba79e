"""kernel_ab.py loads a git revision's Adam and Lion kernels beside the installed package and
launches each with only the constexprs it declares (the timing itself needs a GPU)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("memopt_kernels_triton") is None,
    reason="needs memopt-kernels-triton",
)
ROOT = Path(__file__).resolve().parents[2]


def test_declared_drops_unknown_constexprs() -> None:
    import kernel_ab

    seen = {}

    class Fake:
        arg_names = ("x", "ROWS")

        def __getitem__(self, grid):
            def run(*args, **kw):
                seen.update(kw, grid=grid)

            return run

    kernel_ab._Declared(Fake())[(3,)](1, ROWS=4, AHEAD=True, num_warps=8, enable_fp_fusion=False)
    # launch options must reach the kernel: without enable_fp_fusion=False it would contract
    # multiply-adds and compute other bits
    assert seen == {"ROWS": 4, "num_warps": 8, "enable_fp_fusion": False, "grid": (3,)}


def test_loads_the_revision_kernels() -> None:
    import kernel_ab

    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    kernels = kernel_ab.load_baseline("HEAD", ROOT)
    assert set(kernels) == {"adam", "lion"}
    assert {"ROWS", "MASTER", "FMT1"} <= kernels["adam"].names
    assert "FMT2" not in kernels["lion"].names


def test_loads_kernels_from_a_folder(tmp_path) -> None:
    import kernel_ab

    src = ROOT / kernel_ab._PACKAGE_DIR
    for name in ("adam", "lion"):
        (tmp_path / f"{name}.py").write_text((src / f"{name}.py").read_text())
    kernels = kernel_ab.load_baseline(str(tmp_path), ROOT)
    assert "AHEAD" in kernels["adam"].names


def test_loads_a_shared_module_the_package_no_longer_has(tmp_path) -> None:
    """A baseline from before KERNEL_API 3 imports ``kernels/philox.py`` (now ``kernels/rng.py``):
    its own copy is loaded beside it (here a copy of ``rng.py`` under the old name)."""
    import sys

    import kernel_ab

    src = ROOT / kernel_ab._PACKAGE_DIR
    new, old = (
        "memopt_kernels_triton.kernels.rng import",
        "memopt_kernels_triton.kernels.philox import",
    )
    for name in ("adam", "lion"):
        text = (src / f"{name}.py").read_text()
        assert new in text
        (tmp_path / f"{name}.py").write_text(text.replace(new, old))
    (tmp_path / "philox.py").write_text((src / "rng.py").read_text())
    assert importlib.util.find_spec("memopt_kernels_triton.kernels.philox") is None
    kernels = kernel_ab.load_baseline(str(tmp_path), ROOT)
    assert set(kernels) == {"adam", "lion"}
    shared = sys.modules["baseline_philox"]
    assert kernels["adam"].kernel.fn.__globals__["step_keys"] is shared.step_keys
    assert kernels["lion"].kernel.fn.__globals__["step_keys"] is shared.step_keys
