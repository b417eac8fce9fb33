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

import base64
import dataclasses
import json
import math
import os
import pickle
import re
import secrets
import shutil
import socket
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import ray
import ray.exceptions
import ray.train
import torch
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from pipelines.launchers.base import StageFailed, Task, WorldSpec, probe_placement, worker_pythonpath
from pipelines.launchers.worker import ERROR_FILE, RESULT_FILE, run_task
from pipelines.placement import Placement, resolved_backend
from pipelines.schema import LauncherConfig
from training.config import ConfigError
from training.files import write_atomic

ROOT = Path(__file__).resolve().parents[2]
RESULT_KEY = "scalestudy_result"
CONNECT_TIMEOUT_S = 5.0
# Ray binds AF_UNIX sockets at <temp>/session_<date>_<pid>/sockets/plasma_store (about 66
# characters below <temp>); Linux caps the whole path at 107.
MAX_TEMP_DIR_CHARS = 40
# A private instance gets its own token in the environment instead of ~/.ray/auth_token.
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


class RayLauncher:
    def __init__(self, cfg: LauncherConfig, run_dir: Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir).resolve()
        self.started = cfg.address is None
        self._scratch: Path | None = None
        self._saved_env: dict[str, str | None] = {}
        runtime_env = {"env_vars": {"PYTHONPATH": worker_pythonpath()}}
        if self.started:
            self._start_local(runtime_env)
        else:
            self._join(cfg.address, runtime_env)

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

    def run(self, task: Task, world: WorldSpec) -> Any:
        workdir = Path(task.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        for stale in [*workdir.glob("error-rank*.json"), *workdir.glob("rank*.pid")]:
            stale.unlink()
        use_gpu = torch.cuda.is_available()
        _check_resources(task.stage, world, self.cfg, use_gpu)
        resources = {"CPU": self.cfg.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
        backend = self.cfg.backend if self.cfg.backend != "auto" else ("nccl" if use_gpu else "gloo")
        trainer = TorchTrainer(
            _train_fn,
            train_loop_config={"task": task, "distributed": world.distributed},
            torch_config=TorchConfig(backend=backend, timeout_s=math.ceil(self.cfg.timeout_s)),
            scaling_config=ScalingConfig(
                num_workers=world.size,
                use_gpu=use_gpu,
                resources_per_worker=resources,
                placement_strategy="STRICT_SPREAD" if self.cfg.spread_nodes else "PACK",
            ),
            run_config=RunConfig(
                # A reused name would resume that old run: every call gets its own.
                name=(name := f"{task.stage}-{uuid.uuid4().hex[:8]}"),
                storage_path=str(self.run_dir / "ray-train"),
                failure_config=FailureConfig(max_failures=self.cfg.max_failures),
            ),
        )
        start = time.monotonic()
        print(f"ray: {task.stage} run {name} SUBMITTED: {world.size} workers, {resources}", flush=True)
        try:
            result = trainer.fit()
        except ray.train.WorkerGroupError as err:
            print(f"ray: {task.stage} run {name} FAILED {time.monotonic() - start:.0f}s", flush=True)
            raise StageFailed(_describe_failure(err.worker_failures, workdir)) from None
        except ray.train.ControllerError as err:
            print(f"ray: {task.stage} run {name} FAILED {time.monotonic() - start:.0f}s", flush=True)
            raise StageFailed(_describe_controller_failure(err.controller_failure, workdir)) from None
        print(f"ray: {task.stage} run {name} FINISHED {time.monotonic() - start:.0f}s", flush=True)
        encoded = (result.metrics or {}).get(RESULT_KEY)
        if encoded is None:
            raise StageFailed(f"{task.stage}: rank 0 finished but reported no result (logs: {workdir}/rank0.log)")
        return pickle.loads(base64.b64decode(encoded))

    def placement(self, world: WorldSpec) -> Placement:
        """Read on the workers themselves: a probe task on `world`."""
        found = probe_placement(self, "ray", self.cfg.backend, world, self.run_dir / "logs" / "placement")
        return dataclasses.replace(found, backend=resolved_backend(self.cfg.backend, found.nodes[0]))

    def close(self) -> None:
        """Stop the Ray instance this launcher started; from a joined cluster, only disconnect
        this driver (ray.shutdown does not stop a cluster it did not start)."""
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


def _describe_failure(failures: dict[int, Exception], workdir: Path) -> str:
    """The root cause first: a rank that died without an error report (its peers' errors are only
    the echo of it), else the rank whose exception came first."""
    died = [rank for rank in sorted(failures) if not (workdir / ERROR_FILE.format(rank=rank)).exists()]
    if died:
        return f"rank {died[0]} died: {_first_line(failures[died[0]])} (logs: {workdir})"
    reports = [(json.loads((workdir / ERROR_FILE.format(rank=r)).read_text()), r) for r in failures]
    report, rank = min(reports, key=lambda item: item[0]["time"])
    return f"rank {rank} failed: {report['type']}: {report['message']} (logs: {workdir})"


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


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def _train_fn(config: dict[str, Any]) -> None:
    """One Ray Train worker: our environment conventions, then the stage, then rank 0 reports."""
    task: Task = config["task"]
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    _set_worker_env(ctx, config["distributed"])
    if not config["distributed"] and torch.distributed.is_initialized():
        # one_device stages run without a process group, as under launcher=local.
        torch.distributed.destroy_process_group()
    workdir = Path(task.workdir)
    (workdir / f"rank{rank}.pid").write_text(str(os.getpid()))
    with _redirect_output(workdir / f"rank{rank}.log"):
        result = _run_reporting_errors(task, rank, workdir)
    if rank != 0:
        # The call is collective: every rank reports once, only rank 0 carries the result.
        ray.train.report({})
        return
    data = pickle.dumps(result)
    with tempfile.TemporaryDirectory(prefix="ss-result-") as tmp:
        write_atomic(Path(tmp) / RESULT_FILE, data)
        ray.train.report({RESULT_KEY: base64.b64encode(data).decode()}, checkpoint=Checkpoint.from_directory(tmp))


def _set_worker_env(ctx: Any, distributed: bool) -> None:
    """The torchrun-style variables our code reads, and a thread count that shares this host."""
    os.environ.update(
        RANK=str(ctx.get_world_rank()),
        WORLD_SIZE=str(ctx.get_world_size()),
        LOCAL_RANK=str(ctx.get_local_rank()),
        LOCAL_WORLD_SIZE=str(ctx.get_local_world_size()),
        GROUP_RANK=str(_node_rank(distributed)),
    )
    threads = max(1, (os.cpu_count() or 1) // ctx.get_local_world_size())
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        torch.cuda.set_device(ray.train.torch.get_device())


def _node_rank(distributed: bool) -> int:
    """This worker's Ray node, numbered in rank order. Ray Train's own node rank (and local rank)
    groups workers by IP address, so two Ray nodes on one host would look like one node."""
    node_id = ray.get_runtime_context().get_node_id()
    if not (distributed and torch.distributed.is_initialized()):
        return 0
    ids: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ids, node_id)
    return list(dict.fromkeys(ids)).index(node_id)


def _run_reporting_errors(task: Task, rank: int, workdir: Path) -> Any:
    """run_task, leaving `error-rank<R>.json` behind on failure as the worker module does."""
    try:
        return run_task(task)
    except BaseException as err:
        report = {"type": type(err).__name__, "message": str(err).strip(), "traceback": traceback.format_exc(),
                  "time": time.time()}
        write_atomic(workdir / ERROR_FILE.format(rank=rank), json.dumps(report).encode())
        raise


class _redirect_output:
    """Send this process's stdout and stderr (file descriptors 1 and 2) to `path`, appending, so
    that rank logs sit where launcher=local puts them; restore Ray's own on exit."""

    def __init__(self, path: Path):
        self.path = path
        self.saved: list[int] = []

    def __enter__(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = [os.dup(1), os.dup(2)]
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), self.saved, strict=True):
            os.dup2(fd, target)
            os.close(fd)
