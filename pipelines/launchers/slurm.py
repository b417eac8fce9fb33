"""launcher=slurm: one allocation per invocation, every stage a job step inside it.

The invocation asks Slurm once, with sbatch, for `nodes` nodes of `procs_per_node` tasks (plus the
launcher's options), and each world or one-device stage then runs as a job step of that
allocation: `srun --jobid=<id> ... python -m pipelines.launchers.worker <task>` (the worker every
launcher runs). So the queue is paid once, and `env` validates and `bandwidth` measures the very
nodes `train` runs on. Job steps rather than one long-lived job whose tasks run every stage in
turn: each stage gets fresh processes, as under launcher=local (a stage that hangs or crashes is
killed alone, with --kill-on-bad-exit, and the allocation serves the next one), and Slurm itself
accounts every stage (`sacct -j <id>` lists them).

The allocation's batch script holds it while the driver lives (a heartbeat file the driver touches;
a driver killed with SIGKILL frees it within HEARTBEAT_STALE_S) and, on USR2 (sent before the time
limit, or by preemption), puts itself back in the queue (`scontrol requeue`, at most
`launcher.max_requeues` times). The driver then waits for it to run again and re-runs the step it
was in; the train stage resumes from its checkpoint. With `launcher.submit_only=true` the driver
itself runs inside such an allocation (slurm_batch.py); it finds it in SCALESTUDY_SLURM_ALLOCATION.

Job steps launch from the driver's host, so the repository, its virtual environment and the run
directory must be at the same path on every node (a shared filesystem), as for every Slurm job.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from pipelines.launchers.base import StageFailed, Task, WorldSpec, probe_placement, worker_pythonpath
from pipelines.launchers.slurm_commands import (
    HEARTBEAT_S,
    allocation_script,
    launcher_backend,
    node_share,
    step_command,
    step_failure,
)
from pipelines.launchers.tasks import read_result, remove_task, write_task
from pipelines.launchers.worker import (
    BACKEND_ENV,
    DISTRIBUTED_ENV,
    LOCAL_WORLD_ENV,
    RENDEZVOUS_ENV,
    SLURM_STEP_ENV,
    TIMEOUT_ENV,
)
from pipelines.placement import Placement
from pipelines.schema import LauncherConfig

ALLOCATION_ENV = "SCALESTUDY_SLURM_ALLOCATION"
"""Set by a submit_only batch job: the allocation the driver runs in, to use instead of asking."""
PENDING_CHECK_S = 2.0
"""How long an allocation may be PENDING before its Reason is checked for one it can never leave."""
HOPELESS_REASONS = (
    "PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig", "BadConstraints", "InvalidAccount",
    "InvalidQOS", "QOSMaxNodePerJobLimit", "QOSMaxCpuPerJobLimit", "AssocMaxNodesPerJobLimit",
    "AssocMaxCpuPerJobLimit", "ReqNodeNotAvail, UnavailableNodes",
)
"""squeue Reasons of a PENDING job that no amount of waiting resolves: the request is wrong."""
LIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
               "SUSPENDED", "COMPLETING")


@dataclass
class JobInfo:
    state: str
    reason: str
    nodes: list[str]
    restarts: int


def job_info(job_id: str) -> JobInfo:
    """The job's state from the controller (`scontrol show job`), else from accounting (`sacct`)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
    if out.returncode == 0 and "JobState" in fields:
        nodes = fields.get("NodeList", "(null)")
        return JobInfo(fields["JobState"], fields.get("Reason", "None"), hostnames(nodes),
                       int(fields.get("Restarts", "0")))
    acct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True)
    state = (acct.stdout.split() or ["UNKNOWN"])[0]
    return JobInfo(state.split()[0], "None", [], 0)


def hostnames(nodelist: str) -> list[str]:
    """`node[1-2]` -> [node1, node2] (Slurm's own expansion)."""
    if not nodelist or nodelist == "(null)":
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
    return out.stdout.split()


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


@dataclass
class Allocation:
    job_id: str
    world: WorldSpec
    folder: Path
    nodes: list[str]
    restarts: int = 0
    owned: bool = True
    """False for the allocation a submit_only driver runs inside: it is not ours to release."""

    def fits(self, world: WorldSpec) -> bool:
        """A stage of one rank runs on the first node of any allocation; a larger world needs its
        node count and at most the tasks per node the allocation has."""
        if not world.distributed or world.size == 1:
            return True
        return world.nodes == self.world.nodes and world.procs_per_node <= self.world.procs_per_node


