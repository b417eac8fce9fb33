"""A sweep's study report: Hydra's multirun callback (named in conf/config.yaml) that writes the
study report (reports/study.py, which the compare stage writes too) into `<sweep dir>/study/` when
the sweep ends, records it in MLflow (a `kind=study` run: report and table), and prints where the
MLflow UI shows it. The runs are read through the engine (pipelines/study.py): from MLflow when
the study is tracked there (a study may gather several sweeps), else from the sweep dir."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from common.errors import ConfigError
from pipelines.schema import TrackingConfig
from reports.studies import summaries_from_mlflow, summaries_from_sweep

REPORT_DIR = "study"


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
