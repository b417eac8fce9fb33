"""The local launcher on real gloo ranks: results, failures, dead and hung ranks, no orphans."""

from __future__ import annotations

import os
import time

import pytest

from pipelines.launchers.base import StageFailed
from tests.helpers import run_world

W = "tests.dist.workers"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _no_worker_left(workdir) -> None:
    pids = [int(p.read_text()) for p in workdir.glob("rank*.pid")]
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids), "no worker outlives its stage"


def test_rank0_result_comes_back():
    result = run_world(f"{W}:ranks_sum", world=2)
    assert result["sum"] == 3.0 and result["world"] == 2
    assert not _alive(result["pid"]), "the worker process outlived its stage"


def test_the_ranks_meet_at_a_port_rank_0_opened_named_in_a_file_of_the_launch(tmp_path):
    """No port is chosen before the workers start, where another process could take it in
    between (a stage failed so with EADDRINUSE beside a Ray head); the file goes with the launch."""
    seen = run_world(f"{W}:rendezvous_seen", world=2, workdir=tmp_path)
    assert seen["master_port"] is None
    host, _, port = seen["published"].rpartition(":")
    assert host == "127.0.0.1" and int(port) == seen["store_port"]
    assert not list(tmp_path.glob("rendezvous-*")), "the launch's rendezvous file is removed with it"


def test_an_exception_names_the_rank_and_its_message(tmp_path):
    with pytest.raises(StageFailed, match=r"rank 1 failed: ValueError: planted failure on rank 1"):
        run_world(f"{W}:raise_on_rank1", world=2, workdir=tmp_path)
    assert "Traceback" in (tmp_path / "rank1.log").read_text()
    _no_worker_left(tmp_path)


def test_a_killed_rank_is_an_error_not_a_hang(tmp_path):
    start = time.monotonic()
    with pytest.raises(StageFailed, match="rank 1 was killed by SIGKILL"):
        run_world(f"{W}:kill_rank1", world=2, workdir=tmp_path, timeout_s=30, grace_s=2)
    assert time.monotonic() - start < 25
    _no_worker_left(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("worker", ["hang_rank1", "hang_rank1_in_a_subgroup"])
def test_a_hung_rank_fails_on_the_collective_timeout(tmp_path, worker):
    """In the default group, and in a group made after it (a mesh dimension's): torch gives those
    its own default timeout (30 min on gloo) unless the worker says otherwise."""
    start = time.monotonic()
    with pytest.raises(StageFailed, match=r"rank 0 failed.*killed: ranks \[1\]"):
        run_world(f"{W}:{worker}", world=2, workdir=tmp_path, timeout_s=4, grace_s=1)
    elapsed = time.monotonic() - start
    assert elapsed < 4 + 1 + 15, f"took {elapsed:.1f} s"
    for line in (tmp_path / "rank1.log").read_text().splitlines():
        assert "Traceback" not in line
    _no_worker_left(tmp_path)
