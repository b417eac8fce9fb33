"""The worker entry point, identical under every launcher.

    python -m pipelines.launchers.worker <task.pkl>

It reads its place in the world from torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK),
meets its peers at a store rank 0 opens on a port the OS chose and names in a file
(SCALESTUDY_RENDEZVOUS: launcher=local and launcher=slurm; MASTER_ADDR and MASTER_PORT where it
is not set), initialises torch.distributed with a collective timeout, calls the stage function,
and leaves rank 0's result next to the task file. Any exception is written to
`error-rank<R>.json` (type, message, traceback; the driver reports the message) and exits non-zero.
Every rank, failed or not, leaves its peak device memory over the stage in `memory-rank<R>.json`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pickle
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from common.files import write_atomic
from pipelines.launchers.base import Task
from pipelines.progress import PROGRESS_ENV, progress_file
from training.dist import CHECKPOINT_TIMEOUT_ENV, TIMEOUT_ENV

RESULT_FILE = "result.pkl"
ERROR_FILE = "error-rank{rank}.json"
MEMORY_FILE = "memory-rank{rank}.json"
"""`{"peak_bytes": <int or null>}`: the rank's peak device memory over the stage (training/budget.py)."""
BACKEND_ENV = "SCALESTUDY_BACKEND"
DISTRIBUTED_ENV = "SCALESTUDY_DISTRIBUTED"
DEVICE_ENV = "SCALESTUDY_DEVICE_INDEX"
PARENT_DEATH_ENV = "SCALESTUDY_DIE_WITH_PARENT"
SLURM_STEP_ENV = "SCALESTUDY_SLURM_STEP"
"""Set on a Slurm job step's tasks: take the place in the world from Slurm's variables."""
LOCAL_WORLD_ENV = "SCALESTUDY_LOCAL_WORLD_SIZE"
RENDEZVOUS_ENV = "SCALESTUDY_RENDEZVOUS"
"""A file path, new for each launch: rank 0 publishes its store's `host:port` there, the others
read it (file_rendezvous)."""
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the driver that started it dies (even by SIGKILL),
    so that no worker outlives a killed invocation."""
    import ctypes
    import signal

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the driver died before the request took effect
        os._exit(1)


def resolve_function(path: str) -> Any:
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class NoDevice(RuntimeError):
    """The rank has no CUDA device its backend or local index needs."""


def device_index(local_index: int, visible: int) -> int:
    """The CUDA device this rank uses among the `visible` ones: its launcher's local index, or 0
    when the task sees one device (Slurm's --gpu-bind / --gpus-per-task, Ray's per-worker GPU:
    each task then sees its own as device 0, and index 1 and up do not exist)."""
    if visible == 1:
        return 0
    if not 0 <= local_index < visible:
        raise NoDevice(f"this rank's local index is {local_index} but it sees {visible} CUDA device(s) "
                       f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); give each rank a GPU")
    return local_index


def select_device() -> int | None:
    """Make this rank's GPU the current device (in the calling thread: the current device is per
    thread); None without CUDA, where the calling thread flushes subnormal floats instead."""
    import torch

    if not torch.cuda.is_available():
        flush_subnormals()
        return None
    index = device_index(int(os.environ.get(DEVICE_ENV, os.environ.get("LOCAL_RANK", "0"))), torch.cuda.device_count())
    torch.cuda.set_device(index)
    return index


def flush_subnormals() -> None:
    """On CPU, compute with subnormal floats as zero (x86's FTZ/DAZ, `torch.set_flush_denormal`).

    A training model's softmaxes and their gradients soon hold values below float32's normal range
    (1.2e-38), and an x86 core takes a slow path for each operation on one. Measured on this
    project's 2-core host, gpt-tiny under DDP at world 2: 13.4 ms a step at lr 1e-3, 17.1 ms at
    the 3e-2 its LR finder suggests (the model sharpens faster), 13.5 ms at 3e-2 with subnormals
    flushed; the plan's compute ruler, which times a fresh model, saw none of it. GPUs run
    without the slow path, so a CPU rank flushing is the closer rehearsal of one. The setting is
    per thread and threads inherit it when they start: set here, in the thread a stage runs in,
    before torch's intra-op pool starts its threads."""
    import torch

    torch.set_flush_denormal(True)


def resolve_backend(backend: str, index: int | None) -> str:
    """`auto` as this rank resolves it; nccl without a GPU is an error, never a fallback to gloo."""
    if backend == "auto":
        return "nccl" if index is not None else "gloo"
    if backend == "nccl" and index is None:
        raise NoDevice(f"the backend is nccl but rank {os.environ.get('RANK', '0')} on {os.uname().nodename} sees no "
                       f"CUDA device (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                       "ask the launcher for a GPU per rank or use launcher.backend=gloo")
    return backend


FLIGHT_RECORDER_ENTRIES = "2000"
FLIGHT_RECORDER_DIR = "nccl-trace"
"""Under a stage's log directory: the flight recorder's dump, one file per rank, written by the
NCCL watchdog when a collective times out (a rank aborted by it leaves no error report)."""


def flight_recorder(workdir: Path) -> None:
    """Turn NCCL's flight recorder on with its dump in `workdir` (the user's own settings win).
    torch reads the older TORCH_NCCL_* names and the newer TORCH_FR_* ones; both are set."""
    folder = Path(workdir) / FLIGHT_RECORDER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for names, value in ((("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), FLIGHT_RECORDER_ENTRIES),
                         (("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), str(folder / "rank")),
                         (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1")):
        # The user's own setting wins; one this function set for an earlier stage of the same
        # process (launcher=ray's agent) does not.
        given = next((os.environ[n] for n in names if n in os.environ and FLIGHT_RECORDER_DIR not in os.environ[n]),
                     value)
        for name in names:
            os.environ[name] = given


def flight_recorder_dumps(workdir: Path) -> list[Path]:
    """The flight recorder's dumps a stage's ranks left (the watchdog writes them as it aborts)."""
    folder = Path(workdir) / FLIGHT_RECORDER_DIR
    return sorted(p for p in folder.glob("rank*") if p.is_file()) if folder.is_dir() else []


def init_process_group(backend: str, timeout_s: float, index: int | None, store: Any = None) -> None:
    """torch.distributed over the env:// rendezvous, or over `store`. With nccl, the device is named
    (`device_id`): NCCL's communicator is made now rather than at the first collective, and groups
    can be split from it."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    # Every group made later (a DeviceMesh's dimensions, their flattenings, expert groups) takes
    # torch's default timeout, 30 min on gloo and 10 on nccl, not the default group's: a rank hung
    # in a TP or FSDP collective would hang its peers that long. torch reads these at each new_group.
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if backend == "nccl" and index is not None:
        kwargs["device_id"] = torch.device("cuda", index)
    if store is not None:
        kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(**kwargs)


def setup_torch(store: Any = None, task: Task | None = None) -> None:
    """Select this rank's device and initialise torch.distributed from the environment (env://
    rendezvous at MASTER_ADDR:MASTER_PORT), or over `store` when the launcher made the rendezvous."""
    index = select_device()
    if os.environ.get(DISTRIBUTED_ENV, "1") != "1":
        return
    backend = resolve_backend((task.backend if task else None) or os.environ.get(BACKEND_ENV, "auto"), index)
    timeout_s = task.timeout_s if task is not None and task.timeout_s else float(os.environ.get(TIMEOUT_ENV, "180"))
    if task is not None and task.workdir is not None:
        flight_recorder(Path(task.workdir))
    os.environ[TIMEOUT_ENV] = str(timeout_s)  # what training/dist.py's checkpoint_timeout restores
    if task is not None and task.checkpoint_timeout_s:
        os.environ[CHECKPOINT_TIMEOUT_ENV] = str(task.checkpoint_timeout_s)
    init_process_group(backend, timeout_s, index, store)


def slurm_step_env() -> None:
    """The torchrun-style variables, from Slurm's for this task of the step."""
    os.environ.update(
        RANK=os.environ["SLURM_PROCID"],
        WORLD_SIZE=os.environ["SLURM_NTASKS"],
        LOCAL_RANK=os.environ["SLURM_LOCALID"],
        LOCAL_WORLD_SIZE=os.environ.get(LOCAL_WORLD_ENV, "1"),
        GROUP_RANK=os.environ.get("SLURM_NODEID", "0"),
        **{DEVICE_ENV: os.environ["SLURM_LOCALID"]},
    )


def file_rendezvous() -> Any:
    """The launch's TCPStore, on a port the OS chose on rank 0's node: rank 0 publishes `host:port`
    in a file every rank can read (a Slurm step's shared filesystem, which its logs go through;
    this machine's under launcher=local). A port chosen beforehand collides with whatever takes it
    in between: a launcher=local rank 0 once failed with EADDRINUSE on the port its driver had
    found free, beside a Ray head's processes (2026-12-07). A file names exactly this launch's store."""
    import datetime

    import torch.distributed as dist

    path = Path(os.environ[RENDEZVOUS_ENV])
    timeout_s = float(os.environ.get(TIMEOUT_ENV, "180"))
    timeout = datetime.timedelta(seconds=timeout_s)
    world = int(os.environ["WORLD_SIZE"])
    if os.environ["RANK"] == "0":
        slurm = os.environ.get(SLURM_STEP_ENV) == "1"
        host = (os.environ.get("SLURMD_NODENAME") or os.uname().nodename) if slurm else "127.0.0.1"
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        write_atomic(path, f"{host}:{store.port}")
        return store
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no rendezvous in {timeout_s:g} s ({path})")
        time.sleep(0.05)
    host, _, port = path.read_text().rpartition(":")
    return dist.TCPStore(host, int(port), world, is_master=False, timeout=timeout)


def teardown_torch() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_task(task: Task) -> Any:
    """Call the stage function on this rank, its peak device memory measured and on CPU held to
    the task's budget (left in the work directory, also when it raised); used by every launcher,
    and by the driver for its own stages."""
    fn = resolve_function(task.fn)
    kwargs = dict(task.kwargs)
    rank = int(os.environ.get("RANK", "0"))
    if task.workdir is not None:
        os.environ[PROGRESS_ENV] = str(progress_file(Path(task.workdir)))
    if task.artifacts is not None:
        # Only rank 0 writes artifacts; the others get a private scratch directory.
        kwargs["artifacts"] = task.artifacts if rank == 0 else Path(task.workdir) / f"scratch-rank{rank}"
        Path(kwargs["artifacts"]).mkdir(parents=True, exist_ok=True)
    meter = memory_meter(task.memory_budget_gib, rank)
    try:
        with meter:
            return fn(task.inputs, **kwargs)
    finally:
        if task.workdir is not None:
            Path(task.workdir).mkdir(parents=True, exist_ok=True)
            write_atomic(Path(task.workdir) / MEMORY_FILE.format(rank=rank),
                         json.dumps({"peak_bytes": meter.peak_bytes}).encode())


class _Unmeasured:
    peak_bytes = None

    def __enter__(self) -> _Unmeasured:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def memory_meter(budget_gib: float | None, rank: int) -> Any:
    """training.budget.DeviceMemory; in a process that has not loaded torch (the driver) and has
    no budget to hold, a meter that measures nothing (None) rather than loading torch for it."""
    if budget_gib is None and "torch" not in sys.modules:
        return _Unmeasured()
    from training.budget import DeviceMemory

    return DeviceMemory(budget_gib, rank)


def clear_peak_memory(workdir: Path) -> None:
    """Remove the memory files an earlier launch left in `workdir`."""
    for stale in Path(workdir).glob(MEMORY_FILE.format(rank="*")):
        stale.unlink(missing_ok=True)


def peak_memory(workdir: Path) -> int | None:
    """The highest peak the ranks of a launch in `workdir` left; None when none was measured."""
    peaks = []
    for path in Path(workdir).glob(MEMORY_FILE.format(rank="*")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            peaks.append(json.loads(path.read_text())["peak_bytes"])
    measured = [p for p in peaks if isinstance(p, int)]
    return max(measured) if measured else None


def main(task_file: str) -> int:
    task_path = Path(task_file)
    if os.environ.get(SLURM_STEP_ENV) == "1":
        slurm_step_env()
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get(PARENT_DEATH_ENV) == "1" and sys.platform == "linux":
        die_with_parent()
    try:
        task: Task = pickle.loads(task_path.read_bytes())
        rendezvous = RENDEZVOUS_ENV in os.environ and os.environ.get(DISTRIBUTED_ENV, "1") == "1"
        setup_torch(file_rendezvous() if rendezvous else None, task)
        result = run_task(task)
        if rank == 0:
            write_atomic(task_path.parent / RESULT_FILE, pickle.dumps(result))
        teardown_torch()
        return 0
    except BaseException as err:  # noqa: BLE001 - every failure must reach the driver
        text = traceback.format_exc()
        sys.stderr.write(text)
        report = {"type": type(err).__name__, "message": str(err).strip(), "traceback": text, "time": time.time()}
        write_atomic(task_path.parent / ERROR_FILE.format(rank=rank), json.dumps(report).encode())
        return 1


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit skips interpreter teardown, where a broken process group can hang.
    os._exit(code)
