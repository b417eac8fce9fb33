"""Earlier runs for plan.calibrate: which runs are comparable, and their measured steps.

Two runs are comparable when the same model, data and batch ran on the same cluster through the
same launcher with the same precision: then the cost model's components for one and its
measured step time say how far the model is off for the other. Every invocation's MLflow run is
tagged with that fingerprint (`calibration_key`); the tracker (pipelines/tracking.py) finds the
finished ones and hands their summaries to `history`, and the runner hands the plan stage the
measured steps as its `history`. Which of them count (each point's first few, settled) is the
planner's rule: training/planner/calibration.py `settle`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol, runtime_checkable

from pipelines.configtools import to_jsonable
from pipelines.placement import Placement
from pipelines.summary import RunSummary
from training.planner.calibration import MeasuredStep, settle
from training.planner.predict import COSTMODEL_VERSION


def calibration_key(cfg: Any, placement: Placement | None) -> str:
    """The fingerprint of what the cost model's errors depend on (not the strategy or the world:
    those are what calibration generalises over). Where it ran is the workers' kind of node, read
    on them (Placement.hardware_class: the launcher and the nodes' hardware and software, without
    their names or number, so that one cluster's runs of every size calibrate each other); never
    the driver's host, which on a cluster is a login node."""
    facts = {
        # Components predicted by another version of the model can't be scaled like this one's.
        "costmodel": COSTMODEL_VERSION,
        "model": to_jsonable(cfg.model),
        "data": to_jsonable(cfg.data),
        "cluster": to_jsonable(cfg.cluster),
        "precision": cfg.strategy.precision,
        "activation_checkpointing": cfg.strategy.activation_checkpointing,
        "batch": [cfg.train.micro_batch, cfg.train.global_batch, cfg.train.grad_accum],
        "launcher": cfg.launcher.identity(),
        "procs_per_node": cfg.procs_per_node,
        "workers": placement.hardware_class if placement is not None and cfg.cluster.measured else None,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@runtime_checkable
class MeasuresStep(Protocol):
    """A stage result that holds a measured step time beside the plan's prediction for it (the
    train stage's). Calibration asks for this, not for a stage by name: the engine imports no stage."""

    def measured_step(self) -> MeasuredStep | None: ...


def measured_step(summary: RunSummary) -> MeasuredStep | None:
    """The trained step time beside its plan's uncalibrated components; None where nothing trained
    or the plan made no prediction for the run."""
    for stage in summary.stages.values():
        if isinstance(stage.result, MeasuresStep):
            return stage.result.measured_step()
    return None


def history(summaries: list[RunSummary]) -> list[MeasuredStep]:
    """The settled history (settle) of earlier invocations' summaries, oldest first."""
    return settle([step for summary in summaries if (step := measured_step(summary)) is not None])


