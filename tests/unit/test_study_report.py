"""Study rows from summaries: failed points show as failed, a re-run replaces its point."""

from __future__ import annotations

from stages.study_report import StudyRun, latest_per_point, table_rows, table_text


def summary(strategy: str, nodes: int, finished_at: float, ok: bool = True, samples_per_s: float = 100.0) -> dict:
    train = {"status": "ran", "result": {"strategy": strategy, "samples_per_s": samples_per_s,
                                        "samples_per_s_per_device": samples_per_s / nodes, "scaling_efficiency": 0.5,
                                        "mfu_pct": None, "peak_memory_bytes": 2**30, "final_loss": 1.5,
                                        "prediction": {"step_time_error_pct": 12.5}}}
    if not ok:
        train = {"status": "failed", "result": None}
    return {"run": {"study": "s", "pipeline": "full", "strategy": strategy, "nodes": nodes, "procs_per_node": 1,
                    "world_size": nodes, "global_batch": 8 * nodes, "finished_at": finished_at},
            "stages": {"lr_find": {"status": "cached", "result": None}, "train": train},
            "ok": ok, "mlflow_run_id": None}


def test_a_failed_point_is_a_row_saying_where_it_failed():
    rows = table_rows(latest_per_point([StudyRun.from_summary(summary("zero3", 2, 1.0, ok=False))]))
    assert rows[0]["status"] == "failed at train" and rows[0]["samples/s"] is None
    assert "failed at train" in table_text(rows) and " - " in table_text(rows)


def test_the_latest_run_of_a_point_replaces_earlier_ones_and_rows_sort_by_strategy_and_size():
    runs = [StudyRun.from_summary(s) for s in (
        summary("zero3", 2, 1.0, ok=False), summary("zero3", 2, 2.0, samples_per_s=50.0),
        summary("ddp", 2, 1.5), summary("ddp", 1, 1.2))]
    rows = table_rows(latest_per_point(runs))
    assert [(r["strategy"], r["nodes"], r["status"]) for r in rows] == [("ddp", 1, "ok"), ("ddp", 2, "ok"),
                                                                       ("zero3", 2, "ok")]
    assert rows[-1]["samples/s"] == 50.0 and rows[-1]["peak GiB/device"] == 1.0


def test_summaries_without_a_train_stage_are_not_study_points():
    compare = {"run": {"pipeline": "compare"}, "stages": {"compare": {"status": "ran"}}, "ok": True}
    assert StudyRun.from_summary(compare) is None
    assert StudyRun.from_summary({"stages": {}}) is None


def test_a_later_failure_does_not_hide_an_earlier_success():
    runs = [StudyRun.from_summary(summary("ddp", 2, 1.0)), StudyRun.from_summary(summary("ddp", 2, 5.0, ok=False))]
    (row,) = table_rows(latest_per_point(runs))
    assert row["status"] == "ok" and row["samples/s"] == 100.0


def test_runs_that_differ_in_more_than_strategy_and_size_are_separate_rows_with_a_variant():
    small, large = summary("ddp", 2, 1.0), summary("ddp", 2, 2.0)
    small["run"]["global_batch"], large["run"]["global_batch"] = 16, 64
    rows = table_rows(latest_per_point([StudyRun.from_summary(small), StudyRun.from_summary(large)]))
    assert [r["variant"] for r in rows] == ["global_batch=16", "global_batch=64"]
    assert "variant" in table_text(rows).splitlines()[0]


def test_an_invocation_that_chose_not_to_train_is_no_study_point():
    planned = summary("ddp", 2, 9.0)
    planned["stages"]["train"] = {"status": "skipped", "error": "not selected by only=[...]", "result": None}
    assert StudyRun.from_summary(planned) is None


def test_the_same_point_measured_on_two_placements_is_two_variants():
    local, cluster = summary("ddp", 2, 1.0), summary("ddp", 2, 2.0, samples_per_s=400.0)
    local["run"]["placement"], cluster["run"]["placement"] = "local@d5458a0f4b0b", "slurm@77aa01c2e3f4"
    rows = table_rows(latest_per_point([StudyRun.from_summary(local), StudyRun.from_summary(cluster)]))
    assert [(r["variant"], r["samples/s"]) for r in rows] == [("placement=local@d5458a0f4b0b", 100.0),
                                                              ("placement=slurm@77aa01c2e3f4", 400.0)]
