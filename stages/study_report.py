"""The study report: one sweep's invocations side by side, as a table, plots, Markdown and HTML.

A study run is one invocation's summary.json (its `run` block and its stages' results), read
either from a sweep dir (the multirun callback) or from MLflow, where every invocation logs its
summary.json (pipeline=compare). Both paths hand the same dicts to `write_study_report`, so the
two reports agree by construction.
"""

from __future__ import annotations

import base64
import html
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.units import GIB

POINT_FACTS = ("pipeline", "strategy", "layout", "nodes", "procs_per_node", "world_size", "global_batch", "model", "data",
               "cluster", "launcher", "placement")
"""What makes two invocations the same point of a study (the run block minus ids, seed and time)."""
COLUMNS = ("strategy", "layout", "nodes", "devices", "samples/s", "samples/s/device", "efficiency", "MFU %",
           "peak GiB/device", "final loss", "step-time error %", "measured rank", "plan's rank", "status")
CHOSEN_BY = ("you", "plan", "trials")
"""Who picked a run's layout: the invocation's overrides, the plan's search (strategy=auto), or the
plan's trials (strategy=auto with plan.trials > 0: the measured fastest of the plan's best)."""


@dataclass(frozen=True)
class StudyRun:
    """One invocation of a study, from its summary.json."""

    strategy: str
    """The strategy that trained (strategy=auto: the plan's choice)."""
    nodes: int
    procs_per_node: int
    world_size: int
    global_batch: int
    status: str
    """`ok`, or `failed at <stage>`."""
    finished_at: float
    mlflow_run_id: str | None
    stages: dict[str, Any] = field(repr=False)
    """Each stage's result (None where it produced none)."""
    facts: dict[str, Any] = field(default_factory=dict, repr=False)
    """The run block's POINT_FACTS: runs with equal facts are one point of the study."""
    layout: str = ""
    """What trained (degrees, micro-batch x accumulation, precision, checkpointing), else what was asked."""
    chosen_by: str = "you"
    """One of CHOSEN_BY."""

    @classmethod
    def from_summary(cls, data: dict[str, Any]) -> StudyRun | None:
        """None for a summary that is not a study point (no `run` block, or no train stage)."""
        run = data.get("run")
        train_stage = data.get("stages", {}).get("train")
        if not run or train_stage is None:  # compare, what-if plans: no study point
            return None
        if train_stage.get("status") == "skipped" and "only=" in (train_stage.get("error") or ""):
            return None  # only=[plan] and the like: the invocation chose not to train
        stages = {name: s.get("result") for name, s in data.get("stages", {}).items()}
        failed = next((n for n, s in data.get("stages", {}).items() if s.get("status") == "failed"), None)
        train = stages.get("train") or {}
        trials = stages.get("trials") or {}
        chosen_by = "you" if not train.get("strategy_from_plan") else "trials" if trials.get("chosen") else "plan"
        return cls(
            strategy=train.get("strategy") or run["strategy"],
            nodes=int(run["nodes"]),
            procs_per_node=int(run["procs_per_node"]),
            world_size=int(run["world_size"]),
            global_batch=int(run["global_batch"]),
            status="ok" if data.get("ok") else f"failed at {failed}" if failed else "incomplete",
            finished_at=float(run.get("finished_at") or 0.0),
            mlflow_run_id=data.get("mlflow_run_id"),
            stages=stages,
            facts={k: run.get(k) for k in POINT_FACTS},
            layout=trained_layout(train) or str(run.get("layout") or ""),
            chosen_by=chosen_by,
        )

    @property
    def train(self) -> dict[str, Any] | None:
        return self.stages.get("train")


def trained_layout(train: dict[str, Any]) -> str | None:
    """The train result's layout in the words of the plan's candidates (None: nothing trained)."""
    from training.search import setting_label

    if not train.get("dims"):
        return None
    dims = dict(zip(("dp_replicate", "dp_shard", "tp", "pp"), train["dims"], strict=True))
    return setting_label(dims, train["micro_batch"], train["grad_accum"], train["precision"],
                         train["activation_checkpointing"])


def candidate_layout(candidate: dict[str, Any]) -> str:
    """A plan candidate (summary.json's `recommended`, `candidates`) in the same words."""
    from training.search import setting_label

    return setting_label(candidate["dims"], candidate["micro_batch"], candidate["grad_accum"], candidate["precision"],
                         candidate["activation_checkpointing"])


