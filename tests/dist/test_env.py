"""The env stage on two real gloo ranks (emulated nodes), and in-process without a process group."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pipelines.configtools import from_dict, to_jsonable
from pipelines.launchers.base import StageFailed
from stages.env_check import EnvInputs, EnvResult, FleetMismatch, check_fleet, run
from tests.helpers import run_world
from training.plan_config import EnvConfig
from training.envinfo import collect_local


@pytest.mark.slow
def test_two_ranks_on_two_emulated_nodes_are_consistent() -> None:
    result = run_world("stages.env_check:run", EnvInputs(EnvConfig()), world=2)
    assert isinstance(result, EnvResult)
    assert (result.world_size, result.nodes, result.consistent) == (2, 2, True)
    assert [r.rank for r in result.ranks] == [0, 1]
    assert [r.node_name for r in result.ranks] == ["node0", "node1"]
    assert {r.backend for r in result.ranks} == {"gloo"}
    assert result.ranks[0].pid != result.ranks[1].pid
    share = max(1, (os.cpu_count() or 1) // 2)  # each rank its share of the host's cores
    assert [r.torch_threads for r in result.ranks] == [share, share]
    # CPU ranks compute subnormals as zero (pipelines/launchers/worker.py flush_subnormals).
    assert [r.subnormals_flushed for r in result.ranks] == [True, True]
    assert result.headline().startswith("2 ranks on 2 nodes, torch ")
    # The engine stores results as JSON and reads them back by field types.
    assert from_dict(EnvResult, json.loads(json.dumps(to_jsonable(result)))) == result


@pytest.mark.slow
def test_a_rank_with_another_torch_stops_the_stage() -> None:
    with pytest.raises(StageFailed, match=r"FleetMismatch: env: ranks disagree on torch") as failed:
        run_world("tests.dist.env_workers:torch_differs_on_rank1", EnvInputs(EnvConfig()), world=2)
    assert "0.0.0+planted" in str(failed.value) and "env: to fix, give every rank the same torch" in str(failed.value)


def test_without_a_process_group_the_world_is_this_process() -> None:
    result = run(EnvInputs(EnvConfig()))
    assert (result.world_size, result.nodes, result.ranks[0].backend) == (1, 1, "none")
    assert ("env/world_size", 1.0, 0) in result.metrics()
    assert all(key.startswith("env/") and step == 0 for key, _, step in result.metrics())


def test_mismatch_message_is_a_sentence_a_table_and_a_fix() -> None:
    facts = collect_local()
    # Without a process group check_fleet sees one rank; a second rank is planted by patching the gather.
    other = facts | {"rank": 1, "node_name": "node1", "torch": "0.0.0+planted"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("stages.env_check.gather_objects", lambda obj: [obj, other])
        with pytest.raises(FleetMismatch) as info:
            check_fleet(facts, EnvConfig())
    lines = str(info.value).splitlines()
    assert lines[0] == "env: ranks disagree on torch"
    assert [cell.strip() for cell in lines[1].split("|")] == ["rank", "node", "host", "torch"]
    assert "0.0.0+planted" in lines[4]
    assert lines[-1].startswith("env: to fix, give every rank the same torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_require_cuda_on_a_cpu_machine_fails_with_the_rank() -> None:
    with pytest.raises(FleetMismatch, match="rank 0 has no CUDA device"):
        run(EnvInputs(EnvConfig(require_cuda=True)))
