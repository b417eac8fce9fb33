"""Study rows from summaries: failed points show as failed, a re-run replaces its point."""

from __future__ import annotations

import dataclasses

import pytest

from pipelines.configtools import to_jsonable
from pipelines.summary import SUMMARY_VERSION, read_summary
from reports.study import StudyRun, latest_per_point, regrets, study_runs, table_rows, table_text
from stages.prediction import PredictionCheck
from stages.train_result import TrainResult
from stages.trials import TrialsResult
from training.planner.predict import Prediction
from training.planner.ranking import Candidate
from training.planner.step import StepPrediction


def prediction(samples_per_s: float = 100.0, step_time_error_pct: float = 12.5) -> PredictionCheck:
    return PredictionCheck(components=StepPrediction(0.1, 0.01, 0.0), step_time_s=0.11, samples_per_s=samples_per_s,
                           scaling_efficiency=0.9, memory_bytes=2**30, step_time_error_pct=step_time_error_pct,
                           samples_per_s_error_pct=0.0, efficiency_error_pct=0.0, memory_error_pct=0.0)


def train_result(strategy: str, world: int, samples_per_s: float) -> TrainResult:
    return TrainResult(
        strategy=strategy, strategy_from_plan=False, dims=[world, 1, 1, 1], precision="fp32",
        activation_checkpointing="none", world_size=world, steps=2, resumed_from=0, final_loss=1.5,
        losses=[2.0, 1.5], lrs=[1e-3, 1e-3], lr=1e-3, lr_source="train.lr", global_batch=8 * world, micro_batch=8,
        grad_accum=1, samples_per_s=samples_per_s, tokens_per_s=16 * samples_per_s,
        samples_per_s_per_device=samples_per_s / world, tokens_per_s_per_device=16 * samples_per_s / world,
        step_time_s=0.1, baseline_samples_per_s=samples_per_s, scaling_efficiency=0.5, peak_memory_bytes=2**30,
        param_bytes=0, grad_bytes=0, optim_bytes=0, activation_bytes=0, memory_source="measured",
        flops_per_sample=1e6, mfu_pct=None, device="cpu", ranks_in_sync=True, bucket_allreduce_ms=[],
        prediction=prediction(), time_split=[], system=[])


def stage(fn: str, status: str, result: object = None, error: str | None = None, reason: str | None = None) -> dict:
    return {"status": status, "reason": reason, "seconds": 1.0, "key": "k", "error": error, "fn": fn,
            "result": to_jsonable(result) if result is not None else None}


def summary(strategy: str, nodes: int, finished_at: float, ok: bool = True, samples_per_s: float = 100.0) -> dict:
    """A version-2 summary.json of a full-pipeline run (lr_find cached, train ran or failed)."""
    train = stage("stages.train:run", "ran", train_result(strategy, nodes, samples_per_s))
    if not ok:
        train = stage("stages.train:run", "failed", error="RuntimeError: planted")
    run = {"study": "s", "pipeline": "full", "strategy": strategy, "layout": "", "nodes": nodes, "procs_per_node": 1,
           "world_size": nodes, "global_batch": 8 * nodes, "model": "gpt-tiny", "data": "markov",
           "cluster": "cpu-local", "launcher": "local", "placement": None, "seed": 0, "finished_at": finished_at}
    return {"version": SUMMARY_VERSION, "run": run, "placement": None, "launcher": {}, "mlflow_run_id": None,
            "ok": ok, "run_dir": f"/runs/{strategy}{nodes}-{finished_at}",
            "stages": {"lr_find": stage("stages.lr_find:run", "cached"), "train": train}}


def points(*summaries: dict) -> list[StudyRun]:
    return study_runs([read_summary(s) for s in summaries])


def test_a_failed_point_is_a_row_saying_where_it_failed():
    rows = table_rows(latest_per_point(points(summary("zero3", 2, 1.0, ok=False))))
    assert rows[0]["status"] == "failed at train" and rows[0]["samples/s"] is None
    assert "failed at train" in table_text(rows) and " - " in table_text(rows)


def test_the_latest_run_of_a_point_replaces_earlier_ones_and_rows_sort_by_strategy_and_size():
    runs = points(summary("zero3", 2, 1.0, ok=False), summary("zero3", 2, 2.0, samples_per_s=50.0),
                  summary("ddp", 2, 1.5), summary("ddp", 1, 1.2))
    rows = table_rows(latest_per_point(runs))
    assert [(r["strategy"], r["nodes"], r["status"]) for r in rows] == [("ddp", 1, "ok"), ("ddp", 2, "ok"),
                                                                       ("zero3", 2, "ok")]
    assert rows[-1]["samples/s"] == 50.0 and rows[-1]["peak GiB/device"] == 1.0