def latest_per_point(runs: list[StudyRun]) -> list[StudyRun]:
    """One run per point (equal facts; strategy=auto counts as what it trained): the last to
    finish with a train result, else the last (a re-run replaces a failed point, a later failure
    doesn't hide a success). Ordered by strategy and devices."""
    best: dict[str, StudyRun] = {}
    for run in runs:
        key = repr(sorted({**run.facts, "strategy": run.strategy}.items()))
        held = best.get(key)
        if held is None or (bool(run.train), run.finished_at) > (bool(held.train), held.finished_at):
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
        measured = _rank({id(r): r.train.get("samples_per_s") for r in group})
        planned = _rank({id(r): (r.train.get("prediction") or {}).get("samples_per_s") for r in group})
        out.update({id(r): (measured[id(r)], planned[id(r)]) for r in group})
    return out


@dataclass(frozen=True)
class Regret:
    """How far the plan's recommendation, as measured, is from the best layout measured beside it."""

    devices: int
    chosen_by: str
    """plan (the search alone) or trials (the measured best of the plan's top candidates)."""
    layout: str
    samples_per_s: float
    best_layout: str
    best_samples_per_s: float

    @property
    def ratio(self) -> float:
        return self.samples_per_s / self.best_samples_per_s

    def line(self) -> str:
        return (f"regret at {self.devices} devices, recommended by the {self.chosen_by}: {self.layout} measured "
                f"{self.samples_per_s:.4g} samples/s, the best measured ({self.best_layout}) {self.best_samples_per_s:.4g}:"
                f" {self.ratio:.3f} of the best, regret {100 * (1 - self.ratio):.1f} %")


def regrets(runs: list[StudyRun]) -> list[Regret]:
    """One per contest and chooser, for contests holding a run the plan chose (strategy=auto)."""
    contests: dict[str, list[StudyRun]] = {}
    for run in runs:
        if run.train and run.train.get("samples_per_s"):
            contests.setdefault(contest(run), []).append(run)
    out = []
    for group in contests.values():
        best = max(group, key=lambda r: r.train["samples_per_s"])
        for chosen in sorted((r for r in group if r.chosen_by != "you"), key=lambda r: CHOSEN_BY.index(r.chosen_by)):
            out.append(Regret(chosen.world_size, chosen.chosen_by, chosen.layout, chosen.train["samples_per_s"],
                              f"{best.strategy} {best.layout}", best.train["samples_per_s"]))
    return out


def table_rows(runs: list[StudyRun]) -> list[dict[str, Any]]:
    """The study table: strategy x nodes -> the numbers users compare (plus a `variant` column
    when runs differ in more than strategy and size)."""
    rows = []
    varying = [k for k in varying_facts(runs) if k != "layout"]  # the layout has its own column
    ranked = ranks(runs)
    for run in runs:
        t = run.train or {}
        prediction = t.get("prediction") or {}
        measured_rank, plan_rank = ranked.get(id(run), (None, None))
        rows.append({
            "strategy": run.strategy,
            "layout": run.layout + ("" if run.chosen_by == "you" else f" (by the {run.chosen_by})"),
            "nodes": run.nodes,
            "devices": run.world_size,
            "samples/s": t.get("samples_per_s"),
            "samples/s/device": t.get("samples_per_s_per_device"),
            "efficiency": t.get("scaling_efficiency"),
            "MFU %": t.get("mfu_pct"),
            "peak GiB/device": t["peak_memory_bytes"] / GIB if "peak_memory_bytes" in t else None,
            "final loss": t.get("final_loss"),
            "step-time error %": prediction.get("step_time_error_pct"),
            "measured rank": measured_rank,
            "plan's rank": plan_rank,
            "status": run.status,
        })
        if varying:
            rows[-1]["variant"] = " ".join(f"{k}={run.facts.get(k)}" for k in varying)
    return rows


