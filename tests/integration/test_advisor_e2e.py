"""The advisor end to end on CPU: strategy=auto trains the whole recommendation (degrees,
micro-batch, accumulation, precision, checkpointing), and plan.trials=2 measures the plan's two
best candidates on the workers and trains the faster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A fixed global batch: every candidate trains the same samples per step, only its layout differs.
AUTO = ["experiment=smoke", "strategy=auto", "nodes=2", "train.global_batch=8", "only=[plan,trials,train]"]
SETTING = ("micro_batch", "grad_accum", "precision", "activation_checkpointing")


def run(cwd: Path, *args: str) -> dict:
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((cwd / "run" / "summary.json").read_text())


def trained_as(train: dict, candidate: dict) -> None:
    dims = dict(zip(("dp_replicate", "dp_shard", "tp", "pp"), train["dims"], strict=True), cp=train["cp"], ep=train["ep"])
    assert dims == candidate["dims"]
    assert {k: train[k] for k in SETTING} == {k: candidate[k] for k in SETTING}
    assert train["strategy"] == candidate["strategy"] and train["strategy_from_plan"]


# A plan the defaults can't satisfy: at a 256-token sequence, data parallelism within 5 MB a device
# (the planner's limit only: no stage runs under a budget) fits micro-batch 2 only with full
# checkpointing and 1 only with selective (micro-batch 1 without it needs 5.4 MB), so accumulation too.
TIGHT = ["data.seq_len=256", "model.seq_len=256", "plan.strategies=[ddp]", "plan.device_memory_bytes=5000000",
         "plan.memory_fraction=1.0"]


@pytest.mark.slow
def test_auto_trains_the_whole_recommendation(tmp_path):
    summary = run(tmp_path, *AUTO, *TIGHT, "tracking=none", "hydra.run.dir=run")
    plan, train = summary["stages"]["plan"]["result"], summary["stages"]["train"]["result"]
    recommended = plan["recommended"]
    # Nothing here is a default, so training it shows each field went through.
    assert recommended["grad_accum"] > 1 and recommended["activation_checkpointing"] != "none", recommended
    assert recommended["micro_batch"] != 4 and recommended["dims"]["dp_replicate"] == 2
    assert summary["stages"]["trials"]["status"] == "skipped", "plan.trials=0 asks for no trials"
    trained_as(train, plan["recommended"])
    assert train["global_batch"] == 8 and summary["run"]["layout"] == "auto"
    # The run is held against the prediction for what it trained: the recommendation's.
    assert train["prediction"]["step_time_s"] == pytest.approx(plan["recommended"]["step_time_s"])


@pytest.mark.slow
def test_two_trials_measure_the_two_best_layouts_and_the_faster_trains(tmp_path):
    summary = run(tmp_path, *AUTO, "plan.trials=2", "plan.trial_steps=6", "hydra.run.dir=run")
    plan, trials = summary["stages"]["plan"]["result"], summary["stages"]["trials"]
    assert trials["status"] == "ran"
    measured = trials["result"]["trials"]
    # One trial per layout: the two best layouts, each at its best predicted setting.
    assert [t["candidate"]["command"] for t in measured] == [c["command"] for c in plan["layouts"]][:2]
    layouts = [(t["candidate"]["flavour"], tuple(sorted(t["candidate"]["dims"].items()))) for t in measured]
    assert len(set(layouts)) == 2
    best_of = {(c["flavour"], tuple(sorted(c["dims"].items()))): c for c in reversed(plan["candidates"]) if c["fits"]}
    assert all(best_of[layout]["command"] == t["candidate"]["command"]
               for layout, t in zip(layouts, measured, strict=True) if layout in best_of)
    assert all(t["error"] is None and t["tokens_per_s"] > 0 and t["step_time_s"] > 0 for t in measured)
    faster = max(measured, key=lambda t: t["tokens_per_s"])
    assert trials["result"]["chosen"]["command"] == faster["candidate"]["command"]
    train = summary["stages"]["train"]["result"]
    trained_as(train, faster["candidate"])
    assert train["prediction"]["step_time_s"] == pytest.approx(faster["candidate"]["step_time_s"])
    assert train["prediction"]["components"] == {k: faster["candidate"]["prediction"][k] for k in
                                                 ("compute_s", "exposed_comm_s", "bubble_s", "overhead_s",
                                                  "collective_calls", "seconds_per_sample", "threads")}
    assert trials["result"]["calibration"]["points"] == 2
    assert summary["run"]["layout"] == "auto, 2 trials"
    # Each trial is an MLflow run nested under the plan's, saying which one was chosen.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("scalestudy").experiment_id])
    plan_run = next(r for r in runs if r.data.tags.get("stage") == "plan" and r.data.tags["kind"] == "stage")
    nested = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == plan_run.info.run_id]
    assert sorted(r.data.params["command"] for r in nested) == sorted(t["candidate"]["command"] for t in measured)
    chosen = [r for r in nested if r.data.params["chosen"] == "True"]
    assert len(chosen) == 1 and chosen[0].data.metrics["trial/tokens_per_s"] == pytest.approx(faster["tokens_per_s"])
