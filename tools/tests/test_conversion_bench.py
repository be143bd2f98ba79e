"""The conversion benchmark at toy size: every row runs on both codec paths, which agree."""

from __future__ import annotations

import json

import conversion_bench
import pytest

from memopt_core import conversions


def test_rows_and_paths(tmp_path, capsys) -> None:
    real = conversions.codec_kernels
    argv = ["--device", "cpu", "--profile", "resnet50", "--scale", "64", "--iters", "1"]
    assert conversion_bench.main([*argv, "--out", str(tmp_path)]) == 0
    assert conversions.codec_kernels is real  # the reference path is undone
    data = json.loads((tmp_path / "conversion_bench.json").read_text())
    assert data["results_equal"] is True
    assert data["tensors"] == 161
    got = [(r["row"], r["path"]) for r in data["rows"]]
    assert got == [(row, path) for row in conversion_bench.ROWS for path in conversion_bench.PATHS]
    assert all(r["ms"] > 0 and r["peak_gib"] is None for r in data["rows"])
    assert "| fp32-masters |" in capsys.readouterr().out


def test_unknown_row_is_refused(capsys) -> None:
    """An argparse error before any work (it was a ValueError traceback after building)."""
    with pytest.raises(SystemExit):
        conversion_bench.main(
            ["--device", "cpu", "--profile", "resnet50", "--scale", "64", "--rows", "bogus"]
        )
    assert "unknown rows ['bogus']" in capsys.readouterr().err
