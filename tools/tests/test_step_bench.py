"""The step benchmark's profiles and a toy-size run."""

from __future__ import annotations

import json
import math

import pytest
import step_bench


def test_qwen_profile_matches_the_design() -> None:
    shapes = step_bench.PROFILES["qwen2.5-0.5b"]
    assert len(shapes) == 290
    assert sum(math.prod(s) for s in shapes) == 494_032_768


def test_scaling_keeps_the_tensor_count() -> None:
    shapes = step_bench.scaled(step_bench.PROFILES["qwen2.5-0.5b"], 64)
    assert len(shapes) == 290
    assert shapes[0] == (2374, 896)
    assert shapes[2] == (14,)


def test_tiny_run_reports_every_importable_config(tmp_path) -> None:
    argv = ["--device", "cpu", "--scale", "4096", "--warmup", "1", "--iters", "2"]
    argv += ["--copy-mib", "4", "--optimizers", "adamw,adamw-bf16", "--out", str(tmp_path)]
    assert step_bench.main(argv) == 0
    rows = json.loads((tmp_path / "step_bench.json").read_text())["rows"]
    assert [(r["profile"].split("/")[0], r["config"]) for r in rows] == [
        (p, c) for p in step_bench.PROFILES for c in ("adamw", "adamw-bf16")
    ]
    for r in rows:
        assert r["ms"] > 0
        assert r["time_vs_adamw"] > 0
    assert rows[0]["moved_bytes_per_param"] == pytest.approx(28.0, abs=0.01)
    assert "| torch AdamW pure bf16 fused |" in (tmp_path / "step_bench.md").read_text()
