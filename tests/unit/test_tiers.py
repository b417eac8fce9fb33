"""Links by tier: every collective of a layout is costed on the tier its group crosses, with that
tier's latency and each rank's share of its bandwidth; the search keeps TP inside a node unless a
layout that crosses is more than 5 % faster, and says why when it keeps one."""

from __future__ import annotations

import math

import pytest

from stages.bandwidth import BandwidthResult
from training.collectives import Measurement
from training.parallel.dims import ParallelDims
from training.planner.comm import Group, Link, comm_time, group_of, latency_hops
from training.planner.hardware import Hardware
from training.planner.ranking import Candidate, rank
from training.planner.shape import Shape

# The h100-80g-ndr preset: NVLink 450 GB/s busbw at 10 µs in a node; 8 x NDR 400 Gb/s per node,
# 370 GB/s busbw across full nodes at 20 µs.
INTRA = {"all_reduce": Link(alpha_s=10e-6, busbw_gbps=450, world=8)}
INTER = {"all_reduce": Link(alpha_s=20e-6, busbw_gbps=370, world=16)}
H100 = Hardware(80e9, 8, INTRA, INTER, seconds_per_sample=1e-3)
# A 7B-like model: 32 blocks of 4096 wide, every block's linears split by TP.
SHAPE = Shape(params=int(7e9), layers=32, block_linear_params=int(6.4e9), hidden=4096, seq_len=4096, heads=32,
              first_stage_params=int(1.3e8), last_stage_params=int(1.3e8))


@pytest.mark.parametrize(("dims", "dim", "expected"), [
    (dict(tp=8, dp_shard=4), "tp", Group(8, 8)),        # node-local TP: one node
    (dict(tp=8, dp_shard=4), "dp", Group(4, 1)),        # its data parallelism: one rank per node
    (dict(tp=16, dp_shard=2), "tp", Group(16, 8)),      # TP across two full nodes
    (dict(tp=2, dp_shard=16), "dp", Group(16, 4)),      # 4 of each node's ranks in every dp group
    (dict(pp=4, tp=8), "pp", Group(4, 1)),              # stages a node apart
    (dict(dp_replicate=2, dp_shard=2, tp=2), "dp", Group(4, 4)),
])
def test_a_dimensions_group_follows_the_mesh_layout(dims, dim, expected):
    assert group_of(ParallelDims(**dims), dim, 8) == expected
    assert group_of(ParallelDims(**dims), dim, None).nodes == 1, "without nodes, one node holds all"


def test_inside_a_node_the_intra_link_prices_the_group():
    link = H100.link("all_reduce", Group(8, 8))
    assert link.busbw_gbps == 450 and link.alpha_at(8) == pytest.approx(10e-6)


def test_a_group_across_full_nodes_gets_the_nodes_nics_and_their_latency():
    link = H100.link("all_reduce", Group(16, 8))
    assert link.busbw_gbps == 370
    assert link.alpha_at(16) == pytest.approx(20e-6 * latency_hops(16) / latency_hops(16))


def test_one_rank_per_node_gets_one_nic_not_the_nodes_aggregate():
    """The data-parallel group of TP 8: one GPU per node, one NIC each: 370 / 8 GB/s."""
    link = H100.link("all_reduce", Group(64, 1))
    assert link.busbw_gbps == pytest.approx(370 / 8)
    assert link.alpha_at(64) == pytest.approx(20e-6 * latency_hops(64) / latency_hops(16))
    assert H100.link("all_reduce", Group(32, 4)).busbw_gbps == pytest.approx(4 * 370 / 8), "four NICs' worth"


def test_a_measured_one_rank_per_node_fit_is_used_as_measured():
    single = {"all_reduce": Link(alpha_s=30e-6, busbw_gbps=40, world=2)}
    hw = Hardware(80e9, 8, INTRA, INTER, seconds_per_sample=1e-3, inter_single=single)
    assert hw.link("all_reduce", Group(2, 1)).busbw_gbps == 40
    assert hw.link("all_reduce", Group(16, 8)).busbw_gbps == min(370, 8 * 40)


def test_data_parallel_traffic_of_node_local_tp_rides_one_nic_per_gpu():
    """ddp over 4 nodes x TP 8: each all-reduce bucket crosses nodes with one GPU per node; the
    same bytes over 32 ranks of plain ddp (8 per node) move 8x the NIC bandwidth."""
    grads = {}
    for dims in (dict(dp_replicate=4, tp=8), dict(dp_replicate=32)):
        d = ParallelDims(**dims)
        grads[d.tp] = comm_time(SHAPE, "ddp", d, 8, 1, 1, "bf16", H100.link, devices_per_node=8).data_parallel_s
    per_byte_tp8 = grads[8] / (SHAPE.params / 8)
    per_byte_dp = grads[1] / SHAPE.params
    assert per_byte_tp8 > 4 * per_byte_dp


