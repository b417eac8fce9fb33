"""MLflow's own UI shows a study at first open: a real 2 x 2 study (conftest.py) and a second
study's invocation in the same store, a real `mlflow server` over it, and headless Chromium on the
URLs the sweep printed. The DOM must hold one row per invocation with its name and headline
numbers, grouped by study, cached stages named; the study's charts drawn; and the study's table in
the artifact viewer. No click anywhere."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.helpers import chromium, mlflow_server

ROOT = Path(__file__).resolve().parents[2]
POINTS = {("ddp", 1), ("ddp", 2), ("zero3", 1), ("zero3", 2)}
HEADLINES = ("train/samples_per_s", "train/samples_per_s_per_device", "train/scaling_efficiency",
             "train/final_loss", "memory/peak_gib", "plan/step_time_error_pct")
STUDY_CHARTS = ("train/loss_by_samples", "world_size vs. train/samples_per_s_per_device",
                "world_size vs. train/scaling_efficiency", "comm/all_reduce/busbw_gbps")
"""The titles MLflow gives the view's charts (pipelines.mlflow_ui.CHARTS)."""
NAME = re.compile(r"(ddp|zero3) x(\d+) · gpt-tiny · \d{4}-\d\d-\d\d \d\d:\d\d")


# --- a real MLflow server and a real browser ------------------------------------------------------


SECOND = "second-day"
"""Another study in the same store: one invocation the next day, every stage from the cache."""


