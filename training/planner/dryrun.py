"""Plan a layout at production scale without the hardware: a fake process group and the meta
device build the real mesh and the real sharded model for one rank of each pipeline stage, and
count what that rank would hold: the parameters as the trainer keeps them (bf16 ones where the
layout has no FSDP, sharded fp32 ones under it), their gradients, and the optimizer the trainer
builds, whose state is created with it (masters and moments counted as real meta tensors)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from training.config import ModelConfig, StrategyConfig
from training.contract.calls import build_model, model_loss
from training.contract.spec import model_spec
from training.memory import state_bytes
from training.parallel.compose import TIMED_LR, build_optimizer, parallelize, resolve_dims
from training.planner.memory import fsdp_wraps, gradient_ranks, keeps_gathered
from training.planner.shape import COMPUTE_BYTES
from training.units import GIB


@dataclass(frozen=True)
class RankShare:
    rank: int
    coordinates: dict[str, int]
    param_bytes: int
    """Parameters held during forward and backward (ZeRO-2 keeps the gathered compute copies too)."""
    grad_bytes: int
    """A gradient for every parameter this rank stores, in its dtype (FSDP's sharded fp32 ones)."""
    optim_bytes: int
    """The optimizer's tensors for what this rank updates: AdamW's two fp32 moments, and the fp32
    masters of bf16 parameters."""
    layers: int
    """The model's blocks this rank holds."""


def representative_ranks(strategy: StrategyConfig, world: int) -> list[int]:
    """One rank per pipeline stage: other ranks of a stage hold equal shares (padding aside)."""
    dims = resolve_dims(strategy, world)
    return [stage * (world // dims.pp) for stage in range(dims.pp)]


def rank_share(model_cfg: ModelConfig, strategy: StrategyConfig, world: int, rank: int) -> RankShare:
    """Build the sharded model as `rank` of `world` would, on a fake process group."""
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        with torch.device("meta"):
            model = build_model(model_cfg, seed=0)
        spec = model_spec(model, model_cfg)
        parallel = parallelize(model, spec, strategy, torch.device("cpu"), model_loss(model_cfg), layout_only=True)
        dims = parallel.dims
        optimizer = build_optimizer(parallel, TIMED_LR, 0.0)
        stored, _, optim = state_bytes(parallel.model, optimizer)
        held = stored
        if fsdp_wraps(strategy.name, dims) and keeps_gathered(strategy.name, strategy.reshard):
            # FSDP shards over dp_shard x cp (training/parallel/dims.py): a unit gathers from all of them.
            gathered = sum(p.to_local().numel() for p in parallel.model.parameters()) * gradient_ranks(strategy.name, dims)[1]
            held += gathered * COMPUTE_BYTES[strategy.precision]
        return RankShare(rank, dims.coordinates(rank), held, stored, optim, len(spec.live_blocks()))
    finally:
        dist.destroy_process_group()


def plan_layout(model_cfg: ModelConfig, strategy: StrategyConfig, world: int) -> list[RankShare]:
    return [rank_share(model_cfg, strategy, world, r) for r in representative_ranks(strategy, world)]


def format_layout(shares: list[RankShare], strategy: StrategyConfig, world: int) -> str:
    dims = resolve_dims(strategy, world)
    cp = f" x cp {dims.cp}" if dims.cp_enabled else ""
    lines = [
        f"dry run: strategy={strategy.name} world={world} = pp {dims.pp} x dp_replicate {dims.dp_replicate} x "
        f"dp_shard {dims.dp_shard}{cp} x tp {dims.tp} (fake process group, meta device)",
        f"{'rank':>6}  {'pp':>3}  {'blocks':>6}  {'params GiB':>11}  {'grads GiB':>10}  {'optim GiB':>10}  {'total GiB':>10}",
    ]
    for s in shares:
        total = s.param_bytes + s.grad_bytes + s.optim_bytes
        lines.append(f"{s.rank:>6}  {s.coordinates['pp']:>3}  {s.layers:>6}  {s.param_bytes / GIB:>11.4f}  "
                     f"{s.grad_bytes / GIB:>10.4f}  {s.optim_bytes / GIB:>10.4f}  {total / GIB:>10.4f}")
    if dims.cp_enabled:
        lines.append(f"cp {dims.cp}: each sequence split over {dims.cp} ranks (load-balanced chunks, K/V all-gathered "
                     "every layer); they hold the same parameters, their gradients reduced together")
    return "\n".join(lines)
