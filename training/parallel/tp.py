"""Tensor parallelism with DTensor: Megatron's column-then-row split inside each block.

q/k/v and the first feed-forward linear are split by output columns, the attention output and
the second feed-forward linear by input rows, so each block needs one all-reduce in forward
(and one in backward) per sub-layer. Embeddings, norms and the head stay replicated.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

BLOCK_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def supports_tp(model: nn.Module) -> bool:
    """Whether every block has the projections the plan splits."""
    names = {name for block in model.layers.values() for name, _ in block.named_modules()}
    return all(key in names for key in BLOCK_PLAN)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split every block's projections over `tp_mesh`."""
    if not supports_tp(model):
        raise ValueError(f"{type(model).__name__} has no attention/feed-forward projections to split")
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, BLOCK_PLAN)
    return model
