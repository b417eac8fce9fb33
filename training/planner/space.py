"""The space the advisor searches: what one precision and checkpointing setting costs per sample
(Variant), what the search may choose from (Space), the layouts of a world the model allows, the
batch splits that keep the batch and the pipeline settings of a layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from training import strategies
from training.parallel.dims import ParallelDims, expert_parallel_problem
from training.planner.shape import Activations, Shape
from training.planner.workload import Workload


@dataclass(frozen=True)
class Variant:
    """What one precision and activation-checkpointing setting costs per sample on one device."""

    precision: str
    activation_checkpointing: str
    seconds_per_sample: float
    activations: Activations
    peak_flops: float | None = None
    """The device's peak FLOP/s in this precision (MFU divides by it); None: unknown (CPUs)."""

    def workload(self, shape: Shape, micro: int, accum: int, microbatches: int, schedule: str, bucket_mb: float,
                 clip: bool, tokens_per_sample: int, sequence_parallel: bool = False, virtual: int = 1,
                 expert_imbalance: tuple[tuple[int, float], ...] = (),
                 expert_held_imbalance: tuple[tuple[int, float], ...] = ()) -> Workload:
        """This setting's Workload for one point of the space (the search's and the run's own)."""
        return Workload(shape=shape, micro_batch=micro, grad_accum=accum, microbatches=microbatches,
                        precision=self.precision, checkpointing=self.activation_checkpointing,
                        tokens_per_sample=tokens_per_sample, activations=self.activations,
                        bucket_cap_bytes=bucket_mb * 1024**2, seconds_per_sample=self.seconds_per_sample, clip=clip,
                        pp_schedule=schedule, sequence_parallel=sequence_parallel, pp_virtual_stages=virtual,
                        expert_imbalance=expert_imbalance, expert_held_imbalance=expert_held_imbalance)


@dataclass(frozen=True)
class Space:
    """What the search may choose from."""

    world: int
    devices_per_node: int
    global_batch: int | None
    """train.global_batch: fixed samples per step; None keeps each replica's batch instead."""
    replica_batch: int
    """Without a fixed global batch: samples per data-parallel replica per step (micro x accum)."""
    variants: list[Variant]
    pp_schedules: tuple[tuple[str, int], ...] = (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2),
                                                 ("zbv", 2), ("dualpipev", 2))
    """(schedule, stages per rank) a pipeline may use. GPipe is left out: 1F1B has its bubble and
    holds fewer microbatches (a run may still ask for it)."""
    bucket_caps_mb: tuple[float, ...] = (1.0, 4.0, 25.0, 100.0)
    strategies: tuple[str, ...] | None = None
    """Only candidates reported as one of these (plan.strategies); None: all."""
    clip: bool = True
    expert_imbalance: tuple[tuple[int, float], ...] = ()
    """Routing imbalance measured per expert-parallel degree (Workload.expert_imbalance)."""
    expert_held_imbalance: tuple[tuple[int, float], ...] = ()
    """What the busiest rank holds, for memory (Workload.expert_held_imbalance)."""
    max_cp: int = 1
    """The largest group of context- and tensor-parallel ranks (cp x tp) searched with cp > 1
    (search_cp): 1, no context parallelism."""


