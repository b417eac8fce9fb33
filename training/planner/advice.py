"""The plan's advice: the search over layouts and knobs set up from the run's own measurements (or a
described cluster), the run's own layout predicted the same way, and the reasons in the seeds'
terms: which ruler (memory, bandwidth, compute) decided against each strategy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from training import strategies
from training.config import ClusterConfig, DataConfig, ModelConfig, PlanConfig, StrategyConfig, TrainConfig
from training.parallel.dims import resolve_dims
from training.planner.calibration import Calibration
from training.planner.comm import Group, all_to_all_bytes, group_of
from training.planner.hardware import Hardware
from training.planner.memory import state_memory
from training.planner.predict import predict_layout
from training.planner.search import (
    NODE_LOCAL,
    Candidate,
    Searched,
    Space,
    Variant,
    closest_miss,
    crosses_nodes,
    search,
    search_cp,
    strategy_name,
)
from training.planner.shape import Anatomy, Shape
from training.strategies import flavour_of
from training.units import GIB

if TYPE_CHECKING:
    from training.planner.anatomy import VariantCost

def pure() -> list[str]:
    """The strategies drawn as scaling curves and explained one by one (training/strategies/)."""
    return [s.name for s in strategies.REGISTRY.values() if s.pure]


@dataclass(frozen=True)
class AdviceInputs:
    """What the advice reads of the plan's inputs."""

    plan: PlanConfig
    cluster: ClusterConfig
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    strategy: StrategyConfig
    nodes: int
    procs_per_node: int
    seed: int


def searched_variants(cfg: AdviceInputs, blocks: int) -> list[tuple[str, str]]:
    """(precision, checkpointing) pairs the search may choose, the run's own among them. On a
    described GPU cluster bf16 dominates fp32 (faster and smaller), so fp32 is searched only when
    asked for; a measured cluster is planned in the precision it was measured in."""
    own = (cfg.strategy.precision, cfg.strategy.activation_checkpointing)
    if cfg.plan.precisions is not None:
        precisions = list(cfg.plan.precisions)
    elif cfg.cluster.measured:
        precisions = [cfg.strategy.precision]
    else:
        precisions = ["bf16"]
    if not cfg.cluster.measured and cfg.cluster.fp32_peak_flops is None:
        precisions = [p for p in precisions if p != "fp32"]
    checkpointing = ["none", "selective", "full"] if blocks else ["none"]
    pairs = [(p, c) for p in precisions for c in checkpointing]
    return list(dict.fromkeys([own, *pairs]))


def precision_peak(cfg: AdviceInputs, precision: str) -> float | None:
    """The peak FLOP/s of one device in `precision`: train.peak_flops, else a described cluster's
    datasheet figure (a measured CPU has none). fp8's is the bf16 peak: MFU of a Float8 run is
    reported against it (torchtitan's convention), its linears' fp8 speed-up counted as MFU."""
    if cfg.train.peak_flops is not None:
        return cfg.train.peak_flops
    if cfg.cluster.measured:
        return None
    c = cfg.cluster
    return c.fp32_peak_flops if precision == "fp32" and c.fp32_peak_flops else c.peak_flops


def variant(cfg: AdviceInputs, cost: VariantCost, own: VariantCost, hw: Hardware) -> Variant:
    """A setting's compute per sample: on a measured cluster the measured step scaled by the FLOPs
    it executes (checkpointing's recomputation); on a described one its FLOPs at the cluster's peak
    for that precision times its achievable MFU, fp8's linears at the fp8 peak and the rest of its
    step (attention, norms, pointwise) at the bf16 one."""
    peak = precision_peak(cfg, cost.precision)
    if cfg.cluster.measured:
        seconds = hw.seconds_per_sample * cost.executed_flops_per_sample / own.executed_flops_per_sample
    else:
        float8 = cost.float8_flops_per_sample
        rest = cost.executed_flops_per_sample - float8
        seconds = (rest / peak + (float8 / cfg.cluster.fp8_peak_flops if float8 else 0.0)) / cfg.cluster.achievable_mfu
    return Variant(cost.precision, cost.activation_checkpointing, seconds, cost.activations, peak)


