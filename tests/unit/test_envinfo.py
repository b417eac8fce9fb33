"""Fleet facts and checks: mismatches, requirements and the table on hand-made ranks; real local facts."""

from __future__ import annotations

import platform
from typing import Any

import torch

from training import envinfo
from training.envinfo import (
    check_requirements,
    collect_local,
    find_mismatches,
    mismatch_table,
    parse_ibstat,
)
from training.units import GIB


def rank(i: int, **changes: Any) -> dict[str, Any]:
    """A healthy GPU rank `i` on node `i`, with `changes` applied."""
    facts = {
        "rank": i,
        "node": i,
        "node_name": f"node{i}",
        "hostname": "gpu-host",
        "python": "3.11.7",
        "torch": "2.13.0+cu126",
        "cuda": "12.6",
        "cudnn": 90501,
        "nccl": "2.26.2",
        "backend": "nccl",
        "driver": "560.35.03",
        "has_gpu": True,
        "gpu_count": 8,
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "gpu_free_bytes": 79 * GIB,
    }
    return facts | changes


def test_identical_ranks_have_no_mismatch() -> None:
    assert find_mismatches([rank(0), rank(1), rank(2)]) == []


def test_a_single_rank_has_no_mismatch() -> None:
    assert find_mismatches([rank(0)]) == []


def test_two_torch_versions_are_a_mismatch() -> None:
    assert find_mismatches([rank(0), rank(1, torch="2.12.0+cu126")]) == ["torch"]


def test_two_nccl_versions_and_drivers_are_reported_in_must_match_order() -> None:
    ranks = [rank(0), rank(1, driver="550.54.15"), rank(2, nccl="2.21.5")]
    assert find_mismatches(ranks) == ["nccl", "driver"]


def test_a_rank_without_a_gpu_is_a_mismatch() -> None:
    cpu = rank(
        1, has_gpu=False, gpu_count=0, gpu_name=None, cuda=None, cudnn=None, nccl=None, gpu_free_bytes=None
    )
    assert find_mismatches([rank(0), cpu]) == ["cuda", "cudnn", "nccl", "has_gpu", "gpu_name"]


def test_fields_outside_must_match_may_differ() -> None:
    assert find_mismatches([rank(0), rank(1, hostname="other", gpu_free_bytes=GIB)]) == []


def test_table_shows_who_has_what_in_aligned_columns() -> None:
    table = mismatch_table([rank(0), rank(1, torch="2.12.0")], ["torch", "gpu_free_bytes"])
    lines = table.splitlines()
    assert lines[0].split(" | ") == ["rank", "node ", "host    ", "torch       ", "gpu_free_bytes"]
    assert set(lines[1]) <= {"-", "+"}
    assert lines[2].split(" | ") == ["0   ", "node0", "gpu-host", "2.13.0+cu126", "79.0 GiB"]
    assert lines[3].split(" | ") == ["1   ", "node1", "gpu-host", "2.12.0      ", "79.0 GiB"]
    # Fixed width: every separator sits in the same column.
    assert len({line.index("|") for line in (lines[0], *lines[2:])}) == 1


def test_table_shows_missing_values_as_a_dash() -> None:
    table = mismatch_table([rank(0, driver=None)], ["driver"])
    assert table.splitlines()[-1].endswith("| -")


def test_table_of_a_large_fleet_shows_the_odd_ranks_first(monkeypatch) -> None:
    monkeypatch.setattr(envinfo, "MAX_TABLE_ROWS", 4)
    ranks = [rank(i, nccl="2.21.5" if i in (7, 9) else "2.26.2") for i in range(40)]
    lines = mismatch_table(ranks, ["nccl"]).splitlines()
    assert [line.split(" | ")[0].strip() for line in lines[2:5]] == ["0", "7", "9"]
    assert lines[-1] == "(37 more ranks not shown)"


def test_requirements_met() -> None:
    assert check_requirements([rank(0), rank(1)], require_cuda=True, min_free_gib=10) == []


def test_requirements_name_the_rank_without_cuda() -> None:
    cpu = rank(1, has_gpu=False, gpu_count=0, gpu_free_bytes=None)
    assert check_requirements([rank(0), cpu], require_cuda=True, min_free_gib=0) == [
        "rank 1 has no CUDA device"
    ]


def test_no_requirement_accepts_cpu_ranks() -> None:
    cpu = rank(0, has_gpu=False, gpu_count=0, gpu_free_bytes=None)
    assert check_requirements([cpu], require_cuda=False, min_free_gib=0) == []


def test_free_memory_needs_a_device_even_without_require_cuda() -> None:
    cpu = rank(0, has_gpu=False, gpu_count=0, gpu_free_bytes=None)
    assert check_requirements([cpu], require_cuda=False, min_free_gib=1) == ["rank 0 has no CUDA device"]


def test_requirements_name_the_rank_short_of_free_memory() -> None:
    ranks = [rank(0, gpu_free_bytes=int(3.1 * GIB)), rank(1)]
    assert check_requirements(ranks, require_cuda=True, min_free_gib=10) == [
        "rank 0 GPU has 3.1 GiB free < 10 GiB"
    ]


def test_parse_ibstat_gives_one_line_per_port() -> None:
    text = """CA 'mlx5_0'
\tCA type: MT4123
\tNumber of ports: 1
\tPort 1:
\t\tState: Active
\t\tPhysical state: LinkUp
\t\tRate: 200
\t\tLink layer: InfiniBand
CA 'mlx5_1'
\tCA type: MT4123
\tPort 1:
\t\tState: Down
\t\tRate: 10
\t\tLink layer: Ethernet
"""
    assert parse_ibstat(text) == ["mlx5_0/1 Active 200 Gb/s InfiniBand", "mlx5_1/1 Down 10 Gb/s Ethernet"]


def test_host_memory_reads_meminfo_in_bytes(tmp_path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       16384 kB\nMemAvailable:    8192 kB\nHugePages_Total:       0\n")
    assert envinfo.host_memory(path) == {
        "MemTotal": 16384 * 1024,
        "MemAvailable": 8192 * 1024,
        "HugePages_Total": 0,
    }


def test_host_memory_is_empty_without_meminfo(tmp_path) -> None:
    assert envinfo.host_memory(tmp_path / "absent") == {}


def test_collect_local_reads_this_machine() -> None:
    facts = collect_local()
    assert facts["python"] == platform.python_version()
    assert facts["torch"] == torch.__version__
    assert facts["cuda"] == torch.version.cuda
    assert facts["cpu_count"] > 0
    assert 0 < facts["cpu_affinity"] <= facts["cpu_count"]
    assert facts["host_mem_total_bytes"] > 0
    assert 0 < facts["host_mem_available_bytes"] <= facts["host_mem_total_bytes"]
    assert facts["has_gpu"] == (facts["gpu_count"] > 0) == torch.cuda.is_available()
    assert (facts["rank"], facts["backend"]) == (0, "none")
    assert set(envinfo.MUST_MATCH) <= set(facts)
