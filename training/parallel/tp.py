"""Tensor parallelism with DTensor, from the model's own plan (Hugging Face's strings).

`colwise` splits a linear by output columns and `rowwise` by input rows: a column split followed
by its row partner needs one all-reduce per pair in forward and one in backward (Megatron). The
plan comes from the model (training/models/spec.py), resolved to module names.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
}


def apply_tp(model: nn.Module, plan: dict[str, str], tp_mesh: DeviceMesh) -> nn.Module:
    """Split the modules `plan` names (module name -> style) over `tp_mesh`; names the pipeline
    split removed are skipped."""
    present = {name for name, _ in model.named_modules()}
    styles: dict[str, ParallelStyle] = {name: STYLES[style]() for name, style in plan.items() if name in present}
    parallelize_module(model, tp_mesh, styles)
    return model
