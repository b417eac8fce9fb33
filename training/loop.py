"""The training loop: flat and readable, top to bottom (nanoGPT's shape).

The hot loop never waits on the device: per-step losses stay on the device and are read (and
averaged over ranks) only every `log_every` steps. Throughput is timed from the end of the
`timing_warmup` steps to the end of the run, with the device synchronised at both ends.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from training.config import TrainConfig
from training.contract.calls import Batch
from training.dist import all_reduce_sum, synchronize
from training.memory import StepMemory, StepProbe
from training.parallel.compose import Parallel
from training.profile import StepProfiler
from training.step import optimizer_step


@dataclass(frozen=True)
class Resume:
    """Where a resumed run picks up: the next step and the curve so far."""

    step: int
    losses: list[float]
    lrs: list[float]


@dataclass(frozen=True)
class LoopStats:
    losses: list[float]
    """Loss of every optimizer step, averaged over micro-batches and ranks."""
    lrs: list[float]
    timed_steps: int
    timed_seconds: float
    step_seconds: list[float]
    """Each timed step's own wall time (device time between step starts on CUDA)."""
    memory: StepMemory | None
    """The probed first step's memory, when a probe was given."""


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


@dataclass(frozen=True)
class LoopShape:
    """How the loop runs: its steps, each of `accum` micro-batches, and what it does between them."""

    steps: int
    accum: int
    grad_clip: float | None
    log_every: int
    """Read the losses (the loop's one host sync) every this many steps."""
    timing_warmup: int
    """Steps before the timed window."""
    ckpt_every: int = 0
    """Hand a checkpoint to `Hooks.on_checkpoint` every this many steps; 0: never."""

    @classmethod
    def of(cls, train: TrainConfig) -> LoopShape:
        return cls(train.steps, train.grad_accum, train.grad_clip, train.log_every, train.timing_warmup,
                   train.ckpt_every)


@dataclass(frozen=True)
class Hooks:
    """What the caller watches the loop with; each optional."""

    on_log: Callable[[int, float], None] | None = None
    """(step done, its loss) at every read of the losses."""
    on_checkpoint: Callable[[int, list[float], list[float]], None] | None = None
    """(step done, losses, lrs) every LoopShape.ckpt_every steps."""
    probe: StepProbe | None = None
    """Measures the first step's memory."""
    profiler: StepProfiler | None = None
    """Profiles the steps it covers (keep them out of the timed window)."""


def train_loop(
    parallel: Parallel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: Iterator[Batch],
    shape: LoopShape,
    dev: torch.device,
    hooks: Hooks = Hooks(),
    resume: Resume | None = None,
) -> LoopStats:
    """Run optimizer steps [resume.step or 0, shape.steps), each on the next `shape.accum`
    micro-batches of `micro_batches` (this rank's, in order), watched by `hooks`."""
    steps, accum, grad_clip = shape.steps, shape.accum, shape.grad_clip
    probe, profiler, on_log, on_checkpoint = hooks.probe, hooks.profiler, hooks.on_log, hooks.on_checkpoint
    first = resume.step if resume else 0
    losses: list[float] = list(resume.losses) if resume else []
    lrs: list[float] = list(resume.lrs) if resume else []
    pending: list[torch.Tensor] = []
    memory: list[StepMemory] = []
    timed_from = min(first + shape.timing_warmup, steps - 1)
    start = time.perf_counter()
    marks = StepMarks(dev)
    parallel.model.train()
    for step in range(first, steps):
        if step == timed_from:
            synchronize(dev)
            start = time.perf_counter()
        if step >= timed_from:
            marks.mark()
        if profiler is not None and step == profiler.first:
            profiler.start()
        lrs.append(optimizer.param_groups[0]["lr"])
        batches = itertools.islice(micro_batches, accum)
        if probe is not None and step == first:
            with probe:
                step_loss = optimizer_step(parallel, optimizer, batches, accum, grad_clip, dev,
                                           before_zero=lambda: memory.append(probe.finish(optimizer)))
        else:
            step_loss = optimizer_step(parallel, optimizer, batches, accum, grad_clip, dev)
        scheduler.step()
        pending.append(step_loss)
        if profiler is not None and step == profiler.first + profiler.count - 1:
            synchronize(dev)
            profiler.stop()
        done = step + 1
        checkpoint = shape.ckpt_every > 0 and done % shape.ckpt_every == 0 and done < steps
        if done % shape.log_every == 0 or done == steps or checkpoint:
            # The only host sync of the loop: losses of every rank that computes one, averaged.
            losses.extend((all_reduce_sum(torch.stack(pending)) / parallel.loss_owners).tolist())
            pending.clear()
            if on_log is not None:
                on_log(done, losses[-1])
        if checkpoint and on_checkpoint is not None:
            on_checkpoint(done, losses, lrs)
    marks.mark()
    synchronize(dev)
    elapsed = time.perf_counter() - start
    return LoopStats(losses=losses, lrs=lrs, timed_steps=steps - timed_from, timed_seconds=elapsed,
                     step_seconds=marks.intervals(), memory=memory[0] if memory else None)


class StepMarks:
    """Timestamps at each step's start, without a host sync per step: CUDA events on a GPU (read
    once the loop has synchronised at its end), the host clock on CPU, where work is synchronous."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks (call after a synchronize)."""
        pairs = zip(self.marks, self.marks[1:], strict=False)
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in pairs]
