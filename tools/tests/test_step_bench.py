"""The step benchmark's profiles and a toy-size run."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest
import step_bench
import torch


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
    # 16384x8K is left out: 16384 tensors take torch's fused CPU AdamW seconds per step
    profiles = [p for p in step_bench.PROFILES if p != "16384x8K"]
    argv = ["--device", "cpu", "--scale", "4096", "--warmup", "1", "--iters", "2"]
    argv += ["--copy-mib", "4", "--optimizers", "adamw,adamw-bf16", "--out", str(tmp_path)]
    assert step_bench.main([*argv, "--profiles", ",".join(profiles)]) == 0
    rows = json.loads((tmp_path / "step_bench.json").read_text())["rows"]
    assert [(r["profile"].split("/")[0], r["config"]) for r in rows] == [
        (p, c) for p in profiles for c in ("adamw", "adamw-bf16")
    ]
    for r in rows:
        assert r["ms"] > 0
        assert r["time_vs_adamw"] > 0
    assert rows[0]["moved_bytes_per_param"] == pytest.approx(28.0, abs=0.01)
    assert "| torch AdamW pure bf16 fused |" in (tmp_path / "step_bench.md").read_text()


def test_pipelined_steps_are_timed_and_reported(tmp_path) -> None:
    argv = ["--device", "cpu", "--scale", "4096", "--warmup", "1", "--iters", "2", "--copy-mib"]
    argv += ["4", "--optimizers", "adamw,adamw-bf16", "--profiles", "8x64M", "--out", str(tmp_path)]
    assert step_bench.main([*argv, "--pipelined", "3"]) == 0
    rows = json.loads((tmp_path / "step_bench.json").read_text())["rows"]
    assert all(r["pipelined_ms"] > 0 for r in rows)
    assert rows[0]["pipelined_vs_adamw"] == pytest.approx(1.0)
    assert rows[1]["pipelined_vs_adamw"] == pytest.approx(
        rows[1]["pipelined_ms"] / rows[0]["pipelined_ms"]
    )
    text = (tmp_path / "step_bench.md").read_text()
    assert "pipelined / AdamW |" in text
    assert "- pipelined: 3 steps back to back" in text
    # without the flag the table keeps its columns
    assert step_bench.main(argv) == 0
    assert "pipelined ms" not in (tmp_path / "step_bench.md").read_text()


def test_many_small_profile_mixes_vectors_and_matrices() -> None:
    shapes = step_bench.PROFILES["16384x8K"]
    assert len(shapes) == 16384
    assert shapes[:4] == [(8192,), (64, 128), (64, 128), (64, 128)]
    assert shapes.count((8192,)) == 4096
    assert shapes.count((64, 128)) == 12288
    assert sum(math.prod(s) for s in shapes) == 16384 * 8192


def test_resnet50_profile_matches_torchvision() -> None:
    shapes = step_bench.PROFILES["resnet50"]
    assert len(shapes) == 161
    assert sum(math.prod(s) for s in shapes) == 25_557_032
    assert sum(len(s) == 4 for s in shapes) == 53  # conv layers (4 of them downsample)
    assert shapes[:3] == [(64, 3, 7, 7), (64,), (64,)]
    assert shapes[-2:] == [(1000, 2048), (1000,)]
    assert shapes[3:15] == [  # layer1.0: conv1..conv3 with their norms, then the downsample
        (64, 64, 1, 1), (64,), (64,), (64, 64, 3, 3), (64,), (64,),
        (256, 64, 1, 1), (256,), (256,), (256, 64, 1, 1), (256,), (256,),
    ]  # fmt: skip


def _tiny(tmp_path, rows: str, profiles: str = "resnet50") -> list[str]:
    argv = ["--device", "cpu", "--scale", "4096", "--warmup", "1", "--iters", "2"]
    argv += ["--copy-mib", "4", "--rows", rows, "--profiles", profiles]
    return [*argv, "--out", str(tmp_path)]


def test_rows_of_a_missing_package_are_skipped_with_the_reason(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "memopt_apexw", None)  # import fails, installed or not
    monkeypatch.setitem(sys.modules, "flashoptim", None)
    rows = "adamw,apexw-bf16,apexw-q8-graph,apexw-auto-bf16,apexw-bf16-params,flashoptim-peer"
    assert step_bench.main(_tiny(tmp_path, rows)) == 0
    report = json.loads((tmp_path / "step_bench.json").read_text())
    assert [r["config"] for r in report["rows"]] == ["adamw"]
    skipped = report["header"]["skipped"]
    for name in rows.split(",")[1:-1]:
        assert f"{name}: memopt_apexw cannot be imported" in skipped
    assert "flashoptim-peer: flashoptim cannot be imported" in skipped
    assert report["header"]["status"] == "complete"


def test_cuda_only_rows_are_skipped_on_a_cpu(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "memopt_apexw", types.ModuleType("memopt_apexw"))
    modules, skipped = step_bench.importable({"apexw-q8", "apexw-auto-bf16"}, "cpu")
    assert list(modules) == ["apexw-auto-bf16"]
    assert skipped["apexw-q8"].startswith("needs a CUDA device")


def test_cpu_only_rows_are_skipped_on_cuda(monkeypatch) -> None:
    adam = types.ModuleType("deepspeed.ops.adam")  # found, installed or not
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", adam)
    modules, skipped = step_bench.importable({"deepspeed-cpuadam", "adamw"}, "cuda")
    assert list(modules) == ["adamw"]
    assert skipped["deepspeed-cpuadam"].startswith("steps CPU tensors only")
    modules, skipped = step_bench.importable({"deepspeed-cpuadam"}, "cpu")
    assert modules == {"deepspeed-cpuadam": adam}
    assert skipped == {}


class _FakeApexW(torch.optim.AdamW):
    """ApexW's interface over torch AdamW; mode="auto" decides at its 7th step."""

    made: list[_FakeApexW] = []  # noqa: RUF012

    def __init__(self, params, lr, betas, eps, weight_decay, state, capturable, mode) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.mode, self.steps, self.mode_decision, self.decided_at = mode, 0, None, None
        _FakeApexW.made.append(self)

    def step(self, closure=None):
        self.steps += 1
        if self.mode == "auto" and self.steps == 7:
            timings = {"fused": 2.0, "torch": 1.0}
            self.mode_decision = types.SimpleNamespace(mode="torch", timings_ms=timings)
            self.decided_at = self.steps
        return super().step(closure)

    def state_bytes(self) -> int:
        return 3 * sum(p.numel() for g in self.param_groups for p in g["params"])