@pytest.fixture(scope="module")
def store(study, tmp_path_factory):
    """The store as the sweep left it, plus a second study's invocation (same point as the sweep's
    `ddp x1`, so served whole from the cache): two studies side by side."""
    db = tmp_path_factory.mktemp("ui") / "mlflow.db"
    shutil.copyfile(study["snapshot_uri"].removeprefix("sqlite:///"), db)
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), "experiment=smoke", "strategy=ddp", "nodes=1",
                             f"study={SECOND}", f"tracking.uri=sqlite:///{db}", f"hydra.run.dir={SECOND}"],
                            cwd=study["dir"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return f"sqlite:///{db}"


MOE = "experts-day"
"""A mixture of experts' invocation in the same store (`model=gpt-moe-tiny`), for its routing charts."""


@pytest.fixture(scope="module")
def moe(study, store):
    """One invocation of the built-in mixture of experts in the store: its train stage logs the
    routing, its report draws it."""
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), "experiment=smoke", "model=gpt-moe-tiny",
                             "strategy=ddp", "nodes=1", f"study={MOE}", f"tracking.uri={store}",
                             f"hydra.run.dir={MOE}"],
                            cwd=study["dir"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [run] = invocation_runs(store, MOE).values()
    return run


@pytest.fixture(scope="module")
def server(study, store):
    """`mlflow server --workers 1` over `store`; stopped by its own PID."""
    with mlflow_server(store, study["dir"]) as base:
        yield base


def dom(url: str, tmp: Path, settled: str, width: int = 1600) -> str:
    """The DOM Chromium built from `url` once the page settled (its virtual clock ran out while
    no request was pending); a second, longer look when `settled` is not in it yet (a cold
    server answers the first charts' requests slowly)."""
    browser = chromium()
    page = ""
    for budget in (30_000, 120_000):
        profile = tmp / f"profile-{budget}"
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", f"--window-size={width},1200", f"--virtual-time-budget={budget}"]
        result = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        page = result.stdout
        if settled in page:
            break
    return page


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
"""HTML elements without an end tag (a DOM dump writes every other one closed)."""


class Grid(HTMLParser):
    """The runs table's rows as MLflow renders them (ag-grid): row id -> {column id: text}. A row's
    cells are split between a pinned and a scrolling container; the row id joins them."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self._stack: list[tuple[str | None, str | None]] = []  # (row id, column id) per open element

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        row, col = self._stack[-1] if self._stack else (None, None)
        if a.get("role") == "row" and a.get("row-id"):
            row = a["row-id"]
            self.rows.setdefault(row, {})
        if a.get("col-id") and row is not None:
            col = a["col-id"]
        if tag not in VOID:
            self._stack.append((row, col))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        pass  # `<path/>`: no text inside, nothing to close

    def handle_endtag(self, tag: str) -> None:
        if self._stack:
            self._stack.pop()

    def handle_data(self, data: str) -> None:
        if self._stack:
            row, col = self._stack[-1]
            if row is not None and col is not None:
                cells = self.rows[row]
                cells[col] = (cells.get(col, "") + data).strip()


def grid(page: str) -> dict[str, dict[str, str]]:
    parser = Grid()
    parser.feed(page)
    return parser.rows


def text_lines(page: str) -> list[str]:
    """The page's text, one line per element's text."""
    body = re.sub(r"<(style|script)\b.*?</\1>", "", page, flags=re.S)
    return [line.strip() for line in re.sub(r"<[^>]+>", "\n", body).splitlines() if line.strip()]


def printed_url(study: dict, label: str, base: str) -> str:
    """The URL the sweep printed (`MLflow UI charts: http://127.0.0.1:5000/#/...`), on this server."""
    match = re.search(rf"^MLflow UI {label}:\s+(\S+)$", study["stdout"], re.M)
    assert match, study["stdout"][-2000:]
    return re.sub(r"^http://127\.0\.0\.1:5000", base, match[1])


def invocation_runs(uri: str, study: str) -> dict[str, object]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("scalestudy")
    runs = client.search_runs([experiment.experiment_id], f"tags.kind = 'invocation' AND tags.study = '{study}'")
    return {r.info.run_id: r for r in runs}


# --- the tests ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_runs_page_lists_one_row_per_invocation_with_its_numbers(study, store, server, tmp_path):
    runs = invocation_runs(store, study["id"])
    assert len(runs) == 4
    page = dom(printed_url(study, "table", server), tmp_path, settled="train/samples_per_s_per_device", width=3200)
    rows = grid(page)
    group = f"tag.study.{study['id']}"
    assert group in rows, "grouped by the study tag"
    members = {row_id.removeprefix(group + "."): cells for row_id, cells in rows.items()
               if row_id.startswith(group + ".")}
    assert set(members) == set(runs), "one row per invocation; no study-record row, no stage row"
    seen = set()
    for run_id, cells in members.items():
        run = runs[run_id]
        found = NAME.search(cells["attributes.`Run Name`"])  # the cell also holds the run's colour
        assert found, cells["attributes.`Run Name`"]
        assert found[0] == run.data.tags["mlflow.runName"]
        strategy, world = found.groups()
        seen.add((strategy, int(world)))
        assert cells["params.`strategy`"] == strategy and cells["params.`world_size`"] == world
        assert cells["params.`nodes`"] == run.data.params["nodes"]
        for key in HEADLINES:  # the headline numbers, as logged
            assert math.isclose(float(cells[f"metrics.`{key}`"]), run.data.metrics[key], rel_tol=1e-9), key
        assert "markov" in cells["attributes.`Dataset`"], "the Dataset column says what was trained on"
        assert cells["tags.`cached_stages`"] == run.data.tags["cached_stages"]
    assert seen == POINTS
    # Stages served from the cache are named on the row: env once per world size, lr_find once.
    cached = [set(c["tags.`cached_stages`"].split(",")) for c in members.values()]
    assert sum("lr_find" in c for c in cached) == 3 and sum("env" in c for c in cached) == 2
    # The other study: a group of its own in the same table, its row saying its numbers (the
    # sweep's ddp x1, measured then) came from the cache.
    [other_id] = invocation_runs(store, SECOND)
    cells = rows[f"tag.study.{SECOND}.{other_id}"]
    assert NAME.search(cells["attributes.`Run Name`"])[0].startswith("ddp x1 · ")
    assert "train" in cells["tags.`cached_stages`"].split(","), (
        "the second study's point is the sweep's ddp x1, so train comes from the cache (unless the "
        "project's sources changed during the test: every source change re-keys the cache)")
    sweeps = next(r for r in runs.values() if r.data.tags["mlflow.runName"].startswith("ddp x1 · "))
    assert cells["metrics.`train/samples_per_s`"] == members[sweeps.info.run_id]["metrics.`train/samples_per_s`"]


@pytest.mark.slow
def test_the_chart_view_draws_the_studys_charts_at_first_open(study, store, server, tmp_path):
    page = dom(printed_url(study, "charts", server), tmp_path, settled="(train/loss_by_samples)")
    lines = text_lines(page)
    assert "No charts in this section" not in lines
    start = lines.index("Study")
    section = lines[start: lines.index("comm", start)]  # up to the next (collapsed) section
    for title in STUDY_CHARTS:
        assert title in section, f"chart {title} missing: {section[:40]}"
    # The loss chart overlays every invocation on samples seen; the scatters put each at its size.
    names = {r.data.tags["mlflow.runName"] for s in (study["id"], SECOND) for r in invocation_runs(store, s).values()}
    assert {f"{n} (train/loss_by_samples)" for n in names} <= set(section)
    assert section.count("world_size") == 2, "both scatters plot against the world size (x axis)"
    assert {"train/samples_per_s_per_device", "train/scaling_efficiency"} <= set(section), "their y axes"
    assert page.count("js-plotly-plot") >= len(STUDY_CHARTS), "drawn, not loading"


@pytest.mark.slow
def test_the_study_table_opens_in_the_artifact_viewer(study, server, tmp_path):
    url = printed_url(study, "report", server).replace("report.html", "table.json")
    page = dom(url, tmp_path, settled="View as table", width=2000)
    lines = text_lines(page)
    assert "View as table" in lines
    for column in ("strategy", "nodes", "devices", "samples/s", "efficiency"):
        assert column in lines, column
    assert lines.count("ddp") >= 2 and lines.count("zero3") >= 2, "a row per point"


def stage_run(uri: str, invocation, stage: str):  # noqa: ANN001, ANN201
    """An invocation's stage run (its child run tagged with the stage's name)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([invocation.info.experiment_id],
                               f"tags.mlflow.parentRunId = '{invocation.info.run_id}' AND tags.stage = '{stage}'")
    return run


