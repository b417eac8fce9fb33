"""What MLflow's own UI shows of a study, decided in one place: run names, the data an invocation
declares, and the experiment's saved views (rows, columns, grouping, charts). docs/tracking.md
explains the choices; this module holds them.

Two facts of MLflow 3.17's UI shape it (checked in headless Chromium):
- the runs page lists top-level runs until a parent is expanded, and the chart view draws only the
  runs listed; which rows are expanded is browser state that no server setting reaches. So every
  invocation is a top-level run (one row each, tagged `study=<id>`), and only stage runs nest.
- columns, grouping and charts are browser state too (localStorage), except for a *saved view*: an
  experiment tag `mlflow.sharedViewState.<id>` holding that state as JSON, which the UI applies to
  any browser whose URL carries `viewStateShareKey=<id>` and lists in its views menu. The tracker
  writes two into every experiment it logs to (the study view, VIEW_ID, and the study records'),
  and the URLs the tool prints carry the first.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any
from urllib.parse import quote

VIEW_ID = "scalestudy"
"""The study view's id: the `viewStateShareKey` of the URLs the tool prints and the README gives."""
RECORDS_VIEW_ID = "scalestudy-reports"
"""A second saved view: one row per study record (its report and table), for the views menu."""
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
VIEW_CREATED_MS = 1_764_460_800_000
"""The envelopes' creation time (fixed: rewriting an unchanged view must leave the tag unchanged)."""

INVOCATIONS = "tags.kind = 'invocation'"
"""The study view's filter: one row per invocation (no study-record row; stage runs one click away)."""
CACHED_STAGES_TAG = "cached_stages"
"""Tag of an invocation run: the stages it took from the cache (`none` when every stage ran)."""

# Metric keys the view shows: the headline numbers (one value each, logged at step 0 on the
# invocation run) and the series whose step is a common axis across world sizes.
SAMPLES_PER_S = "train/samples_per_s"
PER_DEVICE = "train/samples_per_s_per_device"
EFFICIENCY = "train/scaling_efficiency"
MFU = "train/mfu_pct"
PEAK_MEMORY = "memory/peak_gib"
FINAL_LOSS = "train/final_loss"
STEP_TIME_ERROR = "plan/step_time_error_pct"
WORLD_SIZE = "train/world_size"
LOSS_BY_SAMPLES = "train/loss_by_samples"
BUSBW = "comm/all_reduce/busbw_gbps"
SERIES_ON_INVOCATION = (LOSS_BY_SAMPLES, BUSBW)
"""Series copied from a stage run to its invocation run, so the chart view (which draws the runs
it lists: the invocations) overlays them: loss on samples seen, busbw on message bytes."""


def invocation_run_name(strategy: str, world_size: int, model: str, started: float) -> str:
    """`zero3 x4 · gpt-tiny · 2026-11-30 15:40`: what a row of the runs page is, at a glance."""
    return f"{strategy} x{world_size} · {model} · {time.strftime('%Y-%m-%d %H:%M', time.localtime(started))}"


def study_reading_run_name(pipeline: str, study: str | None, started: float) -> str:
    """A run of a pipeline that reads a study (pipeline=compare): which study, and when."""
    return f"{pipeline} {study or '-'} · {time.strftime('%Y-%m-%d %H:%M', time.localtime(started))}"


