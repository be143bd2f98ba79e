"""memopt_core.testing.spawn_ranks: a rank that aborts (SIGABRT) after every result file exists
is accepted, as gloo's teardown abort is; an abort before the results, or an ordinary
exception, still fails."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from memopt_core.testing import spawn_ranks


def _write_then_abort(rank: int, out: str) -> None:
    Path(out, f"rank{rank}").write_text("done")
    if rank == 1:
        while not Path(out, "rank0").exists():  # both results written, then the abort
            time.sleep(0.01)
        os.abort()


def _abort_first(rank: int, out: str) -> None:
    if rank == 1:
        os.abort()
    Path(out, f"rank{rank}").write_text("done")


def _raise(rank: int, out: str) -> None:
    Path(out, f"rank{rank}").write_text("done")
    if rank == 1:
        raise RuntimeError("a failing rank")


def _outputs(tmp_path: Path) -> list[Path]:
    return [tmp_path / "rank0", tmp_path / "rank1"]


def test_abort_after_every_result_is_accepted(tmp_path):
    spawn_ranks(_write_then_abort, (str(tmp_path),), 2, _outputs(tmp_path))
    assert all(p.read_text() == "done" for p in _outputs(tmp_path))


def test_abort_before_the_results_fails(tmp_path):
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn_ranks(_abort_first, (str(tmp_path),), 2, _outputs(tmp_path))


def test_an_exception_in_a_rank_fails_even_with_every_result(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="a failing rank"):
        spawn_ranks(_raise, (str(tmp_path),), 2, _outputs(tmp_path))
