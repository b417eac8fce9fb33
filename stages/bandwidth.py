"""bandwidth: measure the interconnect the way nccl-tests does, and hold it against the ruler.

Runs on every rank of the target world. Each configured collective is timed over geometric
message sizes (training.collectives); the all_reduce bus bandwidth at the largest size is the
number the plan compares with `bandwidth.ruler_gbps`. A world of one rank has no links, so it
reports nothing rather than a made-up number.

With several nodes of several ranks, the two tiers a layout's groups ride are probed as well, so
that the plan can tell a node's link (NVLink) from the links between nodes (InfiniBand): each
node's own ranks, all nodes at once (the intra-node tier: a node-local TP group), and one rank of
every node, all local ranks at once (the inter-node tier as one rank's share of the NICs sees it:
the data-parallel group of a node-local TP layout). The whole world is the third: every rank of
every node, across nodes.

On a CPU host the ranks share the cores that both compute and communicate, so the stage also
measures what every rank working at once costs each of them (training.shared_cores): the plan's
cost model needs it there, and on GPUs it does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stages.common import log, progress
from training.collectives import Measurement, element_count, message_sizes, probe
from training.dist import backend, device, is_main, world_size
from training.plan_config import BandwidthConfig
from training.planner.hardware import measured_links
from training.shared_cores import SharedCores
from training.shared_cores import measure as measure_shared_cores

SKIPPED_WORLD_1 = "world size 1: no links to measure"
VERDICT_COLLECTIVE = "all_reduce"
"""Data parallelism's gradient collective: the one the ruler judges."""


@dataclass(frozen=True)
class BandwidthInputs:
    bandwidth: BandwidthConfig
    nodes: int = 1
    procs_per_node: int = 1

    @classmethod
    def from_config(cls, cfg: Any) -> BandwidthInputs:
        return cls(cfg.bandwidth, cfg.nodes, cfg.procs_per_node)


@dataclass(frozen=True)
class BandwidthResult:
    world_size: int
    backend: str
    """The process group's backend (`gloo`, `nccl`), or `none` without one."""
    results: list[Measurement]
    """Every collective at every size, in probe order."""
    verdict: str
    """The all_reduce busbw at the largest size against the ruler, in words."""
    ruler_gbps: float
    largest_all_reduce_busbw_gbps: float | None
    """None when all_reduce was not measured."""
    skipped_reason: str | None
    """Why nothing was measured; None when the probe ran."""
    free_device_bytes: int | None = None
    """CUDA: the least device memory free on any rank after the probe, with its CUDA context and
    communicator buffers (NCCL's) held and the allocator's cache emptied: what a stage on these
    workers can have (the plan's memory ruler takes its fraction of it). None on CPU."""
    nodes: int = 1
    procs_per_node: int = 1
    node_results: list[Measurement] = field(default_factory=list)
    """Each node's own ranks, every node at once (the slowest node's time): the intra-node tier.
    Empty with one rank per node, or on one node (`results` is then that tier)."""
    spread_results: list[Measurement] = field(default_factory=list)
    """One rank of every node, every local rank at once: the inter-node tier as one rank's share of
    the node's NICs carries it. Empty with one node or one rank per node (`results` is then that)."""
    shared_cores: SharedCores | None = None
    """CPU ranks: compute with every rank working against alone, and what a collective issued
    between compute costs beyond what the probe's fit gives it. None on GPUs and at one rank."""

    def metrics(self) -> list[tuple[str, float, int]]:
        """MLflow (key, value, step): each measurement at step = its bytes, and each collective's
        busbw at its largest size at step 0."""
        out: list[tuple[str, float, int]] = [("comm/world_size", float(self.world_size), 0)]
        for prefix, rows in (("comm", self.results), ("comm/node", self.node_results),
                             ("comm/spread", self.spread_results)):
            for m in rows:
                out += [
                    (f"{prefix}/{m.collective}/busbw_gbps", m.busbw_gbps, m.bytes),
                    (f"{prefix}/{m.collective}/algbw_gbps", m.algbw_gbps, m.bytes),
                    (f"{prefix}/{m.collective}/time_us", m.time_us, m.bytes),
                ]
        for name in dict.fromkeys(m.collective for m in self.results):
            top = largest(self.results, name)
            assert top is not None
            out.append((f"comm/{name}/busbw_gbps_largest", top.busbw_gbps, 0))
        if self.shared_cores is not None:
            out += [("comm/shared_cores/compute_factor", self.shared_cores.compute_factor, 0),
                    ("comm/shared_cores/call_ms", self.shared_cores.call_s * 1e3, 0)]
        return out

    def headline(self) -> str:
        """One short line for the closing table."""
        if self.skipped_reason is not None:
            return f"not measured: {self.skipped_reason}"
        top = largest(self.results, VERDICT_COLLECTIVE)
        if top is None:
            return f"{len(self.results)} measurements, world {self.world_size}; no all_reduce, no verdict"
        side = "below" if top.busbw_gbps < self.ruler_gbps else "at or above"
        return (f"all_reduce busbw {top.busbw_gbps:.2f} GB/s at {human_bytes(top.bytes)}, "
                f"world {self.world_size}: {side} the {self.ruler_gbps:g} GB/s ruler")


