"""What the predictions run on: measured links, compute and memory (this machine) or a described
cluster preset; on CPU hosts, how the ranks share the cores.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from training.parallel.dims import ParallelDims
from training.planner.comm import Group, Link, fit_link

if TYPE_CHECKING:
    from training.collectives import Measurement
from training.shared_cores import SharedCores, time_share

EXPERT_DISPATCH = "ep"
"""Hardware.overhead_s's key for what expert parallelism's dispatch adds to a micro-batch step on
one rank, beside its all-to-alls: grouping and regrouping the routed slots by expert, the counts
read back to the host, the buffers copied (training/overhead.py measures it)."""


@dataclass(frozen=True)
class PassCost:
    """How a measured step's compute splits by what it scales with. Each forward and backward pass
    costs a part whatever its size (the dispatch, allocator and autograd work of every op; a kernel
    launch each on a GPU), besides its part per sample; each optimizer step (clip, update, zero) a
    part of its own, once per step whatever the micro-batches. A layout that cuts a micro-batch
    into pipeline microbatches, or accumulates several, pays the first per pass and the last once,
    where a per-sample time alone would scale both with the samples. Measured by stages/rulers.py
    (the step at the run's micro-batch, with a second pass, and at half the micro-batch) and kept
    as shares of the step at `micro`, so that whatever rescales the per-sample time (another
    precision or checkpointing, a calibration's basis) rescales all three parts alike."""

    micro: int
    """The micro-batch the step was measured at."""
    pass_share: float
    """Each forward and backward pass's fixed part, as a share of that step."""
    step_share: float
    """The optimizer step's part (clip, update, zero), as a share of that step."""

    def parts(self, per_sample: float) -> tuple[float, float, float]:
        """(seconds per sample, per pass, per optimizer step) of a step whose per-sample time at
        `micro` is `per_sample`."""
        step = per_sample * self.micro
        fixed_pass, fixed_step = self.pass_share * step, self.step_share * step
        return (step - fixed_pass - fixed_step) / self.micro, fixed_pass, fixed_step


@dataclass(frozen=True)
class Hardware:
    """What the predictions run on: measured (this machine) or described by a cluster preset."""

    device_memory_bytes: float
    devices_per_node: int
    intra: dict[str, Link]
    """α–β per collective inside a node."""
    inter: dict[str, Link]
    """α–β per collective across nodes, every rank of each node in the collective (nccl-tests
    across full nodes: the node's NICs together)."""
    seconds_per_sample: float
    """Forward + backward + step compute of one sample on one device."""
    cores: int | None = None
    """CPU hosts: the cores the ranks share; None for GPUs (every rank has its own device)."""
    threads_per_device: int = 1
    """CPU hosts: threads one rank computes with (the measured "device")."""
    shared: SharedCores | None = None
    """CPU hosts where the bandwidth stage measured it: compute with every rank working, and the
    cost of a collective issued between compute. None: the cores' time-sharing alone, no call cost."""
    overhead_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per strategy: what its wrapper adds to one micro-batch step, measured on one rank
    (training/overhead.py); a strategy not in it (a what-if cluster, pp) is taken to add nothing.
    Under EXPERT_DISPATCH, what expert parallelism's dispatch adds (a mixture of experts)."""
    inter_single: dict[str, Link] = dataclasses.field(default_factory=dict)
    """α–β per collective across nodes with one rank per node (the data-parallel group of a
    node-local TP layout): what one rank's share of the node's NICs carries. Measured by the
    bandwidth stage where there are several ranks per node; else (a preset) the node's figure over
    its devices: one NIC per GPU, as DGX-class nodes are built."""
    passes: PassCost | None = None
    """A measured step's compute by pass and optimizer step (stages/rulers.py); None (a described
    cluster: FLOPs at a peak times an MFU): all of it per sample."""
    _links: dict[tuple[str, Group], Link] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                              compare=False)
    """link()'s answers, kept: a search asks for the same few millions of times (a copy made by
    dataclasses.replace starts empty)."""

    def contention(self, world: int) -> float:
        """How much slower one rank's CPU work runs when `world` ranks run: 1 on GPUs; on a CPU
        host, once the ranks' threads outnumber its cores they time-share them."""
        if self.cores is None:
            return 1.0
        if self.shared is not None:
            return self.shared.contention(world)
        return time_share(world, self.threads_per_device, self.cores)

    def call_cost(self, world: int, gap_s: float) -> float:
        """What a collective issued after `gap_s` of compute adds at `world` ranks (0 on GPUs and
        where nothing measured it)."""
        return self.shared.call_cost(world, gap_s) if self.shared is not None and self.cores is not None else 0.0

    def compute_s(self, per_sample: float, samples: int, passes: int, d: ParallelDims) -> float:
        """One rank's compute in a step of `samples` per replica in `passes` forward and backward
        passes, at `per_sample` on one device, alone: the samples' part split over the ranks that
        share each sample's work (tp, pp, cp); each pass's fixed part over the pipeline's stages
        (a stage runs its share of the blocks' ops; TP and CP ranks run every op, on less); the
        optimizer step's over the ranks that hold the parameters apart (pp, tp: as the step's
        per-sample share did before the split was measured; ZeRO's sharded update is in its
        measured strategy overhead)."""
        if self.passes is None:
            return per_sample * samples / (d.tp * d.pp * d.cp)
        sample, fixed_pass, fixed_step = self.passes.parts(per_sample)
        return sample * samples / (d.tp * d.pp * d.cp) + passes * fixed_pass / d.pp + fixed_step / (d.pp * d.tp)

    def strategy_overhead(self, strategy: str, world: int) -> float:
        """The strategy's per-micro-batch overhead on one rank of `world` (none unwrapped, at 1)."""
        return self.overhead_s.get(strategy, 0.0) * self.contention(world) if world > 1 else 0.0

    def link(self, collective: str, group: Group) -> Link:
        """The α–β model of `collective` over `group`, on the tier it crosses. Inside a node: the
        intra-node fit. Across nodes, as NCCL's hierarchical algorithms run it: the bandwidth of the
        NICs the group's ranks of a node bring (each rank its share: inter_single per rank, at most
        the full node's figure), the latency of the hops across nodes. With nothing measured (a
        world of one) only single-rank calls, which cost nothing, can be asked for."""
        key = (collective, group)
        if key not in self._links:
            self._links[key] = self._link(collective, group)
        return self._links[key]

    def _link(self, collective: str, group: Group) -> Link:
        if group.nodes <= 1:
            found = _pick(self.intra, collective) or _pick(self.inter, collective)
        else:
            full = _pick(self.inter, collective) or _pick(self.intra, collective)
            found = None if full is None else self._across(collective, full, group)
        if found is None:
            assert group.ranks <= 1, "no bandwidth measured: nothing to predict beyond one device"
            return Link(alpha_s=0.0, busbw_gbps=float("inf"), world=1)
        return found

    def _across(self, collective: str, full: Link, group: Group) -> Link:
        """A group spanning nodes: `per_node` ranks' NIC shares, at most the full node's busbw;
        the latency of the full-node fit (several ranks per node: a hierarchical ring), or of one
        rank per node, at this group's size."""
        single = _pick(self.inter_single, collective) or Link(
            full.alpha_s, full.busbw_gbps / max(self.devices_per_node, 1), full.world)
        busbw = min(full.busbw_gbps, single.busbw_gbps * group.per_node)
        alpha = (full if group.per_node > 1 else single).alpha_at(group.ranks)
        return Link(alpha_s=alpha, busbw_gbps=busbw, world=group.ranks)


def _pick(links: dict[str, Link], collective: str) -> Link | None:
    """The fit for `collective`, else all_reduce's (the one every probe and preset has)."""
    return links.get(collective) or links.get("all_reduce")


def measured_links(results: list[Measurement], world: int) -> dict[str, Link]:
    """An α–β fit per collective the probe measured (at `world` ranks: the size of its groups)."""
    links = {}
    for name in sorted({m.collective for m in results}):
        points = [(m.bytes, m.time_us * 1e-6) for m in results if m.collective == name]
        if len(points) >= 2:
            links[name] = fit_link(points, name, world)
    return links


def preset_links(gbps: float, latency_us: float, world: int) -> dict[str, Link]:
    """A preset's published small-message latency is nccl-tests' at a full node (intra) or two
    nodes (inter): the `world` the ring latency is scaled from."""
    return {"all_reduce": Link(alpha_s=latency_us * 1e-6, busbw_gbps=gbps, world=world)}
