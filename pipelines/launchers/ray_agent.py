"""The worker side of launcher=ray: one Ray Train worker group that runs every stage in turn.

Ray Train runs one function per `fit()` on its worker group. That function here is an agent loop:
it takes the invocation's stages one after another from a mailbox (a small Ray actor the driver
writes to), runs each in this same worker process (the same PIDs in every stage's records), and
posts rank 0's result or each rank's error back. Ray Train keeps doing what it is for: placing the
workers (PACK or STRICT_SPREAD), and restarting the whole group when a worker dies (max_failures);
the new group's agents find the stage that was running still open and run it again, and the train
stage resumes from its checkpoint.

Each world stage gets a process group of its own over a store rank 0 hosts for the life of the
group (one-device stages run on rank 0 with none, as under launcher=local). The stage runs in a
thread, so that the agent can end its process when the driver gives up on a rank that hangs.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from common.files import write_atomic
from pipelines.launchers.base import Task
from pipelines.launchers.worker import (
    BACKEND_ENV,
    DEVICE_ENV,
    ERROR_FILE,
    flight_recorder,
    init_process_group,
    resolve_backend,
    run_task,
    select_device,
)
from training.dist import CHECKPOINT_TIMEOUT_ENV, TIMEOUT_ENV

WAIT_S = 1.0
"""Longest wait on the mailbox before asking again (a wait ends early when there is news)."""
ABORT_WAIT_S = 60.0
STOP = "stop"


@dataclass
class Command:
    id: int
    task: bytes
    """The pickled Task."""
    ranks: int
    """Ranks 0 .. ranks-1 run it (1 for a one-device stage)."""
    distributed: bool


@dataclass
class Outcome:
    ok: bool
    result: bytes | None = None
    """Rank 0's pickled result."""
    error: str | None = None


@dataclass
class _Slot:
    command: Command
    outcomes: dict[int, dict[int, Outcome]] = field(default_factory=dict)
    """generation -> rank -> outcome."""
    aborted: bool = False


@ray.remote(num_cpus=0)
class Mailbox:
    """Between the driver and the agents: the open stage, who is alive, and what each rank posted.
    A generation is one start of the worker group (Ray Train restarts it after a failure). An async
    actor: whoever waits for a change (an agent for its next stage, the driver for outcomes) is
    woken by it rather than polling, which on a small host would take cycles from the stage."""

    def __init__(self, size: int):
        import asyncio

        self.size = size
        self.generation = 0
        self.workers: dict[int, dict[int, dict[str, Any]]] = {}
        self.slots: dict[int, _Slot] = {}
        self.stopped = False
        self.store: dict[int, str] = {}
        self.changed = asyncio.Condition()

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _wait(self, predicate: Any, timeout: float) -> bool:
        import asyncio

        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(predicate), timeout)
            except TimeoutError:
                return False
        return True

    async def register(self, rank: int, token: str, facts: dict[str, Any]) -> int:
        """A worker of a (new) group start; returns the generation it belongs to."""
        current = self.workers.get(self.generation, {})
        if rank in current and current[rank]["token"] != token:
            self.generation += 1
        self.workers.setdefault(self.generation, {})[rank] = {"token": token, **facts}
        await self._notify()
        return self.generation

    def _ready(self) -> tuple[int, list[dict[str, Any]]] | None:
        current = self.workers.get(self.generation, {})
        if len(current) < self.size:
            return None
        return self.generation, [current[r] for r in range(self.size)]

    async def ready(self, timeout: float = 0.0) -> tuple[int, list[dict[str, Any]]] | None:
        """The generation whose every worker registered, and their facts in rank order."""
        if timeout:
            await self._wait(lambda: self._ready() is not None, timeout)
        return self._ready()

    async def set_store(self, generation: int, address: str) -> None:
        self.store[generation] = address
        await self._notify()

    async def get_store(self, generation: int, timeout: float) -> str | None:
        await self._wait(lambda: generation in self.store, timeout)
        return self.store.get(generation)

    async def submit(self, command: Command) -> None:
        self.slots[command.id] = _Slot(command)
        await self._notify()

    def _next(self, after: int) -> Command | str | None:
        if self.stopped:
            return STOP
        return next((slot.command for cid, slot in sorted(self.slots.items()) if cid > after and not slot.aborted),
                    None)

    async def next(self, after: int, timeout: float) -> Command | str | None:
        """The first open stage after `after` (an agent's last), STOP, or None after `timeout`."""
        await self._wait(lambda: self._next(after) is not None, timeout)
        return self._next(after)

    async def post(self, cid: int, generation: int, rank: int, outcome: Outcome) -> None:
        self.slots[cid].outcomes.setdefault(generation, {})[rank] = outcome
        await self._notify()

    async def outcomes(self, cid: int, seen: int, timeout: float) -> tuple[int, dict[int, Outcome]]:
        """The current generation's outcomes of stage `cid`, once there are more than `seen` (or a
        new generation), or after `timeout`."""
        start = self.generation

        def news() -> bool:
            return self.generation != start or len(self.slots[cid].outcomes.get(self.generation, {})) > seen

        await self._wait(news, timeout)
        return self.generation, dict(self.slots[cid].outcomes.get(self.generation, {}))

    async def aborted(self, cid: int, timeout: float) -> bool:
        """Whether the driver gave up on stage `cid`; waits up to `timeout` for it to do so."""
        await self._wait(lambda: self.slots[cid].aborted, timeout)
        return self.slots[cid].aborted

    async def close(self, cid: int) -> None:
        """The driver has what it needs (or gave up): no agent runs it again; ranks still in it
        (hung) end their process."""
        self.slots[cid].aborted = True
        self.slots[cid].command.task = b""
        await self._notify()

    async def stop(self) -> None:
        self.stopped = True
        await self._notify()


