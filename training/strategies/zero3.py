"""ZeRO-3: FSDP2 sharding parameters, gradients and optimizer state; parameters gathered per unit
for forward and again for backward."""

from training.strategies.base import Strategy, register

ZERO3 = register(Strategy(
    name="zero3", summary="FSDP2 sharding parameters, gradients and optimizer state (ZeRO-3)",
    degrees={"dp_replicate": 1, "dp_shard": -1, "tp": 1, "pp": 1, "cp": 1}, wrapper="fsdp",
    shards=frozenset({"optimizer", "gradients", "parameters"}), simplicity=3, one_device="zero3", listed=3))
