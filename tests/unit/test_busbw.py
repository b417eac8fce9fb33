"""The bandwidth arithmetic without processes: nccl-tests' factors, sizes, verdict, result plumbing."""

from __future__ import annotations

import json
import re

import pytest

from pipelines.configtools import from_dict, to_jsonable
from stages.bandwidth import BandwidthResult, human_bytes, largest, verdict
from training.collectives import Measurement, bus_factor, element_count, message_sizes
from training.plan_config import COLLECTIVES

# Hand values of nccl-tests' factors: all_reduce 2(n-1)/n, the one-way collectives (n-1)/n, broadcast 1.
FACTORS = {
    2: {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5, "broadcast": 1.0},
    4: {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "all_to_all": 0.75, "broadcast": 1.0},
    8: {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "all_to_all": 0.875, "broadcast": 1.0},
}


@pytest.mark.parametrize("n", sorted(FACTORS))
def test_bus_factors_match_nccl_tests(n: int) -> None:
    assert set(FACTORS[n]) == set(COLLECTIVES)
    for collective, factor in FACTORS[n].items():
        assert bus_factor(collective, n) == pytest.approx(factor)


def test_unknown_collective_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="'gossip': must be one of all_reduce, "):
        bus_factor("gossip", 2)


def test_message_sizes_are_geometric_and_end_at_max() -> None:
    assert message_sizes(8, 8192, 4) == [8, 32, 128, 512, 2048, 8192]
    assert message_sizes(1024, 1024, 2) == [1024]
    # The series steps over max_bytes: the verdict size is still max_bytes (64 MiB by default).
    assert message_sizes(8, 64 * 2**20, 4)[-2:] == [32 * 2**20, 64 * 2**20]
    with pytest.raises(ValueError, match="factor=1"):
        message_sizes(8, 64, 1)


def test_element_count_rounds_down_to_equal_shards() -> None:
    assert element_count(1024, 2) == 256
    assert element_count(1000, 3) == 249  # 250 elements, down to a multiple of 3
    assert element_count(4, 8) == 8  # at least one element per rank


def test_measurement_arithmetic() -> None:
    m = Measurement.from_time("all_reduce", 2_000_000, 1000.0, 4)  # 2 MB in 1 ms
    assert m.algbw_gbps == pytest.approx(2.0)
    assert m.busbw_gbps == pytest.approx(2.0 * 1.5)
    b = Measurement.from_time("broadcast", 10**9, 1e6, 8)  # 1 GB in 1 s
    assert (b.algbw_gbps, b.busbw_gbps) == pytest.approx((1.0, 1.0))


def test_verdict_against_the_ruler() -> None:
    assert verdict(25.0, 20.0) == "ok: 25.00 GB/s >= 20 GB/s ruler"
    assert verdict(20.0, 20.0).startswith("ok: ")
    assert verdict(1.31, 20.0) == (
        "below ruler: 1.31 GB/s < 20 GB/s: keep data parallelism within a few devices"
    )
    assert verdict(None, 20.0).startswith("not measured")


def _result(results: list[Measurement], busbw: float | None) -> BandwidthResult:
    return BandwidthResult(world_size=2, backend="gloo", results=results, verdict=verdict(busbw, 20.0),
                           ruler_gbps=20.0, largest_all_reduce_busbw_gbps=busbw, skipped_reason=None)


def test_result_metrics_headline_and_json_round_trip() -> None:
    rows = [Measurement.from_time(c, size, 100.0 * size / 1024, 2)
            for c in ("all_reduce", "all_gather") for size in (1024, 64 * 2**20)]
    top = largest(rows, "all_reduce")
    assert top is not None and top.bytes == 64 * 2**20
    result = _result(rows, top.busbw_gbps)
    metrics = result.metrics()
    assert all(re.fullmatch(r"[/\w.\- ]*", key) for key, _, _ in metrics)
    assert ("comm/all_gather/time_us", 100.0, 1024) in metrics
    assert ("comm/all_reduce/busbw_gbps_largest", top.busbw_gbps, 0) in metrics
    assert len(metrics) == 1 + 3 * len(rows) + 2
    assert result.headline() == "all_reduce busbw 0.01 GB/s at 64 MiB, world 2: below the 20 GB/s ruler"
    # The engine stores results as JSON and reads them back by field types.
    assert from_dict(BandwidthResult, json.loads(json.dumps(to_jsonable(result)))) == result


def test_no_all_reduce_gives_no_verdict_number() -> None:
    result = _result([Measurement.from_time("broadcast", 1024, 10.0, 2)], None)
    assert result.largest_all_reduce_busbw_gbps is None
    assert "no all_reduce" in result.headline()
    assert not any(key.startswith("comm/all_reduce") for key, _, _ in result.metrics())


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (8, 1000, 1536, 64 * 2**20)] == ["8 B", "1000 B", "1.5 KiB", "64 MiB"]
