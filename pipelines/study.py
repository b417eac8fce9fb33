"""Studies: the invocations of one sweep (or of one `study=<id>`) seen together.

- `study_id_for(sweep_dir)`: the id a `-m` sweep gives its invocations when `study` is unset.
- `summaries_from_sweep` / `summaries_from_mlflow`: every invocation's summary.json, read
  (pipelines.summary), from the sweep dir or from the MLflow store it was logged to (pipeline=compare).
- `RedactSweepConfig`: Hydra's multirun callback that masks the secrets of the sweep's multirun.yaml.

The study report a sweep ends with is the application's (reports/sweep.py, named in conf/config.yaml):
the engine reads studies, it doesn't write their reports.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from common.errors import ConfigError
from pipelines.summary import RunSummary, read_summaries


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