def columns(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    return (*COLUMNS, "variant") if any("variant" in r for r in rows) else COLUMNS


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


# --- plots: each returns its file name, or None when the study holds nothing to draw ----------

def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def _by_strategy(runs: list[StudyRun]) -> dict[str, list[StudyRun]]:
    groups: dict[str, list[StudyRun]] = {}
    for run in runs:
        if run.train:
            groups.setdefault(run.strategy, []).append(run)
    return {s: sorted(g, key=lambda r: r.world_size) for s, g in sorted(groups.items())}


def plot_efficiency(runs: list[StudyRun], out: Path) -> str | None:
    import matplotlib.pyplot as plt

    groups = _by_strategy(runs)
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (strategy, group) in enumerate(groups.items()):
        color = f"C{i}"
        ax.plot([r.world_size for r in group], [r.train["scaling_efficiency"] for r in group],
                marker="o", color=color, label=f"{strategy} measured")
        predicted = [(r.world_size, r.train["prediction"]["scaling_efficiency"]) for r in group if r.train.get("prediction")]
        if predicted:
            ax.plot(*zip(*predicted, strict=True), ls="--", marker="x", color=color, label=f"{strategy} predicted (plan)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="devices", ylabel="scaling efficiency", title="Scaling efficiency vs devices")
    _device_ticks(ax, runs)
    ax.legend(fontsize=8)
    return _save(fig, out / "efficiency.png")


def _device_ticks(ax: Any, runs: list[StudyRun]) -> None:
    ticks = sorted({r.world_size for r in runs})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def plot_throughput(runs: list[StudyRun], out: Path) -> str | None:
    import matplotlib.pyplot as plt

    groups = _by_strategy(runs)
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy, group in groups.items():
        ax.plot([r.world_size for r in group], [r.train["samples_per_s_per_device"] for r in group],
                marker="o", label=strategy)
    ax.set(xscale="log", xlabel="devices", ylabel="samples/s per device", title="Throughput per device vs devices")
    _device_ticks(ax, runs)
    ax.legend(fontsize=8)
    return _save(fig, out / "throughput_per_device.png")


def plot_loss(runs: list[StudyRun], out: Path) -> str | None:
    import matplotlib.pyplot as plt

    trained = [r for r in runs if r.train and r.train.get("losses")]
    if not trained:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in trained:
        batch = run.train["global_batch"]
        losses = run.train["losses"]
        # Samples seen, not steps: runs of different world sizes (and batches) line up.
        ax.plot([batch * (i + 1) for i in range(len(losses))], losses, label=f"{run.strategy} x{run.world_size}")
    ax.set(xlabel="samples seen", ylabel="training loss", title="Loss vs samples seen")
    ax.legend(fontsize=8)
    return _save(fig, out / "loss_vs_samples.png")


def plot_mfu(runs: list[StudyRun], out: Path) -> str | None:
    """MFU where the device's peak FLOP/s is known; otherwise the achieved model FLOP/s per
    device, which is what MFU divides (CPUs have no listed peak)."""
    import matplotlib.pyplot as plt

    groups = _by_strategy(runs)
    if not groups:
        return None
    known = all(r.train.get("mfu_pct") is not None for g in groups.values() for r in g)
    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy, group in groups.items():
        if known:
            values = [r.train["mfu_pct"] for r in group]
        else:
            values = [r.train["flops_per_sample"] * r.train["samples_per_s_per_device"] / 1e9 for r in group]
        ax.plot([r.world_size for r in group], values, marker="o", label=strategy)
    if known:
        ax.set(ylabel="MFU (%)", title="Model FLOPs utilisation vs devices")
    else:
        ax.set(ylabel="model GFLOP/s per device",
               title="Achieved model FLOP/s per device\n(MFU needs a peak FLOP/s; none is listed for this device)")
    ax.set(xscale="log", xlabel="devices")
    _device_ticks(ax, runs)
    ax.legend(fontsize=8)
    return _save(fig, out / "mfu.png")


def plot_memory(runs: list[StudyRun], out: Path) -> str | None:
    import matplotlib.pyplot as plt

    groups = _by_strategy(runs)
    if not groups:
        return None
    worlds = sorted({r.world_size for g in groups.values() for r in g})
    width = 0.8 / len(worlds)
    fig, ax = plt.subplots(figsize=(6, 4))
    for j, world in enumerate(worlds):
        xs, heights, predicted = [], [], []
        for i, group in enumerate(groups.values()):
            run = next((r for r in group if r.world_size == world), None)
            if run is None:
                continue
            x = i - 0.4 + width * (j + 0.5)
            xs.append(x)
            heights.append(run.train["peak_memory_bytes"] / GIB)
            if run.train.get("prediction"):
                predicted.append((x, run.train["prediction"]["memory_bytes"] / GIB))
        ax.bar(xs, heights, width=width * 0.9, label=f"{world} devices", color=f"C{j}")
        if predicted:
            ax.plot(*zip(*predicted, strict=True), ls="none", marker="_", ms=14, mew=2, color="black")
    ax.plot([], [], ls="none", marker="_", ms=14, mew=2, color="black", label="predicted (plan)")
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set(ylabel="peak memory per device (GiB)", title="Peak memory per device")
    ax.legend(fontsize=8)
    return _save(fig, out / "memory.png")


def plot_busbw(runs: list[StudyRun], out: Path, collective: str = "all_reduce") -> str | None:
    import matplotlib.pyplot as plt

    curves: dict[int, list[tuple[int, float]]] = {}
    for run in sorted(runs, key=lambda r: r.world_size):
        bw = run.stages.get("bandwidth") or {}
        points = [(m["bytes"], m["busbw_gbps"]) for m in bw.get("results", []) if m["collective"] == collective]
        if points and bw.get("world_size") not in curves:
            curves[bw["world_size"]] = points  # one probe per world size: the same link
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for world, points in curves.items():
        ax.plot(*zip(*points, strict=True), marker="o", ms=3, label=f"world {world}")
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel=f"{collective} busbw (GB/s)",
           title=f"{collective} bus bandwidth vs message size")
    ax.legend(fontsize=8)
    return _save(fig, out / "busbw.png")


def plot_lr(runs: list[StudyRun], out: Path) -> str | None:
    import matplotlib.pyplot as plt

    found = [r.stages["lr_find"] for r in runs if r.stages.get("lr_find")]
    if not found:
        return None
    lr = found[0]
    curve = lr["curve"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["lr"] for p in curve], [p["smoothed"] for p in curve], label="smoothed loss")
    ax.axvline(lr["suggested_lr"], color="C2", ls="--",
               label=f"suggested {lr['suggested_lr']:.1e} at batch {lr['finder_batch']} ({lr['rule']})")
    # The LR each run trained with: the suggestion carried to its global batch by the rule.
    scaled = sorted({(r.train["global_batch"], r.train["lr"]) for r in runs if r.train})
    for i, (batch, value) in enumerate(scaled):
        ax.axvline(value, color=f"C{3 + i}", ls=":", label=f"scaled {value:.1e} at batch {batch} ({lr['lr_scaling']})")
    top = 1.3 * max(curve[0]["smoothed"], min(p["loss"] for p in curve))
    ax.set(xscale="log", xlabel="learning rate", ylabel="loss", title="LR range test and scaled LRs", ylim=(None, top))
    ax.legend(fontsize=7)
    return _save(fig, out / "lr_find.png")