def test_auto_row_is_timed_after_the_mode_choice_and_reports_it(tmp_path, monkeypatch) -> None:
    module = types.ModuleType("memopt_apexw")
    module.ApexW = _FakeApexW
    monkeypatch.setitem(sys.modules, "memopt_apexw", module)
    _FakeApexW.made.clear()
    assert step_bench.main(_tiny(tmp_path, "adamw,apexw-auto-bf16")) == 0
    rows = json.loads((tmp_path / "step_bench.json").read_text())["rows"]
    auto = rows[1]
    assert auto["config"] == "apexw-auto-bf16"
    assert auto["notes"] == "auto chose torch (fused 2.000 ms, torch 1.000 ms)"
    assert auto["state_bytes_per_param"] == pytest.approx(3.0)
    assert auto["backend"] == "test_step_bench"  # the optimizer's package
    (opt,) = _FakeApexW.made
    assert opt.decided_at == 7
    assert opt.steps == 7 + auto["timed"]  # no timed step before the decision
    assert (
        "| auto chose torch (fused 2.000 ms, torch 1.000 ms) |"
        in (tmp_path / "step_bench.md").read_text()
    )


def test_state_bytes_counts_each_storage_once() -> None:
    class Holder:  # FlashOptim keeps its quantized moments in objects like this
        def __init__(self) -> None:
            self._quantized = torch.zeros(64, dtype=torch.int8)
            self._scales = torch.zeros(2, dtype=torch.float16)

    table = torch.zeros(256)  # one table shared by every parameter (bitsandbytes' qmap)
    opt = types.SimpleNamespace(
        state={
            0: {"exp_avg": Holder(), "qmap": table, "step": 3},
            1: {"exp_avg": Holder(), "qmap": table, "view": table[:10]},
        }
    )
    assert step_bench.state_bytes(opt) == 2 * (64 + 4) + 256 * 4