def agent(config: dict[str, Any]) -> None:
    """Ray Train's worker function: register, then run stages until the driver says stop."""
    import torch
    import torch.distributed as dist

    mailbox = config["mailbox"]
    ctx = ray.train.get_context()
    rank, size = ctx.get_world_rank(), ctx.get_world_size()
    threads = max(1, int(config["cpus_per_worker"]))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    _rank_priority()
    node_id = ray.get_runtime_context().get_node_id()
    facts = {"pid": os.getpid(), "node_id": node_id, "host": os.uname().nodename,
             "ip": ray.util.get_node_ip_address(), "local_rank": ctx.get_local_rank()}
    generation = ray.get(mailbox.register.remote(rank, uuid.uuid4().hex, facts))
    while (group := ray.get(mailbox.ready.remote(WAIT_S))) is None or group[0] != generation:
        pass
    # Nodes numbered in rank order: Ray Train's node rank groups by IP, and two Ray nodes may share one.
    nodes = list(dict.fromkeys(w["node_id"] for w in group[1]))
    os.environ.update(GROUP_RANK=str(nodes.index(node_id)), LOCAL_RANK=str(ctx.get_local_rank()),
                      LOCAL_WORLD_SIZE=str(ctx.get_local_world_size()),
                      **{DEVICE_ENV: str(ctx.get_local_rank()), BACKEND_ENV: config["backend"],
                         TIMEOUT_ENV: str(config["timeout_s"])})
    store = _store(mailbox, generation, rank, size, config["timeout_s"])
    last = -1
    while True:
        command = ray.get(mailbox.next.remote(last, WAIT_S))
        if command == STOP:
            return
        if command is None:
            continue
        last = command.id
        if rank < command.ranks:
            outcome = _run(command, rank, store, generation, config, mailbox, dist)
            mailbox.post.remote(command.id, generation, rank, outcome)


