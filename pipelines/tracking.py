"""Tracking: one top-level MLflow run per invocation, one nested run per stage.

Only the driver talks to MLflow; stages return their metrics inside their results and the engine
logs them here, buffered into `log_batch` calls (one call per point costs ~3.5 ms on sqlite). A
cached stage is logged too, tagged `cached=true`, with its stored metrics and artifacts, so every
run of a sweep is complete in the UI; the invocation run names its cached stages
(`cached_stages`), so a number taken from the cache is never mistaken for a fresh one.

Invocations are top-level runs tagged `study=<id>`, not children of a study run: MLflow's runs
page and chart view show top-level runs only until a parent is expanded (pipelines/mlflow_ui.py).
A study's own record (its report and table) is a run of its own, `kind=study`.
"""

from __future__ import annotations

import math
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from common.errors import ConfigError
from pipelines.mlflow_store import prepare_store, schema_lock
from pipelines.schema import TrackingConfig
from pipelines.summary import RunSummary, read_summaries

BATCH = 1000
SUMMARY_ARTIFACT = "summary.json"
"""Each invocation logs its summary.json at the root of its run (compare and calibrate read it)."""
PARAM_MAX = 500


@dataclass(frozen=True)
class ChildRun:
    """A run nested under a stage's run: one measurement among several (a trial of the plan)."""

    name: str
    params: dict[str, Any]
    metrics: list[tuple[str, float, int]]
    under: str
    """The stage whose run it is nested under (it must have been logged before)."""


@runtime_checkable
class HasMetrics(Protocol):
    """A stage result with numbers for MLflow: (key, value, step) triples."""

    def metrics(self) -> list[tuple[str, float, int]]: ...


@runtime_checkable
class HasHeadline(Protocol):
    """A stage result that says in one line what it found (the summary table's last column)."""

    def headline(self) -> str: ...


@runtime_checkable
class HasChildRuns(Protocol):
    """A stage result some of whose measurements are runs of their own."""

    def child_runs(self) -> list[ChildRun]: ...


class Tracker(Protocol):
    run_id: str | None

    def history(self, key: str) -> list: ...

    def go_live(self) -> None:
        """Called before work that takes time (a stage that runs): from here on, what is logged
        shows in the store as it happens (pipelines.deferred.DeferredTracker waits until then)."""

    def start(self, name: str, params: dict[str, Any], tags: dict[str, str]) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_dataset(self, data: dict[str, str]) -> None: ...

    def log_stage(
        self,
        stage: str,
        status: str,
        tags: dict[str, str],
        params: dict[str, Any],
        metrics: list[tuple[str, float, int]],
        artifacts: Path | None,
        children: list[ChildRun] = (),
    ) -> None: ...

    def finish(self, ok: bool, files: list[Path]) -> None: ...


class NullTracker:
    """tracking=none."""

    run_id: str | None = None

    def history(self, key: str) -> list:
        return []

    def go_live(self) -> None:
        pass

    def start(self, name: str, params: dict[str, Any], tags: dict[str, str]) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_dataset(self, data: dict[str, str]) -> None:
        pass

    def log_stage(self, stage, status, tags, params, metrics, artifacts, children=()) -> None:  # noqa: ANN001
        pass

    def finish(self, ok: bool, files: list[Path]) -> None:
        pass


