"""Cheap driver-side stages for engine tests: they read real top-level config keys."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from training.config import TrainConfig
from training.plan_config import LrFindConfig


@dataclass(frozen=True)
class SeedInputs:
    seed: int


@dataclass(frozen=True)
class LrInputs:
    lr_find: LrFindConfig


@dataclass(frozen=True)
class TrainInputs:
    train: TrainConfig


@dataclass(frozen=True)
class Num:
    value: int

    def metrics(self) -> list[tuple[str, float, int]]:
        return [("toy/value", float(self.value), 0)]


def source(cfg: SeedInputs) -> Num:
    return Num(cfg.seed)


def middle(cfg: LrInputs, *, source: Num) -> Num:
    return Num(source.value + cfg.lr_find.num_iters)


def sink(cfg: TrainInputs, *, middle: Num, artifacts: Path) -> Num:
    if cfg.train.steps == 13:
        raise RuntimeError("planted failure at steps=13")
    (artifacts / "note.txt").write_text(f"{middle.value}\n")
    return Num(middle.value + cfg.train.steps)


def side(cfg: SeedInputs, *, source: Num) -> Num:
    return Num(source.value * 2)


def wrong_needs(cfg: SeedInputs, *, other: Num) -> Num:
    return other


def untyped(cfg, *, source: Num) -> Num:  # noqa: ANN001 - deliberately unannotated
    return source


def reports_progress(_inputs: object) -> str:
    """A worker stage that reports five iterations as a real stage does, slowly enough to be seen."""
    import time

    from stages.common import progress

    for i in range(1, 6):
        progress("lr_find", f"iteration {i}/5")
        time.sleep(0.2)
    return "done"
