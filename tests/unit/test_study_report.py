"""Study rows from summaries: failed points show as failed, a re-run replaces its point."""

from __future__ import annotations

from stages.study_report import StudyRun, latest_per_point, regrets, table_rows, table_text


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


def trained(strategy: str, measured: float, predicted: float, layout: str, by: str = "you",
            dims: tuple[int, int, int, int] = (2, 1, 1, 1), micro: int = 4) -> dict:
    """A world-2 run at global batch 8 that trained `dims` (dp_replicate, dp_shard, tp, pp)."""
    s = summary(strategy, 2, 1.0, samples_per_s=measured)
    s["run"]["layout"] = layout
    s["stages"]["train"]["result"].update(dims=list(dims), micro_batch=micro, grad_accum=1, precision="fp32",
                                          activation_checkpointing="none", strategy_from_plan=by != "you",
                                          prediction={"samples_per_s": predicted, "step_time_error_pct": 1.0})
    if by == "trials":
        s["stages"]["trials"] = {"status": "ran", "result": {"chosen": {"strategy": strategy}}}
    return s


def test_runs_that_compete_are_ranked_measured_and_by_their_plan_and_the_recommendation_has_a_regret():
    runs = latest_per_point([StudyRun.from_summary(s) for s in (
        trained("ddp", 100.0, 90.0, "explicit ddp"),
        trained("zero3", 80.0, 95.0, "explicit zero3", dims=(1, 2, 1, 1)),
        trained("zero3", 82.0, 95.0, "auto", by="plan", dims=(1, 2, 1, 1)),
        trained("ddp", 99.0, 90.0, "auto, 2 trials", by="trials"),
    )])
    rows = {(r["strategy"], r["layout"]): r for r in table_rows(runs)}
    assert len(rows) == 4, "an auto run is its own point beside the explicit run of the same strategy"
    ddp, zero3 = rows["ddp", "dp_replicate2, mb 4 x 1, fp32, ac none"], rows["zero3", "dp_shard2, mb 4 x 1, fp32, ac none"]
    assert (ddp["measured rank"], ddp["plan's rank"]) == (1, 3)  # plan ranks both zero3 runs first (95 > 90)
    assert (zero3["measured rank"], zero3["plan's rank"]) == (4, 1)
    assert rows["zero3", "dp_shard2, mb 4 x 1, fp32, ac none (by the plan)"]["measured rank"] == 3
    plan, trials = regrets(runs)
    assert (plan.chosen_by, plan.ratio) == ("plan", 0.82) and plan.best_samples_per_s == 100.0
    assert (trials.chosen_by, trials.ratio) == ("trials", 0.99)
    assert "regret 18.0 %" in plan.line()


def test_runs_of_different_sizes_do_not_compete():
    small, large = trained("ddp", 100.0, 90.0, "a"), trained("ddp", 150.0, 90.0, "a")
    large["run"].update(nodes=4, world_size=4, global_batch=16)
    auto = trained("ddp", 50.0, 90.0, "auto", by="plan")
    rows = table_rows(latest_per_point([StudyRun.from_summary(s) for s in (small, large, auto)]))
    assert [(r["devices"], r["measured rank"]) for r in rows] == [(2, 1), (2, 2), (4, 1)]
    (regret,) = regrets(latest_per_point([StudyRun.from_summary(s) for s in (small, large, auto)]))
    assert regret.ratio == 0.5 and regret.devices == 2