@pytest.mark.slow
def test_a_mixture_of_experts_run_charts_its_routing(moe, store, server, tmp_path):
    """The train stage's run charts the routing (per step the imbalance; per MoE layer each expert's
    slots, the expert on the step axis), and the report's expert_load.png opens as an image."""
    from mlflow.tracking import MlflowClient

    from pipelines.mlflow_ui import artifact_url

    client = MlflowClient(tracking_uri=store)
    train = stage_run(store, moe, "train")
    summary = json.loads(Path(client.download_artifacts(moe.info.run_id, "summary.json", str(tmp_path))).read_text())
    result = summary["stages"]["train"]["result"]
    loads = result["expert_load"]
    assert len(loads) == 2 and all(len(load) == 4 for load in loads.values()), "gpt-moe-tiny: 2 layers of 4 experts"
    for layer, load in loads.items():
        history = client.get_metric_history(train.info.run_id, f"moe/load/{layer}")
        assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == list(enumerate(map(float, load)))
    imbalance = client.get_metric_history(train.info.run_id, "moe/imbalance")
    assert sorted(m.value for m in imbalance) == sorted(result["expert_imbalance"]) and len(imbalance) > 1
    # The run's chart page: a section for the imbalance metrics and one for the per-layer loads.
    page = dom(f"{server}/#/experiments/{moe.info.experiment_id}/runs/{train.info.run_id}/model-metrics",
               tmp_path / "metrics", settled="moe/load")
    lines = text_lines(page)
    charts = {lines[i]: lines[i + 1] for i in range(len(lines) - 1) if lines[i] in ("moe", "moe/load")}
    degrees = len(result["expert_rank_imbalance"]) + len(result["expert_rank_held_imbalance"])
    assert charts == {"moe": f"({3 + degrees})", "moe/load": "(2)"}, charts  # imbalance, its mean, dropped share
    # The report's chart of the same loads, shown by the artifact viewer (fetched, then drawn from a blob).
    report = stage_run(store, moe, "report")
    assert "expert_load.png" in {a.path for a in client.list_artifacts(report.info.run_id)}
    page = dom(artifact_url(server, moe.info.experiment_id, report.info.run_id, "expert_load.png"),
               tmp_path / "artifact", settled='alt="expert_load.png"')
    assert re.search(r'<img alt="expert_load.png" src="blob:', page), "the PNG is drawn, not loading"


def test_a_study_reported_again_keeps_one_record_with_the_new_table(tmp_path):
    """log_table appends to an existing table: a second report must replace the record instead."""
    from mlflow.tracking import MlflowClient

    from pipelines.mlflow_ui import view_tags
    from pipelines.schema import TrackingConfig
    from pipelines.tracking import MlflowTracker, study_runs

    tracking = TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="scalestudy")
    folder = tmp_path / "study"
    folder.mkdir()
    (folder / "report.html").write_text("<!DOCTYPE html><p>report</p>")
    first = MlflowTracker(tracking).record_study("s1", folder, {"strategy": ["ddp"], "devices": [1]}, "study")
    second = MlflowTracker(tracking).record_study("s1", folder, {"strategy": ["ddp", "zero3"], "devices": [2, 2]},
                                                  "study")
    client = MlflowClient(tracking_uri=tracking.uri)
    experiment = client.get_experiment_by_name("scalestudy")
    assert [r.info.run_id for r in study_runs(client, [experiment.experiment_id], "s1")] == [second]
    assert client.get_run(first).info.lifecycle_stage == "deleted"
    table = json.loads(Path(client.download_artifacts(second, "study/table.json", str(tmp_path))).read_text())
    assert table["data"] == [["ddp", 2], ["zero3", 2]]
    # Every experiment the tracker opens holds the saved views, written once.
    assert {k: experiment.tags.get(k) for k in view_tags()} == view_tags()
