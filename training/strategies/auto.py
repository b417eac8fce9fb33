"""The plan's recommendation: its whole layout and knobs (the measured best of plan.trials when
they ran) replace this placeholder in the train stage."""

from training.strategies.base import Strategy, register

AUTO = register(Strategy(
    name="auto", summary="whatever the plan recommends (strategy=auto trains its whole recommendation)",
    degrees={"dp_replicate": -1, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1}, wrapper=None, pure=False, from_plan=True,
    not_alone="the plan's recommendation: nothing of its own to measure", listed=7))
