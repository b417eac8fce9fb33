"""The built-in mixture-of-experts GPT (model=gpt-moe-tiny's layer, training/models/moe.py) on real
gloo ranks, its experts replicated or FSDP-sharded like any weight: the same losses as one process
at the same global batch, and the routed load per expert, summed over the ranks' tokens, what one
process routes; and with the experts split over ranks (strategy.ep), the same again."""

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


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_experts_split_over_2_ranks_match_one_process(name):
    """strategy.ep=2 at world 2: each rank holds 2 of the 4 experts of every layer, tokens sent to
    them and back by all-to-all; under DDP their gradients are left out of DDP's buckets, under FSDP
    sharded over their own (one-rank) replica mesh, both divided by the 2 data-parallel ranks."""
    one, two = run(StrategyConfig(name="ddp"), 1, MOE), run(StrategyConfig(name=name, ep=2), 2, MOE)
    assert two.ep == 2
    assert two.losses == pytest.approx(one.losses, **TOL)
    assert two.ranks_in_sync, "ranks holding the same experts end equal"
    assert two.expert_load == one.expert_load
    assert two.param_bytes < one.param_bytes, "each rank holds half of the experts"


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [StrategyConfig(name="ddp", ep=2), StrategyConfig(name="zero3", ep=2), StrategyConfig(name="zero3", ep=4),
     StrategyConfig(name="hybrid", dp_shard=2, pp=2, ep=2, microbatches=2)],
    ids=["ddp4-ep2", "fsdp4-ep2", "fsdp4-ep4", "pp2xfsdp2-ep2"],
)
def test_experts_split_on_four_ranks_match_one_process(strategy):
    """At world 4: two expert groups of 2 whose replicas reduce the experts' gradients (DDP: by hand;
    FSDP: sharded over the 2 replicas), one group of 4, and a pipeline of 2 stages, each with its own
    expert groups (its first step's loads not counted: torch also runs its shape inference through
    the experts then)."""
    one, four = run(StrategyConfig(name="ddp"), 1, MOE), run(strategy, 4, MOE)
    assert four.ep == strategy.ep
    assert four.losses == pytest.approx(one.losses, **TOL)
    assert four.ranks_in_sync
    skipped = four.expert_first_step - 1
    assert skipped == (1 if strategy.pp else 0)
    assert four.expert_imbalance == pytest.approx(one.expert_imbalance[skipped:])
    if not skipped:
        assert four.expert_load == one.expert_load
