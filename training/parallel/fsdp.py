"""Sharded data parallelism with FSDP2 `fully_shard`: ZeRO-2 and ZeRO-3, and HSDP on a 2-D mesh."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from training.contract.blocks import Block


@dataclass(frozen=True)
class ExpertShards:
    modules: list[nn.Module]
    mesh: DeviceMesh


def apply_fsdp(model: nn.Module, blocks: list[Block], dp_mesh: DeviceMesh, reshard_after_forward: bool,
               param_dtype: torch.dtype | None, experts: ExpertShards | None = None) -> nn.Module:
    """Shard every block, then the root (which takes whatever is left: embeddings, head).

    `reshard_after_forward=True` is ZeRO-3 (the blocks' parameters gathered again in backward);
    False is ZeRO-2 (gathered parameters kept from forward to backward; gradients and optimizer
    state still sharded). A 2-D `dp_mesh` (replicate, shard) gives HSDP. With `param_dtype`,
    compute runs in that dtype while gradients are reduced in fp32. A model without blocks is one
    unit: correct, but its all-gather cannot overlap with compute. `experts` (expert parallelism):
    modules sharded first over their own mesh, the ranks holding the same experts; their gradients
    come out averaged over those ranks alone (training/parallel/ep.py rescales them)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    if experts is not None:
        for module in experts.modules:
            fully_shard(module, mesh=experts.mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    for block in blocks:
        fully_shard(block.module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    # The root stays gathered from forward to backward, as FSDP2 keeps it by default: its head is
    # the first thing backward needs, so resharding it would only gather it again at once (an
    # explicit True reshards the root too: measured, one all-gather more a step). The cost and
    # memory models count it so (planner/comm.py, planner/memory.py fsdp_gathered_root).
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    return model
