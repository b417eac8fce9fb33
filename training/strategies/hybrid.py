"""Any layout pp x dp_replicate x dp_shard x tp the user or the advisor names: FSDP (HSDP with
replicas) when sharding, DDP when replicating, with TP and PP as the degrees say."""

from training.strategies.base import Strategy, register

HYBRID = register(Strategy(
    name="hybrid", summary="any pp x dp_replicate x dp_shard x tp (FSDP/HSDP, DDP, TP and PP composed)",
    degrees={"dp_replicate": 1, "dp_shard": -1, "tp": 1, "pp": 1}, wrapper=None, pure=False))
