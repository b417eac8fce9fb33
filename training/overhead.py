"""What a strategy's wrapper adds to every step, measured on one rank.

The plan's compute ruler times the bare model. Each parallelism wrapper adds work to every step
that does not shrink with more devices: DDP's reducer (autograd hooks, copies into and out of the
gradient buckets), FSDP2's pre- and post-hooks, its all-gather copy-in and copy-out and an
optimizer stepping DTensors, ZeroRedundancyOptimizer's partition bookkeeping, DTensor dispatch
for tensor parallelism. On a process group of one rank every collective is a local no-op, so the
wrapped step minus the bare one is that overhead: measured here, not assumed. On the 2-core CPU
host this was written on, gpt-tiny's 11.7 ms step grows by about 1 ms under DDP and 10.5 ms under
FSDP2's zero3, more than the α–β model's communication for the latter.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from training.dist import synchronize

MEASURED_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "tp")
"""The strategies whose wrapper runs on one rank (a pipeline needs two stages)."""


@dataclass(frozen=True)
class Overheads:
    seconds: dict[str, float]
    """Per strategy: wrapped minus bare micro-batch step, median over interleaved rounds (>= 0)."""
    bare_step_s: float
    """The bare step these were measured against."""
    not_measured: dict[str, str]
    """Strategy -> why its overhead could not be measured here."""


@contextlib.contextmanager
def one_rank_group(dev: torch.device) -> Iterator[bool]:
    """A process group of this process alone (an in-memory store) for the duration, unless
    torch.distributed is already up. Yields False when it is up with other ranks in it: a
    one-rank mesh can't be made there without them."""
    if dist.is_initialized():
        yield dist.get_world_size() == 1
        return
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield True
    finally:
        dist.destroy_process_group()


def _wrap(strategy: str, model: nn.Module, dev: torch.device) -> torch.optim.Optimizer:
    """Apply `strategy` to `model` in place, as training/parallel does, on a one-rank mesh; return
    the optimizer training would build for it."""
    from torch.distributed.device_mesh import init_device_mesh

    from training.parallel.fsdp import apply_fsdp
    from training.parallel.tp import apply_tp

    if strategy in ("zero2", "zero3"):
        apply_fsdp(model, init_device_mesh(dev.type, (1,)), reshard_after_forward=strategy == "zero3",
                   param_dtype=None)
    elif strategy == "tp":
        apply_tp(model, init_device_mesh(dev.type, (1,)))
    params = [p for p in model.parameters() if p.requires_grad]
    if strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-4)
    return torch.optim.AdamW(params, lr=1e-4)


def _ddp(model: nn.Module, dev: torch.device, bucket_cap_mb: float) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    index = (dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=[index] if index is not None else None,
                                   bucket_cap_mb=bucket_cap_mb)


def measure_overheads(
    model: nn.Module,
    loss: Callable[[nn.Module], torch.Tensor],
    strategies: list[str],
    dev: torch.device,
    grad_clip: float | None,
    bucket_cap_mb: float,
    rounds: int = 3,
    steps: int = 3,
) -> Overheads:
    """Time `model` bare and wrapped by each strategy (a copy of it), alternating in `rounds` so a
    drifting host moves both alike. `loss(model)` is one micro-batch's loss."""
    from training.parallel.compose import clip_model_grads
    from training.parallel.tp import supports_tp

    def stepper(net: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:  # the training loop's step: clipping and zeroing included
            loss(net).backward()
            if grad_clip is not None:
                clip_model_grads(net, grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(dev)
        return step

    def median_step(step: Callable[[], None]) -> float:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    wanted = [s for s in strategies if s in MEASURED_STRATEGIES]
    not_measured = {s: "a pipeline needs two stages: not measurable on one rank" for s in strategies if s == "pp"}
    seconds: dict[str, float] = {}
    bare = stepper(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    bare()  # the optimizer's state is allocated on the first step
    bare_times: list[float] = []
    with one_rank_group(dev) as usable:
        if not usable:
            reason = "torch.distributed is up with other ranks: no one-rank mesh"
            return Overheads({}, 0.0, {s: reason for s in wanted} | not_measured)
        for strategy in wanted:
            if strategy == "tp" and not supports_tp(model):
                not_measured[strategy] = "the model has no projections to split"
                continue
            try:  # a second copy of the model and its optimizer state must fit beside the first
                net = copy.deepcopy(model)
                optimizer = _wrap(strategy, net, dev)
                if strategy in ("ddp", "zero1"):
                    net = _ddp(net, dev, bucket_cap_mb)
                wrapped = stepper(net, optimizer)
                wrapped()
                wrapped()  # warm: lazy initialisation (FSDP's, the reducer's) happens in the first steps
            except torch.OutOfMemoryError:
                net = optimizer = wrapped = None  # free what was built before retrying the next
                not_measured[strategy] = "no room for a second copy of the model on this device"
                continue
            diffs = []
            for _ in range(rounds):
                plain = median_step(bare)
                bare_times.append(plain)
                diffs.append(median_step(wrapped) - plain)
            seconds[strategy] = max(statistics.median(diffs), 0.0)
            del net, optimizer, wrapped
    return Overheads(seconds, statistics.median(bare_times) if bare_times else 0.0, not_measured)
