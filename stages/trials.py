"""trials: the cost model prunes, measurement decides.

With plan.trials=K, the K best fitting layouts of the plan's search (each at its best predicted
setting: one trial per layout, since the model errs most between layouts) are each trained for
plan.trial_steps steps on the current launcher's world (the same training step and loop as train,
the first two steps untimed), twice, in the order A B C then C B A, and the one with the highest
measured throughput is the
recommendation strategy=auto trains. The measurements also refit the cost model's calibration (how
far off it was for these very layouts on these very workers), reported beside them. A candidate
that does not run (out of memory, say) is reported as such and left out.

An out-of-memory error strikes one rank at a time, often mid-step while its peers wait in one of
the step's collectives. Every rank therefore runs each trial through training/isolation.py's
`run_isolated`: on process groups of its own, which the rank that ran out of memory tears down so
that its peers are released within seconds; then all agree, over the default group, to keep the
measurement or record the same trial as out of memory, and go on together. Each trial's groups
are destroyed after it and the CUDA cache emptied.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stages.common import log, progress
from stages.lr_find import LrFindResult
from stages.plan import PlanResult
from training.config import DataConfig, ModelConfig, StrategyConfig, TrainConfig
from training.isolation import run_isolated
from training.plan_config import PlanConfig
from training.planner.advice import candidate_settings
from training.planner.calibration import Calibration, MeasuredStep, fit_calibration
from training.planner.ranking import Candidate, dims_label

if TYPE_CHECKING:
    from pipelines.tracking import ChildRun

UNTIMED = 2
ROUNDS = 2
"""Each candidate is measured in two rounds, in the order A B C then C B A, and its step time is
the mean of its two medians: a host whose speed drifts while the trials run (another job on a
shared machine, a GPU warming up) then moves every candidate alike instead of favouring the first."""


@dataclass(frozen=True)
class TrialsInputs:
    plan: PlanConfig
    train: TrainConfig
    model: ModelConfig
    data: DataConfig
    strategy: StrategyConfig
    seed: int


@dataclass(frozen=True)
class Trial:
    candidate: Candidate
    step_time_s: float | None
    """The median timed step (None: it did not run)."""
    tokens_per_s: float | None
    error: str | None

    @property
    def measured_over_predicted(self) -> float | None:
        return self.step_time_s / self.candidate.step_time_s if self.step_time_s else None


@dataclass(frozen=True)
class TrialsResult:
    trials: list[Trial]
    chosen: Candidate | None
    """The measured fastest; None when no trial ran."""
    calibration: Calibration | None
    """The cost model refitted to the trials."""

    def metrics(self) -> list[tuple[str, float, int]]:
        out = []
        for i, t in enumerate(self.trials):
            if t.tokens_per_s is not None:
                out += [("trials/tokens_per_s", t.tokens_per_s, i), ("trials/predicted_tokens_per_s",
                                                                   t.candidate.tokens_per_s, i),
                        ("trials/measured_over_predicted_step", t.measured_over_predicted, i)]
        return out

    def child_runs(self) -> list[ChildRun]:
        """Each trial as a run nested under the plan's: the candidate's settings as params, its
        measured and predicted throughput as metrics."""
        from pipelines.tracking import ChildRun

        runs = []
        for i, t in enumerate(self.trials, 1):
            c = t.candidate
            params = {"strategy": c.strategy, "flavour": c.flavour, **c.dims, "micro_batch": c.micro_batch,
                      "grad_accum": c.grad_accum, "precision": c.precision,
                      "activation_checkpointing": c.activation_checkpointing, "command": c.command,
                      "chosen": self.chosen is not None and c.command == self.chosen.command,
                      "error": t.error or ""}
            metrics = [("trial/predicted_tokens_per_s", c.tokens_per_s, 0), ("trial/predicted_step_s", c.step_time_s, 0)]
            if t.step_time_s is not None:
                metrics += [("trial/tokens_per_s", t.tokens_per_s, 0), ("trial/step_s", t.step_time_s, 0),
                            ("trial/measured_over_predicted_step", t.measured_over_predicted, 0)]
            runs.append(ChildRun(f"trial {i}: {c.strategy} {dims_label(c.dims)}", params, metrics, under="plan"))
        return runs

    def headline(self) -> str:
        ran = [t for t in self.trials if t.tokens_per_s is not None]
        if self.chosen is None:
            return f"{len(self.trials)} trials, none ran"
        return (f"{len(ran)} of {len(self.trials)} candidates measured: {self.chosen.strategy} "
                f"{max(t.tokens_per_s for t in ran):.0f} tokens/s is the fastest")


def run(cfg: TrialsInputs, *, plan: PlanResult, lr_find: LrFindResult) -> TrialsResult:
    from training.dist import world_size

    picked = plan.layouts[: cfg.plan.trials]
    rounds: dict[int, list[float]] = {i: [] for i in range(len(picked))}
    errors: dict[int, str] = {}
    for r in range(ROUNDS):
        for i in range(len(picked)) if r % 2 == 0 else reversed(range(len(picked))):
            if i in errors:
                continue
            candidate = picked[i]
            progress("trials", f"round {r + 1}/{ROUNDS}, trial {i + 1}/{len(picked)}: "
                               f"{candidate.command.split(' strategy=', 1)[-1]}")
            step_s, error = run_isolated(lambda c=candidate: _measure(cfg, c, lr_find, world_size()),
                                         lambda line: log("trials", line))
            if error is not None:
                errors[i] = error
            else:
                rounds[i].append(step_s)
    trials = []
    for i, candidate in enumerate(picked):
        if i in errors:
            trials.append(Trial(candidate, None, None, errors[i]))
        else:
            step_s = statistics.mean(rounds[i])
            trials.append(Trial(candidate, step_s, candidate.tokens_per_s * candidate.step_time_s / step_s, None))
        log("trials", f"{candidate.strategy} {candidate.dims}: {trials[-1].tokens_per_s or trials[-1].error}")
    ran = [t for t in trials if t.step_time_s is not None]
    chosen = max(ran, key=lambda t: t.tokens_per_s).candidate if ran else None
    points = [MeasuredStep(t.candidate.strategy, plan.world_size, t.candidate.prediction.components, t.step_time_s) for t in ran]
    return TrialsResult(trials, chosen, fit_calibration(points))


def _measure(cfg: TrialsInputs, candidate: Candidate, lr_find: LrFindResult, world: int) -> float:
    """The median step of a short run of `candidate` (this rank's)."""
    from stages.setting import build_setting, run_setting

    strategy, train = candidate_settings(candidate, cfg.strategy, cfg.train, world)
    # Short, untimed at first, at the peak LR throughout (no warm-up to wait for), no checkpoints.
    train = dataclasses.replace(train, steps=cfg.plan.trial_steps, timing_warmup=UNTIMED, log_every=cfg.plan.trial_steps,
                                ckpt_every=0, warmup_steps=0, schedule="constant")
    setting = build_setting(cfg.model, cfg.data, cfg.seed, strategy, train, lr_find)
    stats = run_setting(setting, cfg.data.num_workers)
    return statistics.median(stats.step_seconds)  # `run_isolated` frees what the trial held
