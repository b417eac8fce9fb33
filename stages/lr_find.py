"""lr_find: an LR range test on ONE device, then the LR for the scaled run by an explicit rule.

The finder's batch is small and fixed; the scaled run's effective global batch is
micro_batch x grad_accum x data-parallel size. `lr_scaling` (linear, sqrt or none) carries the
suggested LR from one to the other, and the scaled run warms up over train.warmup_steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.common import log, workbench
from training.config import DataConfig, LrFindConfig, ModelConfig, StrategyConfig, TrainConfig
from training.data import GlobalBatches
from training.lr_finder import range_test, scale_lr, suggest
from training.models import loss_fn
from training.parallel.compose import resolve_dims


@dataclass(frozen=True)
class LrFindInputs:
    lr_find: LrFindConfig
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    strategy: StrategyConfig
    nodes: int
    procs_per_node: int
    seed: int


@dataclass(frozen=True)
class CurvePoint:
    lr: float
    loss: float
    smoothed: float


@dataclass(frozen=True)
class LrFindResult:
    suggested_lr: float
    """The finder's suggestion at its own batch."""
    scaled_lr: float
    """The LR for the scaled run's effective global batch."""
    rule: str
    """The suggestion rule (`steepest` or `min_div_10`)."""
    lr_scaling: str
    finder_batch: int
    target_batch: int
    warmup_steps: int
    stopped_early: bool
    curve: list[CurvePoint]

    def metrics(self) -> list[tuple[str, float, int]]:
        out = [
            ("lr_find/suggested_lr", self.suggested_lr, 0),
            ("lr_find/scaled_lr", self.scaled_lr, 0),
            ("lr_find/target_batch", float(self.target_batch), 0),
        ]
        for i, p in enumerate(self.curve):
            out += [("lr_find/lr", p.lr, i), ("lr_find/loss", p.loss, i), ("lr_find/smoothed_loss", p.smoothed, i)]
        return out

    def headline(self) -> str:
        return (
            f"suggested {self.suggested_lr:.2e} ({self.rule}) at batch {self.finder_batch} -> "
            f"{self.scaled_lr:.2e} at batch {self.target_batch} ({self.lr_scaling})"
        )


def run(cfg: LrFindInputs) -> LrFindResult:
    finder = cfg.lr_find
    bench = workbench(cfg.model, cfg.data, cfg.seed)
    # The scaled run's effective batch: what one optimizer step of it averages over.
    dp = resolve_dims(cfg.strategy, cfg.nodes * cfg.procs_per_node).dp_size
    target = cfg.train.micro_batch_for(dp) * cfg.train.grad_accum * dp
    batch = finder.batch or cfg.train.micro_batch_for(dp)
    optimizer = torch.optim.AdamW(bench.model.parameters(), lr=finder.min_lr, weight_decay=cfg.train.weight_decay)
    rows = GlobalBatches(cfg.data.num_samples, batch, 1, 0, 1, cfg.seed)
    inputs, targets = bench.pool

    def batches():
        for step in range(finder.num_iters):
            idx = rows.rows(step, 0).to(bench.dev)
            yield inputs[idx], targets[idx]

    test = range_test(
        bench.model, optimizer, batches(), loss_fn,
        finder.min_lr, finder.max_lr, finder.num_iters, finder.beta, finder.diverge_threshold,
    )
    suggested = suggest(test.lrs, test.smoothed, finder.suggestion)
    scaled = scale_lr(suggested, finder.lr_scaling, batch, target)
    log("lr_find", f"{len(test.lrs)} iterations, suggested {suggested:.3e}, scaled {scaled:.3e}")
    return LrFindResult(
        suggested_lr=suggested,
        scaled_lr=scaled,
        rule=finder.suggestion,
        lr_scaling=finder.lr_scaling,
        finder_batch=batch,
        target_batch=target,
        warmup_steps=cfg.train.warmup_steps,
        stopped_early=test.stopped_early,
        curve=[CurvePoint(lr, loss, s) for lr, loss, s in zip(test.lrs, test.losses, test.smoothed, strict=True)],
    )
