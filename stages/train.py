"""train: the scaled run, and (through the engine) the 1-device baseline it is measured against.

Weak scaling: the per-device micro-batch is fixed, so the global batch grows with the world.
Scaling efficiency = samples/s(N) / (N x samples/s(1)), both measured in the same invocation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.common import log, progress
from stages.lr_find import LrFindResult
from stages.plan import PlanResult
from stages.prediction import PredictionCheck, check_prediction
from stages.trials import TrialsResult
from training.config import DataConfig, ModelConfig, StrategyConfig, TrainConfig
from training.dist import gather_objects, rank, world_size
from training.memory import StepProbe
from training.planner.advice import candidate_settings, one_device
from training.planner.calibration import MeasuredStep
from training.planner.fit import SHARDED
from training.planner.ranking import Candidate
from training.profile import StepProfiler, TimeSplit
from training.sysmetrics import SystemSample, SystemSampler, node_id, sample_metrics
from training.units import GIB

if TYPE_CHECKING:
    import torch



@dataclass(frozen=True)
class TrainInputs:
    train: TrainConfig
    model: ModelConfig
    data: DataConfig
    strategy: StrategyConfig
    seed: int
    world_size: int | None = None
    """The invocation's world (nodes x procs_per_node): a run on fewer ranks is its baseline on the
    smallest layout that holds the model (None: whatever world it runs on is the run's)."""

    @classmethod
    def from_config(cls, cfg: Any) -> TrainInputs:
        return cls(cfg.train, cfg.model, cfg.data, cfg.strategy, cfg.seed, cfg.nodes * cfg.procs_per_node)


def smallest_world(cfg: TrainInputs, budget_bytes: float, max_ranks: int) -> int:
    """The engine's question for the baseline (the stage's `fits`): how many ranks hold a step of
    the run's per-device micro-batch within `budget_bytes` each: 1 (the one-device form), or
    zero3 over the fewest that do (weak scaling: each rank keeps the per-device batch)."""
    from training.planner.fit import SHARDED, counted, rank_memory

    s, t = cfg.strategy, cfg.train
    c = counted(cfg.model, cfg.data, cfg.seed, s.precision, s.activation_checkpointing)
    world = cfg.world_size or max_ranks
    micro = t.micro_batch if t.global_batch is None else max(t.global_batch // (world * t.grad_accum), 1)
    knobs = dict(precision=s.precision, activation_checkpointing=s.activation_checkpointing)
    if rank_memory(c, StrategyConfig(name="ddp", **knobs), "ddp", 1, micro).total <= budget_bytes:
        return 1
    ranks = 2
    while ranks < max_ranks:
        if max_ranks % ranks == 0 and rank_memory(c, StrategyConfig(name=SHARDED, **knobs), SHARDED, ranks,
                                                  micro).total <= budget_bytes:
            return ranks
        ranks *= 2
    return max_ranks


@dataclass(frozen=True)
class TrainResult:
    strategy: str
    strategy_from_plan: bool
    """True when strategy=auto took the plan's recommendation."""
    dims: list[int]
    """Degrees dp_replicate, dp_shard, tp, pp (cp apart, below: summaries written before it read the same)."""
    precision: str
    activation_checkpointing: str
    world_size: int
    steps: int
    resumed_from: int
    """The checkpoint step this run resumed from (0: a fresh run)."""
    final_loss: float
    losses: list[float]
    lrs: list[float]
    lr: float
    lr_source: str
    global_batch: int
    micro_batch: int
    grad_accum: int
    samples_per_s: float
    tokens_per_s: float
    samples_per_s_per_device: float
    tokens_per_s_per_device: float
    step_time_s: float
    """The median timed step (samples_per_s is over the whole timed window)."""
    baseline_samples_per_s: float
    scaling_efficiency: float
    """samples/s per device over the baseline's samples/s per device (weak scaling)."""
    peak_memory_bytes: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    activation_bytes: int
    memory_source: str
    flops_per_sample: float
    mfu_pct: float | None
    """None where the device's peak FLOP/s is unknown (CPUs, unlisted GPUs)."""
    device: str
    ranks_in_sync: bool
    """Ranks holding the same pipeline stage ended with bitwise-identical full parameters."""
    bucket_allreduce_ms: list[float]
    """strategy.time_buckets: each DDP bucket all-reduce's time to its completion, in order (CUDA:
    on the device, from when the NCCL stream could start it; gloo: wall time from its launch)."""
    prediction: PredictionCheck | None
    """The plan's prediction for this run and its relative errors."""
    time_split: list[TimeSplit]
    """torch.profiler's split of a step into communication, matmul, memcpy and other (rank 0)."""
    system: list[SystemSample]
    """Each node's system metrics during the run (sampled by its local rank 0)."""
    baseline_world_size: int = 1
    """Ranks of the baseline it is measured against: 1, or the smallest world that holds the
    model (zero3), for a model larger than one device."""
    mfu_peak_precision: str | None = None
    """The datasheet peak MFU divides by: `bf16`, `fp16`, or for fp32 `tf32` (train.tf32 on CUDA)
    or `fp32`; None without MFU or when train.peak_flops sets the peak."""
    cp: int = 1
    """Context-parallel degree: the ranks each sequence was split over."""
    ep: int = 1
    """Expert-parallel degree: the ranks each MoE layer's experts were split over."""
    expert_load: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Mixture-of-experts models: each MoE layer's routed slots per expert over the run's steps,
    all ranks' tokens (training/models/moe.py); empty for a dense model."""
    expert_imbalance: list[float] = dataclasses.field(default_factory=list)
    """Per step from `expert_first_step`, the MoE layers' mean of busiest-expert slots over the mean
    (1.0: balanced)."""
    expert_rank_imbalance: dict[str, float] = dataclasses.field(default_factory=dict)
    """For each expert-parallel degree that divides the experts ("2", "4", ...): the steps' mean of the
    busiest rank's routed slots over the mean rank's, had the experts been split over that many
    ranks (training/models/moe.py's rank_imbalance). A later plan's prediction stretches the
    experts' compute by it (plan.calibrate)."""
    expert_first_step: int = 1
    """The first step the expert loads count: 2 under a pipeline, whose first step also runs torch's
    shape inference through the experts; later for a resumed run."""

    def metrics(self) -> list[tuple[str, float, int]]:
        out = [("train/loss", loss, step) for step, loss in enumerate(self.losses, 1)]
        out += [("train/lr", lr, step) for step, lr in enumerate(self.lrs, 1)]
        # Samples seen as the step: runs of different world sizes line up on one axis.
        out += [("train/loss_by_samples", loss, step * self.global_batch) for step, loss in enumerate(self.losses, 1)]
        scalars = {
            "train/final_loss": self.final_loss,
            "train/samples_per_s": self.samples_per_s,
            "train/tokens_per_s": self.tokens_per_s,
            "train/samples_per_s_per_device": self.samples_per_s_per_device,
            "train/tokens_per_s_per_device": self.tokens_per_s_per_device,
            "train/step_time_ms": self.step_time_s * 1e3,
            "train/baseline_samples_per_s": self.baseline_samples_per_s,
            "train/scaling_efficiency": self.scaling_efficiency,
            "train/world_size": float(self.world_size),
            "memory/peak_gib": self.peak_memory_bytes / GIB,
            "memory/param_bytes": float(self.param_bytes),
            "memory/grad_bytes": float(self.grad_bytes),
            "memory/optim_bytes": float(self.optim_bytes),
            "memory/activation_bytes": float(self.activation_bytes),
        }
        if self.mfu_pct is not None:
            scalars["train/mfu_pct"] = self.mfu_pct
        if self.prediction is not None:
            p = self.prediction
            scalars.update({
                "plan/predicted_step_time_ms": p.step_time_s * 1e3,
                "plan/predicted_samples_per_s": p.samples_per_s,
                "plan/predicted_scaling_efficiency": p.scaling_efficiency,
                "plan/predicted_memory_gib": p.memory_bytes / GIB,
                "plan/step_time_error_pct": p.step_time_error_pct,
                "plan/samples_per_s_error_pct": p.samples_per_s_error_pct,
                "plan/efficiency_error_pct": p.efficiency_error_pct,
                "plan/memory_error_pct": p.memory_error_pct,
            })
        scalars.update({f"profile/{s.kind}_ms_per_step": s.ms_per_step for s in self.time_split})
        if self.bucket_allreduce_ms:
            scalars["comm/ddp_bucket_allreduce_ms_median"] = statistics.median(self.bucket_allreduce_ms)
            out += [("comm/ddp_bucket_allreduce_ms", ms, i) for i, ms in enumerate(self.bucket_allreduce_ms)]
        out += sample_metrics(self.system)
        if self.expert_imbalance:
            out += [("moe/imbalance", x, step) for step, x in enumerate(self.expert_imbalance, self.expert_first_step)]
            scalars["moe/imbalance_mean"] = statistics.fmean(self.expert_imbalance)
        scalars.update({f"moe/rank_imbalance_ep{ep}": x for ep, x in self.expert_rank_imbalance.items()})
        # One chart per layer: the expert's index on the step axis, its slots as the value.
        out += [(f"moe/load/{layer}", float(n), e) for layer, load in self.expert_load.items() for e, n in enumerate(load)]
        return out + [(k, v, 0) for k, v in scalars.items()]

    def measured_step(self) -> MeasuredStep | None:
        """What calibration fits (pipelines/calibration.py): the measured step time beside the
        uncalibrated components the plan predicted it from; None without a prediction."""
        if self.prediction is None:
            return None
        return MeasuredStep(self.strategy, self.world_size, self.prediction.components, self.step_time_s,
                            tuple((int(ep), x) for ep, x in self.expert_rank_imbalance.items()))

    def headline(self) -> str:
        mfu = f", MFU {self.mfu_pct:.1f} %" if self.mfu_pct is not None else ""
        base = (f" against zero3 x{self.baseline_world_size} (the smallest world that holds the model)"
                if 1 < self.baseline_world_size < self.world_size else "")
        return (
            f"{self.strategy} x{self.world_size}: loss {self.losses[0]:.3f} -> {self.final_loss:.3f}, "
            f"{self.samples_per_s:.1f} samples/s, efficiency {self.scaling_efficiency:.2f}{base}{mfu}"
        )


class StepReporter:
    """Each logged step's loss and the samples/s since the previous one, as progress."""

    def __init__(self, steps: int, global_batch: int, first: int):
        self.steps, self.global_batch = steps, global_batch
        self.last_step, self.last_t = first, time.perf_counter()

    def __call__(self, step: int, loss: float) -> None:
        now = time.perf_counter()
        rate = (step - self.last_step) * self.global_batch / max(now - self.last_t, 1e-9)
        self.last_step, self.last_t = step, now
        progress("train", f"step {step}/{self.steps} loss {loss:.4f}, {rate:.1f} samples/s")


def parameter_digest(model: torch.nn.Module) -> str:
    """A hash of every parameter's full value (sharded ones gathered: a collective)."""
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(full.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def resolve_strategy(strategy: StrategyConfig, train: TrainConfig, plan: PlanResult, trials: TrialsResult | None,
                     world: int, sharded_baseline: bool = False) -> tuple[StrategyConfig, TrainConfig, Candidate | None]:
    """`auto` becomes the plan's whole recommendation (the measured best when trials ran): its
    degrees, data-parallel flavour, micro-batch and accumulation, precision, checkpointing, pipeline
    schedule and buckets, returned with the candidate. Anything but auto is kept as configured; on
    one device (the 1-device baseline), in its one-device form; as a `sharded_baseline` (the model
    exceeds one device), that form sharded by zero3 over the ranks it runs on."""
    chosen = trials.chosen if trials is not None and trials.chosen is not None else plan.recommended
    if sharded_baseline:
        if strategy.from_plan and chosen is not None:
            strategy, train = candidate_settings(chosen, strategy, train, 1)
        return dataclasses.replace(one_device(strategy), name=SHARDED, dp_shard=-1, cp=None), train, None
    if not strategy.from_plan or chosen is None:
        # cp=None: a one-device baseline splits no sequence (one_device predates context parallelism).
        return (strategy if world > 1 else dataclasses.replace(one_device(strategy), cp=None)), train, None
    return (*candidate_settings(chosen, strategy, train, world), chosen)


def run(cfg: TrainInputs, *, plan: PlanResult, lr_find: LrFindResult, trials: TrialsResult | None,
        baseline: TrainResult | None, checkpoints: Path) -> TrainResult:
    # Here, not at the top: FSDP, pipelining and dynamo cost ~1 s to import, and the driver
    # imports this module for TrainResult on every invocation, a fully cached one included.
    from stages.setting import build_setting, run_setting
    from training import checkpoint
    from training.budget import stage_peak_bytes
    from training.contract.calls import tokens_per_sample
    from training.data import first_samples
    from training.flops import peak_column, peak_flops
    from training.loop import Hooks
    from training.models.moe import ExpertLoads, merge_counts, rank_imbalance, step_imbalance

    sharded_baseline = baseline is None and cfg.world_size is not None and 1 < world_size() < cfg.world_size
    strategy, t, chosen = resolve_strategy(cfg.strategy, cfg.train, plan, trials, world_size(), sharded_baseline)
    setting = build_setting(cfg.model, cfg.data, cfg.seed, strategy, t, lr_find)
    bench, parallel, batches, optimizer = setting.bench, setting.parallel, setting.batches, setting.optimizer
    tokens = tokens_per_sample(first_samples(bench.dataset, 1))
    dims = parallel.dims
    layout = checkpoint.Layout(strategy.name, dims.world_size)
    zero1 = parallel.shard_optimizer and parallel.dp_group is not None
    resume = checkpoint.load(checkpoints, parallel.model, optimizer, layout, zero1)
    if resume:
        log("train", f"resumed from the checkpoint of step {resume.step}")
    first = resume.step if resume else 0
    # Profile between the memory-probed first step and the timed window, so neither is disturbed.
    count = min(t.profile_steps, t.timing_warmup - 1, t.steps - first - 1)
    profiler = StepProfiler(first + 1, count, bench.dev) if count > 0 else None
    skipped = 1 if dims.pp > 1 else 0  # a pipeline's first step (of each invocation) infers shapes too
    loads = ExpertLoads({s.name: (s.module, s.n_experts) for s in parallel.expert_sites}, optimizer, skipped)
    sampling = t.system_metrics_s > 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0
    sampler = SystemSampler(t.system_metrics_s, node_id()) if sampling else contextlib.nullcontext()
    with sampler:
        hooks = Hooks(
            on_log=StepReporter(t.steps, batches.global_batch, first),
            on_checkpoint=lambda step, losses, lrs: checkpoint.save(
                checkpoints, step, parallel.model, optimizer, losses, lrs, layout, zero1),
            probe=StepProbe(parallel.model, bench.dev),
            profiler=profiler,
        )
        stats = run_setting(setting, cfg.data.num_workers, hooks, resume)
    world = dims.world_size
    samples_per_s = stats.timed_steps * batches.global_batch / stats.timed_seconds
    base = baseline.samples_per_s if baseline is not None else samples_per_s
    base_world = baseline.world_size if baseline is not None else world_size()
    peak = peak_flops(bench.dev, strategy.precision, t.peak_flops, t.tf32)
    per_device = samples_per_s / world
    memory = stats.memory
    # The median step: one stray slow step (another process, a page fault) doesn't move it;
    # throughput above stays the whole window's.
    step_time = statistics.median(stats.step_seconds) if stats.step_seconds else stats.timed_seconds / stats.timed_steps
    efficiency = (samples_per_s / world) / (base / base_world)
    stage = dims.coordinates(rank())["pp"] if world > 1 else 0
    # The prediction is held against the highest rank's real peak where it is measured (a CPU
    # budget's tracker, CUDA's allocator), else against the step's counted tensors.
    peaks = [p for p in gather_objects(stage_peak_bytes()) if p is not None]
    held_peak = max(peaks) if peaks else memory.peak_bytes
    # Ranks that should hold the same parameters: the same pipeline stage, and the same experts.
    holds = (stage, parallel.experts.ep_rank if parallel.experts is not None else 0)
    digests = gather_objects((holds, parameter_digest(parallel.model)))
    system = [x for node in gather_objects(sampler.samples if sampling else []) for x in node]
    # Tensor-parallel ranks route the same tokens: one of them speaks for its group.
    routed = merge_counts(gather_objects(loads.counts() if dims.coordinates(rank())["tp"] == 0 else {}))
    return TrainResult(
        strategy=strategy.name,
        strategy_from_plan=chosen is not None,
        dims=[dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp],
        cp=dims.cp,
        ep=strategy.ep,
        precision=strategy.precision,
        activation_checkpointing=strategy.activation_checkpointing,
        world_size=world,
        steps=t.steps,
        resumed_from=resume.step if resume else 0,
        final_loss=stats.losses[-1],
        losses=stats.losses,
        lrs=stats.lrs,
        lr=setting.lr,
        lr_source=setting.lr_source,
        global_batch=batches.global_batch,
        micro_batch=batches.micro,
        grad_accum=t.grad_accum,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * tokens,
        samples_per_s_per_device=per_device,
        tokens_per_s_per_device=per_device * tokens,
        step_time_s=step_time,
        baseline_samples_per_s=base,
        baseline_world_size=base_world,
        scaling_efficiency=efficiency,
        peak_memory_bytes=memory.peak_bytes,
        param_bytes=memory.param_bytes,
        grad_bytes=memory.grad_bytes,
        optim_bytes=memory.optim_bytes,
        activation_bytes=memory.activation_bytes,
        memory_source=memory.source,
        flops_per_sample=plan.flops_per_sample,
        mfu_pct=100 * plan.flops_per_sample * per_device / peak if peak else None,
        mfu_peak_precision=peak_column(strategy.precision, t.tf32) if peak and t.peak_flops is None else None,
        device=str(bench.dev),
        bucket_allreduce_ms=parallel.bucket_timer.ms if parallel.bucket_timer is not None else [],
        time_split=profiler.split if profiler is not None else [],
        prediction=check_prediction(plan, chosen, strategy.name, world, step_time, samples_per_s, efficiency,
                                    held_peak),
        system=system,
        ranks_in_sync=all(len({d for s, d in digests if s == k}) == 1 for k in {s for s, _ in digests}),
        expert_load={layer: [sum(e) for e in zip(*steps, strict=True)] for layer, steps in routed.items()},
        expert_imbalance=step_imbalance(routed),
        expert_rank_imbalance=rank_imbalance(routed),
        expert_first_step=first + skipped + 1,
    )
