"""Data parallelism: every rank a full replica; gradients all-reduced in buckets (DDP)."""

from training.strategies.base import Strategy, register

DDP = register(Strategy(
    name="ddp", summary="every rank a full replica; gradients all-reduced in buckets (DDP)",
    degrees={"dp_replicate": -1, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1}, wrapper="ddp", simplicity=0, one_device="ddp", listed=0))
