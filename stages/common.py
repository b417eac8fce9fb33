"""What several stages share: the user's model and data on this rank's device, and progress lines."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.files import write_atomic
from pipelines.progress import PROGRESS_ENV
from training.config import DataConfig, ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from training.contract.calls import LossFn
    from training.contract.spec import ModelSpec


@dataclass
class Workbench:
    model: nn.Module
    spec: ModelSpec
    """What the model declared: its blocks and plans."""
    loss: LossFn
    dataset: Dataset
    dev: torch.device


def workbench(model: ModelConfig, data: DataConfig, seed: int, tf32: bool = True, blocks: int | None = None) -> Workbench:
    """The seeded model for this rank's device, what it declares, its loss and the data set. A
    model that declares its initialisation comes on the meta device (spec.pending): `parallelize`
    shards it, then gives this rank its shard; nothing holds the whole model. On CUDA, fp32
    matmuls use TF32 unless `tf32` (train.tf32) is false. `blocks`: only the model's first blocks
    (with its embeddings and head) are kept, the slice plan times of a model one device can't hold."""
    from training.budget import host_side
    from training.contract.calls import model_loss
    from training.data import build_dataset
    from training.dist import device
    from training.flops import set_tf32
    from training.parallel.materialize import build_on_device

    dev = device()
    set_tf32(dev, tf32)
    net, spec = build_on_device(model, seed, dev)
    if blocks is not None:
        spec.keep_first_blocks(blocks)
    with host_side():  # the data set lives in host memory, as on a GPU machine; batches go to the device
        dataset = build_dataset(data)
    return Workbench(net, spec, model_loss(model), dataset, dev)


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
