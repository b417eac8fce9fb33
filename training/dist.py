"""Small helpers over torch.distributed that also work without a process group (world of 1)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


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
