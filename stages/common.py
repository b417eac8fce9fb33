"""What several stages share: building the model, its data pool and the device in one call."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from training.config import DataConfig, ModelConfig
from training.data import make_pool
from training.dist import device
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