class MlflowTracker:
    def __init__(self, cfg: TrackingConfig):
        from mlflow.tracking import MlflowClient

        self.cfg = cfg
        self.run_id: str | None = None
        self.cached: list[str] = []
        """The stages of this invocation served from the cache, in DAG order."""
        self._last_ms: dict[str, int] = {}
        self.clock: Callable[[], float] = time.time
        """When each call happens, in seconds; a deferred record replays its calls at their own times."""
        self.stage_runs: dict[str, str] = {}
        """Each stage of this invocation logged so far -> its nested run's id."""
        self.db = db = prepare_store(cfg.uri)
        with schema_lock(db):
            self.client = MlflowClient(tracking_uri=cfg.uri)
            self.experiment_id = self._experiment(db)

    def _experiment(self, db: Path | None) -> str:
        try:
            found = self.client.get_experiment_by_name(self.cfg.experiment)
        except Exception as err:  # noqa: BLE001 - any backend failure is the user's URI
            raise ConfigError("tracking.uri", self.cfg.uri, f"is not a reachable MLflow store ({_first_line(err)})") from None
        if found is not None:
            self._keep_views(found.experiment_id, found.tags)
            return found.experiment_id
        location = (db.parent / "mlartifacts").resolve().as_uri() if db is not None else None
        try:
            experiment_id = self.client.create_experiment(self.cfg.experiment, artifact_location=location)
        except Exception:  # noqa: BLE001 - created meanwhile by a concurrent invocation
            experiment_id = self.client.get_experiment_by_name(self.cfg.experiment).experiment_id
        # MLflow 3 opens experiments on its GenAI view unless marked as model training.
        self.client.set_experiment_tag(experiment_id, "mlflow.experimentKind", "custom_model_development")
        self._keep_views(experiment_id, {})
        return experiment_id

    def _keep_views(self, experiment_id: str, tags: dict[str, str]) -> None:
        """Write the saved views (pipelines/mlflow_ui.py) into the experiment unless they are there
        as they are: every experiment the tool logs to opens as a study from the URLs it prints,
        including one created by an older version or whose view a user deleted in the UI."""
        from pipelines.mlflow_ui import view_tags

        for key, value in view_tags().items():
            if tags.get(key) == value:
                continue
            try:
                self.client.set_experiment_tag(experiment_id, key, value)
            except Exception:  # noqa: BLE001 - settled by what the store holds now
                # Invocations that share a server may write the same view at once; one insert
                # wins. Only a view that is still not there is an error.
                if self.client.get_experiment(experiment_id).tags.get(key) != value:
                    raise

    def record_study(self, study: str, folder: Path, table: dict[str, list[Any]], under: str) -> str:
        """The study's record: a `kind=study` run holding its report folder (in `<under>/`) and
        its table as an MLflow table (`<under>/table.json`, which the artifact viewer shows as a
        table). A new report replaces the record: this run is created, then older study runs of
        the same id are deleted (MLflow's log_table appends to an existing table, and a study
        reported again must show the new rows, not both). Returns the run id."""
        from mlflow.entities import RunTag

        run = self.client.create_run(self.experiment_id, run_name=f"study {study}",
                                     tags={"kind": "study", "study": study})
        mine = run.info.run_id
        self.client.log_artifacts(mine, str(folder), artifact_path=under)
        self.client.log_table(mine, data=table, artifact_file=f"{under}/table.json")
        rows = len(next(iter(table.values()), []))
        note = (f"Study `{study}`: {rows} points; its invocations are the runs tagged `study = '{study}'`. "
                f"Report: artifacts `{under}/report.html`; table: `{under}/table.json`.")
        self.client.log_batch(mine, tags=[RunTag("mlflow.note.content", note)])
        self.client.set_terminated(mine, "FINISHED")
        # Only older ones: two reports written at once keep the newer, never neither.
        for older in study_runs(self.client, [self.experiment_id], study):
            if (older.info.start_time, older.info.run_id) < (run.info.start_time, mine):
                self.client.delete_run(older.info.run_id)
        return mine

    def history(self, key: str, limit: int = 500) -> list:
        """Measured steps of earlier finished invocations with this calibration key."""
        from pipelines.calibration import history

        runs = self.client.search_runs([self.experiment_id], f"tags.kind = 'invocation' AND tags.calibration_key = "
                                       f"'{key}' AND attributes.status = 'FINISHED'", max_results=limit,
                                       order_by=["attributes.start_time ASC"])
        return history(run_summaries(self.client, runs))

    def start(self, name: str, params: dict[str, Any], tags: dict[str, str]) -> None:
        run = self.client.create_run(self.experiment_id, start_time=self._ms(), run_name=name, tags=tags)
        self.run_id = run.info.run_id
        self._log(self.run_id, params=params)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Tags learnt after the run started (where its worker stages run)."""
        from mlflow.entities import RunTag

        assert self.run_id is not None, "set_tags before start"
        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def log_dataset(self, data: dict[str, str]) -> None:
        """Declare what the invocation trains on (pipelines.mlflow_ui.training_data): the runs
        page's Dataset column shows it, and MLflow can group and filter runs by it."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        assert self.run_id is not None, "log_dataset before start"
        dataset = Dataset(name=data["name"], digest=data["digest"], source_type=data["source_type"],
                          source=data["source"])
        declared = [DatasetInput(dataset, [InputTag("mlflow.data.context", "train")])]
        for attempt in range(3):
            try:
                self.client.log_inputs(self.run_id, datasets=declared)
                return
            except Exception:  # noqa: BLE001 - see below
                # Invocations of one sweep declare the same dataset at once; MLflow looks it up,
                # then inserts it, so all but one can fail on the unique key. Once it is stored,
                # the next attempt links the existing one.
                if attempt == 2:
                    raise
                time.sleep(0.2 * (attempt + 1))

    def log_stage(self, stage, status, tags, params, metrics, artifacts, children=()) -> None:  # noqa: ANN001
        assert self.run_id is not None, "log_stage before start"
        run = self.client.create_run(
            self.experiment_id,
            start_time=self._ms(),
            run_name=stage,
            tags={"mlflow.parentRunId": self.run_id, "kind": "stage", "stage": stage, "status": status, **tags},
        )
        child = run.info.run_id
        self._log(child, params=params, metrics=metrics)
        self._log(self.run_id, metrics=[m for m in metrics if _on_invocation(m)])
        if status == "cached":
            self.cached.append(stage)
        if artifacts is not None and artifacts.is_dir() and any(artifacts.iterdir()):
            self.client.log_artifacts(child, str(artifacts))
        self.client.set_terminated(child, "FINISHED" if status in ("ran", "cached") else "FAILED", end_time=self._ms())
        self.stage_runs[stage] = child
        for nested in children:
            parent = self.stage_runs.get(nested.under, child)
            run = self.client.create_run(self.experiment_id, start_time=self._ms(), run_name=nested.name, tags={
                "mlflow.parentRunId": parent, "kind": "measurement", "stage": stage, "cached": tags.get("cached", "")})
            self._log(run.info.run_id, params=nested.params, metrics=nested.metrics)
            self.client.set_terminated(run.info.run_id, "FINISHED", end_time=self._ms())

    def finish(self, ok: bool, files: list[Path]) -> None:
        from pipelines.mlflow_ui import CACHED_STAGES_TAG

        if self.run_id is None:
            return
        self.set_tags({CACHED_STAGES_TAG: ",".join(self.cached) or "none"})
        for path in files:
            if path.exists():
                self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED", end_time=self._ms())

    def go_live(self) -> None:
        pass

    def _ms(self) -> int:
        return int(self.clock() * 1000)

    def _log(self, run_id: str, params: dict[str, Any] | None = None, metrics: list | None = None) -> None:
        from mlflow.entities import Metric, Param

        # Later calls stamp later, even within a millisecond: where two stages log one key on the
        # invocation (the plan's predicted memory/peak_gib, then train's measured one), MLflow
        # shows the latest timestamp, so the stage that ran later in the DAG wins.
        now = max(self._ms(), self._last_ms.get(run_id, 0) + 1)
        self._last_ms[run_id] = now
        param_list = [Param(_param_key(k), _param_value(v)) for k, v in (params or {}).items()]
        metric_list = [Metric(k, float(v), now, int(s)) for k, v, s in (metrics or []) if math.isfinite(v)]
        for i in range(0, len(param_list), 100):
            self.client.log_batch(run_id, params=param_list[i : i + 100])
        for i in range(0, len(metric_list), BATCH):
            self.client.log_batch(run_id, metrics=metric_list[i : i + BATCH])


