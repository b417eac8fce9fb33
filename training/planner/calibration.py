"""Calibration: earlier runs' measured steps refine the model's components (plan.calibrate).

A non-negative least-squares fit of per-strategy communication scales and a compute scale to the
measured step times, with a prior toward the model (PRIOR_WEIGHT).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from training.planner.hardware import Hardware
from training.planner.step import StepPrediction


@dataclass(frozen=True)
class MeasuredStep:
    """One earlier run: the model's uncalibrated components for it, and its measured step time."""

    strategy: str
    devices: int
    predicted: StepPrediction
    """The model's components for that run, uncalibrated."""
    measured_step_s: float
    expert_imbalance: tuple[tuple[int, float], ...] = ()
    """(ep, imbalance) the run measured (TrainResult.expert_rank_imbalance); () for a dense model."""
    expert_held_imbalance: tuple[tuple[int, float], ...] = ()
    """(ep, imbalance of what the busiest rank holds) the run measured (TrainResult.expert_rank_held_imbalance)."""


def measured_imbalance(points: list[MeasuredStep]) -> tuple[tuple[int, float], ...]:
    """Per expert-parallel degree, the median imbalance earlier runs of the model measured
    (Workload.expert_imbalance); () when none did."""
    return _per_degree([p.expert_imbalance for p in points], statistics.median)


def measured_held_imbalance(points: list[MeasuredStep]) -> tuple[tuple[int, float], ...]:
    """Per expert-parallel degree, the highest of what earlier runs of the model measured of the
    busiest rank's held slots (Workload.expert_held_imbalance: memory must hold the worst step);
    () when none did."""
    return _per_degree([p.expert_held_imbalance for p in points], max)


def _per_degree(measured: list[tuple[tuple[int, float], ...]], combine) -> tuple[tuple[int, float], ...]:
    seen: dict[int, list[float]] = {}
    for pairs in measured:
        for ep, x in pairs:
            seen.setdefault(ep, []).append(x)
    return tuple((ep, combine(xs)) for ep, xs in sorted(seen.items()))


