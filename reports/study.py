"""The study report: one study's invocations side by side, as a table, plots, Markdown and HTML.

A study run is one invocation's summary, read by pipelines.summary from a sweep dir (the multirun
callback, reports/sweep.py) or from MLflow, where every invocation logs its summary.json (the
compare stage, stages/compare.py). Both hand the same RunSummary objects to `StudyRun` and
`write_study_report`, so the two reports agree by construction.
"""

from __future__ import annotations

import base64
import html
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.summary import RunSummary, SkipReason
from reports import plots
from stages.bandwidth import VERDICT_COLLECTIVE, BandwidthResult
from stages.lr_find import LrFindResult
from stages.train_result import TrainResult
from stages.trials import TrialsResult
from training.config import DEGREES
from training.units import GIB

POINT_FACTS = ("pipeline", "strategy", "layout", "nodes", "procs_per_node", "world_size", "global_batch", "model", "data",
               "cluster", "launcher", "placement")
"""What makes two invocations the same point of a study: the RunFacts minus study, seed and time."""
COLUMNS = ("strategy", "layout", "nodes", "devices", "samples/s", "samples/s/device", "efficiency", "MFU %",
           "peak GiB/device", "final loss", "step-time error %", "measured rank", "plan's rank", "status")
CHOSEN_BY = ("you", "plan", "trials")
"""Who picked a run's layout: the invocation's overrides, the plan's search (strategy=auto), or the
plan's trials (strategy=auto with plan.trials > 0: the measured fastest of the plan's best)."""


@dataclass(frozen=True)
class StudyRun:
    """One invocation of a study, from its summary."""

    strategy: str
    """The strategy that trained (strategy=auto: the plan's choice)."""
    nodes: int
    procs_per_node: int
    world_size: int
    global_batch: int
    status: str
    """`ok`, `failed at <stage>`, or `incomplete`."""
    finished_at: float
    mlflow_run_id: str | None
    train: TrainResult | None = field(repr=False)
    """What it trained; None where training failed or never ran."""
    bandwidth: BandwidthResult | None = field(repr=False)
    lr_find: LrFindResult | None = field(repr=False)
    facts: dict[str, Any] = field(default_factory=dict, repr=False)
    """Its POINT_FACTS: runs with equal facts are one point of the study."""
    layout: str = ""
    """What trained (degrees, micro-batch x accumulation, precision, checkpointing), else what was asked."""
    chosen_by: str = "you"
    """One of CHOSEN_BY."""

    @classmethod
    def from_summary(cls, summary: RunSummary) -> StudyRun | None:
        """None for a summary that is no study point: its pipeline trains nothing (compare, what-if
        plans), or the invocation chose not to train (only=[plan] and the like)."""
        trainer = summary.stage_returning(TrainResult)
        if trainer is None or trainer.reason is SkipReason.NOT_SELECTED:
            return None
        train: TrainResult | None = trainer.result
        trials = summary.result(TrialsResult)
        failed = next((name for name, s in summary.stages.items() if s.status == "failed"), None)
        run = summary.run
        return cls(
            strategy=train.strategy if train else run.strategy,
            nodes=run.nodes,
            procs_per_node=run.procs_per_node,
            world_size=run.world_size,
            global_batch=run.global_batch,
            status="ok" if summary.ok else f"failed at {failed}" if failed else "incomplete",
            finished_at=run.finished_at,
            mlflow_run_id=summary.mlflow_run_id,
            train=train,
            bandwidth=summary.result(BandwidthResult),
            lr_find=summary.result(LrFindResult),
            facts={k: getattr(run, k) for k in POINT_FACTS},
            layout=trained_layout(train) if train else run.layout,
            chosen_by="you" if not (train and train.strategy_from_plan) else "trials" if trials and trials.chosen
            else "plan",
        )


def study_runs(summaries: list[RunSummary]) -> list[StudyRun]:
    """The study points among `summaries`."""
    return [r for r in map(StudyRun.from_summary, summaries) if r is not None]


