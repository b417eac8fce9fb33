"""The advisor's search: every parallel layout of the world and the knobs that make it fit, ranked
by the cost model's predicted throughput.

A candidate is a factorisation pp x dp_replicate x dp_shard x tp of the world that the model allows
(tp divides its widths and heads, pp has a block per stage and a declared layout), the data-parallel
flavour (ddp or zero1 when replicating; zero2 or zero3 when sharding), a micro-batch and the
accumulation that keeps the batch (train.global_batch when set, else each replica's micro_batch x
grad_accum), activation checkpointing, precision, the pipeline schedule and microbatches, and DDP's
bucket size. Pure strategies are points of this space.

It is not enumerated blindly: within a layout and setting, a larger micro-batch never predicts
slower (fewer accumulation steps: fewer FSDP gathers, fewer tensor-parallel calls, deeper
pipelines), so the micro-batches are tried from the largest down and the search stops at the first
that fits. The objective is the highest predicted tokens/s among candidates that fit in
plan.memory_fraction of a device; within 1 % of the best, the simpler layout wins (fewer non-trivial
degrees, then the plainer data parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

from training import strategies
from training.parallel.dims import ParallelDims
from training.planner.calibration import Calibration
from training.planner.hardware import Hardware
from training.planner.memory import memory_per_device, state_memory
from training.planner.predict import predict_layout
from training.planner.ranking import Candidate, Searched, candidate_of, rank
from training.planner.shape import Shape
from training.planner.space import Space, Variant, batch_splits, layouts, pipeline_settings, strategy_name
from training.planner.workload import Workload, feasible

TOP = 10


def search(space: Space, shape: Shape, hw: Hardware, tokens_per_sample: int, model_flops_per_sample: float,
           memory_limit: float, overlap: float,
           calibration: Calibration | None = None, command_prefix: str = "") -> Searched:
    """Every candidate's prediction; the best fitting setting of each layout, ranked. A candidate's
    scaling efficiency is against one device running the same setting.

    The memory ruler prunes before the time is predicted (most settings of a large world don't fit:
    99 % of a DeepSeek-V3-sized search's). Every setting that fits, at the largest micro-batch of
    its layout and setting that does, is predicted, so the ranking of those is what exhaustive
    search gives. Of a layout and setting of which nothing fits, one candidate is kept: the least
    memory of each schedule's smallest feasible micro-batch (what the reasons and `closest_miss`
    quote); one whose parameters, gradients and optimizer state alone exceed the limit (a floor
    under every micro-batch, schedule and checkpointing) is walked from there alone.
    tests/unit/test_search.py holds this against an exhaustive walk."""
    kept: list[Candidate] = []
    evaluated = 0
    for flavour, d in layouts(space.world, shape, space.max_cp):
        name = strategy_name(flavour, d)
        if space.strategies is not None and name not in space.strategies:
            continue
        buckets = space.bucket_caps_mb if strategies.get(flavour).wrapper == "ddp" and d.dp_replicate > 1 else (25.0,)
        for variant in space.variants:
            for sp in ((False, True) if d.tp > 1 else (False,)):
                setting = _Setting(space, shape, hw, flavour, d, name, variant, sp, buckets, tokens_per_sample,
                                   model_flops_per_sample, memory_limit, overlap, calibration, command_prefix)
                found, held = _walk(setting)
                kept += found
                evaluated += held
    return Searched(rank(kept, space.devices_per_node), evaluated)


Point = tuple[int, int, str, int, int]
"""(micro-batch, accumulation, schedule, stages per rank, microbatches): one point of a setting."""


@dataclass(frozen=True)
class _Setting:
    """One layout under one precision, checkpointing and sequence-parallel choice: what the search
    walks over micro-batches and schedules."""

    space: Space
    shape: Shape
    hw: Hardware
    flavour: str
    d: ParallelDims
    name: str
    variant: Variant
    sequence_parallel: bool
    buckets: tuple[float, ...]
    tokens_per_sample: int
    model_flops_per_sample: float
    memory_limit: float
    overlap: float
    calibration: Calibration | None
    command_prefix: str

    def workload(self, point: Point, bucket: float) -> Workload:
        micro, accum, schedule, virtual, m = point
        return self.variant.workload(self.shape, micro, accum, m, schedule, bucket, self.space.clip,
                                     self.tokens_per_sample, self.sequence_parallel, virtual,
                                     self.space.expert_imbalance, self.space.expert_held_imbalance)

    def memory(self, point: Point) -> float:
        return memory_per_device(self.workload(point, self.buckets[0]), self.flavour, self.d)

    def predicted(self, point: Point) -> Candidate | None:
        """The point's prediction under its best bucket (DDP's buckets are a knob of one layout, not
        layouts of their own)."""
        best: Candidate | None = None
        for bucket in self.buckets:
            w = self.workload(point, bucket)
            p = predict_layout(w, self.hw, self.flavour, self.d, self.memory_limit, self.overlap,
                               1.0 / self.variant.seconds_per_sample, self.calibration, self.name)
            if p is None:
                continue
            c = candidate_of(p, self.flavour, self.d, w, self.variant, point[2], bucket, self.model_flops_per_sample,
                           self.space, self.command_prefix)
            if best is None or (c.fits, c.tokens_per_s) > (best.fits, best.tokens_per_s):
                best = c
        return best


def _walk(s: _Setting) -> tuple[list[Candidate], int]:
    """The candidates kept of one setting (search's rules) and how many points were held against
    the memory ruler."""
    hopeless = state_memory(s.shape, s.flavour, s.d, s.variant.precision).states > s.memory_limit
    # Per schedule and microbatch count, its smallest feasible micro-batch that doesn't fit (its
    # least memory: fewer samples in flight).
    least: dict[tuple[str, int, int], Point] = {}
    kept: list[Candidate] = []
    held = 0
    splits = batch_splits(s.space, s.d.dp_size)
    for micro, accum in reversed(splits) if hopeless else splits:
        for schedule, virtual, m in pipeline_settings(s.space, s.d, micro):
            point = (micro, accum, schedule, virtual, m)
            if hopeless and (schedule, virtual, m) in least:
                continue  # walking up from the smallest: the least memory is already found
            w = s.workload(point, s.buckets[0])
            if not feasible(s.shape, s.d, w):
                continue
            held += 1
            if hopeless or memory_per_device(w, s.flavour, s.d) > s.memory_limit:
                least[schedule, virtual, m] = point
                continue
            c = s.predicted(point)
            kept += [c] if c is not None else []
        if any(c.fits for c in kept):
            return kept, held  # a smaller micro-batch of this layout and setting can only be slower
    lowest = s.predicted(min(least.values(), key=s.memory)) if least else None  # what the reasons quote
    return kept + ([lowest] if lowest is not None else []), held


