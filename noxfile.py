"""Every task of the memopt monorepo is one nox session: ``nox -l`` is the menu.

CPU sessions pin torch==2.13.0 (a CPU build; an unpinned torch pulls a multi-GB CUDA build).
``gpu_tests`` instead runs in the current interpreter with no downloads, for an offline GPU host.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the packages support Python 3.10, where nox brings tomli (tomllib's origin)
    import tomli as tomllib

import nox
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).parent
PACKAGES = ROOT / "packages"
TORCH_CPU = "torch==2.13.0"

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "check_versions", "tests"]
nox.options.error_on_external_run = True


def _package_dirs() -> list[Path]:
    """Package folders in dependency order (core first, the meta-package last)."""
    dirs = sorted(p.parent for p in PACKAGES.glob("*/pyproject.toml"))
    order = {"memopt-core": 0, "memopt": 2}
    return sorted(dirs, key=lambda d: (order.get(d.name, 1), d.name))


PACKAGE_NAMES = [d.name for d in _package_dirs()]


def _sibling_closure(package: str) -> list[str]:
    """The sibling packages ``package`` needs, directly or through other siblings."""
    local = {canonicalize_name(name): name for name in PACKAGE_NAMES}
    needed: list[str] = []
    todo = [package]
    while todo:
        pyproject = tomllib.loads((PACKAGES / todo.pop() / "pyproject.toml").read_text())
        for dep in pyproject["project"].get("dependencies", []):
            name = local.get(canonicalize_name(Requirement(dep).name))
            if name and name not in needed:
                needed.append(name)
                todo.append(name)
    return needed


def _install_torch(session: nox.Session) -> None:
    session.install(TORCH_CPU)


def _pytest(
    session: nox.Session,
    package: Path,
    *args: str,
    python: str = "python",
    env: dict[str, str] | None = None,
    success_codes: list[int] | None = None,
) -> None:
    """Run one package's tests with its own pyproject's pytest config, against the installed package."""
    if not (package / "tests").is_dir():
        return
    with session.chdir(package):
        session.run(
            python, "-m", "pytest", *args, *session.posargs, env=env, success_codes=success_codes
        )


#: Extension builds in CI sessions: compiler warnings are errors (scikit-build-core reads this).
_STRICT_BUILD = {"SKBUILD_CMAKE_DEFINE": "MEMOPT_WERROR=ON"}


@nox.session
def lint(session: nox.Session) -> None:
    """Lint and format-check every Python file with ruff."""
    session.install("ruff==0.17.6")  # pinned: a new ruff release must not turn CI red by itself
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over every package's sources, with each package's ``[tool.mypy]`` settings. The
    memopt packages resolve from their source trees (``MYPYPATH``), so nothing is built; torch
    is installed for its types (triton ships none: memopt-kernels-triton's settings say so)."""
    _install_torch(session)
    # pinned as ruff is: a new release must not turn CI red; pytest for core's device fixture
    session.install("mypy==2.4.1", "pytest")
    mypy_path = os.pathsep.join(str(d / "src") for d in _package_dirs())
    for package in _package_dirs():
        with session.chdir(package):
            session.run("mypy", env={"MYPYPATH": mypy_path})


@nox.session(python=False)
def check_versions(session: nox.Session) -> None:
    """Fail when a sibling pin does not admit the local version of the package it names."""
    session.run(sys.executable, str(ROOT / "tools" / "check_versions.py"))


@nox.session
def tests(session: nox.Session) -> None:
    """Every package's CPU tests (Triton kernels in its interpreter) and the tools' tests: the CI command."""
    _install_torch(session)
    # [test] extras: pytest, and numpy for Triton's CPU interpreter (the kernels' CPU tests).
    # Compiled packages build with isolation (pip's default), warnings as errors.
    session.install(*[f"{d}[test]" for d in _package_dirs()], env=_STRICT_BUILD)
    for package in _package_dirs():
        _pytest(session, package)
    with session.chdir(ROOT / "tools"):
        session.run("python", "-m", "pytest", *session.posargs)


@nox.session
@nox.parametrize("package", PACKAGE_NAMES)
def isolated(session: nox.Session, package: str) -> None:
    """One package alone with only what it declares: proves a la carte installs."""
    _install_torch(session)
    pkg = PACKAGES / package
    # Siblings come from this checkout, not from PyPI, but only those the package declares.
    siblings = [str(PACKAGES / name) for name in _sibling_closure(package)]
    session.install(*siblings, f"{pkg}[test]", env=_STRICT_BUILD)
    _pytest(session, pkg)


@nox.session(python=False)
def gpu_tests(session: nox.Session) -> None:
    """GPU tests in the current interpreter (no downloads); fails without a CUDA device.

    Every package is installed here, offline, into a fresh folder under ``.nox/`` with ``pip
    install --no-build-isolation --no-deps --no-index --target`` (the host's setuptools,
    pybind11, scikit-build-core, cmake and ninja; no network), and that folder goes first on
    ``PYTHONPATH``. Installing matters for pure packages too: their ``.dist-info`` registers the
    kernel backends' entry points, without which memopt optimizers would silently take core's
    torch backend on the GPU. A package without GPU tests (pytest exit code 5: nothing
    selected) is not a failure. ``MEMOPT_GPU_PACKAGES`` (comma-separated package folder names)
    runs those packages' tests only (every package is installed either way); arguments after
    ``--`` go to pytest. Tests marked ``gpu(min_devices=2)`` (NCCL, one
    GPU per rank) run where the host has two GPUs and are skipped with the reason elsewhere.
    """
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        session.run(sys.executable, "-c", probe, silent=True)
    except nox.command.CommandFailed:
        session.error("gpu_tests needs a CUDA device and a CUDA build of torch in this interpreter")
    target = Path(session.create_tmp()).resolve() / "installed"
    shutil.rmtree(target, ignore_errors=True)
    session.run(
        sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
        "--no-index", "--disable-pip-version-check", "--target", str(target),
        *[str(d) for d in _package_dirs()],
    )  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    only = [n for n in os.environ.get("MEMOPT_GPU_PACKAGES", "").split(",") if n]
    unknown = set(only) - set(PACKAGE_NAMES)
    if unknown:
        session.error(f"MEMOPT_GPU_PACKAGES names unknown packages {sorted(unknown)}")
    chosen = [d for d in _package_dirs() if not only or d.name in only]
    for package in chosen:
        _pytest(session, package, "-m", "gpu", python=sys.executable, env=env, success_codes=[0, 5])


