"""A mixture of experts end to end on CPU: experts split over the two halves of each sequence
(cp=2 x ep=2 at world 2) trained from run.py, held against the plan's prediction for that layout,
and the plan's note on the experts' GEMMs timed at each degree; run again, everything is cached and
the driver never imports torch (what a stage's result holds must be readable without it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.test_advisor_e2e import ROOT, run

CP_EP = ["experiment=smoke", "model=gpt-moe-tiny", "strategy=hybrid", "strategy.cp=2", "strategy.ep=2", "nodes=2",
         "only=[plan,train]", "tracking=none", "hydra.run.dir=run"]


@pytest.mark.slow
def test_experts_split_over_context_parallel_ranks_train_and_are_predicted_as_trained(tmp_path):
    summary = run(tmp_path, *CP_EP, f"cache_dir={tmp_path / 'cache'}")
    plan, train = summary["stages"]["plan"]["result"], summary["stages"]["train"]["result"]
    assert (train["cp"], train["ep"]) == (2, 2)
    requested = plan["requested"]
    assert requested["dims"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1, "ep": 2}
    # hybrid shards over dp_shard x cp as the trainer does (FSDP, resharding): charged as zero3.
    assert requested["flavour"] == "zero3"
    assert train["prediction"]["step_time_s"] == pytest.approx(requested["step_time_s"])
    # The dispatch's host work, measured on one rank, is in the overhead of the layout that splits the experts.
    dispatch = plan["rulers"]["strategy_overhead_s"]["ep"]
    assert dispatch > 0 and train["prediction"]["components"]["overhead_s"] >= dispatch
    assert any("ep's dispatch (its experts split on one rank) +" in r for r in plan["reasons"])
    # The experts' GEMMs timed at ep=1 and 2: micro-batch 4 of 32 tokens, 2 of 4 experts a token.
    gemms = plan["rulers"]["expert_gemms"]
    assert (gemms["degrees"], gemms["rows"], gemms["hidden"], gemms["width"]) == ([1, 2], [64, 128], 64, 512)
    assert any(r.startswith("experts' GEMMs: each expert on its routed rows") for r in plan["reasons"])

    # The same invocation again: every stage cached, and the driver imported neither torch nor MLflow.
    probe = tmp_path / "imported.txt"
    code = (f"import atexit, runpy, sys; sys.path.insert(0, {str(ROOT)!r}); "
            f"atexit.register(lambda: open({str(probe)!r}, 'w').write(str(sorted({{'torch', 'mlflow'}} & set(sys.modules))))); "
            f"sys.argv = [{str(ROOT / 'run.py')!r}] + sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    again = subprocess.run([sys.executable, "-c", code, *CP_EP[:-1], "hydra.run.dir=again", f"cache_dir={tmp_path / 'cache'}"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    cached = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert {cached["stages"][name]["status"] for name in ("plan", "train")} == {"cached"}
    assert probe.read_text() == "[]", "the cached re-run's driver imported torch or MLflow"
