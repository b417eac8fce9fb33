"""compare: rebuild a study's report from MLflow alone, without running any stage.

`python run.py pipeline=compare study=<study id or experiment name>` reads the summary.json every
invocation of the study logged to its MLflow run, so studies made on other days, clusters or
machines (sharing a tracking server) compare side by side. It runs in the driver and reads the
store named by `tracking`; it is never cached, since the store changes between calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.schema import TrackingConfig
from reports.studies import summaries_from_mlflow
from reports.study import study_runs, write_study_report


@dataclass(frozen=True)
class CompareInputs:
    study: str | None
    tracking: TrackingConfig


@dataclass(frozen=True)
class CompareResult:
    study: str
    source: str
    runs: int
    rows: list[dict[str, Any]]
    files: list[str]
    text: str
    """The study table as plain text."""

    def headline(self) -> str:
        return f"{self.runs} runs of study {self.study} from MLflow -> study/report.html"


def run(cfg: CompareInputs, *, artifacts: Path) -> CompareResult:
    assert cfg.study is not None, "validate.resolve requires study with pipeline=compare"
    summaries, source = summaries_from_mlflow(cfg.tracking.uri, cfg.study)
    report = write_study_report(study_runs(summaries), artifacts, cfg.study, source)
    return CompareResult(cfg.study, source, len(report.rows), report.rows, report.files, report.text())