def test_summaries_without_a_train_stage_are_not_study_points():
    compare, whatif = summary("ddp", 1, 1.0), summary("ddp", 1, 1.0)
    compare["run"]["pipeline"], compare["stages"] = "compare", {"compare": stage("stages.compare:run", "ran")}
    whatif["run"]["pipeline"], whatif["stages"] = "plan", {"plan": stage("stages.plan:whatif", "ran")}
    assert points(compare, whatif) == []


def test_a_later_failure_does_not_hide_an_earlier_success():
    (row,) = table_rows(latest_per_point(points(summary("ddp", 2, 1.0), summary("ddp", 2, 5.0, ok=False))))
    assert row["status"] == "ok" and row["samples/s"] == 100.0


def test_runs_that_differ_in_more_than_strategy_and_size_are_separate_rows_with_a_variant():
    small, large = summary("ddp", 2, 1.0), summary("ddp", 2, 2.0)
    small["run"]["global_batch"], large["run"]["global_batch"] = 16, 64
    rows = table_rows(latest_per_point(points(small, large)))
    assert [r["variant"] for r in rows] == ["global_batch=16", "global_batch=64"]
    assert "variant" in table_text(rows).splitlines()[0]


def test_an_invocation_that_chose_not_to_train_is_no_study_point():
    planned = summary("ddp", 2, 9.0)
    # The runner's words for people may change: the typed reason decides.
    planned["stages"]["train"] = stage("stages.train:run", "skipped", error="any words", reason="not_selected")
    assert points(planned) == []
    blocked = summary("ddp", 2, 9.0, ok=False)
    blocked["stages"]["train"] = stage("stages.train:run", "skipped", error="not selected by only=[...]")
    assert [r.status for r in points(blocked)] == ["incomplete"], "no reason, no choice: the point is incomplete"


def test_the_same_point_measured_on_two_placements_is_two_variants():
    local, cluster = summary("ddp", 2, 1.0), summary("ddp", 2, 2.0, samples_per_s=400.0)
    local["run"]["placement"], cluster["run"]["placement"] = "local@d5458a0f4b0b", "slurm@77aa01c2e3f4"
    rows = table_rows(latest_per_point(points(local, cluster)))
    assert [(r["variant"], r["samples/s"]) for r in rows] == [("placement=local@d5458a0f4b0b", 100.0),
                                                              ("placement=slurm@77aa01c2e3f4", 400.0)]


def candidate(strategy: str) -> Candidate:
    predicted = Prediction(strategy, 2, True, 2**30, 0.1, 1000.0, 0.9, 80.0, 0.01, 0.0)
    return Candidate(strategy=strategy, flavour=strategy, dims={"dp_replicate": 2, "dp_shard": 1, "tp": 1, "pp": 1},
                     micro_batch=4, grad_accum=1, activation_checkpointing="none", precision="fp32",
                     pp_schedule="1f1b", microbatches=1, bucket_cap_mb=25.0, fits=True, memory_per_device_bytes=2**30,
                     step_time_s=0.1, tokens_per_s=1000.0, mfu_pct=None, scaling_efficiency=0.9,
                     command=f"strategy={strategy}", prediction=predicted)


def trained(strategy: str, measured: float, predicted: float, layout: str, by: str = "you",
            dims: tuple[int, int, int, int] = (2, 1, 1, 1), micro: int = 4) -> dict:
    """A world-2 run at global batch 8 that trained `dims` (dp_replicate, dp_shard, tp, pp)."""
    s = summary(strategy, 2, 1.0, samples_per_s=measured)
    s["run"]["layout"] = layout
    result = dataclasses.replace(train_result(strategy, 2, measured), dims=list(dims), micro_batch=micro,
                                 strategy_from_plan=by != "you", prediction=prediction(predicted, 1.0))
    s["stages"]["train"] = stage("stages.train:run", "ran", result)
    if by == "trials":
        s["stages"]["trials"] = stage("stages.trials:run", "ran", TrialsResult([], candidate(strategy), None))
    return s


