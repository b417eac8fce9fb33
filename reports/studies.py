"""Studies read back: every invocation's summary.json of a sweep, from its sweep dir or from the
MLflow store it was logged to (pipeline=compare, and the report a sweep ends with), and the check
that a study named by `study=` exists (the compare pipeline's precheck).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from pipelines.summary import RunSummary, read_summaries


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


def check_study(cfg: Any) -> None:
    """The compare pipeline's precheck (conf/pipeline/compare.yaml): the study named by `study=`
    has runs in the tracking store, or one line saying it has none (ConfigError)."""
    find_study(cfg.tracking.uri, cfg.study)