def test_zero_copy_buffer_is_an_argparse_error(capsys) -> None:
    # it made every row fail with a ZeroDivisionError in its bandwidth figures
    with pytest.raises(SystemExit) as exc:
        step_bench.parse_args(["--device", "cpu", "--copy-mib", "0"])
    assert exc.value.code == 2
    assert "--copy-mib must be at least 1" in capsys.readouterr().err


def test_negative_pipelined_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        step_bench.parse_args(["--device", "cpu", "--pipelined", "-1"])
    assert exc.value.code == 2
    assert "--pipelined must be at least 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--warmup", "-1"], ["--iters", "0"]])
def test_warmup_and_iters_below_one_are_argparse_errors(argv, capsys) -> None:
    # they ran like 1, which the help text states as the least
    with pytest.raises(SystemExit) as exc:
        step_bench.parse_args(["--device", "cpu", *argv])
    assert exc.value.code == 2
    assert "--warmup and --iters must be at least 1" in capsys.readouterr().err


def test_param_groups_split_as_named() -> None:
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(4, 2), (4,), (3, 3), (2,), (5,)]]
    assert step_bench.param_groups(params, "1") is params
    groups = step_bench.param_groups(params, "2")
    assert [len(g["params"]) for g in groups] == [2, 3]
    assert [g["lr"] for g in groups] == [pytest.approx(9e-4), pytest.approx(1e-3)]
    decay, no_decay = step_bench.param_groups(params, "no-decay-1d")
    assert [p.dim() for p in decay["params"]] == [2, 2]
    assert [p.dim() for p in no_decay["params"]] == [1, 1, 1]
    assert no_decay["weight_decay"] == 0.0
    assert "weight_decay" not in decay


def test_param_groups_reach_the_rows_and_the_report(tmp_path) -> None:
    argv = ["--device", "cpu", "--scale", "4096", "--warmup", "1", "--iters", "2", "--copy-mib"]
    argv += ["4", "--optimizers", "adamw,memopt-ecc32-q8", "--profiles", "qwen2.5-0.5b"]
    assert step_bench.main([*argv, "--out", str(tmp_path), "--param-groups", "5"]) == 0
    rows = json.loads((tmp_path / "step_bench.json").read_text())["rows"]
    assert [r["profile"] for r in rows] == ["qwen2.5-0.5b/4096 (5 groups)"] * 2
    assert all(r["error"] is None for r in rows), rows
    assert "- param groups: 5" in (tmp_path / "step_bench.md").read_text()


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_bad_param_groups_are_argparse_errors(value, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        step_bench.parse_args(["--device", "cpu", "--param-groups", value])
    assert exc.value.code == 2
    assert "--param-groups must be a count >= 1 or no-decay-1d" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profiles", "64M", "--param-groups", "5"], "profile 64M has 1 tensors"),
        (["--profiles", "8x64M", "--param-groups", "no-decay-1d"], "8x64M has only 1-D tensors"),
        (["--device", "foo"], "--device: Expected one of"),
    ],
)
def test_groups_that_would_be_empty_and_bad_devices_are_argparse_errors(argv, message, capsys):
    """Groups were built empty without a word (the row labelled "(5 groups)" over 1 tensor);
    an unknown device was a traceback."""
    with pytest.raises(SystemExit) as exc:
        step_bench.parse_args(["--device", "cpu", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_group_count_is_read_as_a_number() -> None:
    assert step_bench.parse_args(["--device", "cpu", "--param-groups", "01"]).param_groups == "1"
