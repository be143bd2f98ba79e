"""The ApexW end-to-end benchmark at toy size on a CPU, and its models' full shapes."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import apexw_e2e
import pytest
import torch

TINY = ["--device", "cpu", "--tiny", "--iters", "2", "--threads", "1"]
ALL_ROWS = [spec.name for spec in apexw_e2e.ROWS if spec.kind != "flash"]
FP32_ROWS = [s.name for s in apexw_e2e.ROWS if s.dtype == torch.float32 and s.kind != "flash"]
BF16_ROWS = [s.name for s in apexw_e2e.ROWS if s.dtype == torch.bfloat16 and s.kind != "flash"]
needs_apexw = pytest.mark.skipif(
    importlib.util.find_spec("memopt_apexw") is None, reason="memopt_apexw is not installed"
)
needs_cpu_kernels = pytest.mark.skipif(
    importlib.util.find_spec("memopt_kernels_cpu") is None,
    reason="ApexW's fused step on a CPU needs memopt_kernels_cpu",
)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run(tmp_path, rows: list[str], *extra: str, expect: int = 0) -> dict:
    argv = [*TINY, *extra, "--rows", ",".join(rows), "--out", str(tmp_path)]
    assert apexw_e2e.main(argv) == expect
    (found,) = tmp_path.glob("apexw_e2e_*.json")
    return json.loads(found.read_text())


def test_default_rows_are_the_issues() -> None:
    assert apexw_e2e.DEFAULT_ROWS == (
        "torch-adamw",
        "apexw-bf16",
        "apexw-q8",
        "apexw-bf16-graph",
        "apexw-auto",
        "torch-adamw-bf16",
        "apexw-bf16params-q8",
    )
    assert apexw_e2e.parse_args(["--device", "cpu"]).warmup == apexw_e2e.DEFAULT_WARMUP


@needs_apexw
def test_the_default_warmup_covers_the_auto_trial() -> None:
    """The trial grew from 10 steps to 16 (an untimed re-entry step before each timed one): with
    the old default of 11, apexw-auto ran untimed steps the other rows did not."""
    from memopt_apexw.auto_mode import Trial

    t, steps = Trial(["fused", "torch"]), 0
    while (nxt := t.next()) is not None:
        steps += 1
        if nxt[1]:
            t.record(nxt[0], 1.0)
    assert steps + 1 == apexw_e2e.DEFAULT_WARMUP  # decided at the start of the step after


def _shape_of(argv: list[str]) -> tuple[int, int]:
    args = apexw_e2e.parse_args(["--device", "cpu", "--no-tiny", "--batch", "1", *argv])
    work = apexw_e2e.make_workload(args, torch.device("cpu"))
    return work.tensors, work.params


def test_full_size_models() -> None:
    # 24 x (LayerNorm 2 x 2048, 2048 -> 4096 and 4096 -> 2048 with biases) + a final LayerNorm
    assert _shape_of(["--model", "mlp"]) == (146, 24 * 16_787_456 + 4096)
    assert _shape_of(["--model", "mlp", "--mlp-small"]) == (1538, 256 * 2_100_736 + 1024)
    assert _shape_of(["--model", "qwen", "--seq", "2", "--qwen-impl", "plain"]) == (
        290,
        494_032_768,
    )


@needs_apexw
@needs_cpu_kernels
def test_tiny_run_of_every_row(tmp_path, capsys) -> None:
    data = _run(tmp_path, ALL_ROWS)
    assert data["status"] == "complete"
    assert data["model"]["name"] == "mlp-tiny"
    assert data["model"]["tensors"] == 26
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ALL_ROWS
    graph = rows.pop("apexw-bf16-graph")
    assert graph["median_ms"] is None
    assert "CUDA" in graph["skipped"]
    for r in rows.values():
        assert r["error"] is None, r["name"]
        assert r["skipped"] is None
        assert len(r["step_ms"]) == len(r["opt_ms"]) == 2
        assert 0 < r["min_ms"] <= r["median_ms"]
        assert 0 < r["opt_median_ms"] < r["median_ms"]
        assert r["peak_gib"] is None  # no CUDA
        assert r["warmup_steps"] == apexw_e2e.DEFAULT_WARMUP
        assert len(r["losses"]) == apexw_e2e.DEFAULT_WARMUP + 2
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["final_loss"] == r["losses"][-1]
        base = rows["torch-adamw"]["median_ms"]
        assert r["vs_torch_adamw"]["step"] == pytest.approx(r["median_ms"] / base)
    per_param = {name: r["state_bytes_per_param"] for name, r in rows.items()}
    assert per_param["torch-adamw"] == pytest.approx(8.0, abs=0.01)  # + the step counters
    assert per_param["torch-adamw-bf16"] == pytest.approx(4.0, abs=0.01)
    assert per_param["apexw-bf16"] == pytest.approx(4.0, abs=0.01)
    assert 2.0 < per_param["apexw-q8"] < 2.2  # 1 B per moment and the group scales
    assert per_param["apexw-bf16params-q8"] == pytest.approx(per_param["apexw-q8"] + 1, abs=0.01)
    assert rows["torch-adamw"]["vs_torch_adamw"]["step"] == pytest.approx(1.0)
    assert rows["apexw-bf16"]["vs_torch_adamw"]["state"] == pytest.approx(0.5, abs=0.01)
    decision = rows["apexw-auto"]["mode_decision"]
    assert decision["mode"] in ("fused", "torch")
    assert decision["source"] == "measured"
    assert set(decision["timings_ms"]) == {"fused", "torch"}
    assert rows["apexw-auto"]["notes"].startswith(f"auto chose {decision['mode']} (measured; ")

    # the same initialization and batches in every row: the first losses agree exactly within a
    # model dtype; ApexW's bf16 and q8 moments track torch AdamW's fp32 ones closely
    first = {name: r["losses"][0] for name, r in rows.items()}
    assert len({first[n] for n in FP32_ROWS if n in rows}) == 1
    assert len({first[n] for n in BF16_ROWS}) == 1
    assert first["torch-adamw"] == pytest.approx(first["torch-adamw-bf16"], rel=0.01)
    final = {name: r["final_loss"] for name, r in rows.items()}
    assert final["torch-adamw"] < first["torch-adamw"]
    for name in ("apexw-bf16", "apexw-q8", "apexw-auto"):
        assert final[name] == pytest.approx(final["torch-adamw"], rel=1e-3)
    assert final["apexw-bf16params-q8"] == pytest.approx(final["torch-adamw"], rel=1e-2)

    report = (tmp_path / "apexw_e2e_mlp-tiny.md").read_text()
    assert "| row | median step ms | min | opt.step ms | peak VRAM GiB |" in report
    assert "| apexw-bf16-graph | skipped: capturable=True captures a CUDA graph" in report
    assert "- apexw-q8: speed " in report
    assert "memory met (state 2." in report
    assert report in capsys.readouterr().out


@needs_apexw
@needs_cpu_kernels
def test_apexw_modes_compute_the_same_losses(tmp_path) -> None:
    """fused (memopt-kernels-cpu), torch (core's pure-torch step) and auto (trial steps of both,
    then the faster) give the same bits, so the same loss at every step."""
    rows = ["apexw-bf16", "apexw-bf16-torch", "apexw-auto", "apexw-q8", "apexw-q8-torch"]
    data = _run(tmp_path, rows, "--model", "qwen", "--qwen-impl", "plain")
    losses = {r["name"]: r["losses"] for r in data["rows"]}
    assert all(len(x) == apexw_e2e.DEFAULT_WARMUP + 2 for x in losses.values())
    assert losses["apexw-bf16"] == losses["apexw-bf16-torch"] == losses["apexw-auto"]
    assert losses["apexw-q8"] == losses["apexw-q8-torch"]
    assert losses["apexw-q8"] != losses["apexw-bf16"]  # the state format matters
    assert losses["apexw-q8"][0] == losses["apexw-bf16"][0]
    modes = {r["name"]: (r["mode_decision"] or {}).get("mode") for r in data["rows"]}
    assert modes["apexw-bf16"] == "fused"
    assert modes["apexw-bf16-torch"] == "torch"


def test_apexw_rows_skip_without_the_package(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "memopt_apexw", None)  # import fails, installed or not
    data = _run(tmp_path, ["torch-adamw", "apexw-bf16", "apexw-bf16-graph"], "--warmup", "1")
    torch_row, *apexw_rows = data["rows"]
    assert torch_row["median_ms"] > 0
    for r in apexw_rows:
        assert r["median_ms"] is None
        assert r["skipped"].startswith("memopt_apexw cannot be imported")
    assert "apexw-bf16: memopt_apexw cannot be imported" in data["header"]["skipped"]
    captured = capsys.readouterr()
    assert "skipping apexw-bf16: memopt_apexw cannot be imported" in captured.err
    assert "| apexw-bf16 | skipped: memopt_apexw cannot be imported" in captured.out
    assert "speed" not in "\n".join(data["targets"][1:])  # no ApexW row to judge


@needs_apexw
def test_fused_rows_skip_without_a_kernel_backend(tmp_path, monkeypatch) -> None:
    from memopt_core import backends

    # no kernel package registers a backend: core has its pure-torch one only
    monkeypatch.setattr(backends.importlib.metadata, "entry_points", lambda **_: [])
    assert set(backends.refresh_backends()) == {"torch"}
    try:
        data = _run(tmp_path, ["apexw-q8", "apexw-auto"], "--warmup", "1")
    finally:
        monkeypatch.undo()
        backends.refresh_backends()
    fused, auto = data["rows"]
    assert fused["median_ms"] is None
    assert fused["skipped"].startswith("no kernel backend for mode='fused' here: ")
    assert auto["error"] is None
    assert auto["mode_decision"]["mode"] == "torch"
    assert auto["mode_decision"]["source"] == "only candidate"
    assert auto["warmup_steps"] == 1


@needs_apexw
@needs_cpu_kernels
def test_isolated_rows_run_in_their_own_processes(tmp_path) -> None:
    # a row outside the default set: the child process must find it too
    extra = ["--model", "mlp", "--mlp-small", "--warmup", "1", "--isolate"]
    data = _run(tmp_path, ["apexw-q8-torch"], *extra)
    assert data["header"]["isolation"] == "each row in its own process"
    assert data["model"]["name"] == "mlp-small-tiny"
    assert data["model"]["tensors"] == 32 * 6 + 2
    (r,) = data["rows"]
    assert r["error"] is None
    assert len(r["step_ms"]) == 2
    assert len(r["losses"]) == 3
    assert r["mode_decision"]["mode"] == "torch"
    assert 2.0 < r["state_bytes_per_param"] < 2.3


@needs_cpu_kernels
def test_flash_rows(tmp_path) -> None:
    """The ECC family's rows: memopt_ecc's with and without gradient release (bucketed and per
    parameter) train the same cast model to the same losses (release applies the same update,
    only during backward);
    FlashOptim's rows skip where it is not installed (it needs CUDA)."""
    if importlib.util.find_spec("memopt_ecc") is None:
        pytest.skip("memopt_ecc is not installed")
    data = _run(tmp_path, ["torch-adamw", *apexw_e2e.FLASH_ROWS], "--warmup", "2")
    rows = {r["name"]: r for r in data["rows"]}
    plain, released = rows["flash-adamw"], rows["flash-adamw-release"]
    each = rows["flash-adamw-release-each"]
    for r in (plain, released, each):
        assert r["error"] is None, r["error"]
        assert r["skipped"] is None
        assert 3.0 < r["state_bytes_per_param"] < 3.2  # ECC-24 code and q8 moments
        assert all(math.isfinite(x) for x in r["losses"])
    assert plain["losses"] == released["losses"] == each["losses"]
    assert plain["losses"][-1] < plain["losses"][0]
    if importlib.util.find_spec("flashoptim") is None:
        assert rows["flashoptim-adamw"]["skipped"].startswith("flashoptim cannot be imported")


