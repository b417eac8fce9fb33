"""Any layout pp x dp_replicate x dp_shard x cp x tp the user or the advisor names: FSDP (HSDP with
replicas) when sharding, DDP when replicating, with CP, TP and PP as the degrees say (FSDP shards
over dp_shard x cp when cp > 1, as torchtitan does)."""

from training.strategies.base import Strategy, register

HYBRID = register(Strategy(
    name="hybrid", summary="any pp x dp_replicate x dp_shard x cp x tp (FSDP/HSDP, DDP, CP, TP and PP composed)",
    degrees={"dp_replicate": 1, "dp_shard": -1, "tp": 1, "pp": 1, "cp": 1}, wrapper=None, pure=False,
    any_layout=True, listed=6))
