"""train's result: what a scaled run (or its baseline) measured, and how it is made from a run on
every rank: throughput and scaling efficiency against the baseline, memory, MFU, the plan's
prediction held against it, and what the ranks report together (peaks, parameter digests, system
metrics, routed tokens).
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.plan import PlanResult
from stages.prediction import PredictionCheck, check_prediction
from training.dist import gather_objects, rank, world_size
from training.planner.calibration import MeasuredStep
from training.profile import TimeSplit
from training.sysmetrics import SystemSample, sample_metrics
from training.units import GIB

if TYPE_CHECKING:
    import torch

    from stages.train import Run, TrainInputs


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
    """The timed window's mean step (global_batch / samples_per_s): what the plan's prediction is
    held against and calibration fits."""
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
    """Mixture-of-experts models: each MoE layer's slots per expert over the run's steps, all
    ranks' tokens, those dropped over capacity not counted (training/contract/experts.py); empty
    for a dense model."""
    expert_dropped_share: float = 0.0
    """Of the slots routed over the run, in every MoE layer, the share dropped over the experts'
    capacity (0 without a capacity factor)."""
    expert_imbalance: list[float] = dataclasses.field(default_factory=list)
    """Per step from `expert_first_step`, the MoE layers' mean of busiest-expert slots over a
    balanced expert's share of those routed (1.0: balanced; a capacity factor c bounds it by c)."""
    expert_rank_imbalance: dict[str, float] = dataclasses.field(default_factory=dict)
    """For each expert-parallel degree that divides the experts ("2", "4", ...): the steps' mean of the
    busiest rank's kept slots over a balanced rank's share of those routed, had the experts been
    split over that many ranks (training/contract/experts.py's rank_imbalance). A later plan's
    prediction stretches the experts' compute by it (plan.calibrate)."""
    expert_rank_held_imbalance: dict[str, float] = dataclasses.field(default_factory=dict)
    """For the same degrees, the highest over the steps of the busiest rank's slots summed over the
    layers over the mean rank's (rank_held_imbalance): what a later plan's memory ruler stretches
    the busiest rank's experts' activations by."""
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
            scalars["moe/dropped_share"] = self.expert_dropped_share
        scalars.update({f"moe/rank_imbalance_ep{ep}": x for ep, x in self.expert_rank_imbalance.items()})
        scalars.update({f"moe/rank_held_imbalance_ep{ep}": x for ep, x in self.expert_rank_held_imbalance.items()})
        # One chart per layer: the expert's index on the step axis, its slots as the value.
        out += [(f"moe/load/{layer}", float(n), e) for layer, load in self.expert_load.items() for e, n in enumerate(load)]
        return out + [(k, v, 0) for k, v in scalars.items()]

    def measured_step(self) -> MeasuredStep | None:
        """What calibration fits (pipelines/calibration.py): the measured step time beside the
        uncalibrated components the plan predicted it from; None without a prediction."""
        if self.prediction is None:
            return None
        return MeasuredStep(self.strategy, self.world_size, self.prediction.components, self.step_time_s,
                            tuple((int(ep), x) for ep, x in self.expert_rank_imbalance.items()),
                            tuple((int(ep), x) for ep, x in self.expert_rank_held_imbalance.items()))

    def headline(self) -> str:
        mfu = f", MFU {self.mfu_pct:.1f} %" if self.mfu_pct is not None else ""
        base = (f" against zero3 x{self.baseline_world_size} (the smallest world that holds the model)"
                if 1 < self.baseline_world_size < self.world_size else "")
        return (
            f"{self.strategy} x{self.world_size}: loss {self.losses[0]:.3f} -> {self.final_loss:.3f}, "
            f"{self.samples_per_s:.1f} samples/s, efficiency {self.scaling_efficiency:.2f}{base}{mfu}"
        )


