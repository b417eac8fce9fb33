"""Tensor parallelism: the model's block linears split over the ranks (its TP plan, Megatron's
column/row pairs), two all-reduces per block in forward and two in backward."""

from training.strategies.base import Strategy, register

TP = register(Strategy(
    name="tp", summary="the block linears split over the ranks (Megatron-style tensor parallelism)",
    degrees={"dp_replicate": 1, "dp_shard": 1, "tp": -1, "pp": 1, "cp": 1}, wrapper=None, listed=4))
