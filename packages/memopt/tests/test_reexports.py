from __future__ import annotations

import importlib.util
from importlib.metadata import version

import pytest

import memopt
import memopt_core
import memopt_ecc


def test_every_export_resolves_to_the_component_object():
    for name in memopt.__all__:
        if name == "__version__":
            continue
        module, dist = memopt._EXPORTS[name]
        if importlib.util.find_spec(module.split(".")[0]) is None:  # an extra not installed
            with pytest.raises(ImportError, match=f"pip install {dist}"):
                getattr(memopt, name)
            continue
        assert getattr(memopt, name) is getattr(__import__(module, fromlist=[name]), name)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'FlashNothing'"):
        _ = memopt.FlashNothing


def test_missing_component_names_the_package(monkeypatch):
    monkeypatch.setitem(memopt._EXPORTS, "Ghost", ("memopt_ghost_pkg", "memopt-ghost"))
    with pytest.raises(ImportError, match="pip install memopt-ghost"):
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