def command_prefix(cfg: AdviceInputs) -> str:
    """What every candidate's command shares: the world and the workload as this run named them."""
    return (f"model={cfg.model.name} data={cfg.data.name} cluster={cfg.cluster.name} nodes={cfg.nodes} "
            f"procs_per_node={cfg.procs_per_node}")


def advise(cfg: AdviceInputs, anatomy: Anatomy, costs: list[VariantCost], hw: Hardware, memory_limit: float,
           overlap: float, calibration: Calibration | None,
           expert_imbalance: tuple[tuple[int, float], ...] = ()) -> tuple[Searched, Candidate, list[Variant]]:
    """The search, and the run's own layout and knobs predicted the same way (`expert_imbalance`:
    the routing imbalance earlier runs measured, Workload's field)."""
    world = cfg.nodes * cfg.procs_per_node
    own_cost = next(c for c in costs if (c.precision, c.activation_checkpointing) ==
                    (cfg.strategy.precision, cfg.strategy.activation_checkpointing))
    variants = [variant(cfg, c, own_cost, hw) for c in costs]
    space = Space(
        world=world, devices_per_node=min(hw.devices_per_node, world),
        global_batch=cfg.train.global_batch, replica_batch=cfg.train.micro_batch * cfg.train.grad_accum,
        variants=variants, strategies=tuple(cfg.plan.strategies) if cfg.plan.strategies else None,
        clip=cfg.train.grad_clip is not None, expert_imbalance=expert_imbalance,
        context_parallel=search_cp(anatomy.shape, variants, memory_limit, min(hw.devices_per_node, world)),
    )
    searched = search(space, anatomy.shape, hw, anatomy.tokens_per_sample, anatomy.flops_per_sample,
                      memory_limit, overlap, calibration, command_prefix(cfg))
    requested = None
    if not cfg.strategy.from_plan:
        micro = cfg.train.micro_batch_for(resolve_dims(cfg.strategy, world).dp_size)
        requested = own_candidate(cfg, anatomy, variants, hw, memory_limit, overlap, calibration, micro, space)
    return searched, requested, variants


def own_candidate(cfg: AdviceInputs, anatomy: Anatomy, variants: list[Variant], hw: Hardware, memory_limit: float,
                  overlap: float, calibration: Calibration | None, micro: int, space: Space) -> Candidate | None:
    """The layout and knobs this invocation asked for, predicted as a candidate."""
    from training.planner.search import candidate_of

    world = cfg.nodes * cfg.procs_per_node
    d = resolve_dims(cfg.strategy, world)
    flavour = flavour_of(cfg.strategy, d)
    own = next(v for v in variants if (v.precision, v.activation_checkpointing) ==
               (cfg.strategy.precision, cfg.strategy.activation_checkpointing))
    w = own.workload(anatomy.shape, micro, cfg.train.grad_accum, cfg.strategy.microbatches, cfg.strategy.pp_schedule,
                     cfg.strategy.bucket_cap_mb, cfg.train.grad_clip is not None, anatomy.tokens_per_sample,
                     cfg.strategy.sequence_parallel and d.tp > 1, cfg.strategy.pp_virtual_stages,
                     space.expert_imbalance)
    name = cfg.strategy.name if cfg.strategy.name in pure() else strategy_name(flavour, d)
    p = predict_layout(w, hw, flavour, d, memory_limit, overlap, 1.0 / own.seconds_per_sample, calibration, name)
    if p is None:
        return None
    return candidate_of(p, flavour, d, w, own, cfg.strategy.pp_schedule, cfg.strategy.bucket_cap_mb,
                      anatomy.flops_per_sample, dataclasses.replace(space, global_batch=cfg.train.global_batch),
                      command_prefix(cfg))


