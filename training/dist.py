"""Small helpers over torch.distributed that also work without a process group (world of 1)."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


TIMEOUT_ENV = "SCALESTUDY_TIMEOUT_S"
"""The stage's collective timeout in seconds (set by the worker that made the process group)."""
CHECKPOINT_TIMEOUT_ENV = "SCALESTUDY_CHECKPOINT_TIMEOUT_S"
"""The collective timeout while a checkpoint is saved or loaded (launcher.checkpoint_timeout_s)."""


def is_dist() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if is_dist() else 1


def is_main() -> bool:
    return rank() == 0


def node_rank() -> int:
    """The node (host, or emulated node of launcher=local) this rank belongs to."""
    for var in ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def device() -> torch.device:
    """This rank's device: its CUDA device when there is one, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    import torch.distributed as dist

    return dist.get_backend() if is_dist() else "none"


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    import torch.distributed as dist

    if not is_dist():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a copy); identity without a process group."""
    import torch.distributed as dist

    if not is_dist():
        return tensor
    out = tensor.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def synchronize(dev: torch.device) -> None:
    """Wait for queued device work, so that host timers measure it."""
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def all_reduce_max(value: float) -> float:
    """The largest `value` over ranks (the slowest rank's time); itself without a process group."""
    import torch
    import torch.distributed as dist

    if not is_dist():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


@contextlib.contextmanager
def checkpoint_timeout() -> Iterator[None]:
    """The default group's collective timeout raised to launcher.checkpoint_timeout_s while a
    checkpoint is written or read (a large model's shards on a shared filesystem take longer than
    any step's collective should), and set back to the stage's after."""
    seconds = os.environ.get(CHECKPOINT_TIMEOUT_ENV)
    if not is_dist() or seconds is None:
        yield
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=float(seconds)))
    try:
        yield
    finally:
        _set_pg_timeout(datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "180"))))