PLOTS = (
    ("Scaling efficiency (measured solid, plan's prediction dashed)", plot_efficiency),
    ("Throughput per device", plot_throughput),
    ("Loss vs samples seen", plot_loss),
    ("MFU", plot_mfu),
    ("Peak memory per device", plot_memory),
    ("Bus bandwidth per world size", plot_busbw),
    ("LR range test", plot_lr),
)


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
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    runs = latest_per_point(runs)
    rows = table_rows(runs)
    plots = [(title, fn(runs, out)) for title, fn in PLOTS]
    plots = [(title, name) for title, name in plots if name]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    md = [f"# Study {study}", "", f"{len(runs)} runs, from {source}; written {stamp}.", "",
          table_markdown(rows), "", *_notes(runs), ""]
    for title, name in plots:
        md += [f"## {title}", "", f"![{title}]({name})", ""]
    (out / "report.md").write_text("\n".join(md))
    (out / "report.html").write_text(_html(study, source, stamp, rows, plots, out, runs))
    return StudyReport(study, source, rows, ["report.md", "report.html", *(name for _, name in plots)])


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


def _html(study: str, source: str, stamp: str, rows: list[dict[str, Any]], plots: list[tuple[str, str]],
          out: Path, runs: list[StudyRun]) -> str:
    """One page with no outside references: styles inline, plots as data: URIs, no scripts."""
    esc = html.escape
    cols = columns(rows)
    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{esc(_cell(r[c]))}</td>" for c in cols) + "</tr>" for r in rows)
    figures = "".join(
        f'<figure><img alt="{esc(title)}" src="data:image/png;base64,'
        f'{base64.b64encode((out / name).read_bytes()).decode()}"><figcaption>{esc(title)}</figcaption></figure>'
        for title, name in plots
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
