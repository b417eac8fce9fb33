"""The bandwidth stage on real gloo ranks: every collective at every size, and a world of one."""

from __future__ import annotations

import pytest

from stages.bandwidth import SKIPPED_WORLD_1, BandwidthInputs, BandwidthResult
from tests.helpers import run_world
from training.collectives import bus_factor
from training.config import COLLECTIVES, BandwidthConfig

SIZES = [1024, 4096, 16384, 65536]


def test_two_ranks_measure_every_collective_at_every_size() -> None:
    cfg = BandwidthConfig(min_bytes=SIZES[0], max_bytes=SIZES[-1], factor=4, iters=3, warmup_iters=1)
    result = run_world("stages.bandwidth:run", BandwidthInputs(cfg), world=2)
    assert isinstance(result, BandwidthResult)
    assert (result.world_size, result.backend, result.skipped_reason) == (2, "gloo", None)
    assert [(m.collective, m.bytes) for m in result.results] == [(c, s) for c in COLLECTIVES for s in SIZES]
    for m in result.results:
        assert m.time_us > 0 and m.busbw_gbps > 0
        assert m.busbw_gbps == pytest.approx(m.algbw_gbps * bus_factor(m.collective, 2))
    top = result.results[len(SIZES) - 1]
    assert (top.collective, top.bytes) == ("all_reduce", SIZES[-1])
    assert result.largest_all_reduce_busbw_gbps == top.busbw_gbps
    assert result.verdict.startswith(("ok: ", "below ruler: "))


def test_world_of_one_measures_nothing() -> None:
    result = run_world("stages.bandwidth:run", BandwidthInputs(BandwidthConfig(max_bytes=1024)), world=1)
    assert (result.results, result.skipped_reason) == ([], SKIPPED_WORLD_1)
    assert result.largest_all_reduce_busbw_gbps is None
    assert result.verdict.startswith("not measured")
    assert result.headline() == f"not measured: {SKIPPED_WORLD_1}"
