"""Data parallelism by replication: DDP all-reduces gradients in buckets during backward."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from training.dist import world_size


def apply_ddp(
    model: nn.Module,
    dev: torch.device,
    bucket_cap_mb: float,
    find_unused_parameters: bool,
    process_group: ProcessGroup | None = None,
    force: bool = False,
) -> nn.Module:
    """Wrap `model` in DDP over `process_group` (default: every rank). A world of one is left
    unwrapped, so that the 1-device baseline pays no replication overhead, unless `force` (the
    overhead probe measures the wrapper on one rank). Around a pipeline stage DDP needs
    find_unused_parameters=True (its reducer asserts on the second step otherwise). Gradients are
    views into DDP's buckets: without that DDP holds each gradient twice (the parameter's and the
    bucket's copy), which neither the ZeRO paper's accounting nor the cost model counts."""
    if world_size() == 1 and not force:
        return model
    return DistributedDataParallel(
        model,
        device_ids=[dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
        process_group=process_group,
        gradient_as_bucket_view=True,
    )


class BucketTimer:
    """A DDP comm hook that all-reduces each gradient bucket as DDP would, and records the wall
    time from launching the bucket's all-reduce to its completion (the seed's hand-made
    "how long does each bucket take")."""

    def __init__(self) -> None:
        self.ms: list[float] = []

    def __call__(self, process_group: ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future:
        start = time.perf_counter()
        future = default_hooks.allreduce_hook(process_group, bucket)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self.ms.append((time.perf_counter() - start) * 1e3)
            return fut.value()

        return future.then(done)


def time_buckets(model: nn.Module) -> BucketTimer | None:
    """Register a BucketTimer on a DDP-wrapped model; None for anything else."""
    if not isinstance(model, DistributedDataParallel):
        return None
    timer = BucketTimer()

    # Unannotated on purpose: DDP checks a hook's annotations against the real classes, and this
    # module's annotations are strings (from __future__ import annotations).
    def hook(state, bucket):  # noqa: ANN001, ANN202
        return timer(state, bucket)

    model.register_comm_hook(model.process_group, hook)
    return timer
