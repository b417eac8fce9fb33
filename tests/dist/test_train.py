"""DDP training on real gloo ranks: the loss falls, replicas agree, and world 2 = world 1."""

from __future__ import annotations

import pytest

from stages.train import TrainInputs
from tests.helpers import run_world
from training.config import DataConfig, ModelConfig, StrategyConfig, TrainConfig

MODEL = ModelConfig(kwargs=dict(vocab_size=256, d_model=32, n_layers=1, n_heads=2, seq_len=16))
DATA = DataConfig(kwargs=dict(num_samples=256, seq_len=16, vocab_size=256))


def inputs(micro_batch: int, steps: int = 12, grad_accum: int = 1) -> TrainInputs:
    train = TrainConfig(steps=steps, micro_batch=micro_batch, grad_accum=grad_accum, lr=1e-2, log_every=4,
                        timing_warmup=2, warmup_steps=2, schedule="constant")
    return TrainInputs(train=train, model=MODEL, data=DATA, strategy=StrategyConfig(), seed=0)


@pytest.fixture(scope="module")
def world2():
    return run_world("tests.dist.workers:train_ddp", inputs(micro_batch=4), world=2)


def test_ddp_lowers_the_loss_and_keeps_replicas_identical(world2):
    assert world2.world_size == 2 and world2.global_batch == 8
    assert len(world2.losses) == 12
    assert world2.final_loss < world2.losses[0] - 0.2
    assert world2.ranks_in_sync
    assert world2.samples_per_s > 0 and world2.param_bytes > 0
    # The step the plan is held against is the window's mean, the same window as samples/s.
    assert world2.step_time_s == pytest.approx(world2.global_batch / world2.samples_per_s, rel=1e-9)
    # AdamW holds two fp32 moments per parameter (its scalar step counters aside), made with it.
    assert world2.optim_bytes == 2 * world2.param_bytes


def test_world2_matches_one_process_with_the_same_global_batch(world2):
    single = run_world("tests.dist.workers:train_ddp", inputs(micro_batch=8), world=1)
    assert single.global_batch == world2.global_batch
    assert single.losses == pytest.approx(world2.losses, rel=1e-5, abs=1e-5)


def test_accumulation_matches_the_larger_micro_batch():
    accumulated = run_world("tests.dist.workers:train_ddp", inputs(micro_batch=2, steps=6, grad_accum=2), world=2)
    plain = run_world("tests.dist.workers:train_ddp", inputs(micro_batch=4, steps=6), world=2)
    assert accumulated.losses == pytest.approx(plain.losses, rel=1e-5, abs=1e-5)


def test_each_node_reports_its_system_metrics_under_its_own_id(world2):
    from training.sysmetrics import sample_metrics

    nodes = sorted({s.node for s in world2.system})
    assert len(nodes) == 2 and nodes[0].endswith("-node0") and nodes[1].endswith("-node1")
    for node in nodes:
        samples = [s for s in world2.system if s.node == node]
        assert len(samples) >= 1, "a sample at the end even of a run shorter than the interval"
        assert [s.t_s for s in samples] == sorted(s.t_s for s in samples) and samples[-1].t_s > 0
        assert all(0 <= s.cpu_utilization_percentage <= 100 * 64 for s in samples)
        assert all(0 < s.system_memory_usage_percentage < 100 for s in samples)
    keys = {k for k, _, _ in sample_metrics(world2.system)}
    assert f"system/{nodes[1]}/cpu_utilization_percentage" in keys
    assert f"system/{nodes[0]}/system_memory_usage_megabytes" in keys
