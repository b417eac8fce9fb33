"""Studies: the invocations of one sweep (or of one `study=<id>`) seen together.

- `study_id_for(sweep_dir)`: the id a `-m` sweep gives its invocations when `study` is unset.
- `summaries_from_sweep` / `summaries_from_mlflow`: every invocation's summary.json, read
  (pipelines.summary), from the sweep dir or from the MLflow store it was logged to (pipeline=compare).
- `StudyReportCallback`: Hydra's multirun callback that writes the study report
  (reports/study.py, which the compare stage writes too) into the sweep
  dir when the sweep ends and records it in MLflow (a `kind=study` run: report and table), then
  prints the MLflow UI's URL of the study view.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from common.errors import ConfigError
from pipelines.schema import TrackingConfig
from pipelines.summary import RunSummary, read_summaries

REPORT_DIR = "study"


def study_id_for(sweep_dir: str | Path) -> str:
    """`outputs/multirun/2026-11-29/11-40-12-123456` -> `2026-11-29_11-40-12-123456`."""
    path = Path(sweep_dir)
    return re.sub(r"[^\w.:/-]", "-", f"{path.parent.name}_{path.name}" if path.parent.name else path.name)


def summaries_from_sweep(sweep_dir: Path) -> list[RunSummary]:
    """The summary.json of every job of a sweep (jobs that failed before running have none)."""
    # rglob: an override holding a path (cache_dir=/x/y) nests the job's subdir.
    from pipelines.tracking import SUMMARY_ARTIFACT

    return read_summaries(json.loads(p.read_text()) for p in sorted(sweep_dir.rglob(SUMMARY_ARTIFACT)))


def _client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def find_study(uri: str, study: str) -> tuple[list[Any], str]:
    """The invocation runs of `study`: runs tagged with it in any experiment, or else every
    invocation run of the experiment named `study`. Raises ConfigError when neither exists."""
    from mlflow.entities import ViewType

    from pipelines.mlflow_store import check_server, is_server, sqlite_path
    from pipelines.redact import redact_text

    db = sqlite_path(uri)
    if db is not None and not db.is_file():  # opening it would create an empty store
        raise ConfigError("tracking.uri", uri, f"has no MLflow database at {db}: no study to compare")
    if is_server(uri):
        check_server(uri)  # seconds, not MLflow's minutes of retries
    client = _client(uri)
    try:
        experiments = client.search_experiments(view_type=ViewType.ACTIVE_ONLY)
    except Exception as err:  # noqa: BLE001 - any backend failure is the user's URI
        reason = redact_text(str(err).splitlines()[0][:200])
        raise ConfigError("tracking.uri", redact_text(uri), f"is not a reachable MLflow store ({reason})") from None
    ids = [e.experiment_id for e in experiments]
    runs = _search(client, ids, f"tags.kind = 'invocation' AND tags.study = '{study}'") if ids else []
    if runs:
        return runs, f"MLflow runs tagged study={study}"
    named = next((e for e in experiments if e.name == study), None)
    if named is not None:
        runs = _search(client, [named.experiment_id], "tags.kind = 'invocation'")
        if runs:
            return runs, f"MLflow experiment {study}"
    raise ConfigError("study", study, "matches no runs tagged with that study id and no MLflow experiment "
                      "with invocation runs (study ids are printed at the end of a sweep)")


def _search(client: Any, experiment_ids: list[str], query: str) -> list[Any]:
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, query, max_results=1000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            return runs


def summaries_from_mlflow(uri: str, study: str) -> tuple[list[RunSummary], str]:
    """Each invocation's summary.json as logged to its MLflow run, and where they came from."""
    from pipelines.tracking import run_summaries

    runs, source = find_study(uri, study)
    return run_summaries(_client(uri), runs), f"{source} at {_redacted(uri)}"


def _redacted(uri: str) -> str:
    from pipelines.redact import redact_text

    return redact_text(uri)