def test_runs_that_compete_are_ranked_measured_and_by_their_plan_and_the_recommendation_has_a_regret():
    runs = latest_per_point(points(
        trained("ddp", 100.0, 90.0, "explicit ddp"),
        trained("zero3", 80.0, 95.0, "explicit zero3", dims=(1, 2, 1, 1)),
        trained("zero3", 82.0, 95.0, "auto", by="plan", dims=(1, 2, 1, 1)),
        trained("ddp", 99.0, 90.0, "auto, 2 trials", by="trials"),
    ))
    rows = {(r["strategy"], r["layout"]): r for r in table_rows(runs)}
    assert len(rows) == 4, "an auto run is its own point beside the explicit run of the same strategy"
    ddp, zero3 = rows["ddp", "dp_replicate2, mb 4 x 1, fp32, ac none"], rows["zero3", "dp_shard2, mb 4 x 1, fp32, ac none"]
    assert (ddp["measured rank"], ddp["plan's rank"]) == (1, 3)  # plan ranks both zero3 runs first (95 > 90)
    assert (zero3["measured rank"], zero3["plan's rank"]) == (4, 1)
    assert rows["zero3", "dp_shard2, mb 4 x 1, fp32, ac none (by the plan)"]["measured rank"] == 3
    # Runs of one setting pool, whoever chose them: ddp is the median of 100 and 99, zero3 of 80 and 82.
    plan, trials = regrets(runs)
    assert (plan.chosen_by, plan.runs) == ("plan", 2) and plan.ratio == pytest.approx(81.0 / 99.5)
    assert plan.best_samples_per_s == 99.5 and plan.best_layout == "ddp dp_replicate2, mb 4 x 1, fp32, ac none"
    assert (trials.chosen_by, trials.ratio) == ("trials", 1.0)
    assert "regret 18.6 %" in plan.line() and "median of its 2 runs" in plan.line()


def test_a_recommendation_of_the_best_setting_has_no_regret_however_its_own_run_measured():
    """Identical runs on a shared host differ by 15 %: the auto run of the best setting measuring
    below an explicit run of that same setting is noise, not a worse choice. A different setting
    that measures below the best is regret."""
    best = trained("ddp", 100.0, 90.0, "explicit ddp")
    other = trained("zero3", 70.0, 80.0, "explicit zero3", dims=(1, 2, 1, 1))
    (same,) = regrets(latest_per_point(points(best, other, trained("ddp", 86.0, 90.0, "auto", by="plan"))))
    assert same.ratio == 1.0 and same.samples_per_s == 93.0 and same.runs == 2
    (worse,) = regrets(latest_per_point(points(best, other, trained("zero3", 74.0, 80.0, "auto", by="plan",
                                                                     dims=(1, 2, 1, 1)))))
    assert worse.ratio == pytest.approx(72.0 / 100.0)


def test_runs_of_different_sizes_do_not_compete():
    small, large = trained("ddp", 100.0, 90.0, "a"), trained("ddp", 150.0, 90.0, "a")
    large["run"].update(nodes=4, world_size=4, global_batch=16)
    auto = trained("zero3", 50.0, 90.0, "auto", by="plan", dims=(1, 2, 1, 1))
    rows = table_rows(latest_per_point(points(small, large, auto)))
    assert sorted((r["devices"], r["measured rank"]) for r in rows) == [(2, 1), (2, 2), (4, 1)]
    (regret,) = regrets(latest_per_point(points(small, large, auto)))
    assert regret.ratio == 0.5 and regret.devices == 2


def test_a_mixture_of_experts_study_has_an_ep_column_and_the_imbalance_it_measured():
    """A study over strategy.ep=1,2 of a MoE model: each row's expert-parallel degree and, where the
    experts were split, the rank imbalance measured at that degree; a dense study has neither."""
    whole, split = summary("hybrid", 2, 1.0), summary("hybrid", 2, 2.0)
    for s, ep in ((whole, 1), (split, 2)):
        result = s["stages"]["train"]["result"]
        result.update(ep=ep, expert_load={"layers.0": [5, 3]}, expert_rank_imbalance={"2": 1.25})
        s["run"]["layout"] = "dp_shard2" + ("xep2" if ep > 1 else "")
    rows = table_rows(latest_per_point(points(whole, split)))
    assert [(r["ep"], r["rank imbalance"]) for r in rows] == [(1, None), (2, 1.25)]
    header = table_text(rows).splitlines()[0].split()
    assert header[header.index("layout") + 1:header.index("layout") + 4] == ["ep", "rank", "imbalance"]
    dense = table_rows(latest_per_point(points(summary("ddp", 2, 1.0))))
    assert "ep" not in dense[0] and "ep" not in table_text(dense).splitlines()[0].split()