def rejection_reasons(searched: Searched, best: Candidate | None, memory_limit: float, hw: Hardware,
                      cfg: AdviceInputs, anatomy: Anatomy) -> list[str]:
    """For each pure strategy, the ruler that decided against it (or that it is the choice)."""
    reasons = []
    pct = f"{cfg.plan.memory_fraction:.0%} of {hw.device_memory_bytes / GIB:.1f} GiB"
    for name in pure():
        own = [c for c in searched.ranked if c.strategy == name]
        if not own:
            reasons.append(f"{name}: {_why_absent(name, anatomy, cfg)}")
            continue
        top = own[0]
        if best is not None and top is best:
            continue
        if not top.fits:
            states = state_memory(anatomy.shape, top.flavour, top.degrees, top.precision).total
            rest = top.memory_per_device_bytes - states
            reasons.append(f"{name}: states {states / GIB:.1f} GiB + activations {rest / GIB:.1f} GiB per device "
                           f"> {memory_limit / GIB:.1f} GiB ({pct}), even at micro-batch {top.micro_batch} in "
                           f"{top.precision} with {top.activation_checkpointing} checkpointing: the memory ruler")
            continue
        if crosses_nodes(top, hw.devices_per_node):
            reasons.append(f"{name}: {tier(top, hw)}: the bandwidth ruler ({top.tokens_per_s:.0f} tokens/s)")
            continue
        if best is not None:
            reasons.append(f"{name}: fits ({top.memory_per_device_bytes / GIB:.1f} GiB) but predicted "
                           f"{top.tokens_per_s:.0f} tokens/s, {top.tokens_per_s / best.tokens_per_s:.2f}x the "
                           f"recommendation: {_what_costs(top, best)}")
    return reasons


def _what_costs(c: Candidate, best: Candidate) -> str:
    """Which ruler a slower candidate loses by: exposed communication (bandwidth), the pipeline's
    bubble, or compute (recomputation it needs to fit, or its overhead)."""
    step, p = c.step_time_s, c.prediction
    if p.bubble_s > 0.2 * step:
        return f"the pipeline bubble ({100 * p.bubble_s / step:.0f} % of its step)"
    if p.exposed_comm_s > 0.2 * step:
        return f"the bandwidth ruler ({100 * p.exposed_comm_s / step:.0f} % of its step is exposed communication)"
    if c.activation_checkpointing == "full" and best.activation_checkpointing == "none":
        return "the memory ruler: it fits only with full checkpointing, whose recomputation costs compute"
    return f"the compute ruler ({100 * (p.compute_s + p.overhead_s) / step:.0f} % of its step is compute and overhead)"


def _why_absent(name: str, anatomy: Anatomy, cfg: AdviceInputs) -> str:
    shape, degrees = anatomy.shape, strategies.get(name).degrees
    if degrees["tp"] == -1:
        if shape.block_linear_params == 0:
            return "the model declares no tensor-parallel plan"
        return f"tp={cfg.nodes * cfg.procs_per_node} does not divide its widths and heads {list(shape.tp_sizes)}"
    if degrees["pp"] == -1:
        if not shape.pipeline:
            return "the model declares no pipeline layout"
        return f"pp={cfg.nodes * cfg.procs_per_node} stages would exceed its {shape.layers} blocks"
    if cfg.plan.strategies and name not in cfg.plan.strategies:
        return "left out by plan.strategies"
    return "no batch split of this world keeps the batch"


TIER_TRAFFIC = {"tp": ("all_reduce", "4 all-reduces per layer"), "cp": ("all_gather", "K/V all-gathered per layer"),
                "ep": ("all_to_all", "4 all-to-alls per MoE layer")}
"""What each node-local degree sends per layer (training/planner/comm.py's comm_time), and its collective."""


