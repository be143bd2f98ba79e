"""The demo end to end at toy size, and the corpus split it relies on."""

from __future__ import annotations

import json
import math
import struct

import gpt_demo
import pytest
from corpus import SKIP_DIRS, fixed_batches, is_val_file, load_corpus, random_batches, stdlib_files
from optimizers import CONFIGS, available

TINY = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--d-model", "16"]
TINY += ["--layers", "1", "--heads", "2", "--eval-every", "2", "--device", "cpu"]


def test_corpus_split_is_deterministic_and_disjoint_by_file() -> None:
    a = load_corpus(max_train_bytes=200_000, max_val_bytes=50_000)
    b = load_corpus(max_train_bytes=200_000, max_val_bytes=50_000)
    assert a.train_files == b.train_files
    assert a.val_files == b.val_files
    assert a.train.equal(b.train)
    assert a.val.equal(b.val)
    assert not set(a.train_files) & set(a.val_files)
    assert all(is_val_file(f) for f in a.val_files)
    assert not any(is_val_file(f) for f in a.train_files)
    assert (len(a.train), len(a.val)) == (200_000, 50_000)
    assert int(a.train.max()) < 256


def test_corpus_skips_tests_and_installed_packages() -> None:
    files = stdlib_files()
    assert files
    assert all(f.endswith(".py") for f in files)
    assert not any(SKIP_DIRS.intersection(f.split("/")[:-1]) for f in files)


def test_batches_are_next_byte_pairs_and_reproducible() -> None:
    data = load_corpus(max_train_bytes=10_000, max_val_bytes=10_000).train
    first = random_batches(data, batch_size=3, seq_len=8, count=2, seed=1)
    again = random_batches(data, batch_size=3, seq_len=8, count=2, seed=1)
    for (x, y), (x2, y2) in zip(first, again, strict=True):
        assert x.shape == y.shape == (3, 8)
        assert x.equal(x2)
        assert y.equal(y2)
        assert x[:, 1:].equal(y[:, :-1])
    assert len(fixed_batches(data, batch_size=3, seq_len=8, count=4)) == 4


def test_tiny_run_writes_table_json_and_png(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpt_demo.main([*TINY, "--out", str(tmp_path)]) == 0
    expected, _ = available(CONFIGS)

    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0].removeprefix("| ") for row in table[1:]] == [
        c.label for c in expected
    ]

    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["name"] for r in results] == [c.name for c in expected]
    for r in results:
        assert math.isfinite(r["final_val_loss"])
        assert [step for step, _ in r["val_curve"]] == [0, 2, 3]
        assert len(r["train_curve"]) == 3
        assert r["state_bytes_per_param"] > 0

    png = (tmp_path / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", png[8:16])
    assert (length, kind) == (13, b"IHDR")
    assert struct.unpack(">II", png[16:24]) == (1100, 500)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--optimizers", "adamw,nope"], "--optimizers: unknown optimizer(s) ['nope']"),
        (["--batch-size", "0"], "must be positive"),  # was a run of NaN losses, exit code 0
        (["--seq-len", "0"], "must be positive"),  # the same
        (["--d-model", "0"], "must be positive"),  # was a ZeroDivisionError
        (["--heads", "3"], "--heads must be positive and divide --d-model 16"),
        (["--lr", "-1"], "--lr must be finite and positive"),  # was torch's ValueError
        (["--weight-decay", "nan"], "--weight-decay finite and at least 0"),
        (["--layers", "-1"], "--layers must be at least 0, got -1"),  # ran like 0 layers
        (["--optimizers", ""], "unknown optimizer(s) ['']"),  # ran every optimizer
        (["--device", "foo"], "--device: Expected one of"),  # a traceback at the first tensor
    ],
)
def test_bad_arguments_are_argparse_errors(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        gpt_demo.main([*TINY, *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_sequence_longer_than_the_corpus_is_refused(capsys) -> None:
    # was a RuntimeError from torch.randint deep in the batch sampler
    assert gpt_demo.main([*TINY, "--seq-len", "100000000"]) == 2
    assert "--seq-len 100000000 needs corpus splits longer than" in capsys.readouterr().err
