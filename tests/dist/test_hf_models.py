"""Hugging Face models through the strategies, split by their own declarations: the presets
model=hf-llama and model=hf-qwen2 (composed from conf/), ddp, zero3 and tp at world 2 against one
process, step for step."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest

from stages.train import TrainInputs
from tests.dist.test_strategies import TOL
from tests.helpers import run_world
from training.config import StrategyConfig, TrainConfig

pytestmark = pytest.mark.slow
_RUNS: dict = {}


def run(compose_cfg, preset: str, strategy: str, world: int):
    key = (preset, strategy, world)
    if key not in _RUNS:
        cfg = compose_cfg(f"model={preset}", "data.num_samples=256", "data.seq_len=16", "tracking=none")
        train = TrainConfig(steps=6, global_batch=8, lr=1e-2, log_every=3, timing_warmup=2, warmup_steps=2,
                            schedule="constant", grad_clip=0.5)
        inputs = TrainInputs(train, cfg.model, cfg.data, dataclasses.replace(StrategyConfig(name=strategy)), seed=0)
        _RUNS[key] = run_world("tests.dist.workers:train_any", (inputs, tempfile.mkdtemp()), world=world, timeout_s=120)
    return _RUNS[key]


@pytest.mark.parametrize("preset", ["hf-llama", "hf-qwen2"])
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "tp"])
def test_a_hugging_face_model_at_world_2_matches_one_process(compose_cfg, preset, strategy):
    one = run(compose_cfg, preset, "ddp", 1)
    two = run(compose_cfg, preset, strategy, 2)
    assert two.world_size == 2 and two.strategy == strategy and two.ranks_in_sync
    assert two.losses == pytest.approx(one.losses, **TOL)
    assert one.losses[-1] < one.losses[0]
    if strategy == "tp":
        # Its own plan split q/k/v/o and the MLP: each rank holds half of those weights.
        assert two.param_bytes < 0.8 * one.param_bytes
