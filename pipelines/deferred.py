"""A fully cached invocation's MLflow record, written after the command has returned.

A no-op re-run of the default pipeline takes ~0.7 s without tracking; importing MLflow (~1.1 s)
and opening its sqlite store (~0.7 s) would more than double it, for a run in which nothing was
measured. So the runner starts with a DeferredTracker, which keeps every call the runner makes, in
order, with the time it was made:

- when a stage has to run, or the plan asks MLflow for its history, it goes live: the real
  MlflowTracker is opened (a local sqlite store on a thread, while that stage runs: ~3.5 s of a
  smoke run's ~30 s taken off its critical path), the kept calls are replayed once it is open, and
  every later call passes through, so a run that measures something shows in the UI while it
  measures, as before;
- when nothing ran, it never goes live: `finish` writes the calls, atomically, to a queue file
  (`<cache_dir>/mlflow-pending/<id>.pkl`) and starts a detached `python -m pipelines.deferred FILE`,
  which replays them into MLflow at their original times, writes the run's id into summary.json
  once the run is complete (the copy logged to the run carries it too) and deletes the file.

Nothing is lost: a replay that fails leaves its file, and the next invocation that opens MLflow
replays what is older than a minute (`drain`). A file is replayed under an exclusive lock and
deleted before the lock is released, so two replayers never log it twice.

A sweep's invocations are not deferred: its study report reads their runs from MLflow as soon as
the sweep ends."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.files import write_atomic
from pipelines.mlflow_store import prepare_store, sqlite_path
from pipelines.schema import TrackingConfig
from pipelines.tracking import MlflowTracker

QUEUE = "mlflow-pending"
ORPHAN_AFTER_S = 60.0
"""A queue file this old whose replayer holds no lock on it is replayed by the next live tracker."""


@dataclass(frozen=True)
class Call:
    method: str
    args: tuple
    at: float
    """time.time() when the runner made the call."""


@dataclass(frozen=True)
class Pending:
    """One invocation's record, waiting to be logged."""

    tracking: TrackingConfig
    cwd: str
    """Where the invocation ran: a relative sqlite URI is relative to it."""
    summary: str
    """The invocation's summary.json, which gets the run's id."""
    calls: list[Call] = field(default_factory=list)


def defers(cfg: TrackingConfig, sweep: bool) -> bool:
    """Whether an invocation's MLflow record may wait: MLflow on, not a sweep's invocation (the
    study report reads them as the sweep ends), and no credentials in the URI (the queue file
    would hold them on disk)."""
    from pipelines.redact import redact_text

    return cfg.name == "mlflow" and not sweep and redact_text(cfg.uri) == cfg.uri


