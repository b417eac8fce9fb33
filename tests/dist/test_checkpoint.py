"""Distributed checkpoints: a rank killed mid-run, a re-run resumes and ends as if uninterrupted."""

from __future__ import annotations

import pytest

from pipelines.launchers.base import StageFailed
from tests.dist.test_moe import MOE
from tests.dist.test_strategies import GPT, TOL, train_inputs
from tests.helpers import run_world
from training.config import ModelConfig, StrategyConfig

STEPS, EVERY, KILL = 10, 4, 6


def crash_then_resume(tmp_path, first: StrategyConfig, second: StrategyConfig, world: int = 2,
                      model: ModelConfig = GPT):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "killed"
    with pytest.raises(StageFailed, match="rank 1 was killed by SIGKILL"):
        inputs = (train_inputs(first, model, steps=STEPS, ckpt_every=EVERY), str(ckpt), str(marker), KILL)
        run_world("tests.dist.workers:train_crash_once", inputs, world=2)
    assert marker.exists() and (ckpt / "latest.json").exists()
    inputs = (train_inputs(second, model, steps=STEPS, ckpt_every=EVERY), str(ckpt), str(marker), KILL)
    return run_world("tests.dist.workers:train_crash_once", inputs, world=world)


def uninterrupted(tmp_path, strategy: StrategyConfig, model: ModelConfig = GPT):
    inputs = (train_inputs(strategy, model, steps=STEPS, ckpt_every=EVERY), str(tmp_path / "clean"))
    return run_world("tests.dist.workers:train_any", inputs, world=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_killed_run_resumes_from_its_checkpoint(tmp_path, name):
    strategy = StrategyConfig(name=name)
    resumed = crash_then_resume(tmp_path, strategy, strategy)
    clean = uninterrupted(tmp_path, strategy)
    assert resumed.resumed_from == EVERY
    assert len(resumed.losses) == STEPS and len(resumed.lrs) == STEPS
    assert resumed.losses == pytest.approx(clean.losses, **TOL)
    assert resumed.lrs == pytest.approx(clean.lrs)


@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_under_zero3(tmp_path):
    resumed = crash_then_resume(tmp_path, StrategyConfig(name="ddp"), StrategyConfig(name="zero3"))
    clean = uninterrupted(tmp_path, StrategyConfig(name="ddp"))
    assert resumed.resumed_from == EVERY and resumed.strategy == "zero3"
    assert resumed.losses == pytest.approx(clean.losses, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_a_checkpoint_from_two_ranks_resumes_on_four(tmp_path, name):
    """DCP reshards: the same global batch of 8 on 4 ranks goes on as the 2-rank run would have."""
    strategy = StrategyConfig(name=name)
    resumed = crash_then_resume(tmp_path, strategy, strategy, world=4)
    clean = uninterrupted(tmp_path, strategy)
    assert resumed.resumed_from == EVERY and resumed.world_size == 4 and resumed.micro_batch == 2
    assert resumed.losses == pytest.approx(clean.losses, **TOL)


@pytest.mark.slow
def test_zero1_optimizer_shards_say_why_they_cannot_move(tmp_path):
    with pytest.raises(StageFailed, match="zero1's optimizer shards reload only into zero1"):
        crash_then_resume(tmp_path, StrategyConfig(name="zero1"), StrategyConfig(name="ddp"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("first", "second", "world"),
    [(StrategyConfig(name="zero3", ep=2), StrategyConfig(name="zero3", ep=2), 2),
     (StrategyConfig(name="ddp", ep=2), StrategyConfig(name="zero3"), 2),
     (StrategyConfig(name="zero3", ep=2), StrategyConfig(name="zero3", ep=4), 4),
     (StrategyConfig(name="zero1", ep=2), StrategyConfig(name="zero1", ep=2), 2)],
    ids=["fsdp-ep2", "ddp-ep2-to-fsdp-ep1", "ep2-to-ep4-on-4", "zero1-ep2"],
)
def test_experts_split_over_ranks_resume_from_their_checkpoint(tmp_path, first, second, world):
    """Split experts are DTensors sharded along the experts: DCP writes each rank's experts under the
    whole model's names and reads back whatever split the re-run has (the same, none, or more ranks);
    under zero1 each rank's optimizer file holds its share of the rest and of its experts."""
    resumed = crash_then_resume(tmp_path, first, second, world=world, model=MOE)
    clean = uninterrupted(tmp_path, first, model=MOE)
    assert resumed.resumed_from == EVERY and resumed.ep == second.ep and resumed.world_size == world
    assert resumed.losses == pytest.approx(clean.losses, **TOL)
