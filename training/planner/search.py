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

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from training import strategies
from training.parallel.dims import ParallelDims, expert_parallel_problem
from training.planner.calibration import Calibration
from training.planner.hardware import Hardware
from training.planner.memory import memory_per_device, state_memory
from training.planner.predict import Prediction, predict_layout
from training.planner.shape import Activations, Shape
from training.planner.workload import Workload, feasible
from training.units import GIB

TOP = 10
TIE = 0.01
NODE_LOCAL = 0.05
"""How much faster a layout whose TP group crosses nodes must be predicted to be to be recommended
over a node-local one (search.rank)."""


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
                 expert_imbalance: tuple[tuple[int, float], ...] = ()) -> Workload:
        """This setting's Workload for one point of the space (the search's and the run's own)."""
        return Workload(shape=shape, micro_batch=micro, grad_accum=accum, microbatches=microbatches,
                        precision=self.precision, checkpointing=self.activation_checkpointing,
                        tokens_per_sample=tokens_per_sample, activations=self.activations,
                        bucket_cap_bytes=bucket_mb * 1024**2, seconds_per_sample=self.seconds_per_sample, clip=clip,
                        pp_schedule=schedule, sequence_parallel=sequence_parallel, pp_virtual_stages=virtual,
                        expert_imbalance=expert_imbalance)


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
    context_parallel: bool = False
    """Search cp > 1 (the model can be split over the sequence, and its activations are what fills
    a device: search_cp)."""


@dataclass(frozen=True)
class Candidate:
    """One point of the space, predicted."""

    strategy: str
    """ddp, zero1, zero2, zero3, tp, pp, or hybrid (more than one degree, or HSDP)."""
    flavour: str
    """The data-parallel flavour (ddp, zero1, zero2, zero3)."""
    dims: dict[str, int]
    """pp, dp_replicate, dp_shard, cp, tp, ep."""
    micro_batch: int
    grad_accum: int
    activation_checkpointing: str
    precision: str
    pp_schedule: str
    microbatches: int
    bucket_cap_mb: float
    fits: bool
    memory_per_device_bytes: float
    step_time_s: float
    tokens_per_s: float
    mfu_pct: float | None
    scaling_efficiency: float
    command: str
    prediction: Prediction = field(repr=False)
    """The cost model's components (compute, exposed communication, bubble, calls)."""
    sequence_parallel: bool = False
    pp_virtual_stages: int = 1

    @property
    def degrees(self) -> ParallelDims:
        return ParallelDims(self.dims["dp_replicate"], self.dims["dp_shard"], self.dims["tp"], self.dims["pp"],
                            self.dims.get("cp", 1), self.dims.get("ep", 1))

    @property
    def non_trivial(self) -> int:
        return sum(v > 1 for v in self.dims.values())

    def overrides(self, global_batch: int | None) -> list[str]:
        """The `run.py` overrides that train exactly this candidate."""
        out = [f"strategy={self.strategy}"]
        if strategies.get(self.strategy).any_layout:
            out += [f"strategy.{k}={self.dims[k]}" for k in ("dp_replicate", "dp_shard", "tp", "pp")]
        if self.dims.get("cp", 1) > 1:
            out.append(f"strategy.cp={self.dims['cp']}")
        if self.dims.get("ep", 1) > 1:
            out.append(f"strategy.ep={self.dims['ep']}")
        if self.sequence_parallel:
            out.append("strategy.sequence_parallel=true")
            if not strategies.get(self.flavour).reshard_after_forward:
                out.append("strategy.reshard_after_forward=false")
        out += [] if global_batch is not None else [f"train.micro_batch={self.micro_batch}"]
        out += [f"train.grad_accum={self.grad_accum}", f"strategy.precision={self.precision}",
                f"strategy.activation_checkpointing={self.activation_checkpointing}"]
        if self.dims["pp"] > 1:
            out += [f"strategy.pp_schedule={self.pp_schedule}", f"strategy.microbatches={self.microbatches}"]
            out += [f"strategy.pp_virtual_stages={self.pp_virtual_stages}"] if self.pp_virtual_stages > 1 else []
        if strategies.get(self.flavour).wrapper == "ddp" and self.dims["dp_replicate"] > 1:
            out.append(f"strategy.bucket_cap_mb={self.bucket_cap_mb:g}")
        return out


@dataclass(frozen=True)
class Searched:
    ranked: list[Candidate]
    """Every candidate kept (the best per layout and setting), best first: fitting ones first."""
    evaluated: int
    """Settings the search held against the memory ruler (those that fit, and the least-memory ones
    that don't, also predicted in time)."""

    def best_per_layout(self, limit: int) -> list[Candidate]:
        """The fastest fitting setting of each layout (flavour and degrees), best first: what trials
        measure. The top of `ranked` is often one layout under settings the model barely tells
        apart (a schedule, a bucket size); the model's errors are largest between layouts (a
        pipeline's sends, a wrapper's hooks), so that is where measurement has to decide."""
        seen: set[tuple] = set()
        out = []
        for c in self.ranked:
            layout = (c.flavour, c.degrees)
            if c.fits and layout not in seen:
                seen.add(layout)
                out.append(c)
        return out[:limit]


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


