"""One setting made runnable, the same way wherever a setting trains: the seeded model built and
parallelized by its strategy, this rank's share of the global batches, the optimizer at the run's
peak learning rate and its schedule, and the loop over them. The train stage runs the user's (or the
plan's) setting through it; trials run each candidate through it.

Heavy imports (torch, FSDP, pipelining) stay inside the functions: the driver imports the stages for
their result types on every invocation, a fully cached one included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.common import Workbench, workbench
from stages.lr_find import LrFindResult
from training.config import DataConfig, ModelConfig, StrategyConfig, TrainConfig

if TYPE_CHECKING:
    from training.data import GlobalBatches
    from training.loop import Hooks, LoopStats, Resume
    from training.parallel.compose import Parallel


def learning_rate(t: TrainConfig, lr_find: LrFindResult, global_batch: int) -> tuple[float, str]:
    """train.lr, else lr_find's suggestion carried by its rule to the batch this run really uses
    (the scaled run's batch; the 1-device baseline's smaller one, so it doesn't diverge)."""
    if t.lr is not None:
        return t.lr, "train.lr"
    return lr_find.scaled(global_batch), f"lr_find ({lr_find.lr_scaling} rule, batch {lr_find.finder_batch} -> {global_batch})"


@dataclass
class Setting:
    """A setting ready to train on this rank."""

    bench: Workbench
    parallel: Parallel
    batches: GlobalBatches
    optimizer: Any
    """torch.optim.Optimizer (its sharded form under zero1)."""
    scheduler: Any
    """torch.optim.lr_scheduler.LambdaLR over `optimizer`: train's warm-up and schedule."""
    train: TrainConfig
    lr: float
    lr_source: str


def build_setting(model: ModelConfig, data: DataConfig, seed: int, strategy: StrategyConfig, train: TrainConfig,
                  lr_find: LrFindResult) -> Setting:
    """The model built and parallelized by `strategy`, the global batches `train` asks for, and the
    optimizer at `learning_rate`'s peak with train's schedule."""
    import torch

    from training.data import GlobalBatches
    from training.dist import world_size
    from training.loop import lr_lambda
    from training.parallel.compose import trainable
    from training.parallel.dims import resolve_dims

    bench = workbench(model, data, seed, train.tf32)
    dp = resolve_dims(strategy, world_size()).dp_size
    lr, source = learning_rate(train, lr_find, train.global_batch_for(dp))
    parallel, optimizer = trainable(bench.model, bench.spec, strategy, bench.dev, bench.loss, lr, train.weight_decay)
    batches = GlobalBatches(len(bench.dataset), train.micro_batch_for(dp), train.grad_accum, parallel.dp_rank, dp, seed)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train.warmup_steps, train.steps, train.schedule))
    return Setting(bench, parallel, batches, optimizer, scheduler, train, lr, source)


def run_setting(s: Setting, num_workers: int, hooks: Hooks | None = None, resume: Resume | None = None) -> LoopStats:
    """Train `s` for its steps (from `resume`'s step, its schedule caught up) on its batches."""
    from training.data import loader
    from training.loop import Hooks, LoopShape, train_loop

    first = resume.step if resume else 0
    for _ in range(first):
        s.scheduler.step()
    data = iter(loader(s.bench.dataset, s.batches, first, s.train.steps, num_workers, s.bench.dev))
    return train_loop(s.parallel, s.optimizer, s.scheduler, data, LoopShape.of(s.train), s.bench.dev,
                      hooks or Hooks(), resume)
