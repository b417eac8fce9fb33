"""The LR answer end to end: with train.lr unset, the train stage trains at lr_find's suggestion
carried by lr_find.lr_scaling from the finder's batch to the run's effective global batch
(micro-batch x accumulation x data-parallel size) — and its 1-device baseline at its own batch.
The expected factors are written out by hand here, not computed by the code under test."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# World 2, a fixed global batch of 16 with 2 accumulation steps: micro-batch 4 per rank, which is
# also the finder's batch (lr_find.batch unset). The 1-device baseline keeps the global batch
# (micro-batch 8 x 2): the same LR.
RUN = ["experiment=smoke", "nodes=2", "train.global_batch=16", "train.grad_accum=2", "tracking=none",
       "only=[lr_find,plan,train]"]
FACTORS = {"linear": 16 / 4, "sqrt": math.sqrt(16 / 4), "none": 1.0}


@pytest.mark.slow
@pytest.mark.parametrize("rule", list(FACTORS))
def test_train_uses_the_finders_lr_scaled_to_its_global_batch(tmp_path, rule):
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), *RUN, f"lr_find.lr_scaling={rule}",
                             "hydra.run.dir=run"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stages = json.loads((tmp_path / "run" / "summary.json").read_text())["stages"]
    found, train = stages["lr_find"]["result"], stages["train"]["result"]
    suggested = found["suggested_lr"]
    assert 1e-5 <= suggested <= 0.1, "inside the range the finder swept (lr_find.min_lr, smoke's max_lr)"
    assert found["finder_batch"] == 4 and found["lr_scaling"] == rule
    assert (train["global_batch"], train["micro_batch"], train["grad_accum"]) == (16, 4, 2)
    scaled = suggested * FACTORS[rule]
    assert train["lr"] == pytest.approx(scaled, rel=1e-9)
    assert train["lr_source"].startswith(f"lr_find ({rule} rule, batch 4 -> 16)")
    # What the optimizer was given: the schedule peaks at the scaled LR (after warm-up).
    assert max(train["lrs"]) == pytest.approx(scaled, rel=1e-6)
    key = stages["train"]["baseline"]["key"]
    baseline = json.loads((tmp_path / "outputs/cache/train-baseline" / key / "entry.json").read_text())["result"]
    assert (baseline["world_size"], baseline["global_batch"], baseline["micro_batch"]) == (1, 16, 8)
    assert baseline["lr"] == pytest.approx(scaled, rel=1e-9)
