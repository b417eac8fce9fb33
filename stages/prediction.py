"""A trained run held against the plan's prediction for it: step time, throughput, scaling
efficiency and memory, each as (measured - predicted) / measured. What calibration (plan.calibrate)
later fits is the prediction's uncalibrated components, kept here beside the measurement."""

from __future__ import annotations

from dataclasses import dataclass

from stages.plan import PlanResult
from training.planner.ranking import Candidate
from training.planner.step import StepPrediction


@dataclass(frozen=True)
class PredictionCheck:
    """The plan's prediction for what this run trained (the requested layout, or under
    strategy=auto the recommendation or trials' choice), against what this run measured."""

    components: StepPrediction
    """The step time's uncalibrated parts: what calibration (plan.calibrate) fits to this run."""
    step_time_s: float
    samples_per_s: float
    scaling_efficiency: float
    memory_bytes: float
    step_time_error_pct: float
    """(measured - predicted) / measured, in percent."""
    samples_per_s_error_pct: float
    efficiency_error_pct: float
    memory_error_pct: float


def _error_pct(measured: float, predicted: float) -> float:
    return 100.0 * (measured - predicted) / measured if measured else float("nan")


def check_prediction(plan: PlanResult, chosen: Candidate | None, strategy: str, world: int, step_time_s: float,
                     samples_per_s: float, efficiency: float, memory_bytes: float) -> PredictionCheck | None:
    """Hold the run against the plan's prediction for it: the chosen candidate's when strategy=auto
    chose one, else the plan's for `strategy` on `world` (None when the plan made none)."""
    predicted = chosen.prediction if chosen is not None else plan.prediction_for_run(strategy, world)
    if predicted is None:
        return None
    return PredictionCheck(
        components=predicted.components,
        step_time_s=predicted.step_time_s,
        samples_per_s=predicted.samples_per_s,
        scaling_efficiency=predicted.scaling_efficiency,
        memory_bytes=predicted.memory_per_device_bytes,
        step_time_error_pct=_error_pct(step_time_s, predicted.step_time_s),
        samples_per_s_error_pct=_error_pct(samples_per_s, predicted.samples_per_s),
        efficiency_error_pct=_error_pct(efficiency, predicted.scaling_efficiency),
        memory_error_pct=_error_pct(memory_bytes, predicted.memory_per_device_bytes),
    )