class DeferredTracker:
    """The Tracker of a single invocation with tracking=mlflow (see the module's docstring)."""

    def __init__(self, cfg: TrackingConfig, queue: Path):
        prepare_store(cfg.uri)  # a bad URI is the user's error now, not a failure in the background
        self.cfg, self.queue = cfg, queue
        self.calls: list[Call] = []
        self.real: MlflowTracker | None = None
        self._opening: Future[MlflowTracker] | None = None
        self.pending: Path | None = None
        """The queue file of a record left to the background replayer (never went live)."""

    @property
    def run_id(self) -> str | None:
        self._settle(wait=self._opening is not None)
        return self.real.run_id if self.real is not None else None

    def go_live(self) -> None:
        """Open MLflow. A local sqlite store (already checked by prepare_store) is opened on a thread
        while the stage that made us go live runs (importing MLflow and opening the store take ~3.5 s
        on 2 cores, most of a smoke run's tracking cost); a server is opened here, so that an
        unreachable one is the user's error before anything is launched."""
        if self.real is not None or self._opening is not None:
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-open")
        self._opening = pool.submit(MlflowTracker, self.cfg)
        pool.shutdown(wait=False)
        self._settle(wait=sqlite_path(self.cfg.uri) is None)

    def _settle(self, wait: bool) -> None:
        """Once MLflow is open (or now, with `wait`): replay the kept calls; later ones pass through."""
        if self.real is not None or self._opening is None or not (wait or self._opening.done()):
            return
        real = self._opening.result()  # the opening's error, if any, is raised here
        _replay_calls(real, self.calls)
        real.clock = time.time
        self.real = real
        drain(self.queue, self.cfg)

    def _call(self, method: str, *args: Any) -> None:
        self._settle(wait=False)
        if self.real is not None:
            getattr(self.real, method)(*args)
        else:
            self.calls.append(Call(method, args, time.time()))

    def history(self, key: str) -> list:
        self.go_live()
        self._settle(wait=True)
        assert self.real is not None
        return self.real.history(key)

    def start(self, name: str, params: dict[str, Any], tags: dict[str, str]) -> None:
        self._call("start", name, params, tags)

    def set_tags(self, tags: dict[str, str]) -> None:
        self._call("set_tags", tags)

    def log_dataset(self, data: dict[str, str]) -> None:
        self._call("log_dataset", data)

    def log_stage(self, stage, status, tags, params, metrics, artifacts, children=()) -> None:  # noqa: ANN001
        self._call("log_stage", stage, status, tags, params, metrics, artifacts, list(children))

    def finish(self, ok: bool, files: list[Path]) -> None:
        self._settle(wait=self._opening is not None)
        if self.real is not None:
            self.real.finish(ok, files)
            return
        self.calls.append(Call("finish", (ok, [Path(f).resolve() for f in files]), time.time()))
        summary = next((Path(f).resolve() for f in files if Path(f).name == "summary.json"), None)
        record = Pending(self.cfg, os.getcwd(), str(summary) if summary else "", self.calls)
        self.queue.mkdir(parents=True, exist_ok=True)
        self.pending = self.queue / f"{uuid.uuid4().hex}.pkl"
        write_atomic(self.pending, pickle.dumps(record))
        log = summary.parent / "logs" / "mlflow-deferred.log" if summary else Path(os.devnull)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            # Its own session: Ctrl-C in the terminal, or the end of a test's process group,
            # does not cut a record half-logged (a cut one is replayed whole later anyway).
            subprocess.Popen([sys.executable, "-m", "pipelines.deferred", str(self.pending)], stdin=subprocess.DEVNULL,
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _replay_calls(tracker: MlflowTracker, calls: list[Call], summary: Path | None = None) -> None:
    """Make `calls` on `tracker` at their own times. With `summary`: the run's id goes into the
    copy of summary.json the run logs, and into the run dir's file once the run is complete (its id
    there says the record is all written)."""
    for call in calls:
        tracker.clock = lambda at=call.at: at
        if call.method == "finish" and summary is not None and summary.is_file():
            ok, files = call.args
            with tempfile.TemporaryDirectory() as tmp:
                copy = Path(tmp) / summary.name
                write_atomic(copy, _with_run_id(summary, tracker.run_id))
                tracker.finish(ok, [copy if Path(f) == summary else f for f in files])
            write_atomic(summary, _with_run_id(summary, tracker.run_id))
        else:
            getattr(tracker, call.method)(*call.args)


def _with_run_id(summary: Path, run_id: str | None) -> str:
    data = json.loads(summary.read_text())
    data["mlflow_run_id"] = run_id
    return json.dumps(data, indent=2, default=str)


def replay(path: Path) -> str | None:
    """Log one queue file into MLflow and delete it; the run's id, or None when another replayer
    has it or had it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        if os.fstat(fd).st_nlink == 0:  # replayed and deleted while we waited
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            record: Pending = pickle.load(f)
        here = os.getcwd()
        os.chdir(record.cwd)
        try:
            tracker = MlflowTracker(record.tracking)
            _replay_calls(tracker, record.calls, Path(record.summary) if record.summary else None)
        finally:
            os.chdir(here)
        path.unlink()
        return tracker.run_id
    finally:
        os.close(fd)


def drain(queue: Path, cfg: TrackingConfig, older_than_s: float = ORPHAN_AFTER_S) -> list[str]:
    """Replay the queue's orphans (their replayer died or failed) that log to the same store."""
    done = []
    if not queue.is_dir():
        return done
    for path in sorted(queue.glob("*.pkl")):
        try:
            if time.time() - path.stat().st_mtime < older_than_s:
                continue
            with open(path, "rb") as f:
                record: Pending = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError):
            continue
        if _store(record.tracking, record.cwd) == _store(cfg, os.getcwd()):
            run_id = replay(path)
            if run_id:
                done.append(run_id)
    return done


def _store(cfg: TrackingConfig, cwd: str) -> tuple[str, str]:
    """Which store and experiment a record logs to (a relative sqlite path is relative to `cwd`)."""
    db = sqlite_path(cfg.uri)
    return (str((Path(cwd) / db).resolve()) if db is not None else cfg.uri), cfg.experiment


def main(argv: list[str]) -> int:
    path = Path(argv[0])
    try:
        record: Pending = pickle.loads(path.read_bytes())
    except FileNotFoundError:
        print(f"{path}: replayed by another process")
        return 0
    run_id = replay(path)
    print(f"logged {path} as MLflow run {run_id}" if run_id else f"{path}: replayed by another process")
    # Here, in the background, is also where the orphans of failed replays cost nobody a wait.
    os.chdir(record.cwd)
    for orphan in drain(path.parent, record.tracking):
        print(f"logged an orphaned record as MLflow run {orphan}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
