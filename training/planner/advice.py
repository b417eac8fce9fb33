"""The plan's advice: the search over layouts and knobs set up from the run's own measurements (or a
described cluster), the run's own layout predicted the same way, and the reasons in the seeds'
terms: which ruler (memory, bandwidth, compute) decided against each strategy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from training import strategies
from training.config import DataConfig, ModelConfig, StrategyConfig, TrainConfig
from training.parallel.dims import resolve_dims
from training.plan_config import ClusterConfig, PlanConfig
from training.planner.calibration import Calibration
from training.planner.hardware import Hardware, preset_links
from training.planner.predict import Prediction, device_counts, predict, predict_layout
from training.planner.ranking import Candidate, Searched
from training.planner.reasons import expert_reason, headline_reason, node_local_reason, rejection_reasons
from training.planner.search import search
from training.planner.shape import Anatomy
from training.planner.space import Space, Variant, search_cp, strategy_name
from training.planner.workload import Workload, strategy_workload
from training.strategies import flavour_of
from training.units import GIB

if TYPE_CHECKING:
    from training.planner.anatomy import VariantCost

T = TypeVar("T")

@dataclass(frozen=True)
class PlanInputs:
    """What the plan and its advice read: the run's config groups and its world (the plan stage's
    config, and a what-if's)."""

    plan: PlanConfig
    cluster: ClusterConfig
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    strategy: StrategyConfig
    nodes: int
    procs_per_node: int
    seed: int


def own_setting(cfg: PlanInputs, settings: list[T]) -> T:
    """Of per-setting costs or variants, the one in the run's own precision and checkpointing."""
    own = (cfg.strategy.precision, cfg.strategy.activation_checkpointing)
    return next(s for s in settings if (s.precision, s.activation_checkpointing) == own)


def data_parallel_size(cfg: PlanInputs) -> int:
    return resolve_dims(cfg.strategy, cfg.nodes * cfg.procs_per_node).dp_size


def budget_bytes(cfg: PlanInputs) -> float | None:
    """Each rank's device-memory budget: cluster.device_memory_gib on a measured cluster."""
    c = cfg.cluster
    return c.device_memory_gib * GIB if c.measured and c.device_memory_gib is not None else None


def memory_limit(cfg: PlanInputs, hw: Hardware) -> float:
    """What a layout's predicted peak must stay under: a budget counted in tensor bytes as it is
    (no allocator there to leave room for), else plan.memory_fraction of the device."""
    budget = budget_bytes(cfg)
    return budget if budget is not None else cfg.plan.memory_fraction * hw.device_memory_bytes


def overlap(cfg: PlanInputs, hw: Hardware) -> float:
    """How much of the data-parallel communication hides behind compute: plan.overlap, else none on
    a CPU host (gloo runs on the cores that compute) and all it can on a GPU."""
    return cfg.plan.overlap if cfg.plan.overlap is not None else (0.0 if hw.cores else 1.0)


def workload(cfg: PlanInputs, anatomy: Anatomy) -> Workload:
    """The run's own setting as the planner predicts it."""
    return strategy_workload(anatomy.shape, anatomy.activations, cfg.strategy,
                             cfg.train.micro_batch_for(data_parallel_size(cfg)), cfg.train.grad_accum,
                             anatomy.tokens_per_sample, clip=cfg.train.grad_clip is not None)


def described_hardware(cfg: PlanInputs, executed_flops_per_sample: float) -> Hardware:
    """A cluster preset's hardware: the run's own precision at the datasheet's peak for it, times
    what a tuned step achieves; its links as published."""
    c = cfg.cluster
    per_sample = executed_flops_per_sample / (precision_peak(cfg, cfg.strategy.precision) * c.achievable_mfu)
    return Hardware(
        device_memory_bytes=c.device_memory_gib * GIB,
        devices_per_node=c.devices_per_node,
        intra=preset_links(c.intra_node_gbps, c.intra_node_latency_us, max(c.devices_per_node, 2)),
        inter=preset_links(c.inter_node_gbps, c.inter_node_latency_us, 2 * c.devices_per_node),
        seconds_per_sample=per_sample,
    )


def searched_variants(cfg: PlanInputs, blocks: int) -> list[tuple[str, str]]:
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


def precision_peak(cfg: PlanInputs, precision: str) -> float | None:
    """The peak FLOP/s of one device in `precision`: train.peak_flops, else a described cluster's
    datasheet figure (a measured CPU has none). fp8's is the bf16 peak: MFU of a Float8 run is
    reported against it (torchtitan's convention), its linears' fp8 speed-up counted as MFU."""
    if cfg.train.peak_flops is not None:
        return cfg.train.peak_flops
    if cfg.cluster.measured:
        return None
    c = cfg.cluster
    return c.fp32_peak_flops if precision == "fp32" and c.fp32_peak_flops else c.peak_flops


def variant(cfg: PlanInputs, cost: VariantCost, own: VariantCost, hw: Hardware) -> Variant:
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


def command_prefix(cfg: PlanInputs) -> str:
    """What every candidate's command shares: the world and the workload as this run named them."""
    return (f"model={cfg.model.name} data={cfg.data.name} cluster={cfg.cluster.name} nodes={cfg.nodes} "
            f"procs_per_node={cfg.procs_per_node}")