def _rank_priority() -> None:
    """Run this rank at niceness 0, as a process launcher=local or Slurm starts does, where this
    process may raise its priority (root, CAP_SYS_NICE or RLIMIT_NICE); else leave it.

    Ray starts every worker at niceness 15 (`RAY_worker_niceness`) to keep its own daemons
    responsive. A rank is the job: when the ranks fill every core, as 2 ranks on this project's
    2-core machine do, each wake-up of a Ray daemon (raylet, GCS, the Train controller: about 5 %
    of a core while a stage trains) preempted a niced rank at once, and its peer waited for it
    at the next collective. Measured alternating, 400 steps, 6 rounds: train samples/s 0.85 of
    launcher=local at niceness 15, 0.89 at 0. On Linux the call sets this thread's niceness and
    the threads it starts inherit it: the stage's thread, gloo's and torch's."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:  # PermissionError: no right to raise its priority
        pass


def _store(mailbox: Any, generation: int, rank: int, size: int, timeout_s: float) -> Any:
    """The group's store, hosted by rank 0 on a port the OS chose, found through the mailbox."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        ip = ray.util.get_node_ip_address()
        store = dist.TCPStore(ip, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        ray.get(mailbox.set_store.remote(generation, f"{ip}:{store.port}"))
        return store
    while (address := ray.get(mailbox.get_store.remote(generation, WAIT_S))) is None:
        pass
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), size, is_master=False, timeout=timeout)


def _run(command: Command, rank: int, store: Any, generation: int, config: dict[str, Any], mailbox: Any,
         dist: Any) -> Outcome:
    """One stage on this rank, in a thread this agent watches (so a hung stage can be ended)."""
    task: Task = pickle.loads(command.task)
    workdir = Path(task.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / f"rank{rank}.pid").write_text(str(os.getpid()))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(command.ranks))
    box: dict[str, Any] = {}

    def stage() -> None:
        try:
            # In this thread: CUDA's current device is per thread, and the stage runs here.
            index = select_device()
            if command.distributed:
                prefix = dist.PrefixStore(f"stage{command.id}/gen{generation}", store)
                backend = resolve_backend(task.backend or config["backend"], index)
                timeout_s = task.timeout_s or config["timeout_s"]
                os.environ[TIMEOUT_ENV] = str(timeout_s)
                if task.checkpoint_timeout_s:
                    os.environ[CHECKPOINT_TIMEOUT_ENV] = str(task.checkpoint_timeout_s)
                flight_recorder(workdir)
                os.environ.update(RANK=str(rank), WORLD_SIZE=str(command.ranks))
                init_process_group(backend, timeout_s, index, prefix)
            box["result"] = run_task(task)
        except BaseException as err:  # noqa: BLE001 - every failure goes back to the driver
            # Reported before the process group goes: the peers' errors that follow are its echo.
            report = {"type": type(err).__name__, "message": str(err).strip(), "traceback": traceback.format_exc(),
                      "time": time.time()}
            sys.stderr.write(report["traceback"])
            write_atomic(workdir / ERROR_FILE.format(rank=rank), json.dumps(report).encode())
            box["error"] = f"{report['type']}: {report['message']}"
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    with _redirect_output(workdir / f"rank{rank}.log"):
        thread = threading.Thread(target=stage, name=f"stage-{task.stage}", daemon=True)
        thread.start()
        # The driver's word that it gave up on the stage, awaited without asking the mailbox again
        # and again: a pending reply, checked locally while the stage runs.
        abort = mailbox.aborted.remote(command.id, ABORT_WAIT_S)
        while thread.is_alive():
            thread.join(0.05)
            if not ray.wait([abort], timeout=0)[0]:
                continue
            if not ray.get(abort):
                abort = mailbox.aborted.remote(command.id, ABORT_WAIT_S)
            elif thread.is_alive():
                # The driver gave up on this stage (a peer failed and this rank never returned):
                # end the process, and Ray Train replaces the group.
                sys.stdout.flush()
                os._exit(1)
    if "error" in box:
        return Outcome(False, error=box["error"])
    return Outcome(True, result=pickle.dumps(box["result"]) if rank == 0 else None)


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
