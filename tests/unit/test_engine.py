"""The DAG checks and the cache: which stages re-run after which change. No processes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from common.errors import ConfigError
from pipelines.dag import build
from pipelines.launchers.local import LocalLauncher
from pipelines.runner import Runner
from pipelines.schema import LauncherConfig, PipelineConfig, StageSpec
from pipelines.tracking import NullTracker

TOY = "tests.unit.toy_stages"


def toy_pipeline(**changes: StageSpec) -> PipelineConfig:
    stages = {
        "source": StageSpec(fn=f"{TOY}:source"),
        "middle": StageSpec(fn=f"{TOY}:middle", needs=["source"]),
        "sink": StageSpec(fn=f"{TOY}:sink", needs=["middle"]),
        "side": StageSpec(fn=f"{TOY}:side", needs=["source"]),
    }
    stages.update(changes)
    return PipelineConfig(name="toy", stages=stages)


def run_toy(cfg, tmp_path, **overrides):
    cfg = dataclasses.replace(cfg, cache_dir=str(tmp_path / "cache"), **overrides)
    run_dir = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    run_dir.mkdir()
    runner = Runner(cfg, run_dir, NullTracker(), LocalLauncher(LauncherConfig()), echo=lambda *_: None)
    summary = runner.run()
    statuses = {name: o.status for name, o in summary.stages.items()}
    return summary, statuses


@pytest.fixture
def toy_cfg(compose_cfg):
    return dataclasses.replace(compose_cfg("tracking=none"), pipeline=toy_pipeline())


def test_dag_orders_by_needs():
    dag = build(toy_pipeline())
    assert dag.order.index("source") < dag.order.index("middle") < dag.order.index("sink")
    assert dag.closure(["sink"]) == ["source", "middle", "sink"]
    assert dag.downstream("middle") == ["sink"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"middle": StageSpec(fn=f"{TOY}:middle", needs=["nowhere"])}, "pipeline.stages.middle.needs='nowhere': is not a stage"),
        ({"source": StageSpec(fn=f"{TOY}:source", after=["sink"])}, "forms a cycle"),
        ({"side": StageSpec(fn=f"{TOY}:wrong_needs", needs=["source"])}, "takes (other); declare needs: [other]"),
        ({"side": StageSpec(fn=f"{TOY}:untyped", needs=["source"])}, "must be annotated with a dataclass"),
        ({"side": StageSpec(fn=f"{TOY}:missing", needs=["source"])}, "cannot be imported"),
        ({"side": StageSpec(fn="no.such.module:run")}, "cannot be imported"),
    ],
)
def test_bad_dag_is_one_line_naming_the_stage(change, expected):
    with pytest.raises(ConfigError) as info:
        build(toy_pipeline(**change))
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_second_run_is_all_cached(toy_cfg, tmp_path):
    first, statuses = run_toy(toy_cfg, tmp_path)
    assert set(statuses.values()) == {"ran"}
    second, statuses = run_toy(toy_cfg, tmp_path)
    assert set(statuses.values()) == {"cached"}
    assert second.stages["sink"].result == first.stages["sink"].result
    assert {n: o.key for n, o in first.stages.items()} == {n: o.key for n, o in second.stages.items()}


def test_changing_one_stage_config_reruns_it_and_downstream_only(toy_cfg, tmp_path):
    run_toy(toy_cfg, tmp_path)
    changed = dataclasses.replace(toy_cfg.lr_find, num_iters=toy_cfg.lr_find.num_iters + 1)
    _, statuses = run_toy(toy_cfg, tmp_path, lr_find=changed)
    assert statuses == {"source": "cached", "middle": "ran", "sink": "ran", "side": "cached"}


def test_force_reruns_the_stage_and_only_what_then_changes(toy_cfg, tmp_path):
    run_toy(toy_cfg, tmp_path)
    # source is deterministic: forcing it gives the same result, so nothing downstream re-runs.
    _, statuses = run_toy(toy_cfg, tmp_path, force=["source"])
    assert statuses == {"source": "ran", "middle": "cached", "sink": "cached", "side": "cached"}


def test_only_runs_the_stage_and_its_missing_upstream(toy_cfg, tmp_path):
    summary, statuses = run_toy(toy_cfg, tmp_path, only=["middle"])
    assert statuses == {"source": "ran", "middle": "ran", "sink": "skipped", "side": "skipped"}
    assert summary.ok


def test_failure_skips_downstream_and_the_rerun_resumes_there(toy_cfg, tmp_path):
    bad_train = dataclasses.replace(toy_cfg.train, steps=13)
    summary, statuses = run_toy(toy_cfg, tmp_path, train=bad_train)
    assert statuses == {"source": "ran", "middle": "ran", "sink": "failed", "side": "ran"}
    assert "planted failure at steps=13" in summary.stages["sink"].error
    assert not summary.ok
    assert not any((tmp_path / "cache" / "sink").iterdir()), "a failed stage leaves no cache entry"
    _, statuses = run_toy(toy_cfg, tmp_path)
    assert statuses == {"source": "cached", "middle": "cached", "sink": "ran", "side": "cached"}


def test_summary_json_contract(toy_cfg, tmp_path):
    summary, _ = run_toy(toy_cfg, tmp_path)
    data = json.loads(summary.path.read_text())
    assert data["mlflow_run_id"] is None
    for name, entry in data["stages"].items():
        assert set(entry) >= {"status", "seconds", "key", "error", "result"}, name
        assert entry["status"] == "ran" and entry["error"] is None and isinstance(entry["seconds"], float)
    assert data["stages"]["sink"]["result"] == {"value": toy_cfg.seed + toy_cfg.lr_find.num_iters + toy_cfg.train.steps}


def test_cache_entry_is_complete_or_absent(toy_cfg, tmp_path):
    run_toy(toy_cfg, tmp_path)
    entries = list((tmp_path / "cache" / "sink").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".tmp")
    value = toy_cfg.seed + toy_cfg.lr_find.num_iters + toy_cfg.train.steps
    assert json.loads((entries[0] / "entry.json").read_text())["metrics"] == [["toy/value", float(value), 0]]
    # The stage's own file, written while it ran, is kept with its result: the middle stage's value.
    assert (entries[0] / "artifacts" / "note.txt").read_text() == f"{toy_cfg.seed + toy_cfg.lr_find.num_iters}\n"


def test_summary_table_holds_the_first_line_of_a_long_error():
    from pipelines.outcome import Outcome, Summary, summary_table

    tail = "\n".join(f"stderr line {i} " + "x" * 300 for i in range(20))
    summary = Summary(stages={
        "env": Outcome("ran", 1.0, error=None),
        "train": Outcome("failed", 2.0, error=f"train: Slurm job 7 ended FAILED\n{tail}"),
    })
    lines = summary_table(summary).splitlines()
    assert len(lines) == 4  # header, rule, one row per stage
    assert lines[-1].endswith("train: Slurm job 7 ended FAILED")
    assert max(len(line) for line in lines) < 100
