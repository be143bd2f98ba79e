"""The CPU probe and the choice of instruction set (at import, MEMOPT_CPU_ISA, set_isa)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

import memopt_kernels_cpu
from memopt_kernels_cpu import _core
from memopt_kernels_cpu.backend import BACKEND

ALL = ("scalar", "avx2", "avx512", "neon")
X86 = platform.machine().lower() in ("x86_64", "amd64")
ARM = platform.machine().lower() in ("aarch64", "arm64")


def test_supported_within_built():
    built, supported = _core.built_isas(), _core.supported_isas()
    assert built[0] == supported[0] == "scalar"
    assert set(supported) <= set(built) <= set(ALL)
    assert supported == [i for i in built if i in supported]  # same order: weakest first
    if X86:
        assert built == ["scalar", "avx2", "avx512"]
    if ARM:
        assert built == ["scalar", "neon"]


def test_import_picks_the_best(run_py):
    out = run_py(
        "from memopt_kernels_cpu import _core as c; print(c.get_isa(), c.supported_isas())"
    )
    isa, _rest = out.stdout.strip().split(" ", 1)
    assert isa == _core.supported_isas()[-1]


@pytest.mark.parametrize("name", ALL)
def test_set_isa(name):
    if name in _core.supported_isas():
        assert _core.set_isa(name) == name
        assert _core.get_isa() == name
        ok, why = BACKEND.available()
        assert ok
        assert f"instruction set {name}" in why
    else:
        before = _core.get_isa()
        with pytest.raises(RuntimeError, match=f"'{name}'"):
            _core.set_isa(name)
        assert _core.get_isa() == before  # unchanged after a refused request


def test_set_isa_auto_and_spelling():
    _core.set_isa("scalar")
    assert _core.set_isa("auto") == _core.supported_isas()[-1]
    _core.set_isa("scalar")
    assert _core.set_isa("") == _core.supported_isas()[-1]
    assert _core.set_isa(" Scalar ") == "scalar"


@pytest.mark.parametrize("name", ["sse9", "avx", "native", "avx-512"])
def test_unknown_isa(name):
    with pytest.raises(ValueError, match=f"unknown instruction set '{name}'; choose one of auto"):
        _core.set_isa(name)


@pytest.mark.parametrize("name", ["", "   ", "a v x 2", "sca\tlar", "scalar\x00junk"])
def test_set_isa_refuses_what_names_no_set(name):
    """C++ drops every blank (so "a v x 2" was avx2) and takes "" as auto; a NUL cut its
    message short. Surrounding blanks and case are still ignored."""
    before = _core.get_isa()
    with pytest.raises(ValueError, match=r"is not an instruction set name; choose one of auto"):
        memopt_kernels_cpu.set_isa(name)
    assert _core.get_isa() == before
    assert memopt_kernels_cpu.set_isa(" Scalar\t") == "scalar"
    memopt_kernels_cpu.set_isa(before)


@pytest.mark.parametrize("name", [None, 5, b"avx2"])
def test_set_isa_takes_only_a_str(name):
    """pybind11's own message ("incompatible function arguments") named no argument."""
    before = _core.get_isa()
    with pytest.raises(TypeError, match=r"set_isa: name must be a str, got"):
        memopt_kernels_cpu.set_isa(name)
    assert _core.get_isa() == before


def test_unbuilt_isa_names_what_is_built():
    foreign = "neon" if X86 else "avx2"
    with pytest.raises(RuntimeError, match=r"not built into this memopt-kernels-cpu") as info:
        _core.set_isa(foreign)
    assert ", ".join(_core.built_isas()) in str(info.value)


@pytest.mark.parametrize("name", [*ALL, "auto"])
def test_env_var_at_import(run_py, name):
    code = "import memopt_kernels_cpu as m; print(m.get_isa())"
    if name == "auto" or name in _core.supported_isas():
        out = run_py(code, MEMOPT_CPU_ISA=name)
        want = _core.supported_isas()[-1] if name == "auto" else name
        assert out.stdout.strip() == want
    else:
        out = run_py(code, check=False, MEMOPT_CPU_ISA=name)
        assert out.returncode != 0
        assert "ImportError" in out.stderr
        assert f"MEMOPT_CPU_ISA='{name}'" in out.stderr
        assert "Illegal instruction" not in out.stderr


def test_env_var_unknown_name_fails_import(run_py):
    out = run_py("import memopt_kernels_cpu", check=False, MEMOPT_CPU_ISA="pentium")
    assert out.returncode == 1
    assert "MEMOPT_CPU_ISA='pentium': unknown instruction set" in out.stderr


def test_env_var_reaches_the_registry(run_py):
    code = (
        "from memopt_core import backends\n"
        "s = backends.available_backends()['cpu']\n"
        "print(s.usable, s.reason)"
    )
    out = run_py(code, MEMOPT_CPU_ISA="scalar").stdout
    assert out.startswith("True C++ kernels, instruction set scalar")


def test_cpu_features_agree_with_the_os():
    feats = _core.cpu_features()
    assert all(isinstance(v, bool) for v in feats.values())
    supported = _core.supported_isas()
    if X86:
        assert ("avx2" in supported) == (feats["avx2"] and feats["fma"] and feats["f16c"])
        avx512 = all(feats[f] for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))
        assert ("avx512" in supported) == (avx512 and feats["os_avx512"])
        cpuinfo = Path("/proc/cpuinfo")
        if cpuinfo.exists():
            flags = set()
            for line in cpuinfo.read_text().splitlines():
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
            for ours, linux in [
                ("avx2", "avx2"),
                ("fma", "fma"),
                ("f16c", "f16c"),
                ("avx512f", "avx512f"),
                ("avx512bw", "avx512bw"),
                ("avx512vl", "avx512vl"),
                ("avx512dq", "avx512dq"),
                ("avx512bf16", "avx512_bf16"),
            ]:
                assert feats[ours] == (linux in flags), ours
    if ARM:
        assert feats["neon"] == ("neon" in supported)


def test_available_reason_names_isa_and_threads():
    _core.set_num_threads(3)
    ok, why = BACKEND.available()
    assert ok
    assert f"instruction set {_core.get_isa()}" in why
    assert "3 threads" in why