def parameter_digest(model: torch.nn.Module) -> str:
    """A hash of every parameter's full value (sharded ones gathered: a collective)."""
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(full.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class Gathered:
    """What the ranks report together after the loop."""

    held_peak: int
    """The highest rank's peak where it is measured (a CPU budget's tracker, CUDA's allocator),
    else the step's counted tensors: what the prediction is held against."""
    in_sync: bool
    system: list
    routed: dict


def gathered(r: Run, stats: Any, samples: list) -> Gathered:
    """Every rank's peak memory, parameter digest, system samples and routed-token counts."""
    from training.budget import stage_peak_bytes
    from training.contract.experts import merge_counts

    parallel = r.setting.parallel
    dims = parallel.dims
    stage = dims.coordinates(rank())["pp"] if dims.world_size > 1 else 0
    peaks = [p for p in gather_objects(stage_peak_bytes()) if p is not None]
    # Ranks that should hold the same parameters: the same pipeline stage, and the same experts.
    holds = (stage, parallel.experts.ep_rank if parallel.experts is not None else 0)
    digests = gather_objects((holds, parameter_digest(parallel.model)))
    system = [x for node in gather_objects(samples) for x in node]
    # Tensor-parallel ranks route the same tokens: one of them speaks for its group.
    routed = merge_counts(gather_objects(r.loads.counts() if dims.coordinates(rank())["tp"] == 0 else {}))
    return Gathered(max(peaks) if peaks else stats.memory.peak_bytes,
                    all(len({d for s, d in digests if s == k}) == 1 for k in {s for s, _ in digests}), system, routed)


def result(r: Run, cfg: TrainInputs, plan: PlanResult, baseline: TrainResult | None, stats: Any,
           g: Gathered) -> TrainResult:
    """The run's result: throughput and efficiency against its baseline, memory, MFU, the plan's
    prediction held against it, and what the ranks reported."""
    from training.contract.calls import tokens_per_sample
    from training.contract.experts import dropped_share, rank_held_imbalance, rank_imbalance, step_imbalance
    from training.data import first_samples
    from training.flops import peak_column, peak_flops

    s, t, strategy = r.setting, r.train, r.strategy
    bench, parallel, batches = s.bench, s.parallel, s.batches
    tokens = tokens_per_sample(first_samples(bench.dataset, 1))
    dims = parallel.dims
    world = dims.world_size
    samples_per_s = stats.timed_steps * batches.global_batch / stats.timed_seconds
    base = baseline.samples_per_s if baseline is not None else samples_per_s
    base_world = baseline.world_size if baseline is not None else world_size()
    peak = peak_flops(bench.dev, strategy.precision, t.peak_flops, t.tf32)
    per_device = samples_per_s / world
    memory = stats.memory
    # The window's mean step, as samples/s: what the cost model predicts (each collective's time a
    # mean, its occasional stall part of what a step pays). The median would leave the stalls out:
    # FSDP's calls are heavy-tailed on a CPU host (gpt-tiny's zero3 at 4 ranks on 2 cores: median
    # step 73.1 ms, mean 77.0, predicted 79.8).
    step_time = stats.timed_seconds / stats.timed_steps
    efficiency = (samples_per_s / world) / (base / base_world)
    return TrainResult(
        strategy=strategy.name,
        strategy_from_plan=r.chosen is not None,
        dims=[dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp],
        cp=dims.cp,
        ep=strategy.ep,
        precision=strategy.precision,
        activation_checkpointing=strategy.activation_checkpointing,
        world_size=world,
        steps=t.steps,
        resumed_from=r.first,
        final_loss=stats.losses[-1],
        losses=stats.losses,
        lrs=stats.lrs,
        lr=s.lr,
        lr_source=s.lr_source,
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
        time_split=r.profiler.split if r.profiler is not None else [],
        prediction=check_prediction(plan, r.chosen, strategy.name, world, step_time, samples_per_s, efficiency,
                                    g.held_peak),
        system=g.system,
        ranks_in_sync=g.in_sync,
        expert_load={layer: [sum(e) for e in zip(*steps, strict=True)][:-1] for layer, steps in g.routed.items()},
        expert_dropped_share=dropped_share(g.routed),
        expert_imbalance=step_imbalance(g.routed),
        expert_rank_imbalance=rank_imbalance(g.routed),
        expert_rank_held_imbalance=rank_held_imbalance(g.routed),
        expert_first_step=r.first + r.skipped + 1,
    )
