"""A study end to end: a real 2 strategies x 2 sizes sweep on CPU, its report, the same report
rebuilt from MLflow, the page in headless Chromium, and the runs over a real MLflow server's REST API."""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import mlflow_server

ROOT = Path(__file__).resolve().parents[2]
PLOTS = {"efficiency.png", "throughput_per_device.png", "loss_vs_samples.png", "mfu.png", "memory.png",
         "busbw.png", "lr_find.png"}
POINTS = {("ddp", 1), ("ddp", 2), ("zero3", 1), ("zero3", 2)}


def run_cli(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


# The sweep itself, `study`, is a session fixture in conftest.py (test_mlflow_ui.py shares it).


def table_lines(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith("|")]


@pytest.mark.slow
def test_the_sweep_writes_a_study_report_with_every_plot_and_row(study):
    folder = study["dir"] / "sweep" / "study"
    assert {p.name for p in folder.iterdir()} == PLOTS | {"report.md", "report.html"}
    lines = table_lines((folder / "report.md").read_text())
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [dict(zip(head, (c.strip() for c in row.strip("|").split("|")), strict=True)) for row in lines[2:]]
    assert {(c["strategy"], int(c["nodes"])) for c in cells} == POINTS
    for c in cells:
        assert c["status"] == "ok"
        assert float(c["samples/s"]) > 0  # measured
        if c["nodes"] == "1":
            assert float(c["efficiency"]) == 1.0  # a world of one is its own baseline
        assert c["step-time error %"] != "-", "every run holds the plan's prediction against its measurement"
        assert c["measured rank"] in ("1", "2") and c["plan's rank"] in ("1", "2"), "ddp and zero3 compete per size"


@pytest.mark.slow
def test_the_invocations_are_one_study_and_share_cached_stages(study):
    assert {s["run"]["study"] for s in study["summaries"]} == {study["id"]}
    ran = {name: sum(s["stages"][name]["status"] == "ran" for s in study["summaries"]) for name in ("env", "lr_find")}
    assert ran == {"env": 2, "lr_find": 1}, "env once per world size, the LR finder once for the study"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=study["uri"])
    experiment = client.get_experiment_by_name("scalestudy")
    runs = client.search_runs([experiment.experiment_id], f"tags.study = '{study['id']}'")
    records = [r for r in runs if r.data.tags["kind"] == "study"]
    invocations = [r for r in runs if r.data.tags["kind"] == "invocation"]
    assert [r.info.run_id for r in records] == [study["study_run"]]
    assert len(invocations) == 4
    # Top-level runs grouped by their study tag, not children of the study's record (docs/tracking.md).
    assert not any("mlflow.parentRunId" in r.data.tags for r in invocations)
    # The params MLflow's compare view plots efficiency against.
    assert {(r.data.params["strategy"], int(r.data.params["world_size"])) for r in invocations} == POINTS
    assert all(int(r.data.params["global_batch"]) == 4 * int(r.data.params["world_size"]) for r in invocations)
    logged = {a.path for a in client.list_artifacts(study["study_run"], "study")}
    assert {"study/report.html", "study/report.md", "study/efficiency.png", "study/table.json"} <= logged


@pytest.mark.slow
def test_compare_rebuilds_the_same_table_from_mlflow_alone(study):
    sweep_table = table_lines((study["dir"] / "sweep" / "study" / "report.md").read_text())
    for selector in (study["id"], "scalestudy"):  # a study id, or an experiment name
        result = run_cli(study["dir"], "pipeline=compare", f"study={selector}", f"hydra.run.dir=compare-{selector}")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        rebuilt = study["dir"] / f"compare-{selector}" / "study"
        assert table_lines((rebuilt / "report.md").read_text()) == sweep_table
        assert PLOTS <= {p.name for p in rebuilt.iterdir()}
        summary = json.loads((study["dir"] / f"compare-{selector}" / "summary.json").read_text())
        assert list(summary["stages"]) == ["compare"], "no stage of the study ran again"


@pytest.mark.slow
def test_compare_of_an_unknown_study_is_one_line(study):
    result = run_cli(study["dir"], "pipeline=compare", "study=no-such-study", "hydra.run.dir=compare-none")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: study='no-such-study': matches no runs")
    assert not (study["dir"] / "compare-none").exists()


