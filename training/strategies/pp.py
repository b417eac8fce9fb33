"""Pipeline parallelism: the model's blocks in consecutive stages, microbatches flowing through
(GPipe or 1F1B)."""

from training.strategies.base import Strategy, register

PP = register(Strategy(
    name="pp", summary="the blocks in consecutive stages, microbatches flowing through (GPipe or 1F1B)",
    degrees={"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": -1, "cp": 1}, wrapper=None,
    not_alone="a pipeline needs two stages: not measurable on one rank", listed=5))
