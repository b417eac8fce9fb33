"""Run the DAG: for each stage, compute its key, reuse or run it, record and log the outcome.

The runner is the only place that knows about the cache, the launcher and the tracker together;
a stage sees its own frozen config and its upstream results, nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

from common.errors import ConfigError
from common.files import write_atomic
from common.functions import import_function
from pipelines.cache import Cache, Entry, digest, stage_key, targets_code
from pipelines.calibration import calibration_key
from pipelines.configtools import flatten, to_jsonable
from pipelines.dag import Dag, Stage, build, stage_inputs
from pipelines.deferred import QUEUE, DeferredTracker, defers
from pipelines.launchers import Launcher, StageFailed, Task, WorldSpec, make_launcher
from pipelines.launchers.worker import clear_peak_memory, peak_memory, run_task
from pipelines.mlflow_ui import invocation_run_name, study_reading_run_name, training_data
from pipelines.outcome import Outcome, Summary
from pipelines.placement import Placement, diff, from_json, placement_tags, to_json
from pipelines.progress import StageProgress, progress_file
from pipelines.redact import redact_mapping, redact_text, redact_tree
from pipelines.run_facts import run_facts
from pipelines.schema import Config
from pipelines.summary import SUMMARY_VERSION, SkipReason
from pipelines.tracking import (
    SUMMARY_ARTIFACT,
    HasChildRuns,
    HasMetrics,
    Tracker,
    git_commit,
    make_tracker,
)
from pipelines.validate import check_placement, keep_contract_facts
from training.units import GIB

SUMMARY = SUMMARY_ARTIFACT  # the run dir's file is the one logged at the root of its MLflow run


NOT_SELECTED = "not selected by only=[...]"
NOT_ASKED = "not asked for"
"""The error of a stage its `when` key turned off: no failure, and no reason to skip what needs it."""


class Runner:
    def __init__(self, cfg: Config, run_dir: Path, tracker: Tracker, launcher: Launcher, echo=print,
                 stream: TextIO | None = None):
        self.cfg, self.run_dir, self.tracker, self.launcher, self.echo = cfg, run_dir, tracker, launcher, echo
        self.stream = stream
        """Where the live progress line goes (stdout by default; drawn only on a terminal)."""
        self.dag: Dag = build(cfg.pipeline)
        self.cache = Cache(cfg.cache_dir)
        self.cache.sweep_stale()
        self.world = WorldSpec(cfg.nodes, cfg.procs_per_node)
        self.placement: Placement | None = None
        """Where this invocation's worker stages run, read once, when the first of them starts."""
        self.placement_changes: list[str] = []

    def run(self) -> Summary:
        summary = Summary()
        selected = self.dag.closure(self.cfg.only) if self.cfg.only else self.dag.order
        forced = set(self.cfg.force)
        try:
            for index, name in enumerate(self.dag.order, 1):
                stage = self.dag.stages[name]
                if name not in selected:
                    summary.stages[name] = Outcome("skipped", error=NOT_SELECTED, reason=SkipReason.NOT_SELECTED)
                    continue
                blocked = [u for u in stage.upstream
                           if summary.stages[u].status in ("failed", "skipped") and not summary.stages[u].not_asked]
                off = self._switched_off(stage)
                if off is not None:
                    outcome = Outcome("skipped", error=off, reason=SkipReason.NOT_ASKED)
                elif blocked:
                    outcome = Outcome("skipped", error=f"upstream stage {blocked[0]} {summary.stages[blocked[0]].status}")
                else:
                    self.echo(f"[{index}/{len(self.dag.order)}] {name}: {self._where(stage)} ...")
                    outcome = self._stage(stage, summary.stages, force=name in forced)
                summary.stages[name] = outcome
                self._log(stage, outcome)
                if not stage.spec.cache and outcome.entry is not None:
                    self.cache.discard(outcome.entry.artifacts.parent)
                self.echo(f"[{index}/{len(self.dag.order)}] {name}: {outcome.describe()}")
        except KeyboardInterrupt:
            running = next((n for n in self.dag.order if n not in summary.stages), None)
            if running:
                summary.stages[running] = Outcome("failed", error="interrupted (Ctrl-C)")
            for rest in self.dag.order:
                summary.stages.setdefault(rest, Outcome("skipped", error="interrupted (Ctrl-C)"))
            self._finish(summary)
            raise
        self._finish(summary)
        return summary

    def _switched_off(self, stage: Stage) -> str | None:
        """Why the stage is not asked for (its `when` key is false or 0), or None."""
        key = stage.spec.when
        if key is None:
            return None
        value = self.cfg
        for part in key.split("."):
            value = getattr(value, part)
        return None if value else f"{NOT_ASKED} ({key}={value})"

    def _where(self, stage: Stage) -> str:
        resources = stage.spec.resources
        if resources == "world":
            return f"{self.world.size} ranks ({self.cfg.nodes} nodes x {self.cfg.procs_per_node}) on launcher={self.cfg.launcher.name}"
        if resources == "driver":
            return "driver"
        ranks = self._fitting_ranks(stage)
        return "one device" if ranks == 1 else f"{ranks} ranks (the smallest layout that holds the model)"

    def _placement(self) -> Placement:
        """The pre-flight re-check: where the worker stages run, read there now (launcher=local:
        this machine, from the driver; Ray and Slurm: on the workers). Compared with what the last
        invocation on this launcher and world saw; a change is reported and, being in every worker
        stage's key, re-runs what was measured on the old fleet."""
        if self.placement is None:
            placement = self.launcher.placement(self.world)
            try:
                check_placement(self.cfg, placement)
            except ConfigError as err:  # what the workers reported cannot run this config
                raise StageFailed(str(err)) from None
            scope = f"{placement.launcher}-{self.world.nodes}x{self.world.procs_per_node}"
            last = self.cache.last_placement(scope)
            if last is not None and last.get("fingerprint") != placement.fingerprint:
                self.placement_changes = diff(from_json(last["placement"]), placement)
                self.echo(f"placement changed since the last run on launcher={placement.launcher}: "
                          + "; ".join(self.placement_changes))
            self.cache.record_placement(scope, {"fingerprint": placement.fingerprint, "placement": to_json(placement)})
            self.placement = placement
            self.tracker.set_tags({**placement_tags(placement), "calibration_key": calibration_key(self.cfg, placement)})
        return self.placement

    def _stage(self, stage: Stage, done: dict[str, Outcome], force: bool) -> Outcome:
        if stage.spec.resources != "driver":
            try:
                self._placement()
            except StageFailed as err:
                return Outcome("failed", error=f"placement: {err}")
        inputs = stage_inputs(stage, self.cfg)
        kwargs = {n: done[n].result for n in stage.spec.needs}
        upstream = {n: digest(done[n].result) for n in stage.spec.needs}
        if stage.wants_history:
            kwargs["history"] = self._history() if stage.spec.history else []
            upstream["history"] = digest(kwargs["history"])
        baseline_info = None
        world = self._world_of(stage)
        if stage.spec.baseline:
            single = self._ranks(self._fitting_ranks(stage))
            if world.size == single.size:
                kwargs["baseline"] = None
            else:
                base = self._run_or_load(stage, inputs, dict(kwargs, baseline=None), upstream, single, force, "baseline")
                if base.status == "failed":
                    return Outcome("failed", base.seconds, base.key, f"baseline: {base.error}",
                                   peak_memory_bytes=base.peak_memory_bytes)
                kwargs["baseline"] = base.result
                upstream["baseline"] = digest(base.result)
                baseline_info = {"status": base.status, "seconds": round(base.seconds, 3), "key": base.key,
                                 "peak_memory_bytes": base.peak_memory_bytes}
        outcome = self._run_or_load(stage, inputs, kwargs, upstream, world, force, None)
        outcome.baseline = baseline_info
        return outcome

    def _history(self) -> list:
        """Earlier runs for calibration; a store that can't answer now means none, not a crash."""
        try:
            return self.tracker.history(calibration_key(self.cfg, self.placement))
        except Exception as err:  # noqa: BLE001 - any MLflow failure
            self.echo(f"warning: no calibration history ({type(err).__name__}: {redact_text(str(err))[:200]}); "
                      "planning uncalibrated")
            return []

    def _memory_budget(self) -> float | None:
        """Each rank's device-memory budget: cluster.device_memory_gib where the cluster is this
        machine (`measured`); a described cluster's memory is hardware the workers are not."""
        cluster = self.cfg.cluster
        return cluster.device_memory_gib if cluster.measured else None

    def _world_of(self, stage: Stage) -> WorldSpec:
        if stage.spec.resources == "world":
            return self.world
        ranks = self._fitting_ranks(stage)
        return WorldSpec(1, 1, distributed=False) if ranks == 1 else self._ranks(ranks)

    def _fitting_ranks(self, stage: Stage) -> int:
        """How many ranks the stage's one-device work needs: 1, or under a memory budget what the
        stage's `fits` function says holds the model (the smallest sharded world)."""
        budget = self._memory_budget()
        if stage.spec.fits is None or budget is None:
            return 1
        return import_function(stage.spec.fits)(stage_inputs(stage, self.cfg), budget * GIB, self.world.size)

    def _ranks(self, ranks: int) -> WorldSpec:
        """`ranks` of this invocation's workers, filling a node before the next."""
        per_node = self.world.procs_per_node
        return WorldSpec(1, ranks) if ranks <= per_node else WorldSpec(ranks // per_node, per_node)

    def _run_or_load(self, stage, inputs, kwargs, upstream, world: WorldSpec, force: bool, variant: str | None) -> Outcome:
        name = f"{stage.name}-{variant}" if variant else stage.name
        sized = stage.spec.resources == "world" or world.size > 1
        extra: dict[str, Any] = {"world": [world.nodes, world.procs_per_node]} if sized else {}
        if {"model", "data"} & {f.name for f in dataclasses.fields(stage.inputs)}:
            # A user's model or data set lives outside this project: its code is part of the key.
            extra["user_code"] = targets_code([self.cfg.model.target, self.cfg.data.target,
                                               self.cfg.model.loss.target if self.cfg.model.loss else ""])
        budget = self._memory_budget()
        if budget is not None:
            # A result measured without the budget says nothing of whether the stage runs within it.
            extra["memory_budget_gib"] = budget
        placement = None
        if stage.spec.resources != "driver":
            assert self.placement is not None, "a worker stage's placement is read before its key"
            placement = self.placement if world.size > 1 else self.placement.first_node()
        key = stage_key(name, stage.spec.fn, inputs, upstream, extra,
                        placement.fingerprint if placement is not None else None)
        where = placement.describe() if placement is not None else None
        entry = None if force or not stage.spec.cache else self.cache.load(name, key, stage.result_type)
        if entry is not None:
            return Outcome("cached", entry.seconds, key, result=entry.result, entry=entry, placement=where,
                           peak_memory_bytes=entry.peak_memory_bytes)
        self.tracker.go_live()  # something will be measured: the UI shows it while it is
        staging = self.cache.staging(name)
        checkpoints = self.cache.checkpoints(name, key)
        if stage.wants_checkpoints:
            kwargs = dict(kwargs, checkpoints=checkpoints)
        task = Task(
            stage=name,
            fn=stage.spec.fn,
            inputs=inputs,
            kwargs=kwargs,
            artifacts=staging / "artifacts" if stage.wants_artifacts else None,
            workdir=self.run_dir / "logs" / name,
            memory_budget_gib=budget,
            timeout_s=self.cfg.launcher.timeout_for(name),
            checkpoint_timeout_s=self.cfg.launcher.checkpoint_timeout_s,
        )
        clear_peak_memory(task.workdir)
        start = time.perf_counter()
        try:
            result = self._launch(stage, task, world)
        except StageFailed as err:
            self.cache.discard(staging)
            return Outcome("failed", time.perf_counter() - start, key, error=str(err), placement=where,
                           peak_memory_bytes=peak_memory(task.workdir))
        seconds = time.perf_counter() - start
        peak = peak_memory(task.workdir)
        metrics = list(result.metrics()) if isinstance(result, HasMetrics) else []
        origin = {"run_dir": str(self.run_dir), "mlflow_run_id": self.tracker.run_id, "measured_at": round(time.time(), 3),
                  "placement": where}
        if not stage.spec.cache:  # logged and published from staging, then discarded (Runner.run)
            return Outcome("ran", seconds, key, result=result, placement=where, peak_memory_bytes=peak,
                           entry=Entry(key, result, metrics, seconds, staging / "artifacts", origin, peak))
        entry = self.cache.commit(staging, name, key, result, metrics, seconds, origin, peak)
        self.cache.discard(checkpoints)  # the result is stored: nothing left to resume
        return Outcome("ran", seconds, key, result=result, entry=entry, placement=where, peak_memory_bytes=peak)

    def _launch(self, stage: Stage, task: Task, world: WorldSpec) -> Any:
        if stage.spec.resources != "driver":
            with StageProgress(task.stage, progress_file(Path(task.workdir)), self.stream):
                return self.launcher.run(task, world)
        Path(task.workdir).mkdir(parents=True, exist_ok=True)
        try:
            return run_task(task)
        except Exception as err:  # noqa: BLE001 - a stage's failure is reported, not raised
            (Path(task.workdir) / "driver.log").write_text(redact_text(traceback.format_exc()))
            raise StageFailed(f"{type(err).__name__}: {err} (traceback: {task.workdir}/driver.log)") from err

    def _log(self, stage: Stage, outcome: Outcome) -> None:
        entry = outcome.entry
        tags = {"cached": str(outcome.status == "cached").lower(), "cache_key": outcome.key or ""}
        if outcome.placement is not None:
            tags.update({"placement.launcher": outcome.placement["launcher"],
                         "placement.fingerprint": outcome.placement["fingerprint"],
                         "placement.hosts": ",".join(outcome.placement["hosts"])})
        origin = outcome.measured_by
        if origin is not None:
            tags.update({"measured_by.run_dir": origin.get("run_dir") or "",
                         "measured_by.mlflow_run_id": origin.get("mlflow_run_id") or ""})
        if outcome.error:
            tags["error"] = redact_text(outcome.error)[:5000]
        params = redact_mapping(flatten(to_jsonable(stage_inputs(stage, self.cfg))))
        metrics = entry.metrics if entry else []
        children = outcome.result.child_runs() if isinstance(outcome.result, HasChildRuns) else []
        self.tracker.log_stage(stage.name, outcome.status, tags, params, metrics, entry.artifacts if entry else None,
                               children)
        if stage.spec.publish and entry is not None:
            _copy_tree(entry.artifacts, self.run_dir / stage.spec.publish)

    def _finish(self, summary: Summary) -> None:
        summary.mlflow_run_id = self.tracker.run_id
        path = self.run_dir / SUMMARY
        stages = {n: o.as_json(self.dag.stages[n].spec.fn) for n, o in summary.stages.items()}
        launched = self.launcher.record()
        # Cluster launchers (slurm) name the jobs each stage ran in, baseline included.
        for name, ids in launched.get("jobs", {}).items():
            stage = name.removesuffix("-baseline")
            if stage in stages:
                stages[stage].setdefault("jobs", [])
                stages[stage]["jobs"] += [i for i in ids if i not in stages[stage]["jobs"]]
        payload = {
            "version": SUMMARY_VERSION,
            "run": run_facts(self.cfg, self.placement),
            "placement": None if self.placement is None else {**self.placement.describe(),
                                                             "nodes": to_json(self.placement)["nodes"],
                                                             "changed": self.placement_changes},
            "stages": stages,
            "launcher": {k: v for k, v in launched.items() if k != "jobs"},
            "mlflow_run_id": summary.mlflow_run_id,
            "ok": summary.ok,
            "run_dir": str(self.run_dir),
        }
        write_atomic(path, json.dumps(payload, indent=2, default=str))
        summary.path = path
        self.tracker.finish(summary.ok, [path])


def _copy_tree(src: Path, dst: Path) -> None:
    import shutil

    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True)