@pytest.mark.parametrize(
    "argv",
    [
        ["--rows", "torch-adamw,nope"],
        ["--rows", "torch-adamw,torch-adamw"],
        ["--model", "qwen", "--mlp-small"],
        ["--model", "mlp", "--seq", "16"],
        ["--iters", "0"],
        ["--rounds", "0"],
        ["--paired", "--isolate"],
        ["--batch", "0"],  # was taken as "the default"
        ["--model", "qwen", "--layers", "-1"],
        ["--mlp-width", "-8"],
    ],
)
def test_bad_arguments_are_refused(argv) -> None:
    with pytest.raises(SystemExit):
        apexw_e2e.parse_args(["--device", "cpu", *argv])


def test_rounds_alternate_the_order() -> None:
    assert apexw_e2e.offload_e2e.round_order(["a", "b", "c"], 3) == [
        ["a", "b", "c"],
        ["c", "b", "a"],
        ["a", "b", "c"],
    ]


def test_merge_rounds() -> None:
    def row(steps, bwd, peak, losses=(1.0, 0.5)):
        return apexw_e2e.Row(
            "r", "r", median_ms=sorted(steps)[len(steps) // 2], min_ms=min(steps),
            step_ms=list(steps), opt_median_ms=1.0, opt_ms=[1.0, 2.0], bwd_ms=bwd,
            peak_gib=peak, losses=list(losses),
        )  # fmt: skip

    merged = apexw_e2e.merge_rounds([row([10, 11, 30], 5.0, 2.0), row([12, 13, 14], 7.0, 3.0)])
    assert merged.step_ms == [10, 11, 30, 12, 13, 14]
    assert merged.median_ms == 12.5
    assert merged.min_ms == 10
    assert merged.round_median_ms == [11, 13]
    assert merged.opt_ms == [1.0, 2.0, 1.0, 2.0]
    assert merged.opt_median_ms == 1.5
    assert merged.bwd_ms == 6.0
    assert merged.peak_gib == 3.0
    assert merged.error is None
    paired = [row([10, 20], 5.0, 2.0), row([30], 5.0, 2.0)]
    paired[0].paired_ratios, paired[1].paired_ratios = [1.0, 1.2], [0.9]
    assert apexw_e2e.merge_rounds(paired).paired_ratios == [1.0, 1.2, 0.9]
    assert apexw_e2e.merge_rounds(paired).paired_vs_torch_adamw == 1.0
    differ_runs = [row([1], 1.0, 1.0), row([1], 1.0, 1.0, losses=(1.0, 0.6))]
    differ = apexw_e2e.merge_rounds(differ_runs)
    assert differ.error == "rounds gave different losses (largest relative difference 0.2)"
    assert apexw_e2e.merge_rounds(differ_runs, loss_rtol=0.5).error is None
    skipped = apexw_e2e.Row("r", "r", skipped="no package")
    assert apexw_e2e.merge_rounds([skipped]) is skipped


def test_tiny_run_in_rounds(tmp_path, capsys) -> None:
    data = _run(tmp_path, ["torch-adamw", "apexw-bf16-torch"], "--rounds", "2")
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["torch-adamw", "apexw-bf16-torch"]
    for r in rows.values():
        assert len(r["step_ms"]) == 4
        assert len(r["round_median_ms"]) == 2
        assert r["error"] is None
    err = capsys.readouterr().err
    # the second round runs the rows in reverse order
    assert err.index("apexw-bf16-torch (round 1 of 2)") < err.index("torch-adamw (round 2 of 2)")
    assert err.index("torch-adamw (round 2 of 2)") > err.index("apexw-bf16-torch (round 2 of 2)")
    assert "2 rounds" in data["header"]["timing"]


def test_paired_run_interleaves_the_rows(tmp_path, monkeypatch) -> None:
    rows = ["torch-adamw", "apexw-bf16-torch", "torch-adamw-bf16"]
    alone = {r["name"]: r for r in _run(tmp_path / "alone", rows, "--iters", "3")["rows"]}
    order = []
    step = apexw_e2e.RowRun.step

    def recorded(self):
        order.append(self.spec.name)
        return step(self)

    monkeypatch.setattr(apexw_e2e.RowRun, "step", recorded)
    data = _run(tmp_path / "paired", rows, "--iters", "3", "--paired", "--warmup", "1")
    a, b, c = rows
    # each row's untimed steps, then every timed iteration steps each row once, in reverse
    # order every other iteration
    assert order == [a, b, c, a, b, c, c, b, a, a, b, c]
    paired = {r["name"]: r for r in data["rows"]}
    base = paired[a]["step_ms"]
    for name, r in paired.items():
        assert r["error"] is None
        assert r["peak_gib"] is None  # every row's model was resident: no per-row peak
        assert r["losses"] == alone[name]["losses"][:4]  # the same training, interleaved
        want = [x / y for x, y in zip(r["step_ms"], base, strict=True)]
        assert r["paired_ratios"] == pytest.approx(want)
        assert r["paired_vs_torch_adamw"] == pytest.approx(sorted(want)[1])
    assert paired[a]["paired_ratios"] == [1.0, 1.0, 1.0]
    assert "interleaved" in data["header"]["isolation"]
    assert "paired step vs" in (tmp_path / "paired" / "apexw_e2e_mlp-tiny.md").read_text()
