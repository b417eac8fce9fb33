"""Production layouts planned on one CPU: a fake process group and the meta device (no processes)."""

from __future__ import annotations

import pytest

from training.config import ModelConfig, StrategyConfig
from training.parallel.dryrun import plan_layout

SMALL = ModelConfig(name="gpt-small", kwargs=dict(vocab_size=50304, seq_len=1024, d_model=768, n_layers=12, n_heads=12))
FULL_PARAM_BYTES = plan_layout(SMALL, StrategyConfig(name="ddp"), 1)[0].param_bytes


def test_ddp_holds_everything_and_zero1_shards_only_the_optimizer():
    ddp = plan_layout(SMALL, StrategyConfig(name="ddp"), 8)[0]
    zero1 = plan_layout(SMALL, StrategyConfig(name="zero1"), 8)[0]
    assert ddp.param_bytes == ddp.grad_bytes == FULL_PARAM_BYTES and ddp.optim_bytes == 2 * FULL_PARAM_BYTES
    assert zero1.param_bytes == FULL_PARAM_BYTES and zero1.optim_bytes == pytest.approx(2 * FULL_PARAM_BYTES / 8, rel=0.01)


def test_zero3_on_32_ranks_holds_a_32nd_of_everything():
    (share,) = plan_layout(SMALL, StrategyConfig(name="zero3"), 32)
    assert share.param_bytes == pytest.approx(FULL_PARAM_BYTES / 32, rel=0.01)
    assert share.grad_bytes == share.param_bytes and share.optim_bytes == 2 * share.param_bytes


def test_zero2_keeps_full_parameters_through_backward():
    (share,) = plan_layout(SMALL, StrategyConfig(name="zero2"), 8)
    assert share.param_bytes == pytest.approx(FULL_PARAM_BYTES, rel=0.01)
    assert share.grad_bytes == pytest.approx(FULL_PARAM_BYTES / 8, rel=0.01)


def test_8_rank_3d_layout_has_one_share_per_pipeline_stage():
    shares = plan_layout(SMALL, StrategyConfig(name="hybrid", dp_shard=2, tp=2, pp=2), 8)
    assert [s.rank for s in shares] == [0, 4]
    assert [s.coordinates["pp"] for s in shares] == [0, 1] and [s.layers for s in shares] == [6, 6]
    # Each stage holds about half the model, split 2 ways by TP (block linears) and 2 by FSDP.
    assert sum(s.param_bytes for s in shares) < FULL_PARAM_BYTES / 2


def test_64_rank_hsdp_with_tp():
    (share,) = plan_layout(SMALL, StrategyConfig(name="hybrid", dp_replicate=2, dp_shard=8, tp=4), 64)
    assert share.coordinates == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 0, "dp": 0}
    assert FULL_PARAM_BYTES / 32 < share.param_bytes < FULL_PARAM_BYTES / 8


def test_impossible_degrees_name_both_numbers():
    with pytest.raises(ValueError, match="= 12, but the world size is 8"):
        plan_layout(SMALL, StrategyConfig(name="hybrid", dp_shard=3, tp=4), 8)
