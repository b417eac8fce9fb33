"""Tensor parallelism with DTensor, from the model's own plan (Hugging Face's strings).

`colwise` splits a linear by output columns and `rowwise` by input rows: a column split followed
by its row partner needs one all-reduce per pair in forward and one in backward (Megatron). The
plan comes from the model (training/contract/spec.py), resolved to module names.

**Sequence parallelism** (training/parallel/sp.py) splits what TP leaves whole over the sequence:
its norms' styles join the plan's here, one parallelize_module call for both.

**Loss parallelism** (torchtitan's; Megatron's vocabulary-parallel cross-entropy): the model's head
(training/contract/spec.py) is split by vocabulary and its logits stay split, a DTensor sharded on
the last dimension, into the loss, which torch computes on the shards under `loss_parallel()`: a
max, a sum of exponentials and the target's logit all-reduced per position instead of the logits
gathered. The logits, the loss's saved softmax and its gradients are then split over the TP
ranks; the head's input gradient is all-reduced (a column split's partial sums), as any column
split's is. For a 128K vocabulary the logits outweigh everything else a step saves at short
sequences.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from training.config import REPLICATED_STYLE
from training.parallel.sp import POSITIONS, SequenceLayout, apply_sp, norm_styles

STYLES = {  # "colwise": SharingColwise
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    # A module between a column and a row split that stays whole (Qwen3's per-head q/k norms see
    # only this rank's heads): its parameters replicated DTensors and its input declared one shard
    # of a tensor (dim 0: any dimension its forward does not reduce over), so each rank's gradient
    # is a partial sum, accumulated as one over micro-batches and summed over the TP ranks once a
    # step (sum_partial_grads; under FSDP by its reduction). Hugging Face's own style all-reduces
    # the accumulated .grad after every backward, which sums an earlier micro-batch's gradient
    # again. The output goes on as the local tensor.
    REPLICATED_STYLE: lambda: SequenceParallel(sequence_dim=0, use_local_output=True),
}

SP_STYLES = {
    **STYLES,
    # The partial sums reduce-scattered to positions, kept a DTensor: the residual stream's layout.
    "rowwise": lambda: RowwiseParallel(output_layouts=POSITIONS, use_local_output=False),
}

VOCABULARY = Shard(-1)
"""Where loss parallelism splits the logits (batch, sequence, vocabulary): by vocabulary."""


def apply_tp(model: nn.Module, plan: dict[str, str], tp_mesh: DeviceMesh,
             sequence: SequenceLayout | None = None, head: str | None = None) -> bool:
    """Split the modules `plan` names (module name -> style) over `tp_mesh`, with `sequence` the
    rest by position, and the `head` by vocabulary; names the pipeline split removed are skipped.
    True when this part holds the head and its logits now come out split (the loss must then run
    under `loss_parallel`: split_loss)."""
    present = {name for name, _ in model.named_modules()}
    table = SP_STYLES if sequence is not None else STYLES
    last_input = _LastInput()  # shared by the column-split linears, whose inputs may be one tensor
    styles: dict[str, ParallelStyle] = {name: SharingColwise(last_input) if style == "colwise" else table[style]()
                                        for name, style in plan.items() if name in present}
    split_head = head is not None and head in present
    if split_head:
        styles[head] = ColwiseParallel(output_layouts=VOCABULARY, use_local_output=False)
    if sequence is not None:
        styles.update(norm_styles(model, sequence, present))
    parallelize_module(model, tp_mesh, styles)
    for name, style in styles.items():  # a split region ends where a row split starts
        if isinstance(style, RowwiseParallel):
            model.get_submodule(name).register_forward_pre_hook(last_input.clear)
    model.register_forward_hook(last_input.clear)
    if sequence is not None:
        column_split = [model.get_submodule(n) for n, style in plan.items() if style == "colwise" and n in present]
        apply_sp(model, sequence, column_split, tp_mesh)
    return split_head


class _LastInput:
    """The whole input the last column-split linear took, and the DTensor made of it, held until
    the split region ends (a row split starts, or the forward returns): under checkpointing nothing
    else keeps it, and a weak reference let q, k and v each all-reduce their own input gradient."""

    def __init__(self):
        self.source: weakref.ref | None = None
        self.shared: DTensor | None = None

    def of(self, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        if self.shared is None or self.source is None or self.source() is not x:
            self.shared = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            self.source = weakref.ref(x)
        return self.shared

    def clear(self, *_: Any) -> None:
        self.source = self.shared = None


class SharingColwise(ColwiseParallel):
    """torch's ColwiseParallel, except that column-split linears called one after another on the
    same whole input (attention's q, k and v; a gated MLP's gate and up projections) share one
    DTensor of it. Their input gradients, partial sums, are then added on each rank and all-reduced
    once in backward, as Megatron's fused QKV does, instead of once per linear (measured: 12
    all-reduces a step for a 2-layer GPT with its separate q, k and v, 8 with this:
    tests/unit/test_loss_parallel.py). Inputs that are DTensors already (sequence parallelism's
    gathered norm output) are shared as they are."""

    def __init__(self, last: _LastInput):
        super().__init__()
        self.last = last

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition_linear_fn, self._shared_input,
                                 lambda m, out, mesh: self._prepare_output_fn(self.output_layouts,
                                                                              self.use_local_output, m, out, mesh))

    def _shared_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> DTensor:
        x = inputs[0]
        return x if isinstance(x, DTensor) else self.last.of(x, mesh)


def split_loss(loss: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    """`loss` on vocabulary-split logits (run it, and its backward, under `loss_parallel()`):
    torch's cross-entropy on the shards gives every rank the same loss, a replicated DTensor,
    handed on as a plain tensor."""
    def whole(output: Any, target: Any) -> torch.Tensor:
        value = loss(output, target)
        return value.full_tensor() if isinstance(value, DTensor) else value

    return whole



def sum_partial_grads(params: list[nn.Parameter], tp_mesh: DeviceMesh) -> Callable[[], None]:
    """After the step's last backward, where no FSDP reduces them: the gradients of parameters TP
    keeps whole beside split activations (the sequence-parallel norms, the `replicated_with_grad_allreduce`
    modules) are partial sums over the TP ranks, and DTensor sums them lazily, in every operation
    that reads them: the clip's norm and each of AdamW's reads, four all-reduces per parameter per
    step (measured on a fake process group: 37 for Qwen3-MoE's 9 such parameters). Summed here,
    all of them in one all-reduce per dtype, they are whole before anything reads them."""
    params = [p for p in params if isinstance(p, DTensor) and p.device_mesh == tp_mesh]

    def sum_them() -> None:
        partial = [p for p in params if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)]
        for dtype in {p.grad.dtype for p in partial}:
            group = [p for p in partial if p.grad.dtype == dtype]
            flat = torch.cat([p.grad.to_local().reshape(-1) for p in group])
            torch.distributed.all_reduce(flat, group=tp_mesh.get_group())
            for p, part in zip(group, flat.split([p.grad.to_local().numel() for p in group]), strict=True):
                p.grad = DTensor.from_local(part.view_as(p.grad.to_local()), tp_mesh, [Replicate()], run_check=False)

    return sum_them
