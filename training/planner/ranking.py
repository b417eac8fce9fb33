"""A candidate: one point of the space as predicted (its layout, knobs, throughput, memory and the
command that trains it); how candidates rank (within TIE of the best the simpler wins; a tensor- or
context-parallel group that crosses nodes must be NODE_LOCAL faster), and how they are described.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from training import strategies
from training.parallel.dims import ParallelDims
from training.planner.predict import Prediction
from training.planner.space import Space, Variant
from training.planner.workload import Workload
from training.units import GIB

TIE = 0.01
NODE_LOCAL = 0.05
"""How much faster a layout whose TP group crosses nodes must be predicted to be to be recommended
over a node-local one (search.rank)."""


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
