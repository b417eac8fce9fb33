"""`python run.py cluster.device_memory_gib=...` end to end on CPU: each stage's peak device memory
(the highest of its ranks) lands in summary.json, a cached stage keeps the peak of the run that
measured it, and a budget below what a stage needs fails it with one line and exit code 1."""

from __future__ import annotations

import json
import re

import pytest

from pipelines.summary import read_summary
from tests.integration.test_run_e2e import SMOKE, run_cli
from training.units import GIB

ONLY = [*SMOKE, "tracking=none", "only=[lr_find]"]
"""env on 2 ranks, then lr_find on one device: a world stage and a one-device stage, in seconds."""
TIGHT = 0.002
"""2 MiB: env's gathered facts fit, lr_find's model, its AdamW state and activations do not."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("budget")
    roomy = run_cli(cwd, *ONLY, "cluster.device_memory_gib=1", "hydra.run.dir=runs/roomy")
    again = run_cli(cwd, *ONLY, "cluster.device_memory_gib=1", "hydra.run.dir=runs/again")
    tight = run_cli(cwd, *ONLY, f"cluster.device_memory_gib={TIGHT}", "hydra.run.dir=runs/tight")
    return cwd, roomy, again, tight


def summary(cwd, name):
    return read_summary(json.loads((cwd / "runs" / name / "summary.json").read_text()))


@pytest.mark.slow
def test_each_stage_records_its_peak_and_a_cached_one_keeps_it(runs):
    cwd, roomy, again, _ = runs
    assert roomy.returncode == 0 and again.returncode == 0, roomy.stdout + roomy.stderr + again.stderr
    first, second = summary(cwd, "roomy"), summary(cwd, "again")
    for name in ("env", "lr_find"):
        assert first.stages[name].status == "ran"
        assert 0 < first.stages[name].peak_memory_bytes < GIB
        assert second.stages[name].status == "cached"
        assert second.stages[name].peak_memory_bytes == first.stages[name].peak_memory_bytes
    # lr_find holds a model, its AdamW state and activations; env only the facts it gathers.
    assert first.stages["lr_find"].peak_memory_bytes > 10 * first.stages["env"].peak_memory_bytes
    assert first.stages["plan"].peak_memory_bytes is None, "skipped: not measured"


@pytest.mark.slow
def test_a_budget_below_what_a_stage_needs_fails_it_with_one_line(runs):
    cwd, _, _, tight = runs
    assert tight.returncode == 1, tight.stdout + tight.stderr
    assert "Traceback" not in tight.stdout + tight.stderr
    failed = [line for line in tight.stdout.splitlines() if "device memory budget exceeded" in line]
    assert failed[0].startswith("[3/7] lr_find: failed in ")
    # No layout holds lr_find's model in 2 MiB a rank: it runs sharded over every rank (its `fits`),
    # and whichever rank crosses the budget first fails it.
    assert re.search(r"rank (\d): device memory budget exceeded: ", failed[0])
    assert f"(cluster.device_memory_gib={TIGHT:g})" in failed[0]
    result = summary(cwd, "tight")
    assert not result.ok and result.stages["env"].status == "ran"
    lr_find = result.stages["lr_find"]
    assert lr_find.status == "failed" and re.match(r"rank (\d) failed: DeviceOutOfMemory: rank \1: ", lr_find.error)
    assert 0 < lr_find.peak_memory_bytes <= TIGHT * GIB, "the peak of what fitted, recorded for the failure"