def verdict(busbw_gbps: float | None, ruler_gbps: float) -> str:
    """The ruler's judgement of the all_reduce busbw at the largest size, in words."""
    if busbw_gbps is None:
        return "not measured: no all_reduce busbw to hold against the ruler"
    if busbw_gbps >= ruler_gbps:
        return f"ok: {busbw_gbps:.2f} GB/s >= {ruler_gbps:g} GB/s ruler"
    return (f"below ruler: {busbw_gbps:.2f} GB/s < {ruler_gbps:g} GB/s: "
            "keep data parallelism within a few devices")


def largest(results: list[Measurement], collective: str) -> Measurement | None:
    """`collective`'s measurement at its largest size, or None when it was not measured."""
    rows = [m for m in results if m.collective == collective]
    return max(rows, key=lambda m: m.bytes) if rows else None


def human_bytes(n: int) -> str:
    """`67108864` -> `64 MiB`, `1536` -> `1.5 KiB`."""
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.4g} {unit}"


def run(cfg: BandwidthInputs) -> BandwidthResult:
    """Probe the collectives on every rank; every rank returns the same result."""
    bw = cfg.bandwidth
    world = world_size()
    if world == 1:
        return _result(bw, world, [], SKIPPED_WORLD_1, cfg)
    sizes = message_sizes(bw.min_bytes, bw.max_bytes, bw.factor)
    if is_main():
        log("bandwidth", f"world {world} ({backend()}), {len(sizes)} sizes "
                         f"{human_bytes(sizes[0])}..{human_bytes(sizes[-1])}, {', '.join(bw.collectives)}")
    tiers = cfg.nodes > 1 and cfg.procs_per_node > 1
    total = sum(len({element_count(size, n) for size in sizes}) * len(bw.collectives)  # as probe() dedupes
                for n in ([world, cfg.procs_per_node, cfg.nodes] if tiers else [world]))
    done = iter(range(1, total + 1))
    report = (lambda line: progress("bandwidth", f"{next(done)}/{total} measured; {line.strip()}")) if is_main() else None
    results = probe(bw.collectives, sizes, bw.warmup_iters, bw.iters, report, rounds=bw.rounds)
    node, spread = (_tiers(bw, sizes, cfg.nodes, cfg.procs_per_node, report) if tiers else ([], []))
    shared = None
    if bw.shared_cores and device().type == "cpu":
        fit = measured_links(results, world).get("all_reduce")
        if fit is not None:  # the probe measured all_reduce at two sizes at least: the plan's fit
            shared = measure_shared_cores(bw.max_bytes, bw.iters, bw.warmup_iters,
                                          lambda nbytes: fit.time("all_reduce", nbytes, world))
        if is_main() and shared is not None:
            log("bandwidth", shared.describe())
    return _result(bw, world, results, None, cfg, node, spread, shared)


def _tiers(bw: BandwidthConfig, sizes: list[int], nodes: int, per_node: int,
           report: Any) -> tuple[list[Measurement], list[Measurement]]:
    """The intra-node tier (each node's ranks) and the inter-node tier (one rank per node), each
    measured on all its groups at once. Ranks fill a node before the next (every launcher's order)."""
    import torch.distributed as dist

    by_node = [[n * per_node + i for i in range(per_node)] for n in range(nodes)]
    by_local = [[n * per_node + i for n in range(nodes)] for i in range(per_node)]
    out = []
    for enumeration in (by_node, by_local):
        group, groups = dist.new_subgroups_by_enumeration(enumeration)
        try:
            out.append(probe(bw.collectives, sizes, bw.warmup_iters, bw.iters, report, group, bw.rounds))
        finally:
            for made in groups:
                dist.destroy_process_group(made)
    return out[0], out[1]


def free_device_bytes() -> int | None:
    """The least free memory of any rank's CUDA device now (collective); None without CUDA."""
    import torch

    from training.dist import gather_objects

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = [f for f in gather_objects(torch.cuda.mem_get_info()[0]) if f is not None]
    return min(free) if free else None


def _result(bw: BandwidthConfig, world: int, results: list[Measurement], skipped: str | None,
            cfg: BandwidthInputs | None = None, node: list[Measurement] | None = None,
            spread: list[Measurement] | None = None, shared: SharedCores | None = None) -> BandwidthResult:
    top = largest(results, VERDICT_COLLECTIVE)
    busbw = top.busbw_gbps if top is not None else None
    return BandwidthResult(
        world_size=world,
        backend=backend(),
        results=results,
        verdict=f"not measured: {skipped}" if skipped else verdict(busbw, bw.ruler_gbps),
        ruler_gbps=bw.ruler_gbps,
        largest_all_reduce_busbw_gbps=busbw,
        skipped_reason=skipped,
        free_device_bytes=free_device_bytes(),
        nodes=cfg.nodes if cfg else 1,
        procs_per_node=cfg.procs_per_node if cfg else world,
        node_results=node or [],
        spread_results=spread or [],
        shared_cores=shared,
    )