def test_tp_across_nodes_pays_the_inter_node_tier():
    d = ParallelDims(tp=16)
    across = comm_time(SHAPE, "zero3", d, 8, 1, 1, "bf16", H100.link, devices_per_node=8).tensor_parallel_s
    one_node = comm_time(SHAPE, "zero3", d, 8, 1, 1, "bf16", H100.link, devices_per_node=None).tensor_parallel_s
    local = comm_time(SHAPE, "zero3", ParallelDims(dp_shard=2, tp=8), 8, 1, 1, "bf16", H100.link,
                      devices_per_node=8).tensor_parallel_s
    assert across > one_node, "the same group priced on the inter-node tier"
    assert across > local


def candidate(tp: int, tokens: float, dp_shard: int = 1, cp: int = 1) -> Candidate:
    dims = {"pp": 1, "dp_replicate": 1, "dp_shard": dp_shard, "tp": tp, "cp": cp}
    return Candidate("hybrid", "zero3", dims, 1, 1, "none", "bf16", "1f1b", 1, 25.0, True, 1.0, 1.0, tokens, None,
                     1.0, "", prediction=None)


def test_the_search_keeps_tp_in_a_node_unless_crossing_is_more_than_5_percent_faster():
    across, local = candidate(16, 1000.0), candidate(8, 960.0, dp_shard=2)
    assert rank([across, local], devices_per_node=8)[0] is local, "4 % slower, node-local: preferred"
    slower = candidate(8, 940.0, dp_shard=2)
    assert rank([across, slower], devices_per_node=8)[0] is across, "6 % slower: the faster one stays"
    assert rank([across, local], devices_per_node=None)[0] is across, "without nodes there is no crossing"


def test_a_kept_crossing_layout_says_why_with_the_tiers_numbers():
    from training.planner.ranking import Searched
    from training.planner.reasons import node_local_reason

    across, slower = candidate(16, 1000.0), candidate(8, 900.0, dp_shard=2)
    reason = node_local_reason(across, Searched([across, slower], 2), H100)
    assert reason.startswith("tiers: tp=16 crosses nodes (16 ranks on 2 nodes (8 per node)): 4 all-reduces per layer at "
                             "20 µs and 370 GB/s per GPU, vs 10 µs and 450 GB/s inside a node")
    assert "is predicted 10% slower" in reason
    assert node_local_reason(slower, Searched([slower], 1), H100) is None


def test_a_kept_cp_group_across_nodes_names_cp_and_its_k_v_all_gathers():
    from training.planner.ranking import Searched
    from training.planner.reasons import node_local_reason

    across, slower = candidate(1, 1000.0, cp=64), candidate(8, 800.0, dp_shard=8)
    reason = node_local_reason(across, Searched([across, slower], 2), H100)
    assert reason.startswith("tiers: cp=64 crosses nodes (64 ranks on 8 nodes (8 per node)): K/V all-gathered per "
                             "layer at "), reason
    assert "tp=1" not in reason and "is predicted 20% slower" in reason


def measurement(collective: str, nbytes: int, us: float, world: int) -> Measurement:
    return Measurement.from_time(collective, nbytes, us, world)


def probe_rows(world: int, gbps: float, alpha_us: float) -> list[Measurement]:
    factor = 2 * (world - 1) / world
    return [measurement("all_reduce", b, alpha_us + b * factor / (gbps * 1e3), world) for b in (1024, 2**16, 2**20, 2**24)]


def bandwidth(nodes: int, per_node: int, **rows: list[Measurement]) -> BandwidthResult:
    results = rows.pop("results")
    return BandwidthResult(nodes * per_node, "gloo", results, "", 1.0, None, None, None, nodes=nodes,
                           procs_per_node=per_node, **rows)


def test_the_measured_tiers_come_from_the_probes_groups():
    from stages.rulers import measured_tiers

    full, node, spread = probe_rows(8, 100, 50), probe_rows(4, 400, 10), probe_rows(2, 20, 80)
    tiers = measured_tiers(bandwidth(2, 4, results=full, node_results=node, spread_results=spread))
    assert tiers["devices_per_node"] == 4
    assert math.isclose(tiers["intra"]["all_reduce"].busbw_gbps, 400, rel_tol=0.02)
    assert math.isclose(tiers["inter"]["all_reduce"].busbw_gbps, 100, rel_tol=0.02)
    assert math.isclose(tiers["inter_single"]["all_reduce"].busbw_gbps, 20, rel_tol=0.02)
    one_per_node = measured_tiers(bandwidth(2, 1, results=probe_rows(2, 5, 100)))
    assert one_per_node["devices_per_node"] == 1 and one_per_node["intra"] == {}
    one_node = measured_tiers(bandwidth(1, 4, results=node))
    assert one_node["devices_per_node"] == 10**9 and one_node["intra"] == one_node["inter"]
