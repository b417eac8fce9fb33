"""Pipeline parallelism with torch.distributed.pipelining: split by block, run a schedule.

A model opts in by declaring its layout (training/contract/spec.py: blocks in a ModuleDict,
`pp_first`/`pp_last`, a forward that skips whatever is None; torchtitan's contract; or Hugging
Face's `base_model_pp_plan`). A rank holds one stage (gpipe, 1f1b) or several (interleaved_1f1b,
zero_bubble: looped; zbv, dualpipev: a V), each a chunk of the model (training/parallel/chunks.py);
which stages, and what each schedule asks of the microbatches: training/parallel/schedules.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from training.contract.blocks import PipelineLayout
from training.parallel.chunks import PipelineChunks, parts, split
from training.parallel.schedules import SINGLE, SPLIT_BACKWARD, rank_stages

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


def apply_pp(model: nn.Module, layout: PipelineLayout, pp_mesh: DeviceMesh, schedule: str = "gpipe",
             virtual: int = 1) -> nn.Module:
    """This rank's stages of `model` (the first step of the composition): the model itself, pruned
    to its one stage, or a PipelineChunks of one chunk per stage it holds."""
    pp = pp_mesh.size()
    stages = rank_stages(schedule, pp_mesh.get_local_rank(), pp, virtual)
    chunks = split(model, layout, stages, pp * virtual)
    return chunks[0] if len(chunks) == 1 else PipelineChunks(chunks, stages)


def build_schedule(
    module: nn.Module,
    pp_mesh: DeviceMesh,
    device: torch.device,
    microbatches: int,
    schedule: str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    virtual: int = 1,
) -> object:
    """The schedule that drives this rank's stages. Built last, around the fully wrapped chunks:
    a stage built around a bare chunk would bypass a DDP wrapper's gradient hooks. It leaves the
    gradients unscaled: `loss_fn` divides by the microbatches (compose.py's _ScaledLoss), so that
    gradients accumulated over several steps of the schedule are not divided again."""
    pp = pp_mesh.size()
    ids = rank_stages(schedule, pp_mesh.get_local_rank(), pp, virtual)
    if schedule in SPLIT_BACKWARD:
        for chunk, index in zip(parts(module), ids, strict=True):
            if index < pp * virtual - 1:  # the last stage's loss is what it detaches, not its output
                chunk.register_forward_hook(_own_output)
    stages = [PipelineStage(chunk, index, pp * virtual, device, group=pp_mesh.get_group())
              for chunk, index in zip(parts(module), ids, strict=True)]
    held = stages[0] if schedule in SINGLE else stages
    return SCHEDULES[schedule](held, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def _own_output(module: nn.Module, args: tuple, out: object) -> object:
    """A stage's output handed on as a tensor of its own where it is a view (a block ending in a
    reshape or a slice; sequence parallelism's gathered residual stream, full_tensor()'s view):
    a split-backward schedule detaches the stage's outputs in place once their input gradients
    are taken, which autograd refuses on a view. One copy a microbatch, of views only."""
    if isinstance(out, torch.Tensor):
        return out.clone() if out._is_view() else out
    if isinstance(out, tuple):
        return tuple(t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t for t in out)
    return out


def is_first(pp_mesh: DeviceMesh, schedule: str = "gpipe", virtual: int = 1) -> bool:
    """Whether this rank holds the first stage (it feeds the inputs)."""
    return 0 in rank_stages(schedule, pp_mesh.get_local_rank(), pp_mesh.size(), virtual)


def is_last(pp_mesh: DeviceMesh, schedule: str = "gpipe", virtual: int = 1) -> bool:
    """Whether this rank holds the last stage (it computes the loss; rank 0 under a V)."""
    pp = pp_mesh.size()
    return pp * virtual - 1 in rank_stages(schedule, pp_mesh.get_local_rank(), pp, virtual)