def tier(c: Candidate, hw: Hardware) -> str:
    """What the candidate's TP and CP collectives cost on the tier they ride, against a node's
    link: e.g. `tp=16 crosses nodes (16 ranks on 2 nodes): 4 all-reduces per layer at 61 µs and 370
    GB/s per GPU, vs 13 µs and 450 GB/s inside a node`; the degrees that cross nodes, else tp."""
    d = c.degrees
    groups = {dim: group_of(d, dim, hw.devices_per_node) for dim in TIER_TRAFFIC if c.dims.get(dim, 1) > 1}
    crossing = [dim for dim, g in groups.items() if g.nodes > 1] or ["tp"]
    parts = []
    for dim in crossing:
        group = groups.get(dim) or group_of(d, dim, hw.devices_per_node)
        collective, traffic = TIER_TRAFFIC[dim]
        local = min(group.ranks, hw.devices_per_node)
        across, inside = hw.link(collective, group), hw.link(collective, Group(local, local))
        where = "crosses nodes" if group.nodes > 1 else "stays in one node"
        parts.append(f"{dim}={c.dims.get(dim, 1)} {where} ({group.describe()}): {traffic} at "
                     f"{across.alpha_at(group.ranks) * 1e6:.0f} µs and {across.busbw_gbps:.0f} GB/s per GPU, vs "
                     f"{inside.alpha_at(inside.world) * 1e6:.0f} µs and {inside.busbw_gbps:.0f} GB/s inside a node")
    return "; ".join(parts)


def node_local_reason(best: Candidate | None, searched: Searched, hw: Hardware) -> str | None:
    """Why a recommendation whose TP or CP group crosses nodes was kept: no node-local layout within
    NODE_LOCAL of it (search.rank prefers one that is); None when it does not cross."""
    if best is None or not crosses_nodes(best, hw.devices_per_node):
        return None
    local = next((c for c in searched.ranked if c.fits and not crosses_nodes(c, hw.devices_per_node)), None)
    versus = (f"the best node-local layout, {local.strategy} {_short(local)}, is predicted "
              f"{1 - local.tokens_per_s / best.tokens_per_s:.0%} slower" if local is not None else
              "no node-local layout fits")
    return f"tiers: {tier(best, hw)}; kept because {versus} (more than {NODE_LOCAL:.0%})"


def expert_reason(best: Candidate | None, searched: Searched, hw: Hardware, shape: Shape,
                  imbalance: tuple[tuple[int, float], ...]) -> str | None:
    """For a mixture-of-experts model: the expert-parallel degree chosen and the ruler that decided,
    against the best layout of the other kind (ep > 1 vs experts whole on every rank): the
    all-to-all's bytes (balanced, 4 a layer: dispatch, combine and their gradients) and the
    prediction's all-to-all time a step (the counts, recomputation and imbalance included) on the
    tier its group rides, the experts' states per rank, and the
    routing imbalance the prediction used. None for a dense model."""
    if best is None or not shape.experts:
        return None
    ep = best.dims.get("ep", 1)
    other = next((c for c in searched.ranked if c.fits and (c.dims.get("ep", 1) > 1) != (ep > 1)), None)
    split = best if ep > 1 else other
    if split is None:
        return f"experts: ep=1, every rank holds all {max(shape.experts)} experts a layer; no expert-parallel layout fits"
    d = split.degrees
    group = group_of(d, "ep", hw.devices_per_node)
    per_layer = 4 * all_to_all_bytes(shape, split.micro_batch * shape.seq_len, split.precision)
    link = hw.link("all_to_all", group)
    a2a_s = split.prediction.expert_parallel_s
    states = state_memory(shape, split.flavour, d, split.precision).total
    measured = dict(imbalance).get(d.ep)
    skew = (f"routing imbalance {measured:.2f} measured at ep={d.ep}" if measured is not None
            else "routing taken as balanced (no measured run of this model at that ep)")
    facts = (f"ep={d.ep} ({group.describe()}): {max(shape.experts) // d.ep} of {max(shape.experts)} experts a layer "
             f"per rank, states {states / GIB:.2f} GiB per device; all-to-all {per_layer / 1e6:.2f} MB a MoE "
             f"layer per micro-batch at {link.busbw_gbps:.1f} GB/s, {a2a_s * 1e3:.2f} ms a step; {skew}")
    if ep > 1:
        versus = (f"predicted {best.tokens_per_s / other.tokens_per_s:.2f}x the best layout without it "
                  f"({other.strategy} {_short(other)})" if other is not None else "no layout without it fits")
        return f"experts: {facts}; {versus}"
    return (f"experts: ep=1 (every rank holds every expert); the best expert-parallel layout, {split.strategy} "
            f"{_short(split)}, is predicted {split.tokens_per_s / best.tokens_per_s:.2f}x: {facts}")