def layouts(world: int, shape: Shape, context_parallel: bool = False) -> Iterator[tuple[str, ParallelDims]]:
    """Every (flavour, degrees) the model and the implementation allow on `world` devices (cp > 1
    only when `context_parallel`)."""
    for tp in divisors(world):
        if tp > 1 and (shape.block_linear_params == 0 or any(size % tp for size in shape.tp_sizes)):
            continue
        for cp in divisors(world // tp) if context_parallel else [1]:
            if cp > 1 and shape.seq_len % (2 * cp):
                continue
            for pp in divisors(world // tp // cp):
                if pp > 1 and (not shape.pipeline or pp > shape.layers):
                    continue
                for flavour, d in _data_parallel(world // tp // cp // pp, tp, cp, pp):
                    yield flavour, d
                    if not strategies.get(flavour).shards_optimizer_only:  # zero1 can't hold split experts
                        yield from ((flavour, split) for split in expert_layouts(shape, d))


def expert_layouts(shape: Shape, d: ParallelDims) -> Iterator[ParallelDims]:
    """`d` with each expert-parallel degree > 1 its MoE layers allow (expert_parallel_problem):
    dividing the data-parallel ranks and every layer's experts."""
    for ep in divisors(d.dp_size)[1:] if shape.experts else []:
        split = dataclasses.replace(d, ep=ep)
        if expert_parallel_problem(split, False, shape.experts) is None:
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


def search_cp(shape: Shape, variants: list[Variant], memory_limit: float, devices_per_node: int) -> bool:
    """Whether context parallelism is worth searching: the model can be split over the sequence and
    a sample's activations, at the least any setting saves and divided by a node's tensor
    parallelism, still take a quarter of a device (the point where sequence length, not states,
    is the memory problem, as at Llama 3's 128K context)."""
    if not shape.context_parallel or shape.seq_len < 2 or not variants:
        return False
    least = min(v.activations.saved for v in variants)
    return least / max(min(devices_per_node, max(shape.tp_sizes or (1,))), 1) > memory_limit / 4


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
    for flavour, d in layouts(space.world, shape, space.context_parallel):
        name = strategy_name(flavour, d)
        if space.strategies is not None and name not in space.strategies:
            continue
        buckets = space.bucket_caps_mb if strategies.get(flavour).wrapper == "ddp" and d.dp_replicate > 1 else (25.0,)
        for variant in space.variants:
            # Sequence parallelism hands the experts a sequence-split DTensor: not for a mixture of experts.
            for sp in ((False, True) if d.tp > 1 and not shape.experts else (False,)):
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
                                     self.space.expert_imbalance)

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


def candidate_of(p: Prediction, flavour: str, d: ParallelDims, w: Workload, variant: Variant, schedule: str,
               bucket: float, model_flops_per_sample: float, space: Space, command_prefix: str) -> Candidate:
    """The candidate prediction `p` makes of layout `d` (as `flavour`) at workload `w`: its knobs, its
    numbers, and the `run.py` command that trains it (the search's, and the advisor's `requested`)."""
    per_device = p.samples_per_s / d.world_size
    candidate = Candidate(
        strategy=p.strategy, flavour=flavour,
        dims={"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp, "ep": d.ep},
        micro_batch=w.micro_batch, grad_accum=w.grad_accum, activation_checkpointing=variant.activation_checkpointing,
        precision=variant.precision, pp_schedule=schedule, microbatches=w.microbatches, bucket_cap_mb=bucket,
        fits=p.fits, memory_per_device_bytes=p.memory_per_device_bytes, step_time_s=p.step_time_s,
        tokens_per_s=p.tokens_per_s,
        mfu_pct=100 * model_flops_per_sample * per_device / variant.peak_flops if variant.peak_flops else None,
        scaling_efficiency=p.scaling_efficiency, command="", prediction=p, sequence_parallel=w.sequence_parallel,
        pp_virtual_stages=w.pp_virtual_stages,
    )
    command = " ".join(filter(None, ["python run.py", command_prefix, *candidate.overrides(space.global_batch)]))
    return _with(candidate, command=command)


def _with(candidate: Candidate, **changes: object) -> Candidate:
    return dataclasses.replace(candidate, **changes)


def _simplicity(c: Candidate) -> tuple:
    return (c.non_trivial, strategies.get(c.flavour).simplicity, c.activation_checkpointing != "none", -c.micro_batch,
            c.dims["tp"], c.dims["pp"], c.dims.get("cp", 1), c.dims.get("ep", 1), c.sequence_parallel, c.pp_virtual_stages,
            c.pp_schedule != "1f1b", -c.bucket_cap_mb)


def crosses_nodes(c: Candidate, devices_per_node: int | None) -> bool:
    """Whether the candidate's tensor-, context- or expert-parallel group spans nodes (they are the
    innermost dimensions, cp around tp, an expert group's ranks next to each other around those:
    their ranks are neighbours, so they cross exactly when tp x cp x ep is larger than a node).
    All three exchange activations every layer on the critical path."""
    inner = c.dims["tp"] * c.dims.get("cp", 1) * c.dims.get("ep", 1)
    return devices_per_node is not None and inner > devices_per_node


def rank(candidates: list[Candidate], devices_per_node: int | None = None) -> list[Candidate]:
    """Fitting candidates first, by predicted tokens/s; within 1 % of a faster one, the simpler
    layout first, and a node-local layout before one whose TP group crosses nodes when it is within
    NODE_LOCAL of it (practice keeps TP inside the NVLink domain: Megatron-Core, torchtitan and
    Llama 3 run TP <= 8; the model's α–β tiers may miss what crossing costs). Then the ones that
    don't fit, by the memory they need."""
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: -c.tokens_per_s)
    simplicity = {id(c): _simplicity(c) for c in fitting}
    ordered: list[Candidate] = []
    while fitting:
        # The candidates within TIE of the fastest left are a prefix of the sorted list.
        floor, end = (1 - TIE) * fitting[0].tokens_per_s, 1
        while end < len(fitting) and fitting[end].tokens_per_s >= floor:
            end += 1
        ordered.append(fitting.pop(min(range(end), key=lambda i: simplicity[id(fitting[i])])))
    if ordered and crosses_nodes(ordered[0], devices_per_node):
        local = next((c for c in ordered if not crosses_nodes(c, devices_per_node)
                      and c.tokens_per_s >= (1 - NODE_LOCAL) * ordered[0].tokens_per_s), None)
        if local is not None:
            ordered.remove(local)
            ordered.insert(0, local)
    rest = sorted((c for c in candidates if not c.fits), key=lambda c: c.memory_per_device_bytes)
    return ordered + rest


def closest_miss(ranked: list[Candidate], memory_limit: float) -> str:
    """When nothing fits: what comes closest, by how much, and what would make it fit."""
    if not ranked:
        return "no layout of this world suits the model (check its blocks, plan and the degrees' divisors)"
    c = min(ranked, key=lambda x: x.memory_per_device_bytes)
    over = c.memory_per_device_bytes / memory_limit
    return (f"nothing fits: the closest, {c.strategy} {dims_label(c.dims)} at micro-batch {c.micro_batch} in {c.precision} "
            f"with {c.activation_checkpointing} checkpointing, needs {c.memory_per_device_bytes / GIB:.1f} GiB per "
            f"device, {over:.1f}x the {memory_limit / GIB:.1f} GiB allowed: give it ~{math.ceil(over)}x the devices, "
            "a shorter sequence (data.seq_len) or a larger plan.memory_fraction; offloading to the host is not "
            "something this project does")


def dims_label(dims: dict[str, int]) -> str:
    """The non-trivial degrees, outermost first: `pp2xtp2`, or `1 device`."""
    return "x".join(f"{k}{dims[k]}" for k in ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
                    if dims.get(k, 1) > 1) or "1 device"


def setting_label(dims: dict[str, int], micro_batch: int, grad_accum: int, precision: str, checkpointing: str) -> str:
    """A trained or requested point of the space in one phrase (a study's `layout` column)."""
    return f"{dims_label(dims)}, mb {micro_batch} x {grad_accum}, {precision}, ac {checkpointing}"


def describe(c: Candidate) -> str:
    """One line of the table of candidates."""
    name = c.strategy if not strategies.get(c.strategy).any_layout or c.dims["dp_shard"] == 1 else f"{c.strategy}/{c.flavour}"
    layout = dims_label(c.dims) + (f" {c.pp_schedule}/{c.microbatches}" if c.dims["pp"] > 1 else "")
    return (f"{name:<12} {layout:<22} mb {c.micro_batch:<3} acc {c.grad_accum:<3} {c.precision:<4} "
            f"ac {c.activation_checkpointing:<4} {c.memory_per_device_bytes / GIB:>8.2f} GiB "
            f"{c.step_time_s:>9.4f} s {c.tokens_per_s:>12.0f} tok/s "
            + (f"{c.mfu_pct:>5.1f} % " if c.mfu_pct is not None else "")
            + ("fits" if c.fits else "does not fit"))
