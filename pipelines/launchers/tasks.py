"""What every launcher does with a stage's task around the workers it starts: the task file they
read (private, removed after), rank 0's result they leave beside it, and the root cause named from
their error reports when they fail. launcher=local and slurm use all of them, launcher=ray the failure naming."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

from pipelines.launchers.base import StageFailed, Task
from pipelines.launchers.worker import ERROR_FILE, RESULT_FILE, flight_recorder_dumps

TASK_FILE = "task.pkl"


def write_task(task: Task) -> Path:
    """The task pickled into its work directory, stale results and error reports removed. The task
    holds the stage's config as the workers need it, secrets in clear (a model factory's token, say):
    so it is readable by its owner only and removed when the stage ends (`remove_task`)."""
    workdir = Path(task.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in [workdir / RESULT_FILE, *workdir.glob("error-rank*.json")]:
        stale.unlink(missing_ok=True)
    task_file = workdir / TASK_FILE
    task_file.unlink(missing_ok=True)
    with open(os.open(task_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
        out.write(pickle.dumps(task))
    return task_file


def remove_task(task: Task) -> None:
    """Once every rank has ended: the task file is not evidence, and it may hold secrets."""
    (Path(task.workdir) / TASK_FILE).unlink(missing_ok=True)


def read_result(task: Task) -> Any:
    """Rank 0's result, left beside the task file by the worker."""
    result_file = Path(task.workdir) / RESULT_FILE
    if not result_file.exists():
        raise StageFailed(f"{task.stage}: rank 0 exited cleanly but left no result (see {task.workdir}/rank0.log)")
    return pickle.loads(result_file.read_bytes())


def describe_failure(workdir: Path, world_size: int, ended: dict[int, str], note: str = "") -> str:
    """Name the root cause. `ended`: the ranks that ended badly on their own, with how. One that
    ended without an error report (killed, or exited silently) comes first, since the others'
    errors are then only its echo ("Connection reset by peer"); otherwise the rank whose exception
    came first."""
    dumps = flight_recorder_dumps(workdir)
    where = (f"logs: {workdir}" + (f"; {note}" if note else "")
             + (f"; NCCL flight recorder dumps: {', '.join(str(d) for d in dumps)}" if dumps else ""))
    reports = []
    for rank in range(world_size):
        path = workdir / ERROR_FILE.format(rank=rank)
        if path.exists():
            reports.append((json.loads(path.read_text()), rank))
    reported = {rank for _, rank in reports}
    silent = next(((rank, how) for rank, how in ended.items() if rank not in reported), None)
    if silent is not None:
        rank, how = silent
        return f"rank {rank} {how} without an error report ({where})" if "exited" in how else f"rank {rank} {how} ({where})"
    if not reports:
        return f"a rank failed without an error report ({where})"
    report, rank = min(reports, key=lambda item: item[0]["time"])
    return f"rank {rank} failed: {report['type']}: {report['message']} ({where})"
