"""launcher=local: worker processes on this machine, rendezvous on 127.0.0.1 (rank 0's store on a
port the OS chose, named in a file: worker.file_rendezvous).

`nodes=4` means four groups of `procs_per_node` processes; each knows its node index
(GROUP_RANK), so the env stage sees four nodes. Each worker is its own process group, so that a
failed stage kills exactly the processes it started, children included, and none outlives it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from pipelines.launchers.base import StageFailed, Task, WorldSpec, worker_pythonpath
from pipelines.launchers.tasks import describe_failure, read_result, remove_task, write_task
from pipelines.launchers.worker import (
    BACKEND_ENV,
    DEVICE_ENV,
    DISTRIBUTED_ENV,
    PARENT_DEATH_ENV,
    RENDEZVOUS_ENV,
    TIMEOUT_ENV,
)
from pipelines.placement import NodeIdentity, Placement, node_identity, resolved_backend
from pipelines.schema import LauncherConfig

POLL_S = 0.05


def worker_env(rank: int, world: WorldSpec, rendezvous: Path, cfg: LauncherConfig, ranks_per_host: int,
               backend: str) -> dict[str, str]:
    """A worker's environment: its place in the world, and `backend` resolved once for all ranks."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world.size),
        LOCAL_RANK=str(rank % world.procs_per_node),
        LOCAL_WORLD_SIZE=str(world.procs_per_node),
        GROUP_RANK=str(rank // world.procs_per_node),
        PYTHONPATH=worker_pythonpath(),
        PYTHONUNBUFFERED="1",
        **{
            BACKEND_ENV: backend,
            TIMEOUT_ENV: str(cfg.timeout_s),
            DISTRIBUTED_ENV: "1" if world.distributed else "0",
            RENDEZVOUS_ENV: str(rendezvous),
            # All emulated nodes share this host's GPUs: device = global rank.
            DEVICE_ENV: str(rank),
            PARENT_DEATH_ENV: "1",
        },
    )
    # Every rank of the invocation shares this host's cores, so each gets the same share in every
    # stage, one-device ones and the 1-device baseline included: a "device" is the same thing
    # throughout, and no rank's OpenMP threads spin against another's.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(world.size, ranks_per_host))))
    return env


class LocalLauncher:
    def __init__(self, cfg: LauncherConfig, ranks_per_host: int = 1):
        self.cfg = cfg
        self.ranks_per_host = ranks_per_host
        """The invocation's largest world on this host: every stage's ranks get cores // it threads."""
        self.backend = resolved_backend(cfg.backend, self.identity())
        """`auto` resolved once, here, for every rank: the workers are this machine."""

    def run(self, task: Task, world: WorldSpec) -> Any:
        workdir = Path(task.workdir)
        task_file = write_task(task)
        rendezvous = workdir / f"rendezvous-{uuid.uuid4().hex[:8]}"
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(world.size):
                log = open(workdir / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed by the child's exit
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "pipelines.launchers.worker", str(task_file)],
                        env=worker_env(rank, world, rendezvous, self.cfg, self.ranks_per_host, self.backend),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        cwd=os.getcwd(),
                        start_new_session=True,
                    )
                )
                log.close()
                (workdir / f"rank{rank}.pid").write_text(str(procs[-1].pid))
            self._wait(procs, workdir)
        finally:
            _kill(procs)
            remove_task(task)
            rendezvous.unlink(missing_ok=True)
        return read_result(task)

    def _wait(self, procs: list[subprocess.Popen], workdir: Path) -> None:
        """Return when every rank exited 0; raise on the first failure, after a grace period."""
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                deadline = time.monotonic() + self.cfg.grace_s
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(POLL_S)
                hung = [r for r, p in enumerate(procs) if p.poll() is None]
                note = f"; still running after {self.cfg.grace_s:g} s and killed: ranks {hung}" if hung else ""
                raise StageFailed(describe_failure(workdir, len(procs), _how_they_ended(procs)) + note)
            if all(c == 0 for c in codes):
                return
            time.sleep(POLL_S)

    def identity(self) -> NodeIdentity:
        """This machine, which every emulated node shares (a test may present another)."""
        return node_identity()

    def placement(self, world: WorldSpec) -> Placement:
        """Read in the driver: the workers run on this machine, so the re-check costs nothing.
        Emulated nodes are named `<host>/node<i>`, as the env stage sees them."""
        me = self.identity()
        nodes = [dataclasses.replace(me, name=f"{me.hostname}/node{i}") for i in range(world.nodes)]
        return Placement("local", resolved_backend(self.cfg.backend, me), nodes)

    def record(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass



def _how_they_ended(procs: list[subprocess.Popen]) -> dict[int, str]:
    ended = {}
    for rank, proc in enumerate(procs):
        code = proc.returncode
        if code is not None and code < 0:
            ended[rank] = f"was killed by {signal.Signals(-code).name}"
        elif code not in (None, 0):
            ended[rank] = f"exited with code {code}"
    return ended


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every worker's process group that is still alive, then reap them."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.wait()