def headline_reason(best: Candidate | None, searched: Searched, memory_limit: float, world: int) -> str:
    if best is None or not best.fits:
        return closest_miss(searched.ranked, memory_limit)
    runner = next((c for c in searched.ranked if c is not best and c.fits), None)
    versus = f" vs {runner.strategy} {runner.tokens_per_s:.0f}" if runner else ""
    return (f"throughput: {best.strategy} {_short(best)} is the fastest that fits at {world} devices of "
            f"{searched.evaluated} predictions: {best.tokens_per_s:.0f} tokens/s{versus}, "
            f"efficiency {best.scaling_efficiency:.2f}, {best.memory_per_device_bytes / GIB:.2f} GiB per device")


def _short(c: Candidate) -> str:
    dims = " x ".join(f"{k}={v}" for k, v in c.dims.items() if v > 1)
    return (f"({dims + ', ' if dims else ''}micro-batch {c.micro_batch} x {c.grad_accum}, {c.precision}, "
            f"{c.activation_checkpointing} checkpointing)")


def one_device(strategy: StrategyConfig) -> StrategyConfig:
    """A layout's 1-device baseline: every degree 1, trained as its declaration's `one_device`
    strategy (a hybrid, tp or pp layout as plain data parallelism of one), its precision,
    checkpointing and buckets kept, so that scaling efficiency compares like with like."""
    name = strategies.get(strategy.name).one_device
    return dataclasses.replace(strategy, name=name, dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=None, ep=1,
                               reshard_after_forward=None)


def candidate_settings(c: Candidate, strategy: StrategyConfig, train: TrainConfig,
                       world: int) -> tuple[StrategyConfig, TrainConfig]:
    """The strategy and train settings that train candidate `c` (what `c.command` sets); on one
    device (the 1-device baseline), its `one_device` form."""
    d = c.dims
    chosen = dataclasses.replace(
        strategy, name=c.strategy, dp_replicate=d["dp_replicate"], dp_shard=d["dp_shard"], tp=d["tp"], pp=d["pp"],
        reshard_after_forward=strategies.get(c.flavour).reshard_after_forward if d["dp_shard"] > 1 else None,
        precision=c.precision, activation_checkpointing=c.activation_checkpointing, pp_schedule=c.pp_schedule,
        microbatches=c.microbatches if d["pp"] > 1 else strategy.microbatches, bucket_cap_mb=c.bucket_cap_mb,
        cp=d.get("cp", 1), ep=d.get("ep", 1), sequence_parallel=c.sequence_parallel,
        pp_virtual_stages=c.pp_virtual_stages if d["pp"] > 1 else 1)
    chosen = chosen if world > 1 else one_device(chosen)
    # With a fixed global batch the micro-batch follows from it; else the candidate's is per replica.
    sized = dataclasses.replace(train, grad_accum=c.grad_accum,
                                micro_batch=c.micro_batch if train.global_batch is None else train.micro_batch)
    return chosen, sized