@nox.session(venv_params=["--system-site-packages"], default=False)
def bench(session: nox.Session) -> None:
    """Optimizer-step benchmark against torch AdamW; pass options after --."""
    _install_torch_unless_present(session)
    session.install(*[str(d) for d in _package_dirs()])
    session.run("python", "tools/bench/step_bench.py", *session.posargs)


@nox.session(venv_params=["--system-site-packages"])
def demo(session: nox.Session) -> None:
    """Train a small GPT on the stdlib's sources with torch AdamW and each memopt optimizer.

    The C++ CPU kernels (and AdamBridge, which runs on them) are built if a C++17 compiler is
    there; without one the demo still runs: memopt's steps on core's torch backend (the same
    bits, slower), the AdamBridge rows skipped with the reason."""
    _install_torch_unless_present(session)
    compiled = {"memopt-kernels-cpu", "memopt-offload"}
    session.install(*[str(d) for d in _package_dirs() if d.name not in compiled])
    try:
        session.install(*[str(d) for d in _package_dirs() if d.name in compiled])
    except nox.command.CommandFailed:
        session.warn(
            "memopt-kernels-cpu did not build (it needs a C++17 compiler): the demo runs "
            "memopt's steps on core's torch backend and skips the AdamBridge rows"
        )
    session.run("python", "tools/demo/gpt_demo.py", *session.posargs)


@nox.session(default=False)
def build(session: nox.Session) -> None:
    """Build the sdist and wheel of every package into dist/."""
    session.install("build")
    for package in _package_dirs():
        session.run("python", "-m", "build", "--outdir", str(ROOT / "dist"), str(package))


def _install_torch_unless_present(session: nox.Session) -> None:
    # The demo and the benchmark use a GPU build of torch when the host has one (system site
    # packages); elsewhere they install the pinned CPU build.
    try:
        session.run("python", "-c", "import torch", silent=True)
    except nox.command.CommandFailed:
        _install_torch(session)


#: Cross-compile targets: (zig target, ISA sources besides the common ones, defines).
_CROSS_TARGETS = {
    "aarch64-linux-gnu": (["isa_neon.cpp"], ["MEMOPT_HAVE_NEON"]),
    "x86_64-linux-gnu": (
        ["isa_avx2.cpp", "isa_avx512.cpp"],
        ["MEMOPT_HAVE_AVX2", "MEMOPT_HAVE_AVX512"],
    ),
}


def _cmake_build_facts() -> tuple[list[str], dict[str, list[str]]]:
    """memopt-kernels-cpu's common sources and per-ISA flags as its CMakeLists.txt sets them (the
    one place they are written), for the cross-compile session."""
    text = (PACKAGES / "memopt-kernels-cpu" / "CMakeLists.txt").read_text()
    found = {
        "sources": re.search(r"set\(MEMOPT_SOURCES ([^)]*)\)", text),
        "isa_avx2.cpp": re.search(r'isa_avx2\.cpp PROPERTIES COMPILE_OPTIONS\s+"([^"]*)"', text),
        "isa_avx512.cpp": re.search(r'set\(_avx512_flags "([^"]*)"\)', text),
    }
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise RuntimeError(f"CMakeLists.txt no longer sets what cross_compile reads: {missing}")
    common = [Path(s).name for s in found.pop("sources").group(1).split()]
    return common, {src: m.group(1).split(";") for src, m in found.items()}


@nox.session(default=False)
def cross_compile(session: nox.Session) -> None:
    """Compile memopt-kernels-cpu's C++ for aarch64 (NEON) and x86-64 with clang, warnings as errors.

    No aarch64 host is at hand, so this is how the NEON set is kept compiling: zig's bundled clang
    (the ``ziglang`` wheel, a development-only tool) cross-compiles every translation unit with
    CMakeLists.txt's exactness flags and ``-Werror``. Compiles only; the kernels' results are
    tested where they run (``nox -s tests`` on x86-64).
    """
    session.install("ziglang", "pybind11")
    pkg = PACKAGES / "memopt-kernels-cpu"
    includes = session.run(
        "python", "-c",
        "import pybind11, sysconfig; print(pybind11.get_include()); "
        "print(sysconfig.get_paths()['include'])",
        silent=True,
    ).split()  # fmt: skip
    common, isa_flags = _cmake_build_facts()
    out = Path(session.create_tmp()) / "cross.o"
    for target, (isa_sources, defines) in _CROSS_TARGETS.items():
        for source in common + isa_sources:
            session.run(
                "python", "-m", "ziglang", "c++", "-target", target, "-std=c++17", "-O2",
                "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-Wall", "-Wextra",
                "-Werror", *isa_flags.get(source, []), *[f"-D{d}" for d in defines],
                '-DMEMOPT_VERSION="cross"', f"-I{pkg / 'include'}", f"-I{pkg / 'csrc'}",
                *[f"-I{i}" for i in includes], "-c", str(pkg / "csrc" / source), "-o", str(out),
            )  # fmt: skip