def run_pipeline(cfg: Config, run_dir: Path, echo=print) -> Summary:
    """Build the DAG, open tracking, run every selected stage, write summary.json."""
    dag = build(cfg.pipeline)  # fails on a bad DAG before MLflow or any process starts
    launcher = make_launcher(cfg.launcher, run_dir, WorldSpec(cfg.nodes, cfg.procs_per_node))
    reading = cfg.pipeline.reads_study
    try:
        if defers(cfg.tracking, sweep=cfg.study is not None or reading):
            # Opened when a stage runs; a fully cached invocation is logged in the background.
            tracker: Tracker = DeferredTracker(cfg.tracking, Path(cfg.cache_dir) / QUEUE)
        else:  # a study's report reads its invocations from MLflow as soon as the sweep ends
            tracker = make_tracker(cfg.tracking)
    except BaseException:
        launcher.close()
        raise
    keep_contract_facts(cfg)
    world = cfg.nodes * cfg.procs_per_node
    facts = run_facts(cfg)
    tags = {"kind": "study-reading" if reading else "invocation", "calibration_key": calibration_key(cfg, None)}
    if cfg.study:
        # A top-level run tagged with its study, not a child of a study run: MLflow's runs page
        # and charts show top-level runs, and group them by this tag (pipelines/mlflow_ui.py).
        tags["study"] = cfg.study
    started = time.time()
    tracker.start(
        study_reading_run_name(cfg.pipeline.name, cfg.study, started) if reading else
        invocation_run_name(cfg.strategy.name, world, cfg.model.name, started),
        # strategy / world_size / global_batch as plain params: MLflow's compare view plots
        # scaling efficiency against them.
        params={**redact_mapping(flatten(to_jsonable(cfg))),
                **{k: facts[k] for k in ("strategy", "world_size", "global_batch")}},
        tags={
            **tags,
            "strategy": cfg.strategy.name,
            "nodes": str(cfg.nodes),
            "procs_per_node": str(cfg.procs_per_node),
            "world_size": str(world),
            "launcher": cfg.launcher.name,
            "model": cfg.model.name,
            "data": cfg.data.name,
            "pipeline": cfg.pipeline.name,
            "stages": ",".join(dag.order),
            "git_commit": git_commit(),
            "run_dir": str(run_dir),
            "tracking_uri": redact_text(cfg.tracking.uri),
        },
    )
    try:
        if not reading:
            tracker.log_dataset(training_data(redact_tree(to_jsonable(cfg.data))))
        return Runner(cfg, run_dir, tracker, launcher, echo).run()
    finally:
        launcher.close()
