"""launcher=slurm: each world or one_device stage runs as one Slurm job, submitted with submitit.

A `world` stage becomes a job of `nodes` x `procs_per_node` tasks; a `one_device` stage a 1-task
job. Every task runs `SlurmTask`, which takes its place in the world from Slurm (submitit's
TorchDistributedEnvironment: MASTER_ADDR is the first node), meets its peers through a TCPStore on
a port rank 0 publishes in the job's folder, initialises torch.distributed as the local worker does
and calls the same `run_task`.

The job is requeueable: on preemption or time-out Slurm sends USR2, submitit calls
`SlurmTask.checkpoint()`, which resubmits the same call; the train stage then resumes from its own
distributed checkpoint. Job logs (one stdout/stderr pair per task) go to `<run_dir>/slurm/<stage>`.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import submitit

from pipelines.launchers.base import StageFailed, Task, WorldSpec, probe_placement
from pipelines.launchers.worker import (
    BACKEND_ENV,
    DEVICE_ENV,
    DISTRIBUTED_ENV,
    TIMEOUT_ENV,
    run_task,
    setup_torch,
    teardown_torch,
)
from pipelines.placement import Placement, resolved_backend
from pipelines.schema import LauncherConfig
from training.config import ConfigError
from training.files import write_atomic

ROOT = Path(__file__).resolve().parents[2]
SIGNAL_DELAY_S = 90
"""Seconds before the time limit at which Slurm sends USR2 so that the job can checkpoint."""
PENDING_CHECK_S = 2.0
"""How long a job may be PENDING before its Reason is checked for one it can never leave."""
HOPELESS_REASONS = (
    "PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig", "BadConstraints", "InvalidAccount",
    "InvalidQOS", "QOSMaxNodePerJobLimit", "QOSMaxCpuPerJobLimit", "AssocMaxNodesPerJobLimit",
    "AssocMaxCpuPerJobLimit", "ReqNodeNotAvail, UnavailableNodes",
)
"""squeue Reasons of a PENDING job that no amount of waiting resolves: the request is wrong."""
PEER_ECHOES = ("Connection closed by peer", "Connection reset by peer")
"""A rank that fails with these only echoes another rank's death; the root cause is elsewhere."""
TAIL_LINES = 25


class SlurmTask(submitit.helpers.Checkpointable):
    """The callable every task of a stage's job runs: set up the world, run the stage, return
    rank 0's result. A requeued job calls it again with the same task, and the stage resumes
    from its checkpoint directory."""

    def __init__(self, task: Task, backend: str, timeout_s: float, distributed: bool, max_requeues: int):
        self.task, self.backend, self.timeout_s = task, backend, timeout_s
        self.distributed, self.max_requeues = distributed, max_requeues
        # Names this submission's rendezvous file: job ids repeat (a reset cluster, a reused run
        # dir), and a peer must never read an earlier job's port.
        self.nonce = uuid.uuid4().hex[:12]

    def __call__(self) -> Any:
        # After a requeue the ranks other than 0 left the result pickle of their failed first
        # attempt (their peer vanished); job.results() would report it instead of this run's.
        submitit.JobEnvironment().paths.result_pickle.unlink(missing_ok=True)
        self._export_env()
        setup_torch(store=self._rendezvous() if self.distributed else None)
        result = run_task(self.task)
        teardown_torch()
        # Seen once in ~30 stage jobs: the job completed ("Exiting after successful completion"),
        # then interpreter teardown aborted in a torch C++ destructor ("terminate called without
        # an active exception") and Slurm marked the finished job FAILED. Once the stage has
        # succeeded (submitit pickles the result before exiting), leave without that teardown.
        atexit.register(_exit_after_success)
        return result if os.environ["RANK"] == "0" else None

    def _export_env(self) -> None:
        """The variables every launcher's workers read (see pipelines.launchers.worker)."""
        # overwrite: a stage job submitted from inside the pipeline's own batch job inherits its
        # variables; CUDA_VISIBLE_DEVICES stays whole because the worker selects LOCAL_RANK's device.
        dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False,
                                                                         overwrite=True)
        os.environ.update({
            "GROUP_RANK": os.environ.get("SLURM_NODEID", "0"),
            BACKEND_ENV: self.backend,
            TIMEOUT_ENV: str(self.timeout_s),
            DISTRIBUTED_ENV: "1" if self.distributed else "0",
            DEVICE_ENV: str(dist_env.local_rank),
        })
        # Intra-op threads default to every core of the node; the job was given cpus_per_task.
        # torch is imported by now (unpickling the task), and OpenMP read its environment then:
        # the variable alone would not take effect, so set torch's pool too (as Ray's workers do).
        os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK", "1"))
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    def _rendezvous(self) -> Any:
        """The job's TCPStore, on a port the OS chose on the first node.

        submitit derives MASTER_PORT from the job id, a fixed pick in 20000-60000 that falls in
        Linux's ephemeral range and collides with whatever socket holds it (CI saw EADDRINUSE).
        Rank 0 binds port 0 instead and publishes the port in the job's folder, which every
        task can read: the same shared filesystem the job's logs and results go through.
        """
        import datetime

        import torch.distributed as dist

        env = submitit.JobEnvironment()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")  # a requeued attempt gets a new store
        port_file = Path(env.paths.folder) / f"{env.job_id}.{self.nonce}.restart{restart}.port"
        host, world_size = os.environ["MASTER_ADDR"], int(os.environ["WORLD_SIZE"])
        if env.global_rank == 0:
            store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            write_atomic(port_file, str(store.port))
        else:
            deadline = time.monotonic() + self.timeout_s
            while not port_file.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank 0 of job {env.job_id} published no rendezvous port "
                                       f"in {self.timeout_s:g} s ({port_file})")
                time.sleep(0.05)
            store = dist.TCPStore(host, int(port_file.read_text()), world_size, is_master=False,
                                  timeout=timeout)
        os.environ["MASTER_PORT"] = str(store.port)
        return store

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission | None:
        """Resubmit the same call, unless the job was requeued `max_requeues` times already
        (submitit alone limits time-outs, not preemptions)."""
        if int(os.environ.get("SLURM_RESTART_COUNT", "0")) >= self.max_requeues:
            return None
        return super().checkpoint(*args, **kwargs)


