"""The built-in mixture-of-experts GPT (model=gpt-moe-tiny's layer, training/models/moe.py) on real
gloo ranks, its experts replicated or FSDP-sharded like any weight: the same losses as one process
at the same global batch, and the routed load per expert, summed over the ranks' tokens, what one
process routes. (Expert parallelism, the experts split over ranks, is not built yet.)"""

from __future__ import annotations

import dataclasses

import pytest

from tests.dist.test_strategies import GPT, TOL, run
from training.config import StrategyConfig

MOE = dataclasses.replace(GPT, kwargs={**GPT.kwargs, "n_experts": 4, "top_k": 2, "aux_loss_coef": 0.0})
"""gpt-tiny's test shape with 4 experts a block, 2 a token. The load-balancing loss is off: each rank
computes it on its own tokens (Megatron's per-micro-batch loss), so it would differ from one
process's at the same global batch by construction."""


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_a_moe_gpt_at_world_2_matches_one_process(name):
    one, two = run(StrategyConfig(name="ddp"), 1, MOE), run(StrategyConfig(name=name), 2, MOE)
    assert two.losses == pytest.approx(one.losses, **TOL)
    assert two.ranks_in_sync
    assert set(two.expert_load) == {"layers.0.feed_forward", "layers.1.feed_forward"}
    assert two.expert_load == one.expert_load, "each rank routes its half of the batch as one process does"
    tokens = 10 * 8 * 16  # steps x global batch x sequence
    assert all(sum(load) == 2 * tokens for load in two.expert_load.values()), "top 2: two slots a token"
    assert len(two.expert_imbalance) == 10 and all(x >= 1.0 for x in two.expert_imbalance)
    assert two.expert_imbalance == pytest.approx(one.expert_imbalance)
    names = {name for name, _, _ in two.metrics()}
    assert {"moe/imbalance", "moe/imbalance_mean", "moe/load/layers.0.feed_forward"} <= names
