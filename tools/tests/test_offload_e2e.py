"""The offload end-to-end benchmark at toy size on a CPU, and the Qwen2 replica's shape."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
import types
import warnings

import offload_e2e
import pytest
import qwen2_shape
import step_bench
import torch

TINY = ["--device", "cpu", "--tiny", "--warmup", "1", "--iters", "2", "--bw-mib", "4"]
TINY += ["--threads", "1"]  # tiny ops on a shared 2-CPU machine: threads only add waiting
BRIDGE_ROWS = [s.name for s in offload_e2e.ROWS if s.kind == "bridge"]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


class StandInBridge(torch.optim.AdamW):
    """AdamBridge's API over torch AdamW, so the bridge rows' plumbing runs without the package."""

    built: list[dict] = []  # noqa: RUF012  (the AdamBridge arguments of each row)

    def __init__(self, params, lr, betas, eps, weight_decay, precision, update, **kw):
        key = precision if update == "host" else f"{precision} {update}"
        assert key in offload_e2e.BYTE_MODEL
        StandInBridge.built.append({"precision": precision, "update": update, **kw})
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.hooked = 0
        self.handles = []

    def attach_hooks(self, model, overlap_forward=False):
        def hook(_):
            self.hooked += 1

        self.handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]

    def detach_hooks(self):
        for h in self.handles:
            h.remove()

    def step_sync(self):
        assert self.hooked  # the hooks ran during backward
        self.step()
        self.zero_grad(set_to_none=True)

    def host_bytes(self):
        return 3 * 2**20


def _run(tmp_path, rows: list[str], *extra: str) -> dict:
    out = tmp_path / "e2e.json"
    argv = [*TINY, *extra, "--rows", ",".join(rows), "--json", str(out)]
    assert offload_e2e.main(argv) == 0
    return json.loads(out.read_text())


def test_full_shape_is_qwen25_05b() -> None:
    with torch.device("meta"):
        model = qwen2_shape.Qwen2ForCausalLM(qwen2_shape.QWEN25_05B)
    params = list(model.parameters())
    assert len(params) == 290
    assert sum(p.numel() for p in params) == 494_032_768
    assert [tuple(p.shape) for p in params] == step_bench.qwen25_05b_shapes()
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_byte_model_table() -> None:
    host = {k: (v.kernel, v.host, v.link) for k, v in offload_e2e.BYTE_MODEL.items()}
    assert host == {
        "fp32": (28, 32, 4),
        "bf16": (20, 24, 4),
        "fp8": (16, 20, 4),
        "bf16-ecc24": (16, 20, 4),
        "compact": (12, 16, 4),
        "bf16-ecc24 device": (0, 10, 10),
    }
    device = offload_e2e.SPECS["bridge-device"]
    assert offload_e2e.byte_model_key(device) == "bf16-ecc24 device"


def test_lower_bound_exposes_the_last_gradient() -> None:
    bw = offload_e2e.Bandwidth(d2h_gbs=50.0, h2d_gbs=50.0, both_gbs=100.0, host_gbs=100.0, mib=4)
    base = offload_e2e.Row("fwd-bwd-bf16", "", median_ms=100.0, fwd_ms=40.0, bwd_ms=60.0)
    ready = [
        {"name": "late", "numel": 10**6, "ms": 10.0},
        {"name": "embed", "numel": 10**8, "ms": 60.0},
        {"name": "<backward end>", "numel": 0, "ms": 60.0},
    ]
    n = 10**8 + 10**6
    hooked = offload_e2e.Row("bridge-bf16", "", precision="bf16", hooks=True, median_ms=150.0)
    b = offload_e2e.lower_bound(hooked, n, bw, base, ready)
    assert b["host_ms"] == pytest.approx(24 * n / 100e9 * 1e3)  # 24 B/param at 100 GB/s
    assert b["link_ms"] == pytest.approx(2 * n / 50e9 * 1e3)
    assert b["bound_by"] == "host memory"
    assert b["tail_ms"] == pytest.approx(24 * 10**8 / 100e9 * 1e3)  # the embedding, after bwd
    assert b["step_ms"] == pytest.approx(100.0 + b["tail_ms"])
    assert "from embed on" in b["exposed"]
    plain = offload_e2e.Row("bridge-bf16-nohooks", "", precision="bf16", median_ms=150.0)
    b = offload_e2e.lower_bound(plain, n, bw, base, ready)
    assert b["step_ms"] == pytest.approx(100.0 + b["host_ms"])
    # overlap_forward: the next forward may hide as much of the excess (24 ms) as it lasts
    overlap = offload_e2e.Row(
        "bridge-bf16-overlap", "", precision="bf16", hooks=True, overlap=True, median_ms=120.0
    )
    b = offload_e2e.lower_bound(overlap, n, bw, base, ready)
    assert b["tail_ms"] == 0.0  # a 40 ms forward hides all of it
    short = offload_e2e.Row("fwd-bwd-bf16", "", median_ms=70.0, fwd_ms=10.0, bwd_ms=60.0)
    b = offload_e2e.lower_bound(overlap, n, bw, short, ready)
    assert b["tail_ms"] == pytest.approx(24 * 10**8 / 100e9 * 1e3 - 10.0)
    assert b["step_ms"] == pytest.approx(70.0 + b["tail_ms"])


def test_lower_bound_of_the_device_update() -> None:
    # 10 B per parameter of DMA, 5 each way over the link, spread over forward + backward
    bw = offload_e2e.Bandwidth(d2h_gbs=50.0, h2d_gbs=50.0, both_gbs=60.0, host_gbs=100.0, mib=4)
    base = offload_e2e.Row("fwd-bwd-bf16", "", median_ms=100.0, fwd_ms=40.0, bwd_ms=60.0)
    ready = [{"name": "embed", "numel": 10**9, "ms": 60.0}, {"name": "<backward end>", "numel": 0, "ms": 60.0}]  # fmt: skip
    row = offload_e2e.Row("bridge-device", "", precision="bf16-ecc24", hooks=True, update="device")
    b = offload_e2e.lower_bound(row, 10**9, bw, base, ready)
    assert b["link_ms"] == pytest.approx(10 * 10**9 / 60e9 * 1e3)  # both ways at once: 60 GB/s
    assert b["host_ms"] == pytest.approx(10 * 10**9 / 100e9 * 1e3)
    assert b["tail_ms"] == pytest.approx(b["link_ms"] - 100.0)
    assert b["step_ms"] == pytest.approx(b["link_ms"])
    b = offload_e2e.lower_bound(row, 10**8, bw, base, ready)
    assert b["tail_ms"] == 0.0
    assert b["step_ms"] == 100.0


def test_tiny_run_times_torch_adamw_and_the_floor(tmp_path, capsys) -> None:
    data = _run(tmp_path, ["torch-adamw", "fwd-bwd-bf16"])
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["torch-adamw", "fwd-bwd-bf16"]
    for r in rows.values():
        assert r["error"] is None
        assert r["skipped"] is None
        assert len(r["step_ms"]) == 2
        assert 0 < r["min_ms"] <= r["median_ms"]
        assert r["peak_gib"] is None  # no CUDA
        assert math.isfinite(r["final_loss"])
        assert len(r["losses"]) == 3
    assert rows["torch-adamw"]["vs_torch_adamw"] == pytest.approx(1.0)
    # the same data and init in every row: the first losses agree to bf16 accuracy
    assert rows["torch-adamw"]["losses"][0] == pytest.approx(
        rows["fwd-bwd-bf16"]["losses"][0], rel=0.01
    )
    assert data["model"]["impl"] in ("plain", "transformers")
    assert data["model"]["tensors"] == 26
    assert len(data["grad_ready"]) == 27  # every tensor, then backward's end
    assert data["machine"]["cpu_count"] >= 1
    assert data["bandwidth"]["host_gbs"] > 0
    assert data["argv"][1:4] == TINY[:3]
    out = capsys.readouterr().out
    assert "| optimizer | median step ms | min | peak VRAM GiB |" in out
    assert "| torch AdamW fp32 fused + bf16 autocast |" in out


def test_bridge_rows_skip_without_the_package(tmp_path, capsys, monkeypatch) -> None:
    if importlib.util.find_spec("memopt_offload") is not None:
        monkeypatch.setitem(sys.modules, "memopt_offload", None)  # import raises ImportError
    data = _run(tmp_path, [*BRIDGE_ROWS, "torchao-offload"])
    for r in data["rows"]:
        assert r["median_ms"] is None
        assert r["skipped"]
    assert all("memopt_offload" in r["skipped"] for r in data["rows"][:-1])
    assert "CUDA" in data["rows"][-1]["skipped"] or "torchao" in data["rows"][-1]["skipped"]
    captured = capsys.readouterr()
    assert "skipping bridge-bf16: memopt_offload cannot be imported" in captured.err
    assert "| AdamBridge bf16 | skipped: memopt_offload cannot be imported" in captured.out


class StandInEngine:
    """A DeepSpeed engine's API over torch AdamW: its backward must be the one the row calls (it
    moves the last gradient bucket to the host), and its optimizer reports host partitions."""

    calls: list[str] = []  # noqa: RUF012

    def __init__(self, model, config) -> None:
        assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
        self.inner = torch.optim.AdamW(model.parameters(), **config["optimizer"]["params"])
        self.optimizer = types.SimpleNamespace(
            single_partition_of_fp32_groups=[torch.zeros(256)],  # 1 KiB
            optimizer=types.SimpleNamespace(state={0: {"exp_avg": torch.zeros(512)}}),  # 2 KiB
        )

    def backward(self, loss) -> None:
        StandInEngine.calls.append("backward")
        loss.backward()

    def step(self) -> None:
        StandInEngine.calls.append("step")
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)


def _stand_in_deepspeed() -> types.ModuleType:
    fake = types.ModuleType("deepspeed")
    fake.init_distributed = lambda dist_backend: StandInEngine.calls.append(dist_backend)

    def initialize(model, model_parameters, config):
        return StandInEngine(model, config), None, None, None

    fake.initialize = initialize
    return fake


def test_deepspeed_row_steps_through_the_engine(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", _stand_in_deepspeed())
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "0" if "RANK" in key else "1")  # restored after the test
    StandInEngine.calls = []
    data = _run(tmp_path, ["deepspeed-offload"])
    (row,) = data["rows"]
    assert row["error"] is None
    assert row["median_ms"] > 0
    assert StandInEngine.calls == ["gloo"] + ["backward", "step"] * 3  # warmup 1 + iters 2
    assert row["host_gib"] == pytest.approx(3 / 2**20)
    assert row["losses"][0] != row["losses"][-1]


def test_deepspeed_row_skips_without_the_package(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import raises ImportError
    (row,) = _run(tmp_path, ["deepspeed-offload"])["rows"]
    assert row["median_ms"] is None
    assert row["skipped"].startswith("deepspeed cannot be imported")


def test_bridge_rows_with_a_stand_in(tmp_path, monkeypatch) -> None:
    fake = types.ModuleType("memopt_offload")
    fake.AdamBridge = StandInBridge
    monkeypatch.setitem(sys.modules, "memopt_offload", fake)
    data = _run(tmp_path, ["bridge-bf16", "bridge-compact", "bridge-bf16-nohooks", "fwd-bwd-bf16"])
    rows = {r["name"]: r for r in data["rows"]}
    for name in ("bridge-bf16", "bridge-compact", "bridge-bf16-nohooks"):
        r = rows[name]
        assert r["error"] is None
        assert r["median_ms"] > 0
        assert r["host_gib"] == pytest.approx(3 / 1024)
        b = r["bound"]
        assert b["compute_from"] == "fwd-bwd-bf16"
        assert b["link_ms"] == 0.0  # no GPU: nothing crosses a link
        assert b["step_ms"] >= b["fwd_ms"] + b["bwd_ms"]
    assert rows["bridge-bf16"]["bound"]["host_bytes_per_param"] == 24
    assert rows["bridge-compact"]["bound"]["host_bytes_per_param"] == 16
    assert rows["bridge-bf16"]["hooks"]
    assert not rows["bridge-bf16-nohooks"]["hooks"]


def test_bridge_arguments_reach_their_rows(tmp_path, monkeypatch) -> None:
    fake = types.ModuleType("memopt_offload")
    fake.AdamBridge = StandInBridge
    monkeypatch.setitem(sys.modules, "memopt_offload", fake)
    StandInBridge.built = []
    data = _run(
        tmp_path, ["bridge-bf16", "bridge-device"], "--bucket-mb", "8", "--prefetch-mb", "64"
    )
    assert [r["update"] for r in data["rows"]] == ["host", "device"]
    # the prefetch budget is the device update's alone
    assert StandInBridge.built == [
        {"precision": "bf16", "update": "host", "bucket_mb": 8.0},
        {"precision": "bf16-ecc24", "update": "device", "bucket_mb": 8.0, "prefetch_mb": 64.0},
    ]
    args = offload_e2e.parse_args([*TINY, "--bucket-mb", "8", "--prefetch-mb", "64"])
    argv = offload_e2e.child_argv(args, offload_e2e.choose_model("replica"))
    assert argv[-4:] == ["--bucket-mb", "8.0", "--prefetch-mb", "64.0"]


@pytest.mark.skipif(
    importlib.util.find_spec("memopt_offload") is None, reason="memopt_offload is not installed"
)
def test_the_real_bridge_runs_its_rows(tmp_path) -> None:
    data = _run(tmp_path, ["bridge-bf16", "bridge-bf16-nohooks", "bridge-bf16-overlap"])
    rows = {r["name"]: r for r in data["rows"]}
    for r in rows.values():
        assert r["error"] is None
        assert r["median_ms"] > 0
        assert r["host_gib"] > 0
        assert math.isfinite(r["final_loss"])
    # the same updates whether the next forward waits for them all or overlaps them
    assert rows["bridge-bf16-overlap"]["overlap"]
    assert rows["bridge-bf16-overlap"]["losses"] == rows["bridge-bf16"]["losses"]


def test_isolated_row_runs_in_its_own_process(tmp_path) -> None:
    data = _run(tmp_path, ["torch-adamw"], "--isolate")
    (row,) = data["rows"]
    assert row["error"] is None
    assert len(row["step_ms"]) == 2
    assert data["header"]["isolation"] == "each row in its own process"


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_replica_matches_transformers() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers = importlib.import_module("transformers")
    shape = qwen2_shape.TINY
    torch.manual_seed(0)
    theirs = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**shape.config_kwargs(), attn_implementation="sdpa")
    )
    ours = qwen2_shape.Qwen2ForCausalLM(shape)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    ours.load_state_dict(theirs.state_dict())
    ids = torch.randint(0, shape.vocab_size, (2, 16))
    for dtype in (torch.float32, torch.bfloat16):
        expected = theirs.to(dtype)(input_ids=ids, use_cache=False).logits
        assert torch.equal(ours.to(dtype)(ids), expected)


def test_tiny_run_in_rounds(tmp_path, capsys) -> None:
    data = _run(tmp_path, ["torch-adamw", "fwd-bwd-bf16"], "--rounds", "2")
    rows = {r["name"]: r for r in data["rows"]}
    for r in rows.values():
        assert r["error"] is None
        assert len(r["step_ms"]) == 4  # 2 rounds x 2 timed steps
        assert len(r["round_median_ms"]) == 2
    err = capsys.readouterr().err
    # the floor row first (its gradient-ready order feeds the bounds), reversed in round 2
    assert err.index("fwd-bwd-bf16 (round 1 of 2)") < err.index("torch-adamw (round 1 of 2)")
    assert err.index("torch-adamw (round 2 of 2)") < err.index("fwd-bwd-bf16 (round 2 of 2)")
    assert "2 rounds" in data["header"]["timing"]


def test_merge_rounds() -> None:
    def row(steps, bwd, host, losses=(2.0, 1.5)):
        return offload_e2e.Row(
            "bridge-bf16", "", median_ms=statistics.median(steps), min_ms=min(steps),
            step_ms=list(steps), bwd_ms=bwd, host_gib=host, losses=list(losses),
        )  # fmt: skip

    merged = offload_e2e.merge_rounds([row([100, 110, 300], 50.0, 4.0), row([120, 130], 70.0, 5.0)])
    assert merged.step_ms == [100, 110, 300, 120, 130]
    assert merged.median_ms == 120
    assert merged.min_ms == 100
    assert merged.round_median_ms == [110, 125]
    assert merged.bwd_ms == 60.0
    assert merged.host_gib == 5.0
    assert merged.error is None
    bad = offload_e2e.merge_rounds([row([1], 1.0, 1.0), row([1], 1.0, 1.0, losses=(2.0, 1.4))])
    assert bad.error == "rounds gave different losses (largest relative difference 0.067)"
    # a CUDA run's rounds may differ slightly (GPU backward is not deterministic), a CPU run's not
    close = [row([1], 1.0, 1.0, losses=(2.0, 1.0)), row([1], 1.0, 1.0, losses=(2.0, 1.004))]
    assert offload_e2e.merge_rounds(close, loss_rtol=0.01).error is None
    assert offload_e2e.merge_rounds(close).error.startswith("rounds gave different losses")
    nan = [row([1], 1.0, 1.0, losses=(2.0, 1.0)), row([1], 1.0, 1.0, losses=(2.0, math.nan))]
    assert offload_e2e.merge_rounds(nan, loss_rtol=0.01).error.startswith("rounds gave")
    short = [row([1], 1.0, 1.0, losses=(2.0, 1.0)), row([1], 1.0, 1.0, losses=(2.0,))]
    assert offload_e2e.merge_rounds(short, loss_rtol=0.01).error.startswith("rounds gave")
    assert offload_e2e.round_order(["a", "b"], 3) == [["a", "b"], ["b", "a"], ["a", "b"]]


@pytest.mark.parametrize("flag", ["--batch", "--seq", "--layers", "--bw-mib"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_sizes_below_one_are_argparse_errors(flag, value, capsys) -> None:
    # 0 was silently replaced by the default; a negative size failed deep inside every row
    with pytest.raises(SystemExit) as exc:
        offload_e2e.parse_args([*TINY, flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}: must be at least 1, got {value}" in capsys.readouterr().err