def _exit_after_success() -> None:
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def job_parameters(cfg: LauncherConfig, world: WorldSpec, stage: str) -> dict[str, Any]:
    """AutoExecutor parameters of one stage's job; unset options are left to the cluster."""
    params: dict[str, Any] = {
        "name": f"scalestudy-{stage}",
        "nodes": world.nodes,
        "tasks_per_node": world.procs_per_node,
        "cpus_per_task": cfg.cpus_per_task,
        "timeout_min": cfg.timeout_min,
        # The signal must come inside the time limit, or a short job is "timed out" at once.
        "slurm_signal_delay_s": min(SIGNAL_DELAY_S, cfg.timeout_min * 60 // 2),
        # Job modules (pipelines, stages, the tests' workers) import from the project root.
        "slurm_setup": [f"export PYTHONPATH={ROOT}${{PYTHONPATH:+:$PYTHONPATH}}", *cfg.setup],
        "slurm_additional_parameters": dict(cfg.additional_parameters),
        # A task that fails takes its peers down at once (launcher=local kills them after
        # grace_s) instead of leaving them blocked in a collective until the time limit.
        "slurm_srun_args": ["--kill-on-bad-exit=1"],
    }
    if cfg.gpus_per_node is not None:
        params["gpus_per_node"] = cfg.gpus_per_node
    if cfg.mem_gb is not None:
        params["mem_gb"] = cfg.mem_gb
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(cfg, key) is not None:
            params[f"slurm_{key}"] = getattr(cfg, key)
    return params


def check_partition(partition: str) -> None:
    """A partition the cluster doesn't have is a one-line user error before any job is submitted."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError("launcher", "slurm", f"cannot ask Slurm for its partitions ({err}); run on a login node") from None
    if out.returncode != 0:
        reason = (out.stderr.strip().splitlines() or ["no answer"])[0]
        raise ConfigError("launcher", "slurm", f"sinfo cannot reach the cluster ({reason})")
    partitions = sorted(set(out.stdout.split()))
    if partition not in partitions:
        raise ConfigError("launcher.partition", partition, f"no such partition; this cluster has: {', '.join(partitions)}")


class SlurmLauncher:
    """Submits each stage as a Slurm job and waits for it, printing its progress."""

    def __init__(self, cfg: LauncherConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.job_ids: dict[str, list[str]] = {}
        """Every Slurm job id this launcher submitted, by stage (for the summary)."""

    def executor(self, stage: str, world: WorldSpec) -> submitit.AutoExecutor:
        """The submitit executor of one stage's job; logs go to <run_dir>/slurm/<stage>."""
        # The cluster is named: with srun on the PATH a bare AutoExecutor would also pick Slurm,
        # but never silently fall back to running locally.
        executor = submitit.AutoExecutor(folder=self.run_dir / "slurm" / stage, cluster="slurm",
                                         slurm_max_num_timeout=self.cfg.max_requeues)
        executor.update_parameters(**job_parameters(self.cfg, world, stage))
        return executor

    def run(self, task: Task, world: WorldSpec) -> Any:
        call = SlurmTask(task, self.cfg.backend, self.cfg.timeout_s, world.distributed, self.cfg.max_requeues)
        try:
            job = self.executor(task.stage, world).submit(call)
        except (submitit.core.utils.FailedJobError, subprocess.CalledProcessError) as err:
            raise StageFailed(f"{task.stage}: sbatch rejected the job: {_sbatch_error(err)}") from err
        self.job_ids.setdefault(task.stage, []).append(job.job_id)
        try:
            state = self._wait(job, task.stage)
        except BaseException:
            # Ctrl-C (or any error here) must not leave the job running on the cluster.
            job.cancel(check=False)
            raise
        if state != "COMPLETED":
            raise StageFailed(f"{task.stage}: Slurm job {job.job_id} ended {state}; {_failure_tail(job)}")
        try:
            return job.results()[0]
        except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as err:
            raise StageFailed(f"{task.stage}: Slurm job {job.job_id} failed; {_failure_tail(job)}") from err

    def _wait(self, job: submitit.Job, stage: str) -> str:
        """Poll the job until it ends; return its final state (COMPLETED, FAILED, ...)."""
        start, shown = time.monotonic(), ""
        while True:
            # One forced sacct per poll: submitit's own cache refreshes only every few minutes.
            job.watcher.update()
            state = job.watcher.get_state(job.job_id, mode="cache").split(" ")[0]
            # sacct knows a job only once the controller has recorded it.
            state = "SUBMITTED" if state == "UNKNOWN" else state
            elapsed = time.monotonic() - start
            if state != shown:  # a line per state; the live progress line shows the rest
                print(f"slurm: {stage} job {job.job_id} {state} {elapsed:.0f}s", flush=True)
                shown = state
            if job.watcher.is_done(job.job_id, mode="cache"):
                return state
            if state == "PENDING" and elapsed >= PENDING_CHECK_S:
                _fail_if_hopeless(job.job_id, stage)
            time.sleep(self.cfg.poll_s)

    def placement(self, world: WorldSpec) -> Placement:
        """Read on the workers themselves: a probe task on `world`."""
        found = probe_placement(self, "slurm", self.cfg.backend, world, self.run_dir / "logs" / "placement")
        return dataclasses.replace(found, backend=resolved_backend(self.cfg.backend, found.nodes[0]))

    def close(self) -> None:
        pass


def _fail_if_hopeless(job_id: str, stage: str) -> None:
    """Raise StageFailed when the job waits for a reason that waiting cannot resolve."""
    reason = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%r"], capture_output=True, text=True).stdout.strip()
    if reason.startswith(HOPELESS_REASONS):
        raise StageFailed(f"{stage}: Slurm job {job_id} can never start (Reason={reason}): the cluster cannot "
                          "satisfy this request; check nodes, procs_per_node and the launcher.* resources")


def _sbatch_error(err: Exception) -> str:
    """sbatch's own message, without submitit's wrapping."""
    text = str(err)
    lines = [line.strip() for line in text.splitlines() if "error" in line.lower() and "sbatch" in line.lower()]
    return "; ".join(lines) or text.strip()


def _failure_tail(job: submitit.Job) -> str:
    """The tail of the stderr of the task that caused the failure: the first one with a
    traceback that is not just the echo of a peer's death, else the first with any traceback."""
    logs = []
    for index in range(job.num_tasks):
        path = job.task(index).paths.stderr
        logs.append((index, path, path.read_text(errors="replace") if path.exists() else ""))
    with_tb = [log for log in logs if "Traceback" in log[2]]
    root = [log for log in with_tb if not any(echo in log[2] for echo in PEER_ECHOES)]
    index, path, text = (root or with_tb or logs)[0]
    tail = "\n".join(text.rstrip().splitlines()[-TAIL_LINES:])
    return f"task {index} stderr ({path}):\n{tail}"