@dataclass(frozen=True)
class Calibration:
    """Scales fitted to earlier runs: step = compute_scale x (compute + overhead + bubble) +
    comm_scale[strategy] x exposed communication. One compute scale for the host's CPU-side work
    (contention, kernels the single-device timing missed); one communication scale per strategy,
    since the α–β terms miss different things for each. No cost per collective call of its own:
    what a rank waits at each call for a peer still busy is in the model's communication already
    (on a CPU host the shared-cores line, Hardware.call_cost, measured by the bandwidth stage), so
    the strategy's scale scales it. A fitted per-call term beside it traded off against zero3's
    scale (its only strategy with many calls): on three sets of bench_planner's points (this
    2-core host, 2026-12-06), each point predicted by a fit to the five others, 2, 6 and 5 of 6
    within 15 % with it, 4, 6 and 5 without (and PRIOR_WEIGHT's column size counted as below)."""

    compute_scale: float
    comm_scale: dict[str, float]
    points: int
    error_before_pct: float
    """Root-mean-square of (measured - predicted) / measured over the points, uncalibrated."""
    error_after_pct: float
    """The same, calibrated (in-sample: the fit's own points)."""
    bases: tuple[tuple[int, float], ...] = ()
    """(threads, the median compute per sample of the points timed with that many threads): the
    basis the scales were fitted on. A calibrated plan timed with as many threads predicts from it
    rather than from its own fresh timing (one timing on a busy host moves by a third; the scales
    would carry that into every prediction). Per thread count: a CPU run alone times its step with
    every core, a rank of several with its share (on this 2-core host gpt-tiny's 0.69 and 0.87 ms a
    sample), and one median of both would be neither. Empty where the points don't record it."""

    def step_s(self, strategy: str, step: StepPrediction) -> float:
        comm = self.comm_scale.get(strategy, self.default_comm_scale)
        return self.compute_scale * (step.compute_s + step.overhead_s + step.bubble_s) + comm * step.exposed_comm_s

    def basis(self, threads: int) -> float | None:
        """The points' median compute per sample timed with `threads` threads; None if none was."""
        return dict(self.bases).get(threads)

    def on_basis(self, hw: Hardware) -> Hardware:
        """`hw` with the compute timing the scales were fitted on, where points timed with its
        threads recorded one: the scales apply to components computed as theirs were."""
        basis = self.basis(hw.threads_per_device)
        return dataclasses.replace(hw, seconds_per_sample=basis) if basis else hw

    @property
    def default_comm_scale(self) -> float:
        """For a strategy no earlier run measured: the median of the fitted ones, else 1."""
        values = sorted(self.comm_scale.values())
        return values[len(values) // 2] if values else 1.0

    def describe(self) -> str:
        comm = ", ".join(f"{k} x{v:.2f}" for k, v in sorted(self.comm_scale.items())) or "none measured"
        timings = ", ".join(f"{s * 1e3:.3f} ms a sample with {t} thread{'s' if t > 1 else ''}" for t, s in self.bases)
        basis = f" on their plans' compute timing ({timings}; medians)" if self.bases else ""
        return (f"calibration: {self.points} earlier runs; compute x{self.compute_scale:.2f}{basis}, communication "
                f"{comm}; rms step-time error on them "
                f"{self.error_before_pct:.0f} % -> {self.error_after_pct:.0f} %")


def nonnegative_least_squares(a, b):  # noqa: ANN001, ANN201 - numpy arrays
    """argmin |a x - b| over x >= 0, exactly, by trying every set of free columns (a calibration
    has a handful: 2^k small solves); a negative scale would be noise, not physics."""
    import itertools

    import numpy as np

    best, best_x = float("inf"), np.zeros(a.shape[1])
    for k in range(1, a.shape[1] + 1):
        for free in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
            if (x < 0).any():
                continue
            residual = float(np.sum((a[:, free] @ x - b) ** 2))
            if residual < best - 1e-15:
                best, best_x = residual, np.zeros(a.shape[1])
                best_x[list(free)] = x
    return best_x


PRIOR_WEIGHT = 0.2
"""How many runs' worth of evidence the model's own communication terms (scale 1 for each
strategy) count for in a fit: each scale's distance from 1, in units of its column's typical size
over the runs of that strategy with communication, weighs as this many such runs' relative error.
A handful of runs leaves a strategy's scale resting on one point. Compute has a column in every
run, so it has no prior: one run at world 1 sets it exactly. (The column's size had been its rms
over every point, zeros included, which made the prior a fifth of what it said where the strategy
was one run of five.) On the three sets of Calibration's docstring, each point predicted by a fit
to the five others, 4, 6 and 4 of 6 within 15 % without the prior, 4, 6 and 5 with it (the third
set's zero3 at world 4: 1.20 -> 1.11); with the prior counted five times as strong, 4, 6 and 5
too. What every variant missed is the host: the first set's ddp at world 2 read 1.15x the
model alone and 1.22-1.23x calibrated whatever the fit (tests/unit/test_costmodel.py holds them)."""


def fit_calibration(points: list[MeasuredStep]) -> Calibration | None:
    """Least squares on relative error: minimise sum(((kc (c + o + b) + km[s] m - t) / t)^2) over the
    points, with kc shared and km per strategy, all >= 0, plus a prior toward the model's
    communication (PRIOR_WEIGHT). None without points."""
    import numpy as np

    points = [p for p in points if p.measured_step_s > 0 and p.predicted.step_s > 0]
    if not points:
        return None
    comm_strategies = sorted({p.strategy for p in points if p.predicted.exposed_comm_s > 0})
    a = np.zeros((len(points), 1 + len(comm_strategies)))
    for i, p in enumerate(points):
        a[i, 0] = (p.predicted.compute_s + p.predicted.overhead_s + p.predicted.bubble_s) / p.measured_step_s
        if p.predicted.exposed_comm_s > 0:
            a[i, 1 + comm_strategies.index(p.strategy)] = p.predicted.exposed_comm_s / p.measured_step_s
    # Ridge rows: one per communication scale, sqrt(w) x its column's rms over the runs it is in
    # (so the pull is unit-free) x (k - 1); none for compute.
    weight = np.zeros(a.shape[1])
    for j in range(1, a.shape[1]):
        weight[j] = math.sqrt(PRIOR_WEIGHT) * math.sqrt(float((a[a[:, j] > 0, j] ** 2).mean()))
    ridge = np.diag(weight)
    scales = nonnegative_least_squares(np.vstack([a, ridge]), np.concatenate([np.ones(len(points)), weight]))
    timed: dict[int, list[float]] = {}
    for p in points:
        if p.predicted.seconds_per_sample > 0 and p.predicted.threads > 0:
            timed.setdefault(p.predicted.threads, []).append(p.predicted.seconds_per_sample)
    calibration = Calibration(
        compute_scale=float(scales[0]),
        comm_scale={s: float(scales[1 + i]) for i, s in enumerate(comm_strategies)},
        points=len(points),
        error_before_pct=0.0,
        error_after_pct=0.0,
        bases=tuple((t, statistics.median(s)) for t, s in sorted(timed.items())),
    )

    def rms_error(step: Callable[[MeasuredStep], float]) -> float:
        # Never worse after than before: the fit minimises this plus the prior's pull, which is
        # zero at the model's scales (all 1), a feasible point; a median of a handful of points could be.
        return 100 * math.sqrt(sum(((p.measured_step_s - step(p)) / p.measured_step_s) ** 2 for p in points)
                               / len(points))

    return dataclasses.replace(
        calibration,
        error_before_pct=rms_error(lambda p: p.predicted.step_s),
        error_after_pct=rms_error(lambda p: calibration.step_s(p.strategy, p.predicted)),
    )


HISTORY_REPEATS = 3
"""Measurements of one (strategy, devices) the history takes the median of: a host that drifts
by a third between identical runs (this repo's CI machine does) shouldn't be judged by one."""


def settle(steps: list[MeasuredStep]) -> list[MeasuredStep]:
    """Each (strategy, devices) in `steps` (oldest first): the median of its first HISTORY_REPEATS
    measured step times, beside the first one's components, in a fixed order. The first ones, not
    the latest: the history must settle, or every re-run would see a new history, re-plan, and so
    retrain (train is keyed on the plan's result)."""
    points: dict[tuple[str, int], list[MeasuredStep]] = {}
    for step in steps:
        seen = points.setdefault((step.strategy, step.devices), [])
        # A cached train reports its earlier measurement again: that is no new measurement.
        if len(seen) < HISTORY_REPEATS and all(s.measured_step_s != step.measured_step_s for s in seen):
            seen.append(step)
    return [dataclasses.replace(points[k][0], measured_step_s=statistics.median(s.measured_step_s for s in points[k]))
            for k in sorted(points)]
