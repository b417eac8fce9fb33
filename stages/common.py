"""What several stages share: building the model, its data pool and the device in one call."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch import nn

from pipelines.progress import PROGRESS_ENV
from training.config import DataConfig, ModelConfig
from training.data import make_pool
from training.dist import device
from training.files import write_atomic
from training.models import build_model


@dataclass
class Workbench:
    model: nn.Module
    pool: tuple[torch.Tensor, torch.Tensor]
    dev: torch.device


def workbench(model: ModelConfig, data: DataConfig, seed: int) -> Workbench:
    """The seeded model and data pool, on this rank's device."""
    dev = device()
    net = build_model(model, data, seed).to(dev)
    inputs, targets = make_pool(data, model, seed)
    return Workbench(net, (inputs.to(dev), targets.to(dev)), dev)


def log(stage: str, message: str) -> None:
    """A progress line in the rank's log (rank 0's is the one to read)."""
    print(f"[{stage}] {message}", flush=True)


def progress(stage: str, message: str) -> None:
    """`log`, and on rank 0 also the stage's live status for the driver's progress line
    (pipelines.progress): one small file, replaced whole, that the driver polls."""
    log(stage, message)
    path = os.environ.get(PROGRESS_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        with contextlib.suppress(OSError):  # a status line is never worth failing the stage
            write_atomic(path, message)
