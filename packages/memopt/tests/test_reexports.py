from __future__ import annotations

import importlib.util
import subprocess
import sys
from importlib.metadata import version

import pytest

import memopt
import memopt_core
import memopt_ecc


def test_every_export_resolves_to_the_component_object():
    for name, (module, dist) in memopt._EXPORTS.items():
        if importlib.util.find_spec(module.split(".")[0]) is None:  # an extra not installed
            with pytest.raises(ImportError, match=f"pip install packages/{dist}"):
                getattr(memopt, name)
            continue
        assert getattr(memopt, name) is getattr(__import__(module, fromlist=[name]), name)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'FlashNothing'"):
        _ = memopt.FlashNothing


def test_missing_component_names_the_package(monkeypatch):
    monkeypatch.setitem(memopt._EXPORTS, "Ghost", ("memopt_ghost_pkg", "memopt-ghost"))
    with pytest.raises(ImportError, match="pip install packages/memopt-ghost"):
        _ = memopt.Ghost


def test_installed_metadata_matches_the_modules():
    # A stale install (metadata of one version, code of another) fails here.
    assert version("memopt") == memopt.__version__
    assert version("memopt-core") == memopt_core.__version__
    assert version("memopt-ecc") == memopt_ecc.__version__
    assert "MemOptimizer" in dir(memopt)


def test_checkpoint_submodule():
    import memopt_checkpoint
    from memopt.checkpoint import export_fp32, load, save

    assert save is memopt_checkpoint.save
    assert load is memopt_checkpoint.load
    assert export_fp32 is memopt_checkpoint.export_fp32
    # every public name of memopt_checkpoint, also as an attribute of the meta-package
    assert set(memopt.checkpoint.__all__) == set(memopt_checkpoint.__all__) - {"__version__"}
    assert memopt.checkpoint.check_dcp_load is memopt_checkpoint.check_dcp_load
    assert memopt.CheckpointError is memopt_core.errors.CheckpointError


def _run(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, **kw)


def test_star_import_and_dir_without_a_component():
    # sys.modules[name] = None: what an environment without memopt-offload looks like to
    # find_spec and import
    out = _run(
        "import sys\nsys.modules['memopt_offload'] = None\n"
        "from memopt import *\nimport memopt\n"
        "assert 'AdamBridge' not in memopt.__all__ and 'AdamBridge' not in dir(memopt)\n"
        "assert FlashAdamW is memopt.FlashAdamW\n"
        "try:\n    memopt.AdamBridge\nexcept ImportError as e:\n    print(e)\n"
    )
    assert out.returncode == 0, out.stderr
    assert "memopt.AdamBridge needs the memopt-offload package" in out.stdout
    assert "or the extra memopt[offload]" in out.stdout  # the meta-package's own extra


def test_both_forms_of_the_checkpoint_submodule_name_the_missing_package():
    """``from memopt.checkpoint import save`` goes around the package's __getattr__: it raised
    a bare ModuleNotFoundError without the install hint (adversarial testing, 2026-12-04)."""
    assert "checkpoint" in dir(memopt)  # installed here
    out = _run(
        "import sys\nsys.modules['memopt_checkpoint'] = None\nimport memopt\n"
        "assert 'checkpoint' not in dir(memopt)\n"
        "try:\n    from memopt.checkpoint import save\nexcept ImportError as e:\n    print(e)\n"
        "try:\n    memopt.checkpoint\nexcept ImportError as e:\n    print(e)\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("memopt.checkpoint needs the memopt-checkpoint package") == 2


def test_an_installed_component_that_fails_to_import_raises_its_own_error(tmp_path):
    broken = tmp_path / "memopt_offload"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('memopt_offload: a stale build')\n")
    out = _run("import memopt\nmemopt.AdamBridge\n", env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode != 0
    assert "a stale build" in out.stderr.splitlines()[-1]
    assert "needs the memopt-offload package" not in out.stderr


def test_what_type_checkers_see_matches_the_exports():
    """The names imported under TYPE_CHECKING and the literal __all__ there are what mypy and
    IDEs read: each must be an export, from its module. The lazy __getattr__ is hidden from them
    (it would make every misspelled ``memopt.<name>`` an Any)."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(memopt.__file__).read_text())
    imported: dict[str, str] = {}
    literal: set[str] = set()
    hidden: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for sub in node.body:
                if isinstance(sub, ast.ImportFrom):
                    imported.update({a.name: sub.module for a in sub.names})
                elif isinstance(sub, ast.Assign):
                    literal = set(ast.literal_eval(sub.value))
        elif isinstance(node, ast.If) and ast.unparse(node.test) == "not TYPE_CHECKING":
            hidden.update(sub.name for sub in node.body if isinstance(sub, ast.FunctionDef))
    assert imported.pop("checkpoint") == "memopt"  # the submodule, for memopt.checkpoint.save
    assert set(imported) == set(memopt._EXPORTS)
    assert literal == {*memopt._EXPORTS, "__version__"}
    assert hidden == {"__getattr__", "__dir__"}
    for name, module in imported.items():
        assert getattr(__import__(module, fromlist=[name]), name) is getattr(memopt, name)


def test_public_signatures_resolve_at_runtime():
    """Tools that read signatures at runtime (config builders, CLIs) call get_type_hints: an
    annotation naming a type imported only for type checkers raised NameError there."""
    import inspect
    import typing

    for name, (module, _) in memopt._EXPORTS.items():
        if importlib.util.find_spec(module.split(".")[0]) is None:
            continue
        obj = getattr(memopt, name)
        target = obj.__init__ if inspect.isclass(obj) else obj
        if inspect.isfunction(target):
            typing.get_type_hints(target)