def console_messages(page: Path, tmp: Path) -> tuple[str, list[str]]:
    """Load `page` in headless Chromium: (the DOM it built, its console messages)."""
    from tests.helpers import chromium as browser

    chromium = browser()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp / 'chromium-profile'}", "--enable-logging=stderr", "--v=0"]
    result = subprocess.run([chromium, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.slow
def test_the_html_page_loads_in_headless_chromium_without_console_errors(study, tmp_path):
    # The detector first: a page with a planted error must be caught, or "no errors" means nothing.
    planted = tmp_path / "planted.html"
    planted.write_text('<!DOCTYPE html><html><body><script>console.error("planted"); nope();</script></body></html>')
    _, messages = console_messages(planted, tmp_path)
    assert any("planted" in m for m in messages) and any("nope is not defined" in m for m in messages)

    page = study["dir"] / "sweep" / "study" / "report.html"
    dom, messages = console_messages(page, tmp_path)
    assert messages == []
    assert dom.count("<tr>") == 1 + len(POINTS)
    # Self-contained: every image is inline and decodes; nothing is fetched from elsewhere.
    sources = re.findall(r'src="([^"]+)"', page.read_text())
    assert len(sources) == len(PLOTS)
    from matplotlib.image import imread

    for src in sources:
        assert src.startswith("data:image/png;base64,")
        assert imread(io.BytesIO(base64.b64decode(src.split(",", 1)[1])), format="png").shape[0] > 100
    assert not re.search(r'(href|src)="(?!data:)', page.read_text())



@pytest.mark.slow
def test_an_mlflow_server_lists_the_study_runs_over_rest(study):
    with mlflow_server(study["uri"], study["dir"]) as base:
        with urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=scalestudy") as r:
            experiment_id = json.load(r)["experiment"]["experiment_id"]
        query = json.dumps({"experiment_ids": [experiment_id], "max_results": 100,
                            "filter": f"tags.study = '{study['id']}' AND tags.kind = 'invocation'"}).encode()
        request = urllib.request.Request(f"{base}/api/2.0/mlflow/runs/search", data=query,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            runs = json.load(r)["runs"]
        params = [{p["key"]: p["value"] for p in run["data"]["params"]} for run in runs]
        assert {(p["strategy"], int(p["world_size"])) for p in params} == POINTS


@pytest.mark.slow
def test_calibrate_refines_the_plan_from_the_studys_runs(study):
    result = run_cli(study["dir"], "experiment=smoke", "strategy=zero3", "nodes=2", "plan.calibrate=true",
                     "only=[plan]", "hydra.run.dir=calibrated")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plan = json.loads((study["dir"] / "calibrated" / "summary.json").read_text())["stages"]["plan"]
    assert plan["status"] == "ran", "new history is a new key: the plan is made again"
    cal = plan["result"]["calibration"]
    assert cal["points"] == 4 and set(cal["comm_scale"]) == {"ddp", "zero3"}
    assert cal["error_after_pct"] <= cal["error_before_pct"]
    assert any(r.startswith("calibration: 4 earlier runs") for r in plan["result"]["reasons"])
    # The calibrated plan applies the fitted scales to each of the study's four points. (Whether
    # they then land closer to the measured steps than the raw sum is the fit's in-sample claim
    # above: the new plan's components are not the points' own - it times its strategies'
    # overhead afresh, and on a busy host one timing moves by a third: a loaded CI run read 0.31
    # calibrated vs 0.22 raw summed squared error while its fit improved its points.)
    for s in study["summaries"]:
        p = next(p for p in plan["result"]["predictions"]
                 if p["strategy"] == s["run"]["strategy"] and p["devices"] == s["run"]["world_size"])
        comm = cal["comm_scale"][p["strategy"]]
        expected = (cal["compute_scale"] * (p["compute_s"] + p["overhead_s"] + p["bubble_s"])
                    + comm * p["exposed_comm_s"])
        assert p["step_time_s"] == pytest.approx(expected, rel=1e-9)
    assert cal["error_after_pct"] < cal["error_before_pct"], "the fit moves its own points toward what was measured"
    # No new measurement, the same history: the plan settles and is served from the cache.
    again = run_cli(study["dir"], "experiment=smoke", "strategy=zero3", "nodes=2", "plan.calibrate=true",
                    "only=[plan]", "hydra.run.dir=calibrated-again")
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((study["dir"] / "calibrated-again" / "summary.json").read_text())
    assert summary["stages"]["plan"]["status"] == "cached"