def trained_layout(train: TrainResult) -> str:
    """The train result's layout in the words of the plan's candidates."""
    from training.planner.ranking import setting_label

    dims = {**dict(zip(DEGREES, train.dims, strict=True)), "cp": train.cp, "ep": train.ep}
    return setting_label(dims, train.micro_batch, train.grad_accum, train.precision, train.activation_checkpointing)


def latest_per_point(runs: list[StudyRun]) -> list[StudyRun]:
    """One run per point (equal facts; strategy=auto counts as what it trained): the last to
    finish with a train result, else the last (a re-run replaces a failed point, a later failure
    doesn't hide a success). Ordered by strategy and devices."""
    best: dict[str, StudyRun] = {}
    for run in runs:
        key = repr(sorted({**run.facts, "strategy": run.strategy}.items()))
        held = best.get(key)
        if held is None or (run.train is not None, run.finished_at) > (held.train is not None, held.finished_at):
            best[key] = run
    return sorted(best.values(), key=lambda r: (r.strategy, r.world_size, r.nodes, repr(sorted(r.facts.items()))))


def varying_facts(runs: list[StudyRun]) -> list[str]:
    """Facts that differ between runs of the same strategy and size (model, batch, cluster ...):
    the table shows them, or those rows would look alike. (The global batch of a weak-scaling
    study grows with the size; that alone is no variant.)"""
    groups: dict[tuple[str, int, int], list[StudyRun]] = {}
    for run in runs:
        groups.setdefault((run.strategy, run.nodes, run.procs_per_node), []).append(run)
    return [k for k in POINT_FACTS
            if any(len({repr(r.facts.get(k)) for r in group}) > 1 for group in groups.values())]


def contest(run: StudyRun) -> str:
    """Runs with equal contests compete: the same model, data, devices, global batch and cluster,
    differing only in how they were laid out (the facts other than strategy and layout)."""
    return repr(sorted((k, v) for k, v in run.facts.items() if k not in ("strategy", "layout")))


def _rank(values: dict[int, float | None]) -> dict[int, int | None]:
    """1 for the highest value; None where a value is missing."""
    known = sorted((v for v in values.values() if v is not None), reverse=True)
    return {k: None if v is None else known.index(v) + 1 for k, v in values.items()}


def ranks(runs: list[StudyRun]) -> dict[int, tuple[int | None, int | None]]:
    """id(run) -> (measured rank, the plan's rank) within its contest: by measured samples/s, and by
    the samples/s the run's own plan predicted for what it trained. Trained runs only."""
    out: dict[int, tuple[int | None, int | None]] = {}
    contests: dict[str, list[StudyRun]] = {}
    for run in runs:
        if run.train:
            contests.setdefault(contest(run), []).append(run)
    for group in contests.values():
        measured = _rank({id(r): r.train.samples_per_s for r in group})
        planned = _rank({id(r): r.train.prediction.samples_per_s if r.train.prediction else None for r in group})
        out.update({id(r): (measured[id(r)], planned[id(r)]) for r in group})
    return out


@dataclass(frozen=True)
class Regret:
    """How far the plan's recommendation, as measured, is from the best setting measured beside it.

    Runs of one setting (strategy and layout label: degrees, micro-batch, accumulation, precision,
    checkpointing) are one option measured several times, whoever chose them: an explicit run and
    an auto run of the same setting pool, and each setting counts by the median of its runs. On a
    host where identical runs differ by 15 %, comparing the recommendation's own run with the
    luckiest run of the same setting would measure the noise, not the advice."""

    devices: int
    chosen_by: str
    """plan (the search alone) or trials (the measured best of the plan's best layouts)."""
    layout: str
    samples_per_s: float
    """The median of every run of the recommended setting."""
    runs: int
    """How many runs of the recommended setting that median is over."""
    best_layout: str
    best_samples_per_s: float

    @property
    def ratio(self) -> float:
        return self.samples_per_s / self.best_samples_per_s

    def line(self) -> str:
        return (f"regret at {self.devices} devices, recommended by the {self.chosen_by}: {self.layout} measured "
                f"{self.samples_per_s:.4g} samples/s (median of its {self.runs} runs), the best measured "
                f"({self.best_layout}) {self.best_samples_per_s:.4g}: {self.ratio:.3f} of the best, "
                f"regret {100 * (1 - self.ratio):.1f} %")


