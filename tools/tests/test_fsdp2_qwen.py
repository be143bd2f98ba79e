"""fsdp2_qwen.py's smoke run: every row trains a tiny Qwen2 under fully_shard on 2 gloo ranks on
the CPU, reports its timings, and the rows learn alike from the same start and batches."""

from __future__ import annotations

import json
import math

import fsdp2_qwen
import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)


def test_tiny_run_on_two_gloo_ranks(tmp_path, capsys):
    pytest.importorskip("memopt_ecc")
    pytest.importorskip("memopt_apexw")
    out = tmp_path / "r.json"
    rows = "torch-adamw,flash-adamw,apexw-bf16"
    argv = ["--device", "cpu", "--tiny", "--model", "plain", "--world", "2", "--steps", "2"]
    argv += ["--warmup", "1", "--batch", "2", "--seq", "16", "--rows", rows, "--json", str(out)]
    assert fsdp2_qwen.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["world"] == 2
    results = {r["row"]: r for r in report["results"]}
    assert list(results) == rows.split(",")
    first = [results[r]["ranks"][0]["losses"][0] for r in results]
    for r in results.values():
        assert "error" not in r
        assert len(r["ranks"]) == 2
        assert all(len(k["times_ms"]) == 2 for k in r["ranks"])
        assert math.isfinite(r["median_ms"])
        assert r["median_ms"] > 0
        assert r["ranks"][0]["params"] == r["ranks"][1]["params"]
    # the same initial weights and batches: the first losses agree (bf16 rows within rounding)
    assert max(first) - min(first) < 0.05
    assert "| torch-adamw |" in capsys.readouterr().out
