"""launcher=ray: each world or one_device stage is a Ray Train `TorchTrainer` job.

`launcher.address: null` starts a private Ray instance for this invocation (temp dir under the run's
outputs, no dashboard, its own auth token) and stops it in `close()`; any other address joins an
existing cluster and leaves it running. Every worker calls the same `run_task` as launcher=local,
with torch.distributed set up by Ray Train. Rank 0's result travels back in the metrics of the one
checkpoint it reports at the end, so nothing is reported per step. With `max_failures > 0` Ray
restarts the worker group and calls the stage again; the train stage resumes from its own
checkpoints directory.

Multi-node: the repository, its virtual environment and the outputs directory (stage checkpoints,
artifacts, logs) must sit at the same path on every node, e.g. on a shared filesystem.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import secrets
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import ray
import ray.exceptions
import ray.train
from ray.train import BackendConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from common.errors import ConfigError
from pipelines.launchers.base import StageFailed, Task, WorldSpec, probe_placement, worker_pythonpath
from pipelines.launchers.ray_agent import WAIT_S, Command, Mailbox, agent
from pipelines.launchers.tasks import describe_failure
from pipelines.launchers.worker import ERROR_FILE
from pipelines.placement import Placement
from pipelines.schema import LauncherConfig

CONNECT_TIMEOUT_S = 5.0
DEATH_NOTICE_S = 60.0
"""How much longer than launcher.grace_s a stage waits, once a rank's process is gone, for Ray
Train to notice and restart the group (or end it): a fixed grace read a death as a stage failure
when a loaded host was slow to notice (one CI run)."""
# Ray binds AF_UNIX sockets at <temp>/session_<date>_<pid>/sockets/plasma_store (about 66
# characters below <temp>); Linux caps the whole path at 107.
MAX_TEMP_DIR_CHARS = 40
# A private instance gets its own token in the environment instead of ~/.ray/auth_token.
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
"""Off unless the user's environment sets it. Ray Train starts a PreemptionWatcher actor with each
worker group, a process of its own that polls the GCS for draining nodes and logs them; restarting
the group after a lost node is `launcher.max_failures`'s work, without it. With it, on a 2-core
host, the train stage's samples/s under launcher=ray was 0.86 of launcher=local's; without it,
0.98 (2026-12-06: six alternating rounds of 400-step train stages, medians 843 and 961 against
local's 980; five of the six rounds faster without it)."""


class WorkerGroup:
    """One Ray Train worker group serving stage after stage, driven through its mailbox."""

    def __init__(self, cfg: LauncherConfig, run_dir: Path, size: int, use_gpu: bool):
        self.cfg, self.size = cfg, size
        self.mailbox = Mailbox.remote(size)
        self.name = f"group-{uuid.uuid4().hex[:8]}"  # a reused run name would resume that old run
        self.error: BaseException | None = None
        self.doomed = False
        """A rank that hung was told to end its process: the group serves no further stage."""
        self.commands = 0
        self.resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_gpu else "gloo")
        self.trainer = DataParallelTrainer(
            agent,
            train_loop_config={"mailbox": self.mailbox, "backend": backend, "timeout_s": cfg.timeout_s,
                               "cpus_per_worker": cfg.cpus_per_worker},
            backend_config=BackendConfig(),  # no process group from Ray: each stage makes its own
            scaling_config=ScalingConfig(num_workers=size, use_gpu=use_gpu, resources_per_worker=self.resources,
                                         placement_strategy="STRICT_SPREAD" if cfg.spread_nodes else "PACK"),
            run_config=RunConfig(name=self.name, storage_path=str(run_dir / "ray-train"),
                                 failure_config=FailureConfig(max_failures=cfg.max_failures)),
        )
        self.start = time.monotonic()
        print(f"ray: worker group {self.name} SUBMITTED: {size} workers, {self.resources}", flush=True)
        self.thread = threading.Thread(target=self._fit, name=self.name, daemon=True)
        self.thread.start()
        self.workers = self._wait_ready()
        print(f"ray: worker group {self.name} RUNNING {time.monotonic() - self.start:.0f}s", flush=True)

    def _fit(self) -> None:
        try:
            self.trainer.fit()
        except BaseException as err:  # noqa: BLE001 - reported by the stage that was waiting on it
            self.error = err

    def alive(self) -> bool:
        return self.thread.is_alive() and not self.doomed

    def _wait_ready(self) -> list[dict[str, Any]]:
        while True:
            ready = ray.get(self.mailbox.ready.remote(WAIT_S))
            if ready is not None:
                return ready[1]
            if not self.thread.is_alive():
                raise StageFailed(f"the Ray worker group did not start: {_failure_text(self.error)}")

    def run(self, task: Task, world: WorldSpec) -> Any:
        ranks = world.size if world.distributed else 1
        workdir = Path(task.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        for stale in [*workdir.glob("error-rank*.json"), *workdir.glob("rank*.pid")]:
            stale.unlink()
        cid = self.commands
        self.commands += 1
        ray.get(self.mailbox.submit.remote(Command(cid, pickle.dumps(task), ranks, world.distributed)))
        start, generation, failed_at, seen = time.monotonic(), None, None, 0
        try:
            while True:
                wait = WAIT_S if failed_at is None else 0.2
                current, outcomes = ray.get(self.mailbox.outcomes.remote(cid, seen, wait))
                seen = len(outcomes)
                if generation is not None and current != generation:
                    print(f"ray: worker group {self.name} restarted; {task.stage} runs again", flush=True)
                    failed_at = None
                generation = current
                if len(outcomes) == ranks and all(o.ok for o in outcomes.values()):
                    ready = ray.get(self.mailbox.ready.remote())
                    self.workers = ready[1] if ready is not None else self.workers
                    return pickle.loads(outcomes[0].result)
                if any(not o.ok for o in outcomes.values()):
                    failed_at = failed_at or time.monotonic()
                    # A missing rank whose process is gone died (killed, out of memory): its peers
                    # fail at once on the broken link, and Ray Train restarts the group or ends it
                    # once it notices, which on a loaded host takes longer than grace_s.
                    missing = [r for r in range(ranks) if r not in outcomes]
                    limit = self.cfg.grace_s + (DEATH_NOTICE_S if _gone(workdir, missing) else 0.0)
                    if len(outcomes) == ranks or time.monotonic() - failed_at > limit:
                        hung = [r for r in range(ranks) if r not in outcomes]
                        note = f"; still running after {self.cfg.grace_s:g} s and killed: ranks {hung}" if hung else ""
                        self.doomed = bool(hung)
                        raise StageFailed(describe_failure(workdir, ranks, {}) + note)
                if not self.thread.is_alive():
                    raise StageFailed(self._death(task))
        finally:
            print(f"ray: {task.stage} on {self.name} done {time.monotonic() - start:.0f}s", flush=True)
            self._settle(cid)

    def _settle(self, cid: int) -> None:
        """Close the stage: ranks still in it (hung) end their process, and Ray Train replaces them."""
        if self.thread.is_alive():
            ray.get(self.mailbox.close.remote(cid))

    def _death(self, task: Task) -> str:
        """The group ended while the stage ran: a worker died and no restart was left."""
        err = self.error
        workdir = Path(task.workdir)
        if isinstance(err, ray.train.WorkerGroupError):
            died = {r: f"died: {_first_line(e)}" for r, e in sorted(err.worker_failures.items())
                    if not (workdir / ERROR_FILE.format(rank=r)).exists()}
            return describe_failure(workdir, max(err.worker_failures) + 1, died)
        if isinstance(err, ray.train.ControllerError):
            return _describe_controller_failure(err.controller_failure, workdir)
        return f"the Ray worker group ended: {_failure_text(err)} (logs: {workdir})"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "workers": [{k: w[k] for k in ("pid", "node_id", "host")} for w in self.workers]}

    def stop(self) -> None:
        """Agents leave their loop; Ray Train's fit returns."""
        try:
            ray.get(self.mailbox.stop.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - a dead group or mailbox has nothing left to stop
            pass
        self.thread.join(timeout=30)
        print(f"ray: worker group {self.name} FINISHED {time.monotonic() - self.start:.0f}s", flush=True)


def _failure_text(err: BaseException | None) -> str:
    return _first_line(err) if err is not None else "no error reported"


def _gone(workdir: Path, ranks: list[int]) -> bool:
    """Whether any of `ranks` left a pid file in `workdir` naming a process that no longer exists
    (on this host; a worker on another host reads as gone, which only waits longer)."""
    for rank in ranks:
        path = workdir / f"rank{rank}.pid"
        try:
            os.kill(int(path.read_text().strip()), 0)
        except (FileNotFoundError, ValueError, PermissionError):
            continue
        except ProcessLookupError:
            return True
    return False


def _describe_controller_failure(err: BaseException, workdir: Path) -> str:
    """A worker process that died (SIGKILL, OOM, segfault) surfaces as the controller's error;
    its pid, matched against the pid files the workers left, names the rank."""
    match = re.search(r"\bpid: (\d+)", str(err))
    if isinstance(err, ray.exceptions.RayActorError) and match:
        for path in workdir.glob("rank*.pid"):
            if path.read_text().strip() == match.group(1):
                rank = path.name.removeprefix("rank").removesuffix(".pid")
                return (f"rank {rank} died: its process {match.group(1)} exited unexpectedly (killed, "
                        f"out of memory or crashed) (logs: {workdir})")
    return f"Ray Train failed: {_first_line(err)} (logs: {workdir})"


class RayLauncher:
    def __init__(self, cfg: LauncherConfig, run_dir: Path, invocation: WorldSpec | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir).resolve()
        self.invocation = invocation
        """The invocation's world: the size of the worker group one-device stages run on."""
        self.group: WorkerGroup | None = None
        self.groups: list[WorkerGroup] = []
        self.started = cfg.address is None
        self._scratch: Path | None = None
        self._saved_env: dict[str, str | None] = {}
        runtime_env = {"env_vars": {"PYTHONPATH": worker_pythonpath(),
                                    PREEMPTION_WATCHER_ENV: os.environ.get(PREEMPTION_WATCHER_ENV, "0")}}
        if self.started:
            self._start_local(runtime_env)
        else:
            self._join(cfg.address, runtime_env)
        self.use_gpu = wants_gpus(cfg, ray.cluster_resources())
        """One GPU per worker: launcher.use_gpu, else whether the cluster (not this driver) lists GPUs."""

    def _start_local(self, runtime_env: dict) -> None:
        temp_dir = self.run_dir / "ray"
        if len(str(temp_dir)) > MAX_TEMP_DIR_CHARS:
            self._scratch = temp_dir = Path(tempfile.mkdtemp(prefix="ss-ray-"))
        temp_dir.mkdir(parents=True, exist_ok=True)
        if not any(k in os.environ for k in (*AUTH_ENV, "RAY_AUTH_TOKEN_PATH")):
            self._saved_env = {k: os.environ.get(k) for k in AUTH_ENV}
            os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
            _reload_auth()
        try:
            ray.init(
                num_cpus=os.cpu_count(),
                include_dashboard=False,
                log_to_driver=False,
                _temp_dir=str(temp_dir),
                runtime_env=runtime_env,
            )
        except BaseException:
            self.close()
            raise

    def _join(self, address: str, runtime_env: dict) -> None:
        host_port = address.removeprefix("ray://")
        if address != "auto":
            host, _, port = host_port.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
            except (OSError, ValueError) as err:
                raise ConfigError("launcher.address", address, f"cannot reach a Ray cluster there ({err}); "
                                  "start one with `ray start --head`, or use null for a local instance") from None
        try:
            ray.init(address=address, log_to_driver=False, runtime_env=runtime_env)
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise ConfigError("launcher.address", address, f"cannot join a Ray cluster there: "
                              f"{str(err).strip().splitlines()[0]}") from None

    def _size(self, world: WorldSpec) -> int:
        """Workers the stage needs: a world stage its world; a one-device stage runs on rank 0 of
        the group there is, or of the invocation's group (the stages after it will want it)."""
        alive = self.group is not None and self.group.alive()
        if world.distributed and not (alive and world.size <= self.group.size):
            return max(world.size, self.invocation.size if self.invocation else 1)
        if alive:
            return self.group.size  # its first ranks: the 1-device baseline, a one-device stage
        return max(world.size if world.distributed else 1, self.invocation.size if self.invocation else 1)

    def _ensure(self, size: int) -> WorkerGroup:
        group = self.group
        if group is not None and group.alive() and group.size == size:
            return group
        if group is not None:
            group.stop()
        self.group = WorkerGroup(self.cfg, self.run_dir, size, self.use_gpu)
        self.groups.append(self.group)
        return self.group

    def run(self, task: Task, world: WorldSpec) -> Any:
        size = self._size(world)
        _check_resources(task.stage, WorldSpec(size, 1), self.cfg, self.use_gpu)
        return self._ensure(size).run(task, world)

    def placement(self, world: WorldSpec) -> Placement:
        """Read on the workers themselves: a probe on the worker group every stage then uses."""
        backend = self.cfg.backend if self.cfg.backend != "auto" else ("nccl" if self.use_gpu else "gloo")
        found = probe_placement(self, "ray", backend, world, self.run_dir / "logs" / "placement")
        return dataclasses.replace(found, backend=backend)

    def record(self) -> dict[str, Any]:
        """For summary.json: each worker group (its workers' PIDs and Ray nodes) and its restarts."""
        return {"worker_groups": [g.describe() for g in self.groups]}

    def close(self) -> None:
        """Stop the worker group, then the Ray instance this launcher started; from a joined cluster,
        only disconnect this driver (ray.shutdown does not stop a cluster it did not start)."""
        if self.group is not None:
            self.group.stop()
            self.group = None
        ray.shutdown()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self._saved_env:
            _reload_auth()
            self._saved_env = {}
        if self._scratch is not None:
            # Keep the instance's logs with the run; the short directory itself goes.
            logs = self._scratch / "session_latest" / "logs"
            if logs.is_dir():
                shutil.copytree(logs, self.run_dir / "ray-logs", dirs_exist_ok=True, ignore_dangling_symlinks=True)
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None


def wants_gpus(cfg: LauncherConfig, resources: dict[str, float]) -> bool:
    """Whether each worker asks for a GPU: launcher.use_gpu, else whether the cluster's resources
    list any. Read from the cluster, never from the driver: a CPU head or a ray:// client has no GPU
    of its own, and workers that ask for none have every GPU hidden from them by Ray."""
    if cfg.use_gpu is not None:
        return cfg.use_gpu
    return resources.get("GPU", 0) > 0


def _reload_auth() -> None:
    """Ray caches the auth mode and token of the process; make it read the environment again."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _check_resources(stage: str, world: WorldSpec, cfg: LauncherConfig, use_gpu: bool) -> None:
    """Fail at once when the cluster can never place the world (Ray would wait for it forever)."""
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    slots = [_slots(r, cfg.cpus_per_worker, use_gpu) for r in nodes]
    fits = sum(s > 0 for s in slots) >= world.size if cfg.spread_nodes else sum(slots) >= world.size
    if fits:
        return
    per_worker = f"{cfg.cpus_per_worker:g} CPU" + (" + 1 GPU" if use_gpu else "")
    where = f" on {world.size} distinct nodes (launcher.spread_nodes=true)" if cfg.spread_nodes else ""
    has = ", ".join(f"{r.get('CPU', 0):g} CPU" + (f" + {r.get('GPU', 0):g} GPU" if use_gpu else "") for r in nodes)
    raise StageFailed(
        f"{stage}: asked for {world.size} Ray workers x {per_worker}{where}, but the cluster has "
        f"{len(nodes)} alive node(s): {has or 'none'}; lower nodes/procs_per_node or "
        "launcher.cpus_per_worker, or add nodes"
    )


def _slots(resources: dict[str, float], cpus_per_worker: float, use_gpu: bool) -> int:
    """How many workers fit on one node (a worker's bundle cannot span nodes)."""
    slots = int(resources.get("CPU", 0) // cpus_per_worker)
    return min(slots, int(resources.get("GPU", 0))) if use_gpu else slots


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


