"""The build: versions, the stale-build check, the extension's interface and its flags."""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path

import pytest

import memopt_kernels_cpu
from memopt_kernels_cpu import _core

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT_VERSION = re.search(
    r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M
).group(1)


def test_versions_agree():
    assert memopt_kernels_cpu.__version__ == PYPROJECT_VERSION == "0.1.0"
    assert _core.__version__ == PYPROJECT_VERSION  # passed in by CMake from the pyproject
    assert importlib.metadata.version("memopt-kernels-cpu") == PYPROJECT_VERSION


def test_stale_build_is_refused(run_py):
    code = (
        "import sys, types\n"
        "fake = types.ModuleType('memopt_kernels_cpu._core')\n"
        "fake.__version__ = '0.0.9'\n"
        "sys.modules['memopt_kernels_cpu._core'] = fake\n"
        "try:\n"
        "    import memopt_kernels_cpu\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = run_py(code).stdout
    assert out.startswith("ImportError:"), out
    assert "stale build" in out
    assert "'0.0.9'" in out
    assert "0.1.0" in out
    assert "pip install" in out


def test_check_core_version_directly():
    memopt_kernels_cpu._check_core_version("0.1.0", "0.1.0")
    with pytest.raises(ImportError, match=r"built for version None \(a stale build\)"):
        memopt_kernels_cpu._check_core_version(None, "0.1.0")


def _import_ops_after(run_py, tamper: str) -> str:
    """What importing memopt_kernels_cpu.ops prints once ``tamper`` (a statement on ``_core``)
    made the extension look like a stale build."""
    code = (
        "import sys\n"
        "from memopt_kernels_cpu import _core\n"
        f"{tamper}\n"
        "del sys.modules['memopt_kernels_cpu.ops']\n"
        "try:\n"
        "    import memopt_kernels_cpu.ops\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = run_py(code).stdout
    assert out.startswith("ImportError:"), out
    assert "pip install --force-reinstall" in out
    return out


def test_stale_slot_row_layout_is_refused(run_py):
    # a _core of the same version built before the slot table's index_base column (8 words)
    out = _import_ops_after(run_py, "_core.SLOT_ROW_WORDS = 8")
    assert "rows of 8 words, this ops.py writes 9 (a stale build)" in out


def test_a_build_without_step_variants_is_refused(run_py):
    # a _core of the same version built before fused_step took per-row variants
    out = _import_ops_after(run_py, "del _core.STEP_VARIANTS")
    assert "predates fused_step's per-row variants" in out
    assert "stale build" in out


@pytest.mark.parametrize("change", ["del _core.KERNEL_API", "_core.KERNEL_API = 7"])
def test_a_build_of_another_kernel_api_is_refused(run_py, change):
    # a _core of the same version built for another level (7: Adam's 8-bit second moments
    # were stored as v, the capturable words not normalized; 6 rounded q8_sqrt
    # stochastically through a division, 5 decoded an ECC code left beside a zeroed weight as
    # NaN, 4 stored fp8_e5m2's smallest elements as code 0, 3 q8_sqrt's too; before it, other
    # rounding words)
    out = _import_ops_after(run_py, change)
    assert "this package those of KERNEL_API 8 (a stale build)" in out


def test_missing_extension_says_how_to_build(run_py):
    code = (
        "import sys\n"
        "sys.modules['memopt_kernels_cpu._core'] = None\n"
        "try:\n"
        "    import memopt_kernels_cpu\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    out = run_py(code).stdout
    assert out.startswith("ImportError "), out
    assert "compiled extension (_core) is missing" in out
    assert "pip install packages/memopt-kernels-cpu" in out


def test_extension_links_no_libtorch():
    so = Path(_core.__file__)
    assert so.suffix in (".so", ".pyd"), so
    data = so.read_bytes()
    for lib in (b"libtorch", b"libc10", b"libtorch_python"):
        assert lib not in data, f"{so.name} refers to {lib.decode()}"


def test_stubs_match_the_module():
    stub = ast.parse((Path(memopt_kernels_cpu.__file__).parent / "_core.pyi").read_text())
    stubbed = {n.name for n in stub.body if isinstance(n, ast.FunctionDef)}
    defined = {
        name for name in dir(_core) if not name.startswith("__") and callable(getattr(_core, name))
    }
    assert stubbed == defined
    assert any(isinstance(n, ast.AnnAssign) and n.target.id == "__version__" for n in stub.body)


def test_fused_step_signature_matches_stub():
    stub = ast.parse((Path(memopt_kernels_cpu.__file__).parent / "_core.pyi").read_text())
    fn = next(n for n in stub.body if isinstance(n, ast.FunctionDef) and n.name == "fused_step")
    stub_names = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
    doc = _core.fused_step.__doc__
    sig = doc.splitlines()[0]
    assert [m for m in re.findall(r"(\w+): ", sig)] == stub_names, sig


def test_package_data_installed():
    here = Path(memopt_kernels_cpu.__file__).parent
    assert (here / "py.typed").is_file()
    assert (here / "_core.pyi").is_file()


def test_build_flags_in_cmakelists():
    text = (ROOT / "CMakeLists.txt").read_text()
    code = "\n".join(line.split("#")[0] for line in text.splitlines())  # without comments
    assert "-march" not in code
    assert "-mtune" not in code
    for flag in ("-ffp-contract=off", "-fno-fast-math", "-Wall", "-Wextra", "MEMOPT_WERROR"):
        assert flag in text, flag
    # AVX512_BF16's conversion flushes subnormal inputs, so it must never be enabled
    assert "-mavx512bf16" not in code
    assert "-mavx512f;-mavx512bw;-mavx512vl;-mavx512dq" in code
    assert "-mavx2;-mfma;-mf16c" in text
