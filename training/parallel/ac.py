"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

`full` keeps only each block's input and runs the whole block again in backward (one more forward
of every block). `selective` is torchtitan's per-op policy (torch.utils.checkpoint's
create_selective_checkpoint_contexts): a block keeps the outputs of the ops that are expensive to
run again and recomputes the rest.

A block that declares its own checkpointing hook (Hugging Face's GradientCheckpointingLayer: a
`gradient_checkpointing` flag and the `_gradient_checkpointing_func` it calls) is checkpointed
through it rather than wrapped: its forward then also stops writing its KV cache, which the
recomputation would write a second time (selective checkpointing fails on the extra ops).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from training.contract.blocks import Block
from training.memory import kept_for_backward

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

SAVED_OPS = frozenset({
    # Matmuls: a block's FLOPs (Linear on 3-D inputs runs as mm; addmm with a bias on 2-D ones; bmm
    # in attention written out by hand; _scaled_mm in a Float8Linear).
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_mm.default,
    # Attention, whichever kernel runs it: flash/efficient/cuDNN on GPUs, the flash kernel for CPU
    # (what torch 2.13 runs here, and what the meta-device count runs: training/planner/anatomy.py).
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_fused_attention_overrideable.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._efficient_attention_forward.default,  # context parallelism's lower-right causal chunks (cp.py)
    # A reduction whose result low-precision training reuses (torchtitan's list).
    _aten.max.default,
    # Tensor parallelism's reductions of the row-split linears: recomputing them would repeat the
    # collective in backward.
    _c10d.reduce_scatter_tensor.default, _c10d.all_reduce.default,
})
"""Ops whose outputs a `selective` block keeps.

The policy: keep every matmul and attention output, recompute everything else (norms, GELU/SiLU,
residual adds, dropout, all-gathers). Matmuls and attention are nearly all of a block's FLOPs, so
backward recomputes almost no FLOPs (full checkpointing recomputes all of them, a third more
compute per step); the ops recomputed are memory-bound and cheap, while their outputs are what a
block would otherwise keep most of (the norms' inputs and outputs, the MLP's 4h-wide activation
output). torchtitan's op-SAC keeps only every other mm, trading more recompute for memory; keeping
them all makes `selective` the setting between `none` and `full` that costs (almost) no compute.
A matmul whose output is a partial sum (a row-split linear under TP) is the exception: it is
recomputed and its reduction kept, since the unreduced output is a whole b x s x h tensor on every
rank (under sequence parallelism more than the rest of the block together)."""


def _partial(output: Any) -> bool:
    return isinstance(output, DTensor) and any(p.is_partial() for p in output.placements)


def keeps(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy (SAVED_OPS); what it keeps is reported to the saved-bytes counters."""
    output = ctx.op_output
    if op in SAVED_OPS and not _partial(output):
        kept_for_backward(output)  # cached by the checkpoint, not saved by autograd: counted here
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[Any, Any]:
    """A fresh pair of (forward, recompute) contexts for one checkpointed call."""
    return create_selective_checkpoint_contexts(keeps)


def checkpoints_itself(module: nn.Module) -> bool:
    """Whether the block declares its own checkpointing hook (see the module docstring)."""
    return isinstance(getattr(type(module), "gradient_checkpointing", None), bool)


def apply_ac(blocks: list[Block], mode: str = "full") -> None:
    """Checkpoint every block in place: `full` saves only its input for backward, `selective` its
    input and what `keeps` keeps."""
    extra = {"context_fn": selective_contexts} if mode == "selective" else {}
    for block in blocks:
        if checkpoints_itself(block.module):
            block.module.gradient_checkpointing = True
            block.module._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False,
                                                                preserve_rng_state=False, **extra)
        else:
            block.replace(checkpoint_wrapper(block.module, preserve_rng_state=False, **extra))
