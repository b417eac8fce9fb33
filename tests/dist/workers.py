"""Worker functions that the distributed tests run on real ranks (importable by the workers)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist


def ranks_sum(_inputs: object) -> dict:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"sum": t.item(), "world": dist.get_world_size(), "pid": os.getpid()}


def raise_on_rank1(_inputs: object) -> None:
    if dist.get_rank() == 1:
        raise ValueError("planted failure on rank 1")
    dist.barrier()


def kill_rank1(_inputs: object) -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)


def hang_rank1(_inputs: object) -> None:
    """Rank 1 never joins the collective: rank 0 must fail on the collective timeout."""
    if dist.get_rank() == 1:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)


def hang_rank1_in_a_subgroup(_inputs: object) -> None:
    """As hang_rank1, in a group made after the default one (as a DeviceMesh makes its dimensions')."""
    group = dist.new_group([0, 1])
    if dist.get_rank() == 1:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t, group=group)


def train_ddp(inputs: object) -> object:
    """The real train stage, with the two upstream results it reads stubbed by plain values."""
    import tempfile
    from pathlib import Path
    from types import SimpleNamespace

    from stages.train import run

    plan = SimpleNamespace(flops_per_sample=1.0, recommended=None, prediction_for_run=lambda strategy, world: None)
    lr_find = SimpleNamespace(suggested_lr=1e-2, lr_scaling="none", finder_batch=8)
    return run(inputs, plan=plan, lr_find=lr_find, trials=None, baseline=None, checkpoints=Path(tempfile.mkdtemp()))


def train_any(inputs: object) -> object:
    """The real train stage for any strategy, checkpointing into the path the test gives."""
    from pathlib import Path
    from types import SimpleNamespace

    from stages.train import run

    inputs, ckpt = inputs
    plan = SimpleNamespace(flops_per_sample=1.0, recommended=None, prediction_for_run=lambda strategy, world: None)
    lr_find = SimpleNamespace(suggested_lr=1e-2, lr_scaling="none", finder_batch=8)
    return run(inputs, plan=plan, lr_find=lr_find, trials=None, baseline=None, checkpoints=Path(ckpt))


def train_crash_once(inputs: object) -> object:
    """train_any, but rank 1 SIGKILLs itself at `kill_step` unless `marker` exists (it creates
    it first), so that the first attempt dies mid-run and the second one resumes."""
    from pathlib import Path

    import training.loop as loop

    inputs, ckpt, marker, kill_step = inputs
    original = loop.optimizer_step
    steps = iter(range(10**9))

    def crashing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - optimizer_step's own
        if next(steps) == kill_step and dist.get_rank() == 1 and not Path(marker).exists():
            Path(marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    loop.optimizer_step = crashing
    return train_any((inputs, ckpt))
