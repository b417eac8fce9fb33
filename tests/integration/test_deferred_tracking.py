"""A fully cached invocation is logged to MLflow after the command returns (pipelines/deferred.py):
the driver never imports MLflow, the record a background replay writes is the record a live
tracker writes (same params, tags, metrics, children, at the times the calls were made), it is
written once however many replayers race, and a record whose replayer died is replayed later."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.deferred import QUEUE, Call, DeferredTracker, Pending, defers, drain, replay
from pipelines.schema import TrackingConfig
from pipelines.tracking import ChildRun, MlflowTracker
from tests.helpers import wait_for_mlflow_record

ROOT = Path(__file__).resolve().parents[2]


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _calls(tracker, artifacts: Path, summary: Path) -> None:
    """What the runner says to its tracker in a cached invocation of two stages."""
    tracker.start("ddp-2-tiny", {"train.steps": 8, "strategy": "ddp"}, {"kind": "invocation", "strategy": "ddp"})
    tracker.set_tags({"placement.launcher": "local"})
    tracker.log_stage("env", "cached", {"cached": "true"}, {"seed": 0}, [("env/ranks", 2.0, 0)], None)
    tracker.log_stage("trials", "cached", {"cached": "true"}, {"n": 1}, [("trials/best", 3.5, 0), ("train/loss", 2.0, 1)],
                      artifacts, [ChildRun("trial-0", {"layout": "dp2"}, [("trial/samples_per_s", 10.0, 0)], "trials")])
    tracker.finish(True, [summary])


def _record(uri: str, run_id: str) -> dict:
    """A run and its children as comparable data: everything but ids and times."""
    client = _client(uri)
    run = client.get_run(run_id)
    experiment = run.info.experiment_id
    kids = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{run_id}'")
    grand = {k.data.tags["stage"]: sorted((g.info.run_name, g.data.params["layout"]) for g in client.search_runs(
        [experiment], f"tags.mlflow.parentRunId = '{k.info.run_id}'")) for k in kids}

    def plain(r) -> dict:
        tags = {k: v for k, v in r.data.tags.items() if k != "mlflow.parentRunId"}
        return {"name": r.info.run_name, "status": r.info.status, "params": r.data.params, "tags": tags,
                "metrics": r.data.metrics}

    return {"run": plain(run), "stages": sorted((plain(k) for k in kids), key=lambda r: r["name"]),
            "children": grand, "artifacts": sorted(a.path for a in client.list_artifacts(run_id))}


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    (artifacts / "table.txt").write_text("one artifact")
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"mlflow_run_id": None, "ok": True}))
    return TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db"), artifacts, summary


def _deferred(cfg: TrackingConfig, queue: Path, artifacts: Path, summary: Path, monkeypatch) -> Path:
    """Play the calls into a DeferredTracker that never goes live; its replayer is not started
    (the test replays), so the queue file is the one thing it leaves."""
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: None)
    tracker = DeferredTracker(cfg, queue)
    _calls(tracker, artifacts, summary)
    assert tracker.run_id is None and tracker.pending is not None and tracker.pending.is_file()
    return tracker.pending


def test_the_replayed_record_is_the_live_record_at_the_calls_times(store, tmp_path, monkeypatch):
    cfg, artifacts, summary = store
    live = MlflowTracker(cfg)
    _calls(live, artifacts, summary)
    pending = _deferred(cfg, tmp_path / QUEUE, artifacts, summary, monkeypatch)
    made = [call.at for call in pickle.loads(pending.read_bytes()).calls]
    time.sleep(0.05)
    run_id = replay(pending)
    assert run_id and not pending.exists()
    assert _record(cfg.uri, run_id) == _record(cfg.uri, live.run_id)
    assert json.loads(summary.read_text())["mlflow_run_id"] == run_id, "summary.json names its run"
    run = _client(cfg.uri).get_run(run_id)
    assert (run.info.start_time, run.info.end_time) == (int(made[0] * 1000), int(made[-1] * 1000)), (
        "the run is dated when the invocation ran, not when it was replayed")
    logged = Path(_client(cfg.uri).download_artifacts(run_id, "summary.json", str(tmp_path / "dl")))
    assert json.loads(logged.read_text())["mlflow_run_id"] == run_id, "the logged copy carries the id too"


def test_going_live_replays_what_was_kept_and_passes_the_rest_through(store, tmp_path):
    cfg, artifacts, summary = store
    tracker = DeferredTracker(cfg, tmp_path / QUEUE)
    tracker.start("ddp-2-tiny", {"strategy": "ddp"}, {"kind": "invocation"})
    tracker.set_tags({"placement.launcher": "local"})
    assert tracker.run_id is None, "nothing is written before a stage runs"
    tracker.go_live()
    client = _client(cfg.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "RUNNING" and run.data.tags["placement.launcher"] == "local"
    tracker.log_stage("env", "ran", {"cached": "false"}, {}, [("env/ranks", 2.0, 0)], None)
    assert [k.data.tags["stage"] for k in client.search_runs(
        [run.info.experiment_id], f"tags.mlflow.parentRunId = '{tracker.run_id}'")] == ["env"], "logged as it happens"
    tracker.finish(True, [summary])
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert not (tmp_path / QUEUE).exists() or not any((tmp_path / QUEUE).iterdir()), "a live run leaves no record"


def test_a_local_store_opens_on_a_thread_and_what_is_said_meanwhile_is_kept_in_order(store, tmp_path, monkeypatch):
    """Going live on a sqlite store returns at once: MLflow is imported and opened on a thread while
    the stage runs, and the calls made meanwhile reach the run, in order, once it is open."""
    import threading

    import pipelines.deferred as deferred

    opened_on = []

    class Recording(MlflowTracker):
        def __init__(self, cfg):
            opened_on.append(threading.current_thread().name)
            super().__init__(cfg)

    monkeypatch.setattr(deferred, "MlflowTracker", Recording)
    cfg, artifacts, summary = store
    tracker = DeferredTracker(cfg, tmp_path / QUEUE)
    tracker.start("ddp-2-tiny", {"strategy": "ddp"}, {"kind": "invocation"})
    tracker.go_live()
    tracker.log_stage("env", "ran", {"cached": "false"}, {}, [("env/ranks", 2.0, 0)], None)
    time.sleep(0.01)  # stages a few milliseconds apart at least, as stages are: their runs' order is their times'
    tracker.log_stage("bandwidth", "ran", {"cached": "false"}, {}, [("bandwidth/busbw", 0.5, 0)], None)
    tracker.finish(True, [summary])
    assert len(opened_on) == 1 and opened_on[0].startswith("mlflow-open"), opened_on
    client = _client(cfg.uri)
    run = client.get_run(tracker.run_id)
    kids = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{tracker.run_id}'",
                              order_by=["attributes.start_time ASC"])
    assert run.info.status == "FINISHED" and [k.data.tags["stage"] for k in kids] == ["env", "bandwidth"]
    assert kids[1].data.metrics == {"bandwidth/busbw": 0.5}


def test_a_record_is_logged_once_however_many_replay_it(store, tmp_path, monkeypatch):
    cfg, artifacts, summary = store
    pending = _deferred(cfg, tmp_path / QUEUE, artifacts, summary, monkeypatch)
    fd = os.open(pending, os.O_RDONLY)
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX)  # a replayer at work
    assert replay(pending) is None and pending.exists(), "a locked record is left to its replayer"
    os.close(fd)
    assert replay(pending) and replay(pending) is None
    runs = _client(cfg.uri).search_runs([_client(cfg.uri).get_experiment_by_name(cfg.experiment).experiment_id],
                                        "tags.kind = 'invocation'")
    assert len(runs) == 1


def test_an_orphaned_record_is_replayed_by_the_next_drain(store, tmp_path, monkeypatch):
    cfg, artifacts, summary = store
    queue = tmp_path / QUEUE
    orphan = _deferred(cfg, queue, artifacts, summary, monkeypatch)
    fresh = _deferred(cfg, queue, artifacts, summary, monkeypatch)
    other = queue / "other-store.pkl"
    record = pickle.loads(fresh.read_bytes())
    other.write_bytes(pickle.dumps(Pending(TrackingConfig(uri=f"sqlite:///{tmp_path}/elsewhere.db"), record.cwd,
                                           record.summary, [Call("start", ("x", {}, {}), 0.0)])))
    old = time.time() - 3600
    for path in (orphan, other):
        os.utime(path, (old, old))
    assert len(drain(queue, cfg)) == 1
    assert not orphan.exists(), "a record older than a minute, unlocked, is an orphan: replayed"
    assert fresh.exists(), "a fresh record is its own replayer's"
    assert other.exists(), "a record for another store waits for a tracker of that store"


@pytest.mark.slow
def test_a_cached_rerun_never_imports_mlflow_and_is_logged_after_it_returns(tmp_path):
    """Through run.py: the second invocation's driver has not imported MLflow when it exits; its
    run appears in the store, complete, once the background replay is done."""
    probe = tmp_path / "imported.txt"
    code = ("import atexit, runpy, sys; "
            f"atexit.register(lambda: open({str(probe)!r}, 'w').write(str('mlflow' in sys.modules))); "
            f"sys.argv = [{str(ROOT / 'run.py')!r}] + sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    args = ["only=[env]"]
    for name in ("first", "second"):
        done = subprocess.run([sys.executable, "-c", code, *args, f"hydra.run.dir={name}"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert probe.read_text() == str(name == "first"), f"{name}: MLflow imported by the driver?"
    first = json.loads((tmp_path / "first/summary.json").read_text())
    second = wait_for_mlflow_record(tmp_path / "second/summary.json")
    assert second["stages"]["env"]["status"] == "cached" and second["mlflow_run_id"] != first["mlflow_run_id"]
    uri = f"sqlite:///{tmp_path}/outputs/mlflow.db"
    run = _client(uri).get_run(second["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["cached_stages"] == "env"
    assert run.data.params == _client(uri).get_run(first["mlflow_run_id"]).data.params
    assert not any((tmp_path / "outputs/cache" / QUEUE).iterdir()), "the replayer removed its record"


def test_only_a_single_invocation_without_credentials_in_its_uri_is_deferred():
    assert defers(TrackingConfig(), sweep=False)
    assert not defers(TrackingConfig(), sweep=True), "a study report reads the sweep's runs as it ends"
    assert not defers(TrackingConfig(name="none"), sweep=False)
    assert not defers(TrackingConfig(uri="http://user:s3cr3t@host:5000"), sweep=False), "no secret in a queue file"
