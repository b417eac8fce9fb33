"""One optimizer step: the training step every stage runs, so that what plan times, what lr_find
ramps, what the overhead probe wraps and what train repeats are the same computation (precision,
accumulation, clipping, the optimizer) and can't drift apart."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch

from training.contract.calls import Batch, to_device
from training.parallel.compose import Parallel, clip_grad_norm


def optimizer_step(parallel: Parallel, optimizer: torch.optim.Optimizer, micro_batches: Iterable[Batch],
                   accum: int, grad_clip: float | None, dev: torch.device,
                   before_zero: Callable[[], None] | None = None) -> torch.Tensor:
    """Forward and backward of each of the step's `accum` micro-batches (gradients reduced on the
    last), unscale, clip, step, zero. Returns the step's loss, summed over micro-batches, on the
    device (no host sync). `before_zero` runs after the optimizer step, with gradients still held
    (the memory probe reads them there)."""
    loss = torch.zeros((), device=dev)
    for micro, batch in enumerate(micro_batches):
        last = micro == accum - 1
        with contextlib.nullcontext() if last else parallel.no_sync():
            loss += parallel.forward_backward(to_device(batch, dev), 1.0 / accum)
    for finish in parallel.after_backward:
        finish()
    if parallel.scaler is not None:
        parallel.scaler.unscale_(optimizer)
    if grad_clip is not None:
        clip_grad_norm(parallel, grad_clip)
    if parallel.scaler is not None:
        parallel.scaler.step(optimizer)
        parallel.scaler.update()
    else:
        optimizer.step()
    if before_zero is not None:
        before_zero()
    optimizer.zero_grad(set_to_none=True)
    return loss
