"""The training loop: flat and readable, top to bottom (nanoGPT's shape).

The hot loop never waits on the device: per-step losses stay on the device and are read (and
averaged over ranks) only every `log_every` steps. Throughput is timed from the end of the
`timing_warmup` steps to the end of the run, with the device synchronised at both ends.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from training.data import GlobalBatches
from training.dist import all_reduce_mean, synchronize


@dataclass(frozen=True)
class LoopStats:
    losses: list[float]
    """Loss of every optimizer step, averaged over micro-batches and ranks."""
    lrs: list[float]
    timed_steps: int
    timed_seconds: float


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str) -> Callable[[int], float]:
    """Multiplier of the peak LR at each step: linear warm-up, then constant or cosine to 10 %."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def train_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    pool: tuple[torch.Tensor, torch.Tensor],
    batches: GlobalBatches,
    steps: int,
    grad_clip: float | None,
    log_every: int,
    timing_warmup: int,
    dev: torch.device,
    on_log: Callable[[int, float], None] | None = None,
) -> LoopStats:
    inputs, targets = pool
    losses: list[float] = []
    lrs: list[float] = []
    pending: list[torch.Tensor] = []
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        if step == timing_warmup:
            synchronize(dev)
            start = time.perf_counter()
        lrs.append(optimizer.param_groups[0]["lr"])
        step_loss = torch.zeros((), device=dev)
        for micro in range(batches.accum):
            rows = batches.rows(step, micro).to(dev)
            # Gradients are reduced once per optimizer step, on the last micro-batch.
            last = micro == batches.accum - 1
            sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
            with sync:
                loss = loss_fn(model, inputs[rows], targets[rows]) / batches.accum
                loss.backward()
            step_loss += loss.detach()
        if grad_clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        pending.append(step_loss)
        if (step + 1) % log_every == 0 or step == steps - 1:
            values = all_reduce_mean(torch.stack(pending)).tolist()
            losses.extend(values)
            pending.clear()
            if on_log is not None:
                on_log(step + 1, values[-1])
    synchronize(dev)
    elapsed = time.perf_counter() - start
    return LoopStats(losses=losses, lrs=lrs, timed_steps=steps - timing_warmup, timed_seconds=elapsed)