def _on_invocation(metric: tuple[str, float, int]) -> bool:
    """Whether a stage's metric is also logged on its invocation run, where runs are compared
    side by side without opening children: scalars (step 0), and the series whose steps line up
    across world sizes (pipelines.mlflow_ui.SERIES_ON_INVOCATION). System metrics are time series
    of their own, step 0 being just their first sample."""
    from pipelines.mlflow_ui import SERIES_ON_INVOCATION

    key, _, step = metric
    if key in SERIES_ON_INVOCATION:
        return True
    return step == 0 and "/" in key and not key.startswith("system/")


def run_summaries(client: Any, runs: list[Any]) -> list[RunSummary]:
    """The summary.json each invocation logged to its run, read (pipelines.summary), in the runs'
    order; a run killed before it finished has none, and one this version can't read is named on
    stderr; both are left out."""
    import json
    import tempfile

    summaries = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, run in enumerate(runs):
            dst = Path(tmp) / str(i)
            dst.mkdir()
            try:
                path = client.download_artifacts(run.info.run_id, SUMMARY_ARTIFACT, str(dst))
            except Exception:  # noqa: BLE001 - any missing or unreadable artifact
                continue
            summaries.append(json.loads(Path(path).read_text()))
    return read_summaries(summaries)


def study_runs(client: Any, experiment_ids: list[str], study: str) -> list[Any]:
    """A study's record runs, oldest first (one, unless a new report is replacing it)."""
    runs = client.search_runs(experiment_ids, f"tags.kind = 'study' AND tags.study = '{study}'",
                              max_results=100)
    return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))


def _param_key(key: str) -> str:
    """MLflow's allowed characters: a config key such as `model.tp_plan.blocks.*.q` keeps its shape
    with `*` (and anything else MLflow refuses) as `_`."""
    return re.sub(r"[^\w.\- :/]", "_", key)


def _param_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= PARAM_MAX else text[: PARAM_MAX - 3] + "..."


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def make_tracker(cfg: TrackingConfig) -> Tracker:
    return MlflowTracker(cfg) if cfg.name == "mlflow" else NullTracker()