def advise(cfg: PlanInputs, anatomy: Anatomy, costs: list[VariantCost], hw: Hardware, memory_limit: float,
           overlap: float, calibration: Calibration | None,
           expert_imbalance: tuple[tuple[int, float], ...] = (),
           expert_held_imbalance: tuple[tuple[int, float], ...] = ()) -> tuple[Searched, Candidate, list[Variant]]:
    """The search, and the run's own layout and knobs predicted the same way (`expert_imbalance`,
    `expert_held_imbalance`: the routing imbalance earlier runs measured, Workload's fields)."""
    world = cfg.nodes * cfg.procs_per_node
    own_cost = own_setting(cfg, costs)
    variants = [variant(cfg, c, own_cost, hw) for c in costs]
    space = Space(
        world=world, devices_per_node=min(hw.devices_per_node, world),
        global_batch=cfg.train.global_batch, replica_batch=cfg.train.micro_batch * cfg.train.grad_accum,
        variants=variants, strategies=tuple(cfg.plan.strategies) if cfg.plan.strategies else None,
        clip=cfg.train.grad_clip is not None, expert_imbalance=expert_imbalance,
        expert_held_imbalance=expert_held_imbalance,
        max_cp=search_cp(anatomy.shape, variants, memory_limit, min(hw.devices_per_node, world), world,
                                   cfg.train.global_batch),
    )
    searched = search(space, anatomy.shape, hw, anatomy.tokens_per_sample, anatomy.flops_per_sample,
                      memory_limit, overlap, calibration, command_prefix(cfg))
    requested = None
    if not cfg.strategy.from_plan:
        micro = cfg.train.micro_batch_for(resolve_dims(cfg.strategy, world).dp_size)
        requested = own_candidate(cfg, anatomy, variants, hw, memory_limit, overlap, calibration, micro, space)
    return searched, requested, variants


def own_candidate(cfg: PlanInputs, anatomy: Anatomy, variants: list[Variant], hw: Hardware, memory_limit: float,
                  overlap: float, calibration: Calibration | None, micro: int, space: Space) -> Candidate | None:
    """The layout and knobs this invocation asked for, predicted as a candidate."""
    from training.planner.ranking import candidate_of

    world = cfg.nodes * cfg.procs_per_node
    d = resolve_dims(cfg.strategy, world)
    flavour = flavour_of(cfg.strategy, d)
    own = own_setting(cfg, variants)
    w = strategy_workload(anatomy.shape, own.activations, cfg.strategy, micro, cfg.train.grad_accum,
                          anatomy.tokens_per_sample, cfg.train.grad_clip is not None, own.seconds_per_sample,
                          space.expert_imbalance, space.expert_held_imbalance)
    name = cfg.strategy.name if cfg.strategy.name in strategies.pure() else strategy_name(flavour, d)
    p = predict_layout(w, hw, flavour, d, memory_limit, overlap, 1.0 / own.seconds_per_sample, calibration, name)
    if p is None:
        return None
    return candidate_of(p, flavour, d, w, own, cfg.strategy.pp_schedule, cfg.strategy.bucket_cap_mb,
                      anatomy.flops_per_sample, dataclasses.replace(space, global_batch=cfg.train.global_batch),
                      command_prefix(cfg))


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


def predictions(cfg: PlanInputs, w: Workload, hw: Hardware, world: int,
                calibration: Calibration | None = None) -> list[Prediction]:
    """The pure strategies' scaling curves: each at 1, 2, 4 ... plan.max_devices and the run's world."""
    limit = memory_limit(cfg, hw)
    share = overlap(cfg, hw)
    base = predict(w, hw, "ddp", 1, float("inf"), share, 1.0, calibration)
    single = base.samples_per_s
    out = []
    for devices in device_counts(cfg.plan.max_devices, world):
        if devices > 1 and not (hw.intra or hw.inter):
            continue  # no bandwidth measured: nothing to predict beyond one device
        for strategy in [s for s in strategies.pure() if not cfg.plan.strategies or s in cfg.plan.strategies]:
            p = predict(w, hw, strategy, devices, limit, share, single, calibration)
            if p is not None:
                out.append(p)
    return out


def advise_plan(cfg: PlanInputs, anatomy: Anatomy, costs: list, hw: Hardware, w: Workload,
                calibration: Calibration | None) -> tuple[dict, list[str]]:
    """The search and the reasons: the plan's advice, as fields of its result."""
    world = cfg.nodes * cfg.procs_per_node
    limit = memory_limit(cfg, hw)
    searched, requested, variants = advise(cfg, anatomy, costs, hw, limit, overlap(cfg, hw), calibration,
                                           w.expert_imbalance, w.expert_held_imbalance)
    best = searched.ranked[0] if searched.ranked else None
    best = best if best is not None and best.fits else None
    reasons = [headline_reason(best, searched, limit, world)]
    tiers = node_local_reason(best, searched, hw)
    reasons += [tiers] if tiers is not None else []
    experts = expert_reason(best, searched, hw, anatomy.shape, w.expert_imbalance)
    reasons += [experts] if experts is not None else []
    reasons += rejection_reasons(searched, best, limit, hw, cfg, anatomy)
    if requested is not None and best is not None:
        reasons.append(f"requested: {requested.strategy} predicted {requested.tokens_per_s:.0f} tokens/s, "
                       f"{requested.tokens_per_s / best.tokens_per_s:.2f}x the recommendation"
                       + ("" if requested.fits else ", and it does not fit"))
    recommended = best or (searched.ranked[0] if searched.ranked else None)
    fields = {"recommended": recommended, "requested": requested, "candidates": searched.ranked[:10],
              "layouts": searched.best_per_layout(10),
              "evaluated": searched.evaluated, "variants": variants,
              "predictions": predictions(cfg, w, hw, world, calibration)}
    return fields, reasons
