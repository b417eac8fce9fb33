"""ZeRO-2: FSDP2 keeping gathered parameters from forward to backward; gradients and optimizer state
sharded."""

from training.strategies.base import Strategy, register

ZERO2 = register(Strategy(
    name="zero2", summary="FSDP2 sharding gradients and optimizer state, parameters kept through backward (ZeRO-2)",
    degrees={"dp_replicate": 1, "dp_shard": -1, "tp": 1, "pp": 1, "cp": 1}, wrapper="fsdp",
    shards=frozenset({"optimizer", "gradients"}), reshard_after_forward=False, simplicity=2, one_device="zero2", listed=2))
