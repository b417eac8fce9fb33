"""Data parallelism by replication: DDP all-reduces gradients in buckets during backward."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from training.dist import world_size


def apply_ddp(
    model: nn.Module,
    dev: torch.device,
    bucket_cap_mb: float,
    find_unused_parameters: bool,
    process_group: ProcessGroup | None = None,
) -> nn.Module:
    """Wrap `model` in DDP over `process_group` (default: every rank). A world of one is left
    unwrapped, so that the 1-device baseline pays no replication overhead. Around a pipeline
    stage DDP needs find_unused_parameters=True (its reducer asserts on the second step otherwise)."""
    if world_size() == 1:
        return model
    return DistributedDataParallel(
        model,
        device_ids=[dev.index] if dev.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
        process_group=process_group,
    )
