"""Run a function on N real gloo ranks through the project's own local launcher; the services some
tests need (a Slurm cluster, Chromium), skipped loudly where they are missing and required on CI."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from pipelines.launchers.base import Task, WorldSpec
from pipelines.launchers.local import LocalLauncher
from pipelines.schema import LauncherConfig


def run_world(fn: str, inputs: Any = None, world: int = 2, workdir: Path | None = None,
              timeout_s: float = 60.0, grace_s: float = 5.0, artifacts: Path | None = None,
              memory_budget_gib: float | None = None, **kwargs: Any) -> Any:
    """Call `fn` ("module:function", importable from the repo root) as `fn(inputs, **kwargs)` on
    `world` ranks with torch.distributed (gloo) initialised, each held to `memory_budget_gib` when
    given; return rank 0's result, or raise StageFailed naming the failing rank. Without a
    `workdir` the ranks' own is a scratch directory, removed when they succeed and kept when they
    fail (its rank logs say why; the error names it)."""
    scratch = workdir is None
    workdir = workdir or Path(tempfile.mkdtemp(prefix="scalestudy-test-"))
    launcher = LocalLauncher(LauncherConfig(timeout_s=timeout_s, grace_s=grace_s))
    task = Task(stage="test", fn=fn, inputs=inputs, kwargs=kwargs, artifacts=artifacts, workdir=workdir,
                memory_budget_gib=memory_budget_gib)
    result = launcher.run(task, WorldSpec(world, 1))
    if scratch:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def wait_for_mlflow_record(summary: Path, timeout_s: float = 120.0) -> dict:
    """summary.json once its MLflow run id is in it: a fully cached invocation is logged by a
    background replay after the command returns (pipelines/deferred.py)."""
    import json

    deadline = time.monotonic() + timeout_s
    while True:
        data = json.loads(Path(summary).read_text())
        if data.get("mlflow_run_id") or time.monotonic() > deadline:
            assert data.get("mlflow_run_id"), f"{summary}: no MLflow run logged within {timeout_s:.0f} s"
            return data
        time.sleep(0.2)


_HOST_LOCK: int | None = None


def _host_lock() -> int | None:
    """This pytest-xdist run's lock on the host, one descriptor a worker (None in one process):
    every test holds it shared, and a measurement that needs the cores to itself holds it
    exclusive (`host_to_itself`)."""
    global _HOST_LOCK
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run
    if run is None:
        return None
    if _HOST_LOCK is None:
        path = Path(tempfile.gettempdir()) / f"scalestudy-tests-{run}.lock"
        _HOST_LOCK = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    return _HOST_LOCK


@contextlib.contextmanager
def sharing_the_host() -> Iterator[None]:
    """Held around each test (tests/conftest.py), so `host_to_itself` waits for the other
    workers' tests in progress and holds theirs back."""
    fd = _host_lock()
    if fd is None:
        yield
        return
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


@contextlib.contextmanager
def host_to_itself() -> Iterator[None]:
    """No other worker's test runs inside the block: for a run whose timings a test holds against
    the plan's prediction. Under `make test`'s two workers the other worker's ranks can take the
    cores (a smoke run's step once measured 4.6x its prediction beside them; alone it stays
    within 2.5x). Only inside a test (which holds the lock shared); keep the block short, the
    other worker idles through it."""
    fd = _host_lock()
    if fd is None:
        yield
        return
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX)  # converts this worker's shared hold, once the others let go
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_SH)


def asked_statuses(summary: dict) -> dict[str, str]:
    """Each stage's status in a summary.json, leaving out the stages the run did not ask for
    (trials, with plan.trials=0: skipped by design, not by failure)."""
    return {name: s["status"] for name, s in summary["stages"].items()
            if not (s["status"] == "skipped" and (s.get("error") or "").startswith("not asked for"))}


ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
"""CI's .ci/run starts a Slurm cluster and installs Chromium: there a missing one is a failure."""
SLURM_UP = "bash scripts/slurm-local.sh up"
CHROMIUM_INSTALL = "bash scripts/chromium.sh"


def unavailable(service: str, problem: str, fix: str) -> NoReturn:
    """Skip the calling test loudly on a developer's or user's machine; fail it on CI, where a
    service that did not start is a broken CI, not ten quiet skips."""
    if ON_CI:
        pytest.fail(f"{service} is required on CI (CI=true), but {problem}; .ci/run starts it with `{fix}`",
                    pytrace=False)
    pytest.skip(f"{service.upper()} TESTS SKIPPED: {problem}; run `{fix}`")


def _probe_slurm() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch is not on the PATH (no Slurm client installed)"
    try:
        probe = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 30 s"
    if probe.returncode != 0 or not ({"idle", "mix", "alloc"} & set(probe.stdout.split())):
        return f"no Slurm cluster with usable nodes answers ({probe.stderr.strip() or probe.stdout.strip()})"
    return None


SLURM_LOGS = Path(os.environ.get("SCALESTUDY_SLURM_STATE", "/var/tmp/scalestudy-slurm")) / "log"


def _slurm_log_tail(lines: int = 5) -> str:
    """The last lines of the local cluster's controller log, for a failure message that says why."""
    path = SLURM_LOGS / "slurmctld.log"
    if not path.is_file():
        return f"no {path}"
    return f"{path} ends: " + " | ".join(path.read_text(errors="replace").splitlines()[-lines:])


_slurm_ok = False


def slurm_problem() -> str | None:
    """Why the Slurm tests cannot run here, or None when a cluster with usable nodes answers.

    Only an answer is remembered: one failed probe (a controller busy for a moment) must not fail
    every Slurm test of the session. On CI the cluster is part of the test: a controller that does
    not answer within a minute is started again once (`up` starts only the daemons not running),
    and a failure says what its log ended with."""
    global _slurm_ok
    if _slurm_ok:
        return None
    problem = _probe_slurm()
    if problem is not None and ON_CI and shutil.which("sbatch") is not None:
        deadline = time.monotonic() + 60
        while problem is not None and time.monotonic() < deadline:
            time.sleep(5)
            problem = _probe_slurm()
        if problem is not None:
            print(f"\n!!! Slurm does not answer on CI ({problem}); starting it again: {SLURM_UP} !!!",
                  file=sys.stderr)
            up = subprocess.run(SLURM_UP.split(), cwd=Path(__file__).resolve().parents[1],
                                capture_output=True, text=True, timeout=600)
            problem = _probe_slurm()
            if problem is not None:
                problem += f"; `{SLURM_UP}` exited {up.returncode}: {up.stderr.strip()[-400:]}; {_slurm_log_tail()}"
    _slurm_ok = problem is None
    return problem


def need_slurm() -> None:
    problem = slurm_problem()
    if problem is not None:
        unavailable("Slurm", problem, SLURM_UP)


def chromium() -> str:
    """The headless browser's path (the browser tests need it)."""
    path = shutil.which("chromium")
    if path is None:
        unavailable("Chromium", "chromium is not installed", CHROMIUM_INSTALL)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(store: str, cwd: Path) -> Iterator[str]:
    """A real `mlflow server --workers 1` over `store`, its base URL once /health answers; stopped
    by the PID it was started with (its process group), and checked gone."""
    port = free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--workers", "1", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", store],
        cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None, "mlflow server exited"
                assert time.monotonic() < deadline, "mlflow server did not answer in 90 s"
                time.sleep(0.5)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its worker, by the PID we started
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
