"""A model larger than one device, end to end on CPU under a per-rank budget: the whole DAG runs
sharded (nobody holds the whole model), a layout that cannot hold it is refused before any rank
starts, and the sharded run trains what one process trains."""

from __future__ import annotations

import json

import pytest

from pipelines.summary import read_summary
from tests.helpers import asked_statuses
from tests.integration.test_run_e2e import SMOKE, run_cli
from training.units import GIB

BIG = [*SMOKE, "model=gpt-small", "model.vocab_size=2048", "model.d_model=256", "model.n_layers=8",
       "model.n_heads=4", "train.lr=0.001", "tracking=none"]
"""7.6 M parameters (blocks outweigh embeddings and head, as in large models): 116 MiB of fp32
parameters, gradients and AdamW moments on one device, and smoke's 32-token samples."""
BUDGET = 0.095
"""97 MiB a rank: below the model's states, above zero3's share of them over 2 ranks."""
FP32_ADAM_BYTES = 4 + 4 + 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("big")
    budget = f"cluster.device_memory_gib={BUDGET}"
    refused = run_cli(cwd, *BIG, "strategy=ddp", "nodes=4", budget, "hydra.run.dir=runs/refused")
    sharded = run_cli(cwd, *BIG, "strategy=zero3", "nodes=4", budget, "hydra.run.dir=runs/sharded", timeout=600)
    # One process at the same global batch (16 = 4 ranks x 4), without a budget: the reference.
    one = run_cli(cwd, *BIG, "strategy=ddp", "nodes=1", "train.global_batch=16", "only=[train]",
                  "cache_dir=one-cache", "hydra.run.dir=runs/one")
    return cwd, refused, sharded, one


def summary(cwd, name):
    return read_summary(json.loads((cwd / "runs" / name / "summary.json").read_text()))


@pytest.mark.slow
def test_a_layout_that_cannot_hold_the_model_is_refused_before_any_rank_starts(runs):
    cwd, refused, _, _ = runs
    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in refused.stderr
    assert lines[0].startswith("error: strategy='ddp': each of the 4 ranks needs ")
    assert f"> cluster.device_memory_gib={BUDGET:g}, the memory ruler; shard the model: strategy=zero3" in lines[0]
    assert not (cwd / "runs" / "refused").exists(), "nothing launched or written"


@pytest.mark.slow
def test_every_stage_of_a_model_larger_than_one_device_runs_sharded_within_the_budget(runs):
    cwd, _, sharded, _ = runs
    assert sharded.returncode == 0, sharded.stdout + sharded.stderr
    result = summary(cwd, "sharded")
    raw = json.loads((cwd / "runs" / "sharded" / "summary.json").read_text())
    assert set(asked_statuses(raw).values()) == {"ran"}
    plan = result.stages["plan"].result
    # The whole model's states on one device exceed the budget: a rank within it never held them.
    assert plan.anatomy.shape.params * FP32_ADAM_BYTES > BUDGET * GIB
    for name in ("env", "bandwidth", "lr_find", "plan", "train"):
        assert 0 < result.stages[name].peak_memory_bytes <= BUDGET * GIB, name
    assert 0 < raw["stages"]["train"]["baseline"]["peak_memory_bytes"] <= BUDGET * GIB
    # lr_find and train's baseline on the smallest world that holds the model; plan on a slice.
    lr_find = result.stages["lr_find"].result
    assert lr_find.world_size == 2 and "on zero3 over 2 ranks" in lr_find.headline()
    assert "lr_find: 2 ranks (the smallest layout that holds the model)" in sharded.stdout
    assert 1 <= plan.rulers.sliced_blocks < plan.anatomy.shape.layers
    assert any(f"timed a slice of its first {plan.rulers.sliced_blocks} of 8 blocks" in r for r in plan.reasons)
    train = result.stages["train"].result
    assert train.world_size == 4 and train.baseline_world_size == 2
    assert "against zero3 x2 (the smallest world that holds the model)" in train.headline()
    assert f"(timed on a slice of {plan.rulers.sliced_blocks} of 8 blocks" in plan.headline()
    assert train.scaling_efficiency == pytest.approx((train.samples_per_s / 4) / (train.baseline_samples_per_s / 2))
    # The memory ruler held against the highest rank's tracked peak.
    assert abs(train.prediction.memory_error_pct) < 10


@pytest.mark.slow
def test_the_sharded_run_trains_what_one_process_trains(runs):
    cwd, _, sharded, one = runs
    assert sharded.returncode == 0 and one.returncode == 0, one.stdout + one.stderr
    big, alone = summary(cwd, "sharded").stages["train"].result, summary(cwd, "one").stages["train"].result
    assert big.global_batch == alone.global_batch == 16
    assert big.losses == pytest.approx(alone.losses, rel=1e-5)