def regrets(runs: list[StudyRun]) -> list[Regret]:
    """One per contest and chooser, for contests holding a run the plan chose (strategy=auto)."""
    contests: dict[str, list[StudyRun]] = {}
    for run in runs:
        if run.train and run.train.samples_per_s:
            contests.setdefault(contest(run), []).append(run)
    out = []
    for group in contests.values():
        settings: dict[tuple[str, str], list[float]] = {}
        for run in group:
            settings.setdefault((run.strategy, run.layout), []).append(run.train.samples_per_s)
        measured = {k: statistics.median(v) for k, v in settings.items()}
        best = max(measured, key=measured.get)
        for chosen in sorted((r for r in group if r.chosen_by != "you"), key=lambda r: CHOSEN_BY.index(r.chosen_by)):
            setting = (chosen.strategy, chosen.layout)
            out.append(Regret(chosen.world_size, chosen.chosen_by, chosen.layout, measured[setting],
                              len(settings[setting]), f"{best[0]} {best[1]}", measured[best]))
    return out


def table_rows(runs: list[StudyRun]) -> list[dict[str, Any]]:
    """The study table: strategy x nodes -> the numbers users compare (plus a `variant` column
    when runs differ in more than strategy and size)."""
    rows = []
    varying = [k for k in varying_facts(runs) if k != "layout"]  # the layout has its own column
    ranked = ranks(runs)
    for run in runs:
        t = run.train
        prediction = t.prediction if t else None
        measured_rank, plan_rank = ranked.get(id(run), (None, None))
        rows.append({
            "strategy": run.strategy,
            "layout": run.layout + ("" if run.chosen_by == "you" else f" (by the {run.chosen_by})"),
            "nodes": run.nodes,
            "devices": run.world_size,
            "samples/s": t.samples_per_s if t else None,
            "samples/s/device": t.samples_per_s_per_device if t else None,
            "efficiency": t.scaling_efficiency if t else None,
            "MFU %": t.mfu_pct if t else None,
            "peak GiB/device": t.peak_memory_bytes / GIB if t else None,
            "final loss": t.final_loss if t else None,
            "step-time error %": prediction.step_time_error_pct if prediction else None,
            "measured rank": measured_rank,
            "plan's rank": plan_rank,
            "status": run.status,
        })
        if varying:
            rows[-1]["variant"] = " ".join(f"{k}={run.facts.get(k)}" for k in varying)
    if any(r.train is not None and r.train.expert_load for r in runs):
        for run, row in zip(runs, rows, strict=True):
            row.update(expert_columns(run.train))
    return rows


def expert_columns(t: TrainResult | None) -> dict[str, Any]:
    """A mixture of experts' columns: its expert-parallel degree and the routing imbalance it
    measured at that degree (the busiest rank's slots over a balanced rank's, the steps' mean:
    what the plan's prediction of a later run stretches the experts' compute by)."""
    if t is None:
        return {"ep": None, "rank imbalance": None}
    return {"ep": t.ep, "rank imbalance": t.expert_rank_imbalance.get(str(t.ep)) if t.ep > 1 else None}


