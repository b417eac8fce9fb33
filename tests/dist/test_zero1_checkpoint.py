"""zero1 at world 2, killed mid-run: the re-run reloads each rank's optimizer shard (its own file,
onto its own device) and ends as the uninterrupted run does."""

from __future__ import annotations

import pytest

from tests.dist.test_checkpoint import EVERY, STEPS, crash_then_resume, uninterrupted
from tests.dist.test_strategies import TOL
from training.config import StrategyConfig


@pytest.mark.slow
def test_a_killed_zero1_run_resumes_from_its_optimizer_shards(tmp_path):
    strategy = StrategyConfig(name="zero1")
    resumed = crash_then_resume(tmp_path, strategy, strategy)
    clean = uninterrupted(tmp_path, strategy)
    assert resumed.resumed_from == EVERY and resumed.strategy == "zero1"
    assert len(resumed.losses) == STEPS
    assert resumed.losses == pytest.approx(clean.losses, **TOL)