def training_data(data: dict[str, Any]) -> dict[str, str]:
    """The MLflow dataset entity's fields for a data config (`to_jsonable(cfg.data)`, redacted):
    its name, a digest of everything that decides the samples (so two rows trained on the same data
    show the same digest), and the factory with its arguments as the source. num_workers only
    changes how it is loaded, so it is left out."""
    decides = {k: v for k, v in data.items() if k not in ("name", "num_workers")}
    digest = hashlib.sha256(json.dumps(decides, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return {"name": str(data.get("name") or "data"), "digest": digest, "source_type": "code",
            "source": json.dumps(decides, sort_keys=True, default=str)}


def _column(kind: str, key: str) -> str:
    """The runs table's canonical column key (MLflow's makeCanonicalSortKey)."""
    return f"{kind}.`{key}`"


RUN_NAME = _column("attributes", "Run Name")
DATASET = _column("attributes", "Dataset")
COLUMNS = [
    DATASET,
    _column("params", "strategy"),
    _column("params", "nodes"),
    _column("params", "world_size"),
    *(_column("metrics", k) for k in (SAMPLES_PER_S, PER_DEVICE, EFFICIENCY, MFU, PEAK_MEMORY, FINAL_LOSS,
                                      STEP_TIME_ERROR)),
    _column("tags", CACHED_STAGES_TAG),
    _column("tags", "placement.hosts"),
]
"""The runs table's columns, in order: what an invocation was, its headline numbers, and whether
any of them came from the cache or another fleet."""
WIDTHS = {RUN_NAME: 300, DATASET: 200}
"""Pixels: a run name whole (`zero3 x4 · gpt-tiny · 2026-11-30 15:40`), a dataset's name and digest."""


def _section(uuid: str, name: str, shown: bool) -> dict[str, Any]:
    """A chart section, expanded (`display`) or collapsed; two charts a row, wide enough to read."""
    return {"uuid": uuid, "name": name, "display": shown, "isReordered": True, "deleted": False,
            "isGenerated": False, "columns": 2}


def _line(uuid: str, key: str, log_axes: bool = False) -> dict[str, Any]:
    """A line per run over the metric's steps (samples seen, message bytes: not training steps).
    MLflow titles it with the metric key."""
    return {"uuid": uuid, "type": "LINE", "metricSectionId": "study", "metricKey": key,
            "selectedMetricKeys": [key], "xAxisKey": "step", "useGlobalXaxisKey": False,
            "xAxisScaleType": "log" if log_axes else "linear", "scaleType": "log" if log_axes else "linear",
            "lineSmoothness": 0, "useGlobalLineSmoothing": False, "runsCountToCompare": 100,
            "deleted": False, "isGenerated": False}


def _scatter(uuid: str, key: str) -> dict[str, Any]:
    """A point per run: a metric against the world size (a param of every invocation). MLflow
    titles it `world_size vs. <key>`."""
    return {"uuid": uuid, "type": "SCATTER", "metricSectionId": "study",
            "xaxis": {"key": "world_size", "type": "PARAM"}, "yaxis": {"key": key, "type": "METRIC"},
            "runsCountToCompare": 100, "deleted": False, "isGenerated": False}


CHARTS = [
    _line("loss", LOSS_BY_SAMPLES),
    _scatter("per-device", PER_DEVICE),
    _scatter("efficiency", EFFICIENCY),
    _line("busbw", BUSBW, log_axes=True),
]
"""The charts that answer a study's question, in the first section; MLflow appends one chart per
other metric key in sections of their own, collapsed here (SECTIONS) so the study's charts lead."""

SECTIONS = [_section("study", "Study", True),
            *(_section(name, name, False) for name in ("comm", "env", "lr_find", "memory", "plan", "train"))]


def _facets(search: str, order_by: str, ascending: bool) -> dict[str, Any]:
    """The search half of a view: which runs, in which order, of any age, not deleted."""
    return {"searchFilter": search, "orderByKey": order_by, "orderByAsc": ascending, "startTime": "ALL",
            "lifecycleFilter": "Active", "modelVersionFilter": "All Runs", "datasetsFilter": []}


def study_view() -> dict[str, Any]:
    """The runs page as a study wants it: search facets and UI state in one object (MLflow keeps
    their keys disjoint), the same shape as the UI's own "Save view"."""
    return {
        **_facets(INVOCATIONS, _column("metrics", WORLD_SIZE), ascending=True),
        "selectedColumns": COLUMNS,
        "columnOrder": [RUN_NAME, *COLUMNS],
        "columnWidths": WIDTHS,
        "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": "study"}]},
        "groupsExpanded": {},
        "useGroupedValuesInCharts": False,  # a line per invocation, not one per study
        "runsHiddenMode": "SHOW_ALL",  # every invocation of every study in the charts
        "compareRunCharts": CHARTS,
        "compareRunSections": SECTIONS,
        "isAccordionReordered": True,  # keep "Study" first
        "hideEmptyCharts": True,
        "viewMaximized": False,
        "runListHidden": False,
    }


def records_view() -> dict[str, Any]:
    """Every study's record run, newest first: open one for its report.html and table."""
    return {**_facets("tags.kind = 'study'", "attributes.start_time", ascending=False),
            "selectedColumns": [_column("tags", "study"), _column("attributes", "Description")],
            "columnWidths": {RUN_NAME: 300}}


def view_tags() -> dict[str, str]:
    """The experiment tags of the saved views: MLflow's envelope (name, creation time, state as
    plain JSON, which the UI reads as well as its own deflate-compressed form)."""
    views = {VIEW_ID: ("scalestudy: invocations by study, headline numbers, charts", study_view()),
             RECORDS_VIEW_ID: ("scalestudy: study reports (report.html, table)", records_view())}
    return {f"{VIEW_TAG_PREFIX}{view_id}": json.dumps({"name": name, "createdAt": VIEW_CREATED_MS,
                                                       "state": json.dumps(state, separators=(",", ":"))},
                                                      separators=(",", ":"))
            for view_id, (name, state) in views.items()}


def view_url(base: str, experiment_id: str, charts: bool = True, view: str = VIEW_ID) -> str:
    """The experiment's runs page with a saved view applied: the chart view, or the runs table.
    (The mode is a URL parameter of its own, outside the saved state.)"""
    url = f"{base.rstrip('/')}/#/experiments/{quote(experiment_id)}/runs?viewStateShareKey={view}"
    return url + ("&compareRunsMode=CHART" if charts else "&compareRunsMode=TABLE")


def artifact_url(base: str, experiment_id: str, run_id: str, path: str) -> str:
    """A run's artifact, opened in the UI's artifact viewer."""
    return f"{base.rstrip('/')}/#/experiments/{quote(experiment_id)}/runs/{run_id}/artifacts/{path}"
