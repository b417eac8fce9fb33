"""Selective activation checkpointing (strategy.activation_checkpointing=selective) on real gloo
ranks: the same loss curve as one process under ddp and zero3."""

from __future__ import annotations

import pytest

from tests.dist.test_strategies import MLP, TOL, reference, run
from training.config import StrategyConfig


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_selective_checkpointing_at_world_2_matches_one_process(name):
    result = run(StrategyConfig(name=name, activation_checkpointing="selective"), 2)
    assert result.losses == pytest.approx(reference().losses, **TOL)
    assert result.ranks_in_sync


def test_selective_checkpointing_saves_less_than_none_and_more_than_full_in_the_trainer():
    """The train stage's own measurement of what its step saved (StepProbe), ddp at world 2."""
    saved = {mode: run(StrategyConfig(name="ddp", activation_checkpointing=mode), 2).activation_bytes
             for mode in ("none", "selective", "full")}
    assert saved["full"] < saved["selective"] < saved["none"], saved


def test_selective_checkpointing_of_a_model_without_attention_matches_one_process():
    """The MLP: only matmuls are kept, its activations recomputed."""
    result = run(StrategyConfig(name="ddp", activation_checkpointing="selective"), 2, MLP)
    assert result.losses == pytest.approx(reference(MLP).losses, **TOL)
