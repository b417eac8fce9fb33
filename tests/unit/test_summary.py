"""The summary.json contract: what the runner writes reads back typed, old summaries read through
the fallback, a malformed one is one ValueError naming what is wrong, and docs/summary.md is current."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipelines.calibration import measured_step
from pipelines.configtools import to_jsonable
from pipelines.schema import StageSpec
from pipelines.summary import SUMMARY_VERSION, RunSummary, SkipReason, read_summaries, read_summary
from stages.lr_find import CurvePoint, LrFindResult
from tests.unit.test_engine import TOY, run_toy, toy_pipeline
from tests.unit.test_study_report import summary as study_summary
from tests.unit.toy_stages import Num

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def toy_cfg(compose_cfg):
    cfg = compose_cfg("tracking=none")
    # `side` is asked for only when plan.trials > 0: off here, so it is skipped by choice.
    pipeline = toy_pipeline(side=StageSpec(fn=f"{TOY}:side", needs=["source"], when="plan.trials"))
    return dataclasses.replace(cfg, pipeline=pipeline, plan=dataclasses.replace(cfg.plan, trials=0))


def written(summary) -> dict:
    return json.loads(summary.path.read_text())


def test_what_the_runner_writes_reads_back_into_the_results_it_returned(toy_cfg, tmp_path):
    summary, _ = run_toy(toy_cfg, tmp_path)
    data = written(summary)
    read = read_summary(data)
    assert read.version == SUMMARY_VERSION == data["version"]
    assert read.ok and read.run.seed == toy_cfg.seed and read.run.pipeline == "toy"
    for name, outcome in summary.stages.items():
        record = read.stages[name]
        assert (record.status, record.key, record.result) == (outcome.status, outcome.key, outcome.result), name
        assert record.fn == toy_cfg.pipeline.stages[name].fn
    assert isinstance(read.stages["sink"].result, Num)
    assert read.stages["side"].status == "skipped" and read.stages["side"].reason is SkipReason.NOT_ASKED
    assert read.stages["sink"].reason is None


def test_a_stage_left_out_by_only_is_recorded_as_not_selected(toy_cfg, tmp_path):
    summary, _ = run_toy(toy_cfg, tmp_path, only=["middle"])
    read = read_summary(written(summary))
    assert read.ok and read.stages["sink"].reason is SkipReason.NOT_SELECTED and read.stages["sink"].result is None


def test_a_summary_written_before_versions_reads_through_its_pipeline_file():
    finder = LrFindResult(1e-3, "steepest", "linear", 4, False, [CurvePoint(1e-4, 2.0, 2.0), CurvePoint(1e-3, 1.5, 1.8)])
    entry = {"seconds": 1.0, "key": "k", "error": None, "result": None}
    old = {  # version 1: no version, no stage functions, skips explained in words only, no run layout
        "run": {"study": None, "pipeline": "full", "strategy": "ddp", "nodes": 1, "procs_per_node": 1, "world_size": 1,
                "global_batch": 8, "model": "gpt-tiny", "data": "markov", "cluster": "cpu-local", "launcher": "local",
                "placement": None, "seed": 0, "finished_at": 1.0},
        "placement": None, "launcher": {}, "mlflow_run_id": "abc", "ok": True, "run_dir": "/old/run",
        "stages": {"lr_find": {**entry, "status": "ran", "result": to_jsonable(finder)},
                   "trials": {**entry, "status": "skipped", "error": "not asked for (plan.trials=0)"},
                   "train": {**entry, "status": "skipped", "error": "not selected by only=[...]"}},
    }
    read = read_summary(old)
    assert read.version == 1 and read.run.layout == ""
    assert read.stages["lr_find"].fn == "stages.lr_find:run" and read.result(LrFindResult) == finder
    assert read.stages["trials"].reason is SkipReason.NOT_ASKED
    assert read.stages["train"].reason is SkipReason.NOT_SELECTED

    with pytest.raises(ValueError, match=r"run.pipeline='mine' names no file"):
        read_summary({**old, "run": {**old["run"], "pipeline": "mine"}})


def test_a_version_2_summary_reads_with_no_peak_memory(toy_cfg, tmp_path):
    data = written(run_toy(toy_cfg, tmp_path)[0])
    assert all("peak_memory_bytes" in s for s in data["stages"].values())
    for stage in data["stages"].values():
        del stage["peak_memory_bytes"]
    read = read_summary({**data, "version": 2})
    assert read.version == 2 and all(s.peak_memory_bytes is None for s in read.stages.values())


def toy_summary(toy_cfg, tmp_path) -> dict:
    summary, _ = run_toy(toy_cfg, tmp_path)
    return written(summary)


def malformed(data: dict, change: str) -> dict:
    data = json.loads(json.dumps(data))
    sink = data["stages"]["sink"]
    if change == "newer":
        data["version"] = SUMMARY_VERSION + 1
    elif change == "no ok":
        del data["ok"]
    elif change == "run lacks seed":
        del data["run"]["seed"]
    elif change == "bad status":
        sink["status"] = "done"
    elif change == "bad reason":
        sink["reason"] = "bored"
    elif change == "result key":
        sink["result"]["bogus"] = 1
    elif change == "result lacks":
        sink["result"] = {}
    elif change == "fn":
        sink["fn"] = "no.such.module:run"
    return data


@pytest.mark.parametrize(("change", "expected"), [
    ("newer", f"version={SUMMARY_VERSION + 1}: this scalestudy reads versions 1 to {SUMMARY_VERSION}"),
    ("no ok", "lacks ok"),
    ("run lacks seed", "run lacks seed"),
    ("bad status", "stages.sink.status='done': must be one of ran, cached, failed, skipped"),
    ("bad reason", "stages.sink.reason='bored': must be one of not_selected, not_asked"),
    ("result key", "stages.sink.result holds unknown keys bogus; known: value"),
    ("result lacks", "stages.sink.result lacks value"),
    ("fn", "stage function 'no.such.module:run' cannot be imported"),
])
def test_a_malformed_summary_is_one_value_error_naming_what_is_wrong(toy_cfg, tmp_path, change, expected):
    data = toy_summary(toy_cfg, tmp_path)
    with pytest.raises(ValueError) as info:
        read_summary(malformed(data, change))
    message = str(info.value)
    assert message.startswith(f"summary.json of {data['run_dir']} cannot be read: ") and expected in message
    assert "\n" not in message


def test_a_summary_that_is_no_mapping_is_a_value_error():
    with pytest.raises(ValueError, match="summary.json cannot be read: it holds a list, not a mapping"):
        read_summary([])


def test_unreadable_summaries_are_left_out_and_named(toy_cfg, tmp_path, capsys):
    data = toy_summary(toy_cfg, tmp_path)
    read = read_summaries([data, malformed(data, "bad status")])
    assert len(read) == 1 and isinstance(read[0], RunSummary)
    assert "warning: summary.json of" in capsys.readouterr().err


def test_calibration_reads_the_trained_step_and_its_plans_components():
    step = measured_step(read_summary(study_summary("zero3", 2, 1.0)))
    assert (step.strategy, step.devices, step.measured_step_s) == ("zero3", 2, 0.1)
    assert step.predicted.compute_s == 0.1
    assert measured_step(read_summary(study_summary("zero3", 2, 1.0, ok=False))) is None


def test_docs_summary_md_is_generated_from_the_dataclasses():
    import importlib.util

    spec = importlib.util.spec_from_file_location("summary_docs", ROOT / "scripts" / "summary_docs.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert (ROOT / "docs" / "summary.md").read_text() == generator.markdown(), (
        "docs/summary.md is stale: regenerate it with `.venv/bin/python scripts/summary_docs.py > docs/summary.md`")
