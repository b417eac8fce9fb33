"""lr_find: an LR range test on ONE device; its suggestion is carried to each scaled run by a rule.

The finder's batch is small and fixed; the scaled run's effective global batch is
micro_batch x grad_accum x data-parallel size. `lr_scaling` (linear, sqrt or none) carries the
suggested LR from one to the other (`LrFindResult.scaled`, applied by plan and train, which know
the world), and the scaled run warms up over train.warmup_steps. The finder itself depends on
neither strategy nor world size, so one cached result serves every point of a study.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.common import log, progress, workbench
from training.config import DataConfig, ModelConfig, StrategyConfig
from training.dist import all_reduce_sum, world_size
from training.lr_finder import scale_lr
from training.parallel.dims import resolve_dims
from training.plan_config import LrFindConfig
from training.planner.fit import SHARDED


@dataclass(frozen=True)
class LrFindInputs:
    lr_find: LrFindConfig
    model: ModelConfig
    data: DataConfig
    seed: int
    batch: int
    """The finder's batch: lr_find.batch, or the scaled run's per-rank micro-batch."""
    weight_decay: float
    grad_clip: float | None
    precision: str
    """The run's precision: the finder steps as training will (training/step.py)."""
    tf32: bool = True
    """train.tf32: an fp32 run's matmuls on CUDA as training will run them."""

    @classmethod
    def from_config(cls, cfg: Any) -> LrFindInputs:
        dp = resolve_dims(cfg.strategy, cfg.nodes * cfg.procs_per_node).dp_size
        batch = cfg.lr_find.batch or cfg.train.micro_batch_for(dp)
        return cls(cfg.lr_find, cfg.model, cfg.data, cfg.seed, batch, cfg.train.weight_decay, cfg.train.grad_clip,
                   cfg.strategy.precision, cfg.train.tf32)


@dataclass(frozen=True)
class CurvePoint:
    lr: float
    loss: float
    smoothed: float


@dataclass(frozen=True)
class LrFindResult:
    suggested_lr: float
    """The finder's suggestion at its own batch."""
    rule: str
    """The suggestion rule (`steepest` or `min_div_10`)."""
    lr_scaling: str
    """How the suggestion is carried to a larger batch: linear, sqrt or none."""
    finder_batch: int
    stopped_early: bool
    curve: list[CurvePoint]
    world_size: int = 1
    """Ranks it ran on: 1 (one device), or zero3 over the smallest world that holds the model."""

    def scaled(self, target_batch: int) -> float:
        """The LR for a run whose optimizer step averages over `target_batch` samples."""
        return scale_lr(self.suggested_lr, self.lr_scaling, self.finder_batch, target_batch)

    def metrics(self) -> list[tuple[str, float, int]]:
        out = [("lr_find/suggested_lr", self.suggested_lr, 0), ("lr_find/finder_batch", float(self.finder_batch), 0)]
        for i, p in enumerate(self.curve):
            out += [("lr_find/lr", p.lr, i), ("lr_find/loss", p.loss, i), ("lr_find/smoothed_loss", p.smoothed, i)]
        return out

    def headline(self) -> str:
        where = "" if self.world_size == 1 else f", on zero3 over {self.world_size} ranks (the model exceeds one device)"
        return (f"suggested {self.suggested_lr:.2e} ({self.rule}) at batch {self.finder_batch}, "
                f"{len(self.curve)} iterations{where}; scaled by the {self.lr_scaling} rule")


def run(cfg: LrFindInputs) -> LrFindResult:
    import torch

    from training.data import GlobalBatches, loader
    from training.lr_finder import range_test, suggest
    from training.parallel.compose import trainable
    from training.step import optimizer_step

    finder = cfg.lr_find
    ranks = world_size()  # more than one: the model doesn't fit one device (the engine asked `smallest_world`)
    bench = workbench(cfg.model, cfg.data, cfg.seed, cfg.tf32)
    layout = StrategyConfig(name=SHARDED if ranks > 1 else "ddp", precision=cfg.precision)
    parallel, optimizer = trainable(bench.model, bench.spec, layout, bench.dev, bench.loss, finder.min_lr,
                                    cfg.weight_decay)
    # The finder's batch, split over the ranks that hold the model: the same steps as on one device.
    rows = GlobalBatches(len(bench.dataset), cfg.batch // ranks, 1, parallel.dp_rank, ranks, cfg.seed)
    batches = iter(loader(bench.dataset, rows, 0, finder.num_iters, cfg.data.num_workers, bench.dev))

    def step() -> torch.Tensor:
        loss = optimizer_step(parallel, optimizer, [next(batches)], 1, cfg.grad_clip, bench.dev)
        return all_reduce_sum(loss) / ranks  # every rank decides on the same smoothed loss

    test = range_test(
        bench.model, optimizer, step,
        finder.min_lr, finder.max_lr, finder.num_iters, finder.beta, finder.diverge_threshold,
        on_step=lambda i, lr, loss: progress("lr_find", f"iteration {i + 1}/{finder.num_iters}: lr {lr:.2e}, "
                                                        f"smoothed loss {loss:.4f}"),
        restore=False,  # the model is discarded after: a copy of its states is memory the finder can't spare
    )
    suggested = suggest(test.lrs, test.smoothed, finder.suggestion)
    where = "one device" if ranks == 1 else f"{SHARDED} over {ranks} ranks, the smallest layout that holds the model"
    log("lr_find", f"{len(test.lrs)} iterations, suggested {suggested:.3e} at batch {cfg.batch} ({where})")
    return LrFindResult(
        suggested_lr=suggested,
        rule=finder.suggestion,
        lr_scaling=finder.lr_scaling,
        finder_batch=cfg.batch,
        stopped_early=test.stopped_early,
        curve=[CurvePoint(lr, loss, s) for lr, loss, s in zip(test.lrs, test.losses, test.smoothed, strict=True)],
        world_size=ranks,
    )


def smallest_world(cfg: LrFindInputs, budget_bytes: float, max_ranks: int) -> int:
    """The engine's question (the stage's `fits`): how many ranks hold the finder's steps within
    `budget_bytes` each: 1, or zero3 over the fewest that do (all `max_ranks` if none fits:
    the config check has refused that already)."""
    from training.planner.fit import counted
    from training.planner.fit import smallest_world as fewest

    c = counted(cfg.model, cfg.data, cfg.seed, cfg.precision, "none")
    fit = fewest(c, StrategyConfig(precision=cfg.precision), cfg.batch, budget_bytes, max_ranks)
    return fit.ranks if fit is not None else max_ranks
