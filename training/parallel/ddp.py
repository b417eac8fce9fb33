"""Data parallelism by replication: DDP all-reduces gradients in buckets during backward."""

from __future__ import annotations

import time
from dataclasses import dataclass

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


@dataclass(frozen=True)
class BucketEvents:
    """A bucket all-reduce's CUDA events, resolved to ms once the GPU has passed them."""

    start: torch.cuda.Event
    """On the compute stream, before the launch: the bucket's gradients are ready."""
    end: torch.cuda.Event
    """On a stream that waited on the all-reduce's completion."""
    previous_end: torch.cuda.Event | None
    """The previous bucket's `end`: until then the NCCL stream was busy with that all-reduce."""

    def done(self) -> bool:
        return self.end.query() and (self.previous_end is None or self.previous_end.query())

    def ms(self) -> float:
        """From when the communication stream could start this all-reduce to its completion."""
        self.end.synchronize()
        own = self.start.elapsed_time(self.end)
        if self.previous_end is None:
            return own
        # One process group's collectives run in order on one NCCL stream: a bucket ready while
        # the previous one is still reducing waits for it, and that wait is the previous one's time.
        # (A later previous end, its side stream delayed, says nothing: keep the whole interval.)
        self.previous_end.synchronize()
        queued_behind = self.previous_end.elapsed_time(self.end)
        return min(own, queued_behind) if queued_behind > 0 else own


class BucketTimer:
    """A DDP comm hook that all-reduces each gradient bucket as DDP would and times each all-reduce
    to its completion: on CUDA on the device, on gloo in wall time from its launch (the seed's
    hand-made "how long does each bucket take")."""

    def __init__(self) -> None:
        self._ms: list[float] = []
        self._pending: list[BucketEvents] = []
        self._last_end: torch.cuda.Event | None = None

    @property
    def ms(self) -> list[float]:
        """Every bucket's all-reduce time so far, in ms, in launch order (waits for the GPU)."""
        self._resolve(block=True)
        return list(self._ms)

    def __call__(self, process_group: ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future:
        if bucket.buffer().is_cuda:
            return self._time_on_gpu(process_group, bucket)
        return self._time_on_host(process_group, bucket)

    def _time_on_host(self, process_group: ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future:
        """gloo: its future completes when the all-reduce has, so wall time to the callback is right."""
        start = time.perf_counter()
        future = default_hooks.allreduce_hook(process_group, bucket)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self._ms.append((time.perf_counter() - start) * 1e3)
            return fut.value()

        return future.then(done)

    def _time_on_gpu(self, process_group: ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future:
        """NCCL: the future completes on the host as soon as the all-reduce is enqueued, so host
        time would measure the launch; CUDA events time it on the device instead."""
        self._resolve(block=False)  # keep the pending list short without ever waiting
        # Recorded on the current (compute) stream before the launch: the NCCL stream waits on this
        # stream before it starts, so the interval begins when the bucket's gradients are ready.
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        future = default_hooks.allreduce_hook(process_group, bucket)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            # A CUDA future runs its callbacks with current streams made to wait on the
            # collective's completion, so this event completes only once the all-reduce has.
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append(BucketEvents(start, end, self._last_end))
            self._last_end = end
            return fut.value()

        return future.then(done)

    def _resolve(self, block: bool) -> None:
        """Turn the completed pending event pairs into ms, in order (all of them when `block`)."""
        while self._pending and (block or self._pending[0].done()):
            self._ms.append(self._pending.pop(0).ms())


def time_buckets(model: nn.Module | list[nn.Module]) -> BucketTimer | None:
    """Register a BucketTimer on a DDP-wrapped model (one timer on every DDP chunk of a list: a
    pipeline rank's stages); None where nothing is DDP-wrapped."""
    wrapped = [m for m in (model if isinstance(model, list) else [model]) if isinstance(m, DistributedDataParallel)]
    if not wrapped:
        return None
    timer = BucketTimer()

    # Unannotated on purpose: DDP checks a hook's annotations against the real classes, and this
    # module's annotations are strings (from __future__ import annotations).
    def hook(state, bucket):  # noqa: ANN001, ANN202
        return timer(state, bucket)

    for ddp in wrapped:
        ddp.register_comm_hook(ddp.process_group, hook)
    return timer