def record_in_mlflow(tracking: TrackingConfig, study: str, folder: Path, rows: list[dict[str, Any]]) -> tuple[str, str]:
    """Record the study in MLflow (its report folder and its table, pipelines.tracking
    record_study); the record's run id and its experiment's id."""
    from pipelines.tracking import MlflowTracker
    from reports.study import columns

    tracker = MlflowTracker(tracking)
    table = {c: [row.get(c) for row in rows] for c in columns(rows)}
    return tracker.record_study(study, folder, table, REPORT_DIR), tracker.experiment_id


def ui_lines(uri: str, experiment_id: str, record_run: str) -> list[str]:
    """Where to look in MLflow's UI: the study view's charts and table (every study of the
    experiment, grouped), and this study's report; with a sqlite store, how to serve it first."""
    from pipelines.mlflow_ui import artifact_url, view_url
    from pipelines.redact import redact_text

    served = uri.startswith(("http://", "https://"))
    base = redact_text(uri) if served else "http://127.0.0.1:5000"
    lines = [f"MLflow UI charts: {view_url(base, experiment_id)}",
             f"MLflow UI table:  {view_url(base, experiment_id, charts=False)}",
             f"MLflow UI report: {artifact_url(base, experiment_id, record_run, f'{REPORT_DIR}/report.html')}"]
    if not served:
        lines.append(f"  (serve the store first: mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000)")
    return lines


class StudyReportCallback(Callback):
    """At the end of a `-m` sweep: the study report in `<sweep dir>/study/`, and in MLflow."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        from reports.study import study_runs, write_study_report

        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            summaries = summaries_from_sweep(sweep_dir)
            runs = study_runs(summaries)
            if not runs:
                print(f"study: no invocation of {sweep_dir} finished; no study report", file=sys.stderr)
                return
            study = next(s.run.study for s in summaries if s.run.study)
            source = f"sweep dir {sweep_dir}"
            if config.tracking.name == "mlflow":
                # The whole study, not just this sweep: `study=<id>` may gather several sweeps,
                # and the report recorded in MLflow must cover them all.
                try:
                    summaries, source = summaries_from_mlflow(config.tracking.uri, study)
                    runs = study_runs(summaries)
                except ConfigError as err:
                    print(f"warning: study report from the sweep dir only: {err}", file=sys.stderr)
            report = write_study_report(runs, sweep_dir / REPORT_DIR, study, source)
            print(report.text())
            print(f"study report: {sweep_dir / REPORT_DIR / 'report.html'}")
            if config.tracking.name == "mlflow":
                tracking = TrackingConfig(name="mlflow", uri=config.tracking.uri, experiment=config.tracking.experiment)
                run_id, experiment_id = record_in_mlflow(tracking, study, sweep_dir / REPORT_DIR, report.rows)
                print(f"study {study}: MLflow run {run_id}; rebuild with: python run.py pipeline=compare study={study}")
                print("\n".join(ui_lines(config.tracking.uri, experiment_id, run_id)))
        except ConfigError as err:
            print(f"error: study report: {err}", file=sys.stderr)
        except Exception as err:  # noqa: BLE001 - the jobs' results stand; say why the report didn't
            print(f"error: study report for {sweep_dir} failed: {type(err).__name__}: {err}", file=sys.stderr)


class RedactSweepConfig(Callback):
    """Hydra's sweeper saves `<sweep dir>/multirun.yaml`, overrides included, in clear; mask its
    secrets as soon as the first job starts (the runs' own config.yaml are written masked)."""

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        from common.files import write_atomic
        from pipelines.redact import redact_override, redact_tree

        try:
            path = Path(str(config.hydra.sweep.dir)) / "multirun.yaml"
        except Exception:  # noqa: BLE001 - a single run has no sweep dir to look at
            return
        if not path.is_file():
            return
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        task = data.get("hydra", {}).get("overrides", {}).get("task")
        if task:
            data["hydra"]["overrides"]["task"] = [redact_override(o) for o in task]
        masked = redact_tree(data)  # hydra's own part too: override_dirname repeats the overrides
        write_atomic(path, OmegaConf.to_yaml(OmegaConf.create(masked)))
