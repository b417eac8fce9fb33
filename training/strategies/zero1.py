"""ZeRO-1: DDP's all-reduced gradients, each rank updating its shard of the optimizer state
(ZeroRedundancyOptimizer), which then all-gathers the updated parameters."""

from training.strategies.base import Strategy, register

ZERO1 = register(Strategy(
    name="zero1", summary="DDP with the optimizer state sharded (ZeRO-1, ZeroRedundancyOptimizer)",
    degrees={"dp_replicate": -1, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1}, wrapper="ddp", shards=frozenset({"optimizer"}),
    simplicity=1, listed=1))