class SlurmLauncher:
    """Runs each stage as a job step of the invocation's one allocation, asked for on first use."""

    def __init__(self, cfg: LauncherConfig, run_dir: Path, invocation: WorldSpec | None = None):
        self.cfg, self.run_dir = cfg, Path(run_dir).resolve()
        self.invocation = invocation
        """The invocation's world, the allocation's size (one-device stages run on its first node)."""
        self.allocation: Allocation | None = None
        self.job_ids: dict[str, list[str]] = {}
        """The allocation(s) each stage ran in, by stage (for the summary)."""
        self.allocations: list[dict[str, Any]] = []
        self.backend = launcher_backend(cfg)
        self.cpus = cfg.cpus_per_task or node_share(cfg, (invocation or WorldSpec(1, 1)).procs_per_node)
        """CPUs per task: launcher.cpus_per_task, else the partition's cores shared by its tasks."""
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        inside = os.environ.get(ALLOCATION_ENV)
        if inside:
            info = job_info(inside)
            world = invocation or WorldSpec(len(info.nodes), 1)
            self.allocation = Allocation(inside, world, self.run_dir / "slurm", info.nodes, info.restarts, owned=False)
            self._record(self.allocation)

    # ---- the allocation -----------------------------------------------------------------------

    def _ensure(self, world: WorldSpec) -> Allocation:
        alloc = self.allocation
        if alloc is not None and alloc.fits(world):
            info = job_info(alloc.job_id)
            if info.state in LIVE_STATES:
                if info.state != "RUNNING" or info.restarts != alloc.restarts:
                    self._wait_running(alloc, "requeued")
                return alloc
            print(f"slurm: allocation {alloc.job_id} ended {info.state}; asking for another", flush=True)
        if alloc is not None and not alloc.owned:
            raise StageFailed(f"the allocation {alloc.job_id} this pipeline job runs in cannot run a {world.size}-rank "
                              f"stage ({alloc.world.nodes} nodes x {alloc.world.procs_per_node} tasks)")
        self.release()
        shape = world if world.distributed and world.size > 1 else (self.invocation or WorldSpec(1, 1))
        self.allocation = self._submit(dataclasses.replace(shape, distributed=True))
        return self.allocation

    def _submit(self, world: WorldSpec) -> Allocation:
        folder = self.run_dir / "slurm" / f"allocation-{uuid.uuid4().hex[:8]}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "heartbeat").touch()
        script = folder / "allocation.sbatch"
        script.write_text(allocation_script(self.cfg, world, folder, self.cpus))
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
        if done.returncode != 0:
            raise StageFailed(f"sbatch rejected the allocation: {done.stderr.strip() or done.stdout.strip()}")
        alloc = Allocation(done.stdout.strip().split(";")[0], world, folder, [])
        self._start_heartbeat(folder / "heartbeat")
        try:
            self._wait_running(alloc, "SUBMITTED")
        except BaseException:
            subprocess.run(["scancel", alloc.job_id], capture_output=True)
            raise
        self._record(alloc)
        return alloc

    def _wait_running(self, alloc: Allocation, shown: str) -> None:
        """Wait until the allocation runs, printing each state it passes through."""
        start = time.monotonic()
        print(f"slurm: allocation {alloc.job_id} {shown} ({alloc.world.nodes} nodes x {alloc.world.procs_per_node} "
              "tasks)", flush=True)
        while True:
            info = job_info(alloc.job_id)
            elapsed = time.monotonic() - start
            if info.state != shown:
                print(f"slurm: allocation {alloc.job_id} {info.state} {elapsed:.0f}s", flush=True)
                shown = info.state
            if info.state == "RUNNING" and info.nodes:
                alloc.nodes, alloc.restarts = info.nodes, info.restarts
                return
            if info.state not in LIVE_STATES:
                raise StageFailed(f"Slurm allocation {alloc.job_id} ended {info.state} before it ran "
                                  f"(log: {alloc.folder}/allocation-{alloc.job_id}.out)")
            if info.state == "PENDING" and elapsed >= PENDING_CHECK_S and info.reason.startswith(HOPELESS_REASONS):
                subprocess.run(["scancel", alloc.job_id], capture_output=True)
                raise StageFailed(f"Slurm allocation {alloc.job_id} can never start (Reason={info.reason}): the cluster "
                                  "cannot satisfy this request; check nodes, procs_per_node and the launcher.* resources")
            time.sleep(self.cfg.poll_s)

    def _start_heartbeat(self, path: Path) -> None:
        self._stop.clear()

        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    path.touch()
                except OSError:
                    pass

        self._beat = threading.Thread(target=beat, name="slurm-heartbeat", daemon=True)
        self._beat.start()

    def _record(self, alloc: Allocation) -> None:
        self.allocations.append({"job_id": alloc.job_id, "nodes": list(alloc.nodes), "world": [alloc.world.nodes,
                                 alloc.world.procs_per_node], "log": str(alloc.folder)})

    def release(self) -> None:
        """Let the allocation go (its batch script ends on the release file) and stop beating."""
        alloc, self.allocation = self.allocation, None
        self._stop.set()
        if alloc is None or not alloc.owned:
            return
        (alloc.folder / "release").touch()
        # Its steps are done; whatever still runs there (a step left by Ctrl-C) goes with it.
        subprocess.run(["scancel", alloc.job_id], capture_output=True)

    # ---- the stages ---------------------------------------------------------------------------

    def placement(self, world: WorldSpec) -> Placement:
        """Read on the allocation's nodes themselves: a probe step (a fraction of a second)."""
        found = probe_placement(self, "slurm", self.backend, world, self.run_dir / "logs" / "placement")
        return dataclasses.replace(found, backend=self.backend)

    def run(self, task: Task, world: WorldSpec) -> Any:
        alloc = self._ensure(world)
        self.job_ids.setdefault(task.stage, [])
        if alloc.job_id not in self.job_ids[task.stage]:
            self.job_ids[task.stage].append(alloc.job_id)
        for _ in range(self.cfg.max_requeues + 1):
            code, stderr = self._step(alloc, task, world)
            if code == 0:
                return read_result(task)
            info = job_info(alloc.job_id)
            if info.state in LIVE_STATES and (info.state != "RUNNING" or info.restarts != alloc.restarts):
                # Preempted or at its time limit: the allocation requeued itself. Run the stage again
                # once it is back (the train stage resumes from its checkpoint).
                print(f"slurm: {task.stage}: allocation {alloc.job_id} was requeued; the stage runs again", flush=True)
                self._wait_running(alloc, "requeued")
                continue
            ranks = world.size if world.distributed else 1
            raise StageFailed(f"{task.stage}: " + step_failure(Path(task.workdir), ranks, stderr, alloc.job_id))
        raise StageFailed(f"{task.stage}: the allocation {alloc.job_id} was requeued {self.cfg.max_requeues} times "
                          "(launcher.max_requeues)")

    def _step(self, alloc: Allocation, task: Task, world: WorldSpec) -> tuple[int, str]:
        """One job step on `world`'s tasks of the allocation; its exit code and srun's stderr."""
        workdir = Path(task.workdir)
        task_file = write_task(task)
        procs = world.procs_per_node if world.distributed else 1
        nodes = world.nodes if world.distributed else 1
        # One-rank stages: the first node, every time.
        nodelist = alloc.nodes[:nodes] if nodes < len(alloc.nodes) else None
        cmd = step_command(self.cfg, alloc.job_id, world, self.cpus, workdir, task.stage, task_file, nodelist)
        env = self._step_env(workdir, world, procs)
        err_path = workdir / "srun.err"
        start = time.monotonic()
        print(f"slurm: {task.stage} step of allocation {alloc.job_id} on {', '.join(alloc.nodes[:nodes])}", flush=True)
        with open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=err, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            try:
                code = proc.wait()
            except BaseException:
                _stop_step(proc)
                raise
            finally:
                remove_task(task)
        print(f"slurm: {task.stage} step {'done' if code == 0 else f'ended with code {code}'} "
              f"{time.monotonic() - start:.0f}s", flush=True)
        return code, err_path.read_text(errors="replace")

    def _step_env(self, workdir: Path, world: WorldSpec, procs: int) -> dict[str, str]:
        env = dict(os.environ)
        for key in [k for k in env if k.startswith(("SLURM_STEP", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_CPUS_PER_TASK"))]:
            env.pop(key)  # a submit_only driver runs inside a job: its own step's sizes are not this step's
        env.update({
            "PYTHONPATH": worker_pythonpath(),
            "PYTHONUNBUFFERED": "1",
            # Set before the worker imports torch, so that OpenMP takes it: the task's own cores.
            "OMP_NUM_THREADS": str(self.cpus or 1),
            SLURM_STEP_ENV: "1",
            LOCAL_WORLD_ENV: str(procs),
            RENDEZVOUS_ENV: str(workdir / f"rendezvous-{uuid.uuid4().hex[:8]}"),
            BACKEND_ENV: self.backend,
            TIMEOUT_ENV: str(self.cfg.timeout_s),
            DISTRIBUTED_ENV: "1" if world.distributed else "0",
        })
        return env

    def record(self) -> dict[str, Any]:
        """For summary.json: the allocation(s) and their nodes, and which stages ran in each."""
        return {"allocations": self.allocations, "jobs": self.job_ids}

    def close(self) -> None:
        self.release()


def _stop_step(proc: subprocess.Popen) -> None:
    """Ctrl-C: srun cancels its step on two SIGINTs within a second; then make sure."""
    for _ in range(2):
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
