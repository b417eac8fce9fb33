"""train: the scaled run, and (through the engine) the 1-device baseline it is measured against.

Weak scaling: the per-device micro-batch is fixed, so the global batch grows with the world.
Scaling efficiency = samples/s(N) / (N x samples/s(1)), both measured in the same invocation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.common import log, progress
from stages.lr_find import LrFindResult
from stages.plan import PlanResult
from stages.train_result import TrainResult, gathered, result
from stages.trials import TrialsResult
from training.config import DataConfig, ModelConfig, StrategyConfig, TrainConfig
from training.dist import world_size
from training.memory import StepProbe
from training.planner.advice import candidate_settings, one_device
from training.planner.fit import SHARDED
from training.planner.ranking import Candidate
from training.profile import StepProfiler
from training.sysmetrics import SystemSampler, node_id

if TYPE_CHECKING:
    pass


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


@dataclass
class Run:
    """One train stage's run on this rank, set up: the setting, where it resumes, what it watches."""

    strategy: StrategyConfig
    train: TrainConfig
    chosen: Candidate | None
    """The plan's (or trials') candidate `auto` trains; None for a configured strategy."""
    setting: Any
    """stages.setting.Setting: the model parallelized, its batches, optimizer and schedule."""
    layout: Any
    """training.checkpoint.Layout: what a checkpoint of this run is resumable by."""
    zero1: bool
    resume: Any
    """training.checkpoint.Resume, or None on a fresh start."""
    profiler: StepProfiler | None
    loads: Any
    """training.contract.experts.ExpertLoads: the routed tokens per expert, counted each step."""
    skipped: int
    """Steps whose expert loads are not counted (a pipeline's first infers shapes)."""

    @property
    def first(self) -> int:
        return self.resume.step if self.resume else 0


def setup(cfg: TrainInputs, plan: PlanResult, lr_find: LrFindResult, trials: TrialsResult | None,
          baseline: TrainResult | None, checkpoints: Path) -> Run:
    """The strategy resolved (auto: the plan's whole recommendation), the setting built, the
    checkpoint it resumes from loaded, and the profiler and expert-load counters it runs with."""
    from stages.setting import build_setting
    from training import checkpoint
    from training.contract.experts import ExpertLoads

    sharded_baseline = baseline is None and cfg.world_size is not None and 1 < world_size() < cfg.world_size
    strategy, t, chosen = resolve_strategy(cfg.strategy, cfg.train, plan, trials, world_size(), sharded_baseline)
    setting = build_setting(cfg.model, cfg.data, cfg.seed, strategy, t, lr_find)
    parallel = setting.parallel
    layout = checkpoint.Layout(strategy.name, parallel.dims.world_size)
    zero1 = parallel.shard_optimizer and parallel.dp_group is not None
    resume = checkpoint.load(checkpoints, parallel.model, setting.optimizer, layout, zero1)
    if resume:
        log("train", f"resumed from the checkpoint of step {resume.step}")
    first = resume.step if resume else 0
    # Profile between the memory-probed first step and the timed window, so neither is disturbed.
    count = min(t.profile_steps, t.timing_warmup - 1, t.steps - first - 1)
    profiler = StepProfiler(first + 1, count, setting.bench.dev) if count > 0 else None
    skipped = 1 if parallel.dims.pp > 1 else 0  # a pipeline's first step (of each invocation) infers shapes too
    loads = ExpertLoads({s.name: (s.module, s.n_experts) for s in parallel.expert_sites}, setting.optimizer, skipped)
    return Run(strategy, t, chosen, setting, layout, zero1, resume, profiler, loads, skipped)


def train_steps(r: Run, checkpoints: Path, num_workers: int) -> tuple[Any, list]:
    """The loop over the run's steps, checkpointed, probed and reported; with the node's system
    metrics sampled beside it (local rank 0). Returns the loop's stats and the samples."""
    from stages.setting import run_setting
    from training import checkpoint
    from training.loop import Hooks

    s, t = r.setting, r.train
    sampling = t.system_metrics_s > 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0
    sampler = SystemSampler(t.system_metrics_s, node_id()) if sampling else contextlib.nullcontext()
    with sampler:
        hooks = Hooks(
            on_log=StepReporter(t.steps, s.batches.global_batch, r.first),
            on_checkpoint=lambda step, losses, lrs: checkpoint.save(
                checkpoints, step, s.parallel.model, s.optimizer, losses, lrs, r.layout, r.zero1),
            probe=StepProbe(s.parallel.model, s.bench.dev),
            profiler=r.profiler,
        )
        stats = run_setting(s, num_workers, hooks, r.resume)
    return stats, (sampler.samples if sampling else [])


def run(cfg: TrainInputs, *, plan: PlanResult, lr_find: LrFindResult, trials: TrialsResult | None,
        baseline: TrainResult | None, checkpoints: Path) -> TrainResult:
    # Heavy imports stay inside the functions: FSDP, pipelining and dynamo cost ~1 s to import, and
    # the driver imports this module for TrainResult on every invocation, a fully cached one included.
    r = setup(cfg, plan, lr_find, trials, baseline, checkpoints)
    stats, samples = train_steps(r, checkpoints, cfg.data.num_workers)
    return result(r, cfg, plan, baseline, stats, gathered(r, stats, samples))


