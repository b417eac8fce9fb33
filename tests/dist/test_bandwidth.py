"""The bandwidth stage on real gloo ranks: every collective at every size, and a world of one."""

from __future__ import annotations

import os

import pytest

from stages.bandwidth import SKIPPED_WORLD_1, BandwidthInputs, BandwidthResult
from tests.helpers import run_world
from training.collectives import bus_factor
from training.plan_config import COLLECTIVES, BandwidthConfig

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
    # CPU ranks share the host's cores: what that costs them is measured beside the probe.
    shared = result.shared_cores
    assert shared is not None
    assert (shared.world, shared.cores) == (2, len(os.sched_getaffinity(0)))
    assert shared.threads_per_rank >= 1 and shared.alone_s > 0 and shared.together_s > 0 and shared.call_s >= 0
    assert ("comm/shared_cores/call_ms", shared.call_s * 1e3, 0) in result.metrics()


def test_world_of_one_measures_nothing() -> None:
    result = run_world("stages.bandwidth:run", BandwidthInputs(BandwidthConfig(max_bytes=1024)), world=1)
    assert (result.results, result.skipped_reason) == ([], SKIPPED_WORLD_1)
    assert result.largest_all_reduce_busbw_gbps is None and result.shared_cores is None
    assert result.verdict.startswith("not measured")
    assert result.headline() == f"not measured: {SKIPPED_WORLD_1}"


@pytest.mark.slow
def test_two_nodes_of_two_ranks_probe_both_tiers(tmp_path) -> None:
    """nodes=2 x procs_per_node=2: each node's own pair (the intra-node tier) and one rank of each
    node (the inter-node tier) are measured too, every group of a tier at once; the plan fits one
    link per tier from them (stages/rulers.py: measured_tiers)."""
    from pipelines.launchers.base import Task, WorldSpec
    from pipelines.launchers.local import LocalLauncher
    from pipelines.schema import LauncherConfig
    from stages.rulers import measured_tiers
    from training.shared_cores import time_share

    cfg = BandwidthConfig(min_bytes=1024, max_bytes=65536, factor=8, iters=3, warmup_iters=1,
                          collectives=["all_reduce", "all_gather"])
    task = Task(stage="bandwidth", fn="stages.bandwidth:run", inputs=BandwidthInputs(cfg, nodes=2, procs_per_node=2),
                workdir=tmp_path)
    result = LocalLauncher(LauncherConfig(timeout_s=60)).run(task, WorldSpec(2, 2))
    assert (result.world_size, result.nodes, result.procs_per_node) == (4, 2, 2)
    sizes = [(m.collective, m.bytes) for m in result.results]
    for tier in (result.node_results, result.spread_results):
        assert [m.collective for m in tier] == [c for c, _ in sizes], "the same collectives and sizes per tier"
        for m in tier:
            assert m.time_us > 0 and m.busbw_gbps == pytest.approx(m.algbw_gbps * bus_factor(m.collective, 2))
    # Four single-threaded ranks on this host's cores: once they outnumber the cores, each gets
    # its share of one, and the measured compute slows by at least most of the time-sharing.
    shared = result.shared_cores
    assert shared.world == 4
    assert shared.compute_factor >= 0.75 * time_share(4, shared.threads_per_rank, shared.cores)
    tiers = measured_tiers(result)
    assert tiers["devices_per_node"] == 2 and {"intra", "inter", "inter_single"} <= tiers.keys()
    assert tiers["intra"]["all_reduce"].world == 2 and tiers["inter"]["all_reduce"].world == 4
    assert any(key.startswith("comm/node/all_reduce/") for key, _, _ in result.metrics())


def test_short_loops_are_measured_in_rounds_and_keep_the_median() -> None:
    """The probe's small sizes (latency, which the plan fits) are measured `rounds` times in turn
    and keep the median; a size whose loop lasts SHORT_LOOP_S or more (8 MiB: ~10 ms a call here,
    20 calls) is measured once."""
    from training.collectives import SHORT_LOOP_S

    result = run_world("tests.dist.workers:probe_rounds", None, world=2)
    assert result["rounds"][8] == 3 and result["rounds"][8 << 20] == 1
    for size, times in result["times"].items():
        assert result["rounds"][size] == (3 if times[0] * 1e-6 * 20 < SHORT_LOOP_S else 1)
        assert result["kept"][size] == pytest.approx(sorted(times)[len(times) // 2])
