"""Pipeline parallelism with torch.distributed.pipelining: split by layer, run a schedule.

A model opts in by keeping its blocks in `layers` (a ModuleDict) and naming the modules that
belong only to the first stage (`pp_first`, e.g. embeddings) and only to the last (`pp_last`,
e.g. the final norm and the head); its forward skips whatever is None (torchtitan's layout).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_layers(names: list[str], stage: int, stages: int) -> list[str]:
    """The contiguous run of layer names stage `stage` of `stages` owns (balanced by count)."""
    n = len(names)
    return names[stage * n // stages : (stage + 1) * n // stages]


def split_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Delete, in place, every part of `model` that stage `stage` doesn't own."""
    if stages > len(model.layers):
        raise ValueError(f"strategy.pp={stages} stages but the model has only {len(model.layers)} layers")
    keep = set(stage_layers(list(model.layers.keys()), stage, stages))
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage > 0:
        for name in model.pp_first:
            setattr(model, name, None)
    if stage < stages - 1:
        for name in model.pp_last:
            setattr(model, name, None)
    return model


def apply_pp(model: nn.Module, pp_mesh: DeviceMesh) -> nn.Module:
    """Keep only this rank's stage of `model` (the first step of the composition)."""
    return split_stage(model, pp_mesh.get_local_rank(), pp_mesh.size())


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