def strategy_name(flavour: str, d: ParallelDims) -> str:
    """What a layout is called: the pure strategy whose preset it is (a data-parallel one by its
    flavour, a layout one with plain replicas), else the strategy of any degrees (hybrid)."""
    for s in strategies.REGISTRY.values():
        if s.pure and ParallelDims(**s.degrees_on(d.world_size)) == d and (
                s.name == flavour if s.is_flavour else flavour == strategies.flavours()[0].name):
            return s.name
    return strategies.any_layout().name


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(world: int, shape: Shape, max_cp: int = 1) -> Iterator[tuple[str, ParallelDims]]:
    """Every (flavour, degrees) the model and the implementation allow on `world` devices, cp > 1
    where cp x tp is at most `max_cp`."""
    for tp in divisors(world):
        if tp > 1 and (shape.block_linear_params == 0 or any(size % tp for size in shape.tp_sizes)):
            continue
        for cp in divisors(world // tp):
            if cp > 1 and (cp * tp > max_cp or shape.seq_len % (2 * cp)):
                continue
            for pp in divisors(world // tp // cp):
                if pp > 1 and (not shape.pipeline or pp > shape.layers):
                    continue
                for flavour, d in _data_parallel(world // tp // cp // pp, tp, cp, pp):
                    yield flavour, d
                    yield from ((flavour, split) for split in expert_layouts(shape, d))


def expert_layouts(shape: Shape, d: ParallelDims) -> Iterator[ParallelDims]:
    """`d` with each expert-parallel degree > 1 its MoE layers allow (expert_parallel_problem):
    dividing the data-, context- and tensor-parallel ranks and every layer's experts."""
    for ep in divisors(d.dp_size * d.cp * d.tp)[1:] if shape.experts else []:
        split = dataclasses.replace(d, ep=ep)
        if expert_parallel_problem(split, shape.experts) is None:
            yield split


def _data_parallel(dp: int, tp: int, cp: int, pp: int) -> Iterator[tuple[str, ParallelDims]]:
    """The data-parallel flavours of `dp` ranks around the other degrees."""
    for shard in divisors(dp):
        d = ParallelDims(dp_replicate=dp // shard, dp_shard=shard, tp=tp, pp=pp, cp=cp)
        if shard > 1 or cp > 1:  # FSDP shards over dp_shard x cp
            yield from ((f.name, d) for f in strategies.flavours() if f.wrapper == "fsdp")
        elif d.dp_replicate > 1 and tp == 1 and pp == 1:
            yield from ((f.name, d) for f in strategies.flavours() if f.wrapper == "ddp")
        else:
            # One replica; replicas of a tensor-parallel model (DDP can't replicate
            # DTensors: they go through FSDP's replicate mesh, which holds what DDP does);
            # or replicas of pipeline stages, which strategy=hybrid wraps in plain DDP (a
            # sharded optimizer there is not something it can be told to build).
            yield strategies.flavours()[0].name, d


def search_cp(shape: Shape, variants: list[Variant], memory_limit: float, devices_per_node: int,
              world: int = 1, global_batch: int | None = None) -> int:
    """The largest group of context- and tensor-parallel ranks (cp x tp) to search context
    parallelism in (1: none), where the model can be split over the sequence:
    - any, where a sample's activations, at the least any setting saves and divided by a node's
      tensor parallelism, still take a quarter of a device: the point where sequence length, not
      states, is the memory problem (Llama 3's 128K context, CP 16 across nodes);
    - a node, where the global batch has fewer samples than there are devices: data parallelism
      alone cannot occupy them, some degree must split a sample (TP, PP or CP), and CP is then
      searched beside TP inside a node, where each is kept (torchtitan's long-context runs: one
      sample per FSDP x CP group on 8 GPUs; under GQA, CP's K/V gather moves less than TP's
      activations)."""
    if not shape.context_parallel or shape.seq_len < 2 or not variants:
        return 1
    least = min(v.activations.saved for v in variants)
    if least / max(min(devices_per_node, max(shape.tp_sizes or (1,))), 1) > memory_limit / 4:
        return world
    return devices_per_node if global_batch is not None and global_batch < world else 1


def batch_splits(space: Space, dp: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs that keep the batch, largest micro-batch first."""
    if space.global_batch is not None:
        if space.global_batch % dp:
            return []
        per_replica = space.global_batch // dp
    else:
        per_replica = space.replica_batch
    micros = [m for m in divisors(per_replica) if m & (m - 1) == 0 or m == per_replica]
    return [(m, per_replica // m) for m in sorted(set(micros), reverse=True)]


def pipeline_settings(space: Space, d: ParallelDims, micro: int) -> list[tuple[str, int, int]]:
    """(schedule, stages per rank, microbatches) for a pipeline: m in {p, 2p, 4p} dividing the
    micro-batch (the schedule's own rules are the cost model's `feasible`)."""
    if d.pp == 1:
        return [("1f1b", 1, 1)]
    counts = [m for m in (d.pp, 2 * d.pp, 4 * d.pp) if micro % m == 0] or ([micro] if micro >= 1 else [])
    return [(schedule, v, m) for schedule, v in space.pp_schedules for m in counts]
