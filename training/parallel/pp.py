"""Pipeline parallelism with torch.distributed.pipelining: split by block, run a schedule.

A model opts in by declaring its layout (training/models/spec.py: blocks in a ModuleDict,
`pp_first`/`pp_last`, a forward that skips whatever is None; torchtitan's contract).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from training.models.spec import PipelineLayout

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_layers(names: list[str], stage: int, stages: int) -> list[str]:
    """The contiguous run of block names stage `stage` of `stages` owns (balanced by count)."""
    n = len(names)
    return names[stage * n // stages : (stage + 1) * n // stages]


def split_stage(model: nn.Module, layout: PipelineLayout, stage: int, stages: int) -> nn.Module:
    """Delete, in place, every part of `model` that stage `stage` doesn't own."""
    blocks = layout.container
    if stages > len(blocks):
        raise ValueError(f"strategy.pp={stages} stages but the model has only {len(blocks)} blocks")
    keep = set(stage_layers(list(blocks.keys()), stage, stages))
    for name in list(blocks.keys()):
        if name not in keep:
            del blocks[name]
    if stage > 0:
        for name in layout.first:
            setattr(model, name, None)
    if stage < stages - 1:
        for name in layout.last:
            setattr(model, name, None)
    return model


def apply_pp(model: nn.Module, layout: PipelineLayout, pp_mesh: DeviceMesh) -> nn.Module:
    """Keep only this rank's stage of `model` (the first step of the composition)."""
    return split_stage(model, layout, pp_mesh.get_local_rank(), pp_mesh.size())


def build_schedule(
    module: nn.Module,
    pp_mesh: DeviceMesh,
    device: torch.device,
    microbatches: int,
    schedule: str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> object:
    """The schedule that drives this rank's stage. Built last, around the fully wrapped module:
    a stage built around the bare module would bypass a DDP wrapper's gradient hooks."""
    stage = PipelineStage(module, pp_mesh.get_local_rank(), pp_mesh.size(), device, group=pp_mesh.get_group())
    return SCHEDULES[schedule](stage, n_microbatches=microbatches, loss_fn=loss_fn)


def is_first(pp_mesh: DeviceMesh) -> bool:
    return pp_mesh.get_local_rank() == 0


def is_last(pp_mesh: DeviceMesh) -> bool:
    return pp_mesh.get_local_rank() == pp_mesh.size() - 1
