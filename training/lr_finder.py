"""A model-agnostic learning-rate range test (Leslie Smith, fastai style).

The LR is ramped exponentially from `min_lr` to `max_lr`, one optimizer step per LR, while the
(bias-corrected, EMA-smoothed) loss is recorded. A suggestion rule then reads an LR off the curve,
and `scale_lr` carries it from the finder's batch size to the run's. Nothing here knows about
pipelines, configs or MLflow: the caller passes a model, an optimizer and a stream of batches.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from training.plan_config import LR_SCALING_RULES, SUGGESTION_RULES

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

Step = Callable[[], "Tensor"]
"""One training step on the next batch at the optimizer's current LR; returns the step's loss."""

_MIN_POINTS = 3


@dataclass(frozen=True)
class RangeTest:
    """The recorded curve of one range test."""

    lrs: list[float]
    """The LR of each recorded step."""
    losses: list[float]
    """The raw loss of each recorded step."""
    smoothed: list[float]
    """The bias-corrected EMA of `losses`."""
    stopped_early: bool
    """True when the loss diverged or became non-finite before `num_iters` steps."""
    best_loss: float
    """The lowest smoothed loss seen (inf when nothing was recorded)."""


def lr_at(i: int, num_iters: int, min_lr: float, max_lr: float) -> float:
    """The LR of step `i` of an exponential ramp from `min_lr` (i=0) to `max_lr` (i=num_iters-1)."""
    assert num_iters >= 2, f"an LR ramp needs at least 2 steps, got {num_iters}"
    return min_lr * (max_lr / min_lr) ** (i / (num_iters - 1))


def smooth(losses: list[float], beta: float) -> list[float]:
    """The EMA of `losses` with weight `beta` on the past, bias-corrected like Adam's moments.

    Without the correction the average starts at 0 and the first points read far too low.
    """
    avg, smoothed = 0.0, []
    for i, loss in enumerate(losses):
        avg = beta * avg + (1 - beta) * loss
        smoothed.append(avg / (1 - beta ** (i + 1)))
    return smoothed


def suggest(lrs: list[float], smoothed: list[float], rule: str) -> float:
    """An LR read off a range-test curve.

    `steepest`: the LR where the smoothed loss falls fastest against log10(lr), ignoring the first
    ~10% and the last ~5% of points, where the EMA is still settling or the loss is blowing up.
    `min_div_10`: a tenth of the LR at the lowest smoothed loss.
    """
    import numpy as np

    if len(lrs) != len(smoothed):
        raise ValueError(f"lrs and smoothed differ in length ({len(lrs)} vs {len(smoothed)})")
    if len(lrs) < _MIN_POINTS:
        raise ValueError(
            f"the range test recorded {len(lrs)} points, too few to suggest an LR (need >= {_MIN_POINTS}); "
            "lower min_lr, raise num_iters or raise diverge_threshold"
        )
    if rule == "steepest":
        return _steepest(lrs, smoothed)
    if rule == "min_div_10":
        return lrs[int(np.argmin(smoothed))] / 10
    raise ValueError(f"suggestion rule {rule!r} is unknown; use one of {', '.join(SUGGESTION_RULES)}")


def _steepest(lrs: list[float], smoothed: list[float]) -> float:
    import numpy as np

    n = len(lrs)
    # Integer division keeps at least 3 points for any n >= 3 (n - n//10 - n//20 >= 0.85 n).
    start, stop = n // 10, n - n // 20
    assert stop - start >= _MIN_POINTS, (n, start, stop)
    # The gradient is taken over the whole curve so the window's edge points get central differences.
    slope = np.gradient(np.asarray(smoothed, dtype=float), np.log10(np.asarray(lrs, dtype=float)))
    return lrs[start + int(np.argmin(slope[start:stop]))]


def scale_lr(lr: float, rule: str, finder_batch: int, target_batch: int) -> float:
    """`lr`, found at `finder_batch` samples per step, carried to `target_batch` by `rule`.

    `linear` (Goyal et al.) suits SGD; `sqrt` is the usual rule for Adam-style optimizers.
    """
    if finder_batch < 1 or target_batch < 1:
        raise ValueError(
            f"batch sizes must be >= 1, got finder_batch={finder_batch}, target_batch={target_batch}"
        )
    ratio = target_batch / finder_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    if rule == "none":
        return lr
    raise ValueError(f"LR scaling rule {rule!r} is unknown; use one of {', '.join(LR_SCALING_RULES)}")


@contextmanager
def _restored(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Puts the model's and optimizer's state (and gradients) back on exit, even on an exception."""
    model_state = copy.deepcopy(model.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()]
    try:
        yield
    finally:
        # load_state_dict copies into the existing tensors, so the optimizer's references stay valid.
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        for p, grad in grads:
            p.grad = grad


def range_test(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: Step,
    min_lr: float,
    max_lr: float,
    num_iters: int,
    beta: float,
    diverge_threshold: float,
    on_step: Callable[[int, float, float], None] | None = None,
    restore: bool = True,
) -> RangeTest:
    """Ramp the LR from `min_lr` to `max_lr` over `num_iters` steps and record the loss curve.

    Each step sets every param group's LR, then runs `step` (the training step, on the next batch).
    The test stops early when the smoothed loss exceeds `diverge_threshold` times the best seen
    (that point is kept, it shows the blow-up) or the loss is not finite (that point is dropped,
    it would poison the curve). The model and optimizer are restored afterwards unless not
    `restore` (restoring keeps a copy of their whole state meanwhile). `on_step(i, lr, smoothed
    loss)` follows each step (progress).
    """
    lrs: list[float] = []
    losses: list[float] = []
    smoothed: list[float] = []
    best, avg = math.inf, 0.0
    with _restored(model, optimizer) if restore else contextlib.nullcontext():
        for i in range(num_iters):
            lr = lr_at(i, num_iters, min_lr, max_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = _next_loss(step, i, num_iters)
            if not math.isfinite(loss):
                return RangeTest(lrs, losses, smoothed, stopped_early=True, best_loss=best)
            # The running EMA is kept here rather than re-smoothing the whole list every step.
            avg = beta * avg + (1 - beta) * loss
            lrs.append(lr)
            losses.append(loss)
            smoothed.append(avg / (1 - beta ** (i + 1)))
            if on_step is not None:
                on_step(i, lr, smoothed[-1])
            if i > 0 and smoothed[-1] > diverge_threshold * best:
                return RangeTest(lrs, losses, smoothed, stopped_early=True, best_loss=best)
            best = min(best, smoothed[-1])
    return RangeTest(lrs, losses, smoothed, stopped_early=False, best_loss=best)


def _next_loss(step: Step, i: int, num_iters: int) -> float:
    try:
        return step().item()
    except StopIteration:
        raise ValueError(
            f"batches ran out after {i} of num_iters={num_iters} steps; give the step at least num_iters "
            "batches or lower num_iters"
        ) from None
