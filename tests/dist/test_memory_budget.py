"""The per-rank device-memory budget on real gloo ranks: every rank leaves its peak for the driver,
the tracker sees what sharding saves (FSDP2's DTensor shards and resized storages), and a rank over
its budget fails the stage with one line, as CUDA's out-of-memory would."""

from __future__ import annotations

import json
import tempfile

import pytest
import torch
import torch.distributed as dist

from pipelines.launchers.base import StageFailed
from pipelines.launchers.worker import MEMORY_FILE, peak_memory
from tests.dist.test_strategies import train_inputs
from tests.helpers import run_world
from training.config import StrategyConfig
from training.units import GIB, MIB


def hold_on_rank1(n: int) -> None:
    """A stage function: rank 1 holds `n` float32 numbers, then every rank meets."""
    held = torch.ones(n) if dist.get_rank() == 1 else None
    dist.barrier()
    del held


def rank_peaks(workdir) -> list[int]:
    return [json.loads((workdir / MEMORY_FILE.format(rank=r)).read_text())["peak_bytes"] for r in range(2)]


@pytest.mark.slow
def test_every_rank_leaves_its_peak_and_zero3_holds_less_than_ddp(tmp_path):
    peaks = {}
    for name in ("ddp", "zero3"):
        workdir = tmp_path / name
        inputs = (train_inputs(StrategyConfig(name=name), steps=4, timing_warmup=1), tempfile.mkdtemp())
        result = run_world("tests.dist.workers:train_any", inputs, world=2, workdir=workdir, memory_budget_gib=1.0)
        peaks[name] = peak_memory(workdir)
        assert peaks[name] == max(rank_peaks(workdir))
        # Right after the optimizer step the rank holds its parameters, gradients and optimizer
        # state together (the train stage counts them from the tensors): the peak is above that.
        assert result.param_bytes + result.grad_bytes + result.optim_bytes <= peaks[name] < GIB
    assert peaks["zero3"] < peaks["ddp"]


def test_a_rank_over_its_budget_fails_the_stage_with_one_line(tmp_path):
    with pytest.raises(StageFailed) as failed:
        run_world("tests.dist.test_memory_budget:hold_on_rank1", MIB, world=2, workdir=tmp_path,
                  memory_budget_gib=1 / 1024)
    assert str(failed.value) == (
        "rank 1 failed: DeviceOutOfMemory: rank 1: device memory budget exceeded: 4.00 MiB in use > 1.00 MiB "
        f"(cluster.device_memory_gib=0.000976562) (logs: {tmp_path})")
    failed_rank = json.loads((tmp_path / MEMORY_FILE.format(rank=1)).read_text())["peak_bytes"]
    assert failed_rank < MIB, "left also by the rank that failed, without the allocation that failed"
