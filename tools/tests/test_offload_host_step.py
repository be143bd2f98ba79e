"""The offload host-step benchmark at toy size: every row runs and its figures agree."""

from __future__ import annotations

import json
import sys
import types

import offload_e2e
import offload_host_step
import pytest
import torch


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_rows_in_one_process(tmp_path, capsys) -> None:
    out = tmp_path / "host.json"
    rows = "copy,torch,fp32,bf16,fp8,bf16-ecc24,compact"
    argv = ["--rows", rows, "--log2n", "12", "--iters", "2", "--threads", "1", "--no-isolate"]
    assert offload_host_step.main([*argv, "--rounds", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["n"] == 4096
    assert data["threads"] == 1
    names = [r["name"] for r in data["rows"]]
    assert names == rows.split(",") + rows.split(",")[::-1]  # round 2 reversed
    for r in data["rows"]:
        want = {"copy": 8, "torch": 28}.get(r["name"])
        want = want or offload_e2e.BYTE_MODEL[r["name"]].kernel
        assert r["bytes_per_param"] == want
        assert r["gbs"] == pytest.approx(want * 4096 / (r["ms"] / 1e3) / 1e9)
        assert r["ns_per_param"] == pytest.approx(r["ms"] * 1e6 / 4096)
    table = capsys.readouterr().out
    assert "| bf16-ecc24 | 1 |" in table
    assert "| torch | 2 |" in table


def test_the_steps_update_the_weights() -> None:
    # each timed step is a real update: the master moves (a bf16 ECC-24 weight too)
    for name in ("torch", "fp32", "bf16", "bf16-ecc24", "compact"):
        step, _, weight = offload_host_step.row_step(name, 64)
        before = weight.detach().clone()
        with torch.no_grad():
            step()
        assert not torch.equal(weight.detach(), before), name


class _FakeCPUAdam(torch.optim.AdamW):
    """DeepSpeedCPUAdam's constructor over torch's AdamW (the row's plumbing, not DeepSpeed)."""

    def __init__(self, params, lr, weight_decay, adamw_mode) -> None:
        assert adamw_mode
        super().__init__(params, lr=lr, weight_decay=weight_decay)


def test_deepspeed_row_steps_fp32_tensors(monkeypatch) -> None:
    adam = types.ModuleType("deepspeed.ops.adam")
    adam.DeepSpeedCPUAdam = _FakeCPUAdam
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", adam)
    step, nbytes, weight = offload_host_step.row_step("deepspeed", 64)
    assert nbytes == 28
    assert weight.dtype == torch.float32
    before = weight.detach().clone()
    with torch.no_grad():
        step()
    assert not torch.equal(weight.detach(), before)


def test_isolated_row() -> None:
    assert offload_host_step.main(["--rows", "bf16", "--log2n", "10", "--iters", "1"]) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rows", "copy,nope"], "unknown rows ['nope']"),  # was a failed row after the others
        (["--rows", ","], "--rows names no row"),  # was an empty table and exit code 0
        (["--log2n", "-1"], "argument --log2n: must be at least 1"),  # was a ValueError
        (["--iters", "0"], "argument --iters: must be at least 1"),  # was a StatisticsError
        (["--rounds", "0"], "argument --rounds: must be at least 1"),  # was an empty table
        (["--threads", "-2"], "--threads must be at least 0"),  # was torch's RuntimeError
    ],
)
def test_bad_arguments_are_argparse_errors(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        offload_host_step.main(["--log2n", "10", "--iters", "1", "--no-isolate", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_json_folder_is_created(tmp_path) -> None:
    out = tmp_path / "new" / "host.json"  # a missing folder failed after every row had run
    argv = ["--rows", "copy", "--log2n", "10", "--iters", "1", "--no-isolate", "--json", str(out)]
    assert offload_host_step.main(argv) == 0
    assert json.loads(out.read_text())["rows"][0]["name"] == "copy"