def columns(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """COLUMNS, with a mixture of experts' ep and imbalance after the layout, and a variant last
    where there are any."""
    out = COLUMNS
    if any("ep" in r for r in rows):
        at = out.index("layout") + 1
        out = (*out[:at], "ep", "rank imbalance", *out[at:])
    return (*out, "variant") if any("variant" in r for r in rows) else out


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def table_text(rows: list[dict[str, Any]]) -> str:
    """The table as aligned plain text, for the terminal."""
    cols = columns(rows)
    cells = [list(cols)] + [[_cell(r[c]) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def table_markdown(rows: list[dict[str, Any]]) -> str:
    cols = columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _plots(runs: list[StudyRun], out: Path) -> list[tuple[str, str]]:
    """Each plot (reports/plots.py) the study holds something to draw for: (title, file name)."""
    trains = [r.train for r in runs if r.train]
    probes: dict[int, BandwidthResult] = {}
    for run in sorted(runs, key=lambda r: r.world_size):
        if run.bandwidth and run.bandwidth.results:
            probes.setdefault(run.bandwidth.world_size, run.bandwidth)  # one per world size: the same link
    finder = next((r.lr_find for r in runs if r.lr_find), None)
    drawn = [
        ("Scaling efficiency (measured solid, plan's prediction dashed)", plots.efficiency(trains, out / "efficiency.png")),
        ("Throughput per device", plots.throughput(trains, out / "throughput_per_device.png")),
        ("Loss vs samples seen", plots.loss(trains, out / "loss_vs_samples.png")),
        ("MFU", plots.mfu(trains, out / "mfu.png")),
        ("Peak memory per device", plots.memory(trains, out / "memory.png")),
        ("Bus bandwidth per world size", plots.busbw(list(probes.values()), out / "busbw.png", VERDICT_COLLECTIVE)),
        ("LR range test", plots.lr_find(finder, trains, out / "lr_find.png") if finder else None),
    ]
    return [(title, name) for title, name in drawn if name]


@dataclass(frozen=True)
class StudyReport:
    study: str
    source: str
    rows: list[dict[str, Any]]
    files: list[str]
    """report.md, report.html and the PNGs, relative to the report folder."""

    def text(self) -> str:
        return f"study {self.study} ({self.source}): {len(self.rows)} runs\n{table_text(self.rows)}"


def write_study_report(runs: list[StudyRun], out: Path, study: str, source: str) -> StudyReport:
    """Write report.md, report.html (self-contained: plots inlined) and one PNG per plot."""
    out.mkdir(parents=True, exist_ok=True)
    runs = latest_per_point(runs)
    rows = table_rows(runs)
    drawn = _plots(runs, out)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    md = [f"# Study {study}", "", f"{len(runs)} runs, from {source}; written {stamp}.", "",
          table_markdown(rows), "", *_notes(runs), ""]
    for title, name in drawn:
        md += [f"## {title}", "", f"![{title}]({name})", ""]
    (out / "report.md").write_text("\n".join(md))
    (out / "report.html").write_text(_html(study, source, stamp, rows, drawn, out, runs))
    return StudyReport(study, source, rows, ["report.md", "report.html", *(name for _, name in drawn)])


def _notes(runs: list[StudyRun]) -> list[str]:
    notes = ["Efficiency is each run's samples/s over devices x its own 1-device baseline's; "
             "step-time error is (measured - predicted) / measured against the plan of that run."]
    notes += ["Measured rank and the plan's rank order the runs that compete (same model, data, devices and "
              "global batch) by measured samples/s and by the samples/s each run's plan predicted for it."]
    notes += [r.line() + "." for r in regrets(runs)]
    failed = [r for r in runs if r.status != "ok"]
    if failed:
        notes.append("Not complete: " + ", ".join(f"{r.strategy} x{r.world_size} ({r.status})" for r in failed) + ".")
    return notes


def _html(study: str, source: str, stamp: str, rows: list[dict[str, Any]], drawn: list[tuple[str, str]],
          out: Path, runs: list[StudyRun]) -> str:
    """One page with no outside references: styles inline, plots as data: URIs, no scripts."""
    esc = html.escape
    cols = columns(rows)
    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{esc(_cell(r[c]))}</td>" for c in cols) + "</tr>" for r in rows)
    figures = "".join(
        f'<figure><img alt="{esc(title)}" src="data:image/png;base64,'
        f'{base64.b64encode((out / name).read_bytes()).decode()}"><figcaption>{esc(title)}</figcaption></figure>'
        for title, name in drawn
    )
    notes = "".join(f"<p>{esc(n)}</p>" for n in _notes(runs))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Study {esc(study)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #bbb; padding: 4px 8px; text-align: right; }}
th {{ background: #eee; }}
figure {{ display: inline-block; margin: 1em; }}
</style></head>
<body><h1>Study {esc(study)}</h1>
<p>{len(rows)} runs, from {esc(source)}; written {esc(stamp)}.</p>
<table id="study-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
{notes}
{figures}
</body></html>
"""
