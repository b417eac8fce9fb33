"""summary.json: the contract every invocation writes, and its one reader.

The runner writes summary.json from dataclasses (pipelines/runner.py, `Runner._finish`); whatever
reads one back, from a run dir or from an MLflow run's copy (the study report, compare,
calibration), goes through `read_summary`, which returns the dataclasses below with each stage's
result as the dataclass its function returns. Nothing reading a summary tests a dict key or an
error message. docs/summary.md is generated from these classes:
`scripts/summary_docs.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from common.functions import import_function
from pipelines.configtools import from_dict
from pipelines.paths import CONF_DIR

SUMMARY_VERSION = 3
"""Raised when a field is added, removed or changes meaning. Summaries written before version 2
carry no `version` and are read as version 1 (`_from_version_1`); version 2 lacks each stage's
`peak_memory_bytes`, read as None."""
STATUSES = ("ran", "cached", "failed", "skipped")
T = TypeVar("T")


class SkipReason(StrEnum):
    """Why a stage was skipped by choice: no failure, and no reason to skip what needs it."""

    NOT_SELECTED = "not_selected"
    """`only=[...]` left it out."""
    NOT_ASKED = "not_asked"
    """Its `when` key (conf/pipeline/*.yaml) is false or 0, e.g. trials under plan.trials=0."""


@dataclass(frozen=True)
class RunFacts:
    """What the invocation was: summary.json's `run` block (pipelines.runner.run_facts)."""

    study: str | None
    """The study it belongs to (a `-m` sweep's id, or `study=`); None outside a study."""
    pipeline: str
    """The pipeline's name: conf/pipeline/<name>.yaml."""
    strategy: str
    """The strategy asked for (`auto`: the plan chooses)."""
    layout: str
    """What it asked to train: degrees, micro-batch x accumulation, precision, checkpointing; or `auto`."""
    nodes: int
    procs_per_node: int
    """Ranks per node."""
    world_size: int
    """nodes x procs_per_node."""
    global_batch: int
    """Samples per optimizer step: micro-batch x accumulation x data-parallel size."""
    model: str
    """The names of the model, data, cluster and launcher options (conf/<group>/<name>.yaml)."""
    data: str
    cluster: str
    launcher: str
    placement: str | None
    """`<launcher>@<fingerprint>` of where its worker stages ran; None when none ran."""
    seed: int
    """The seed every stage was given."""
    finished_at: float
    """Unix time the summary was written."""


@dataclass(frozen=True)
class StageRecord:
    """One stage's outcome: an entry of summary.json's `stages`, keyed by the stage's name."""

    status: str
    """ran | cached | failed | skipped"""
    seconds: float
    """Wall time of the run, or for a cached stage of the run that measured it."""
    key: str | None
    """The stage's cache key; None when it was skipped before one was computed."""
    error: str | None
    """Why it failed or was skipped, in words for people (redacted); `status` and `reason` are the facts."""
    result: Any
    """What the stage returned, as the dataclass its function's return annotation names; None
    unless it ran or was cached."""
    fn: str
    """The stage's function, `module:function` (its return annotation types `result`)."""
    reason: SkipReason | None
    """Why a skipped stage was skipped by choice; None otherwise (it ran, failed, or was skipped
    because an upstream stage did not succeed or the run was interrupted)."""
    peak_memory_bytes: int | None = None
    """The highest peak device memory of its ranks, failed ones included: on CUDA the allocator's
    `max_memory_reserved`; on CPU, under a budget (`cluster.device_memory_gib`), the bytes of live
    tensor storages (training/budget.py). For a cached stage, of the run that measured it. None
    where not measured: on CPU without a budget (tracking would slow the steps the stages time),
    a driver stage that never loaded torch, a stage skipped, or one from a summary before version 3."""
    baseline: dict[str, Any] | None = None
    """The 1-device baseline's status, seconds, key and peak_memory_bytes (`baseline: true` stages
    at world > 1)."""
    placement: dict[str, Any] | None = None
    """Where a worker stage's result was measured: launcher, fingerprint, hosts, hardware."""
    measured_by: dict[str, Any] | None = None
    """A cached stage's origin: the run_dir, mlflow_run_id, measured_at and placement that measured it."""
    jobs: list[str] = field(default_factory=list)
    """The cluster jobs it ran in, its baseline's included (launcher=slurm)."""

    @property
    def result_type(self) -> type:
        return result_type(self.fn)


@dataclass(frozen=True)
class RunSummary:
    """A whole summary.json."""

    version: int
    """The contract's version (SUMMARY_VERSION when written; 1 for summaries that carry none)."""
    run: RunFacts
    """What the invocation was."""
    placement: dict[str, Any] | None
    """Where the worker stages ran: launcher, fingerprint, hosts, hardware, nodes, and what `changed`
    since the last run on this launcher and world; None when no worker stage ran."""
    stages: dict[str, StageRecord]
    """Every stage of the pipeline, in run order."""
    launcher: dict[str, Any]
    """What the launcher adds (Slurm allocations, Ray worker groups); empty for launcher=local."""
    mlflow_run_id: str | None
    """The invocation's MLflow run (it holds a copy of this file); None with tracking=none, and, for
    a fully cached invocation, until the background replay has logged it (pipelines/deferred.py)."""
    ok: bool
    """Every stage ran, was cached, or was skipped by choice."""
    run_dir: str
    """The invocation's run dir, where this file was written."""

    def stage_returning(self, cls: type) -> StageRecord | None:
        """The stage whose function returns `cls` (whatever its name in the pipeline), or None."""
        return next((s for s in self.stages.values() if s.result_type is cls), None)

    def result(self, cls: type[T]) -> T | None:
        """That stage's result; None when no stage returns `cls` or it produced nothing."""
        stage = self.stage_returning(cls)
        return None if stage is None else stage.result


@functools.cache
def result_type(fn: str) -> type:
    """The dataclass the stage function `module:function` returns, from its return annotation.
    Imported when first asked: the stage modules import torch only when they run."""
    try:
        returns = typing.get_type_hints(import_function(fn)).get("return")
    except (ImportError, AttributeError, NameError) as err:
        raise ValueError(f"stage function {fn!r} cannot be imported ({err})") from None
    if not dataclasses.is_dataclass(returns):
        raise ValueError(f"stage function {fn!r} declares no dataclass as its return type")
    return returns


def read_summary(data: Any) -> RunSummary:
    """A summary.json's data (a run dir's, or an MLflow run's copy) as a RunSummary. A summary
    this version cannot read raises one ValueError naming the summary and what is wrong."""
    try:
        return _read(data)
    except ValueError as err:
        where = ""
        if isinstance(data, dict) and (data.get("run_dir") or data.get("mlflow_run_id")):
            where = f" of {data.get('run_dir') or 'MLflow run ' + str(data['mlflow_run_id'])}"
        raise ValueError(f"summary.json{where} cannot be read: {err}") from None


def read_summaries(datas: Iterable[Any]) -> list[RunSummary]:
    """Each summary that reads. One that doesn't (written by a version whose results no longer
    match this one's) is named on stderr and left out: one old run must not hide a whole study or
    calibration history."""
    summaries = []
    for data in datas:
        try:
            summaries.append(read_summary(data))
        except ValueError as err:
            print(f"warning: {err}; left out", file=sys.stderr)
    return summaries


def _read(data: Any) -> RunSummary:
    if not isinstance(data, dict):
        raise ValueError(f"it holds a {type(data).__name__}, not a mapping")
    data = dict(data)
    version = data.pop("version", 1)
    if version not in range(1, SUMMARY_VERSION + 1):
        raise ValueError(f"version={version!r}: this scalestudy reads versions 1 to {SUMMARY_VERSION}")
    if version == 1:
        data = _from_version_1(data)
    _check_keys(RunSummary, data, "", skip=frozenset({"version"}))
    stages = data["stages"]
    if not isinstance(stages, dict):
        raise ValueError("stages must be a mapping of stage name to entry")
    return RunSummary(
        version=version,
        run=_build(RunFacts, data["run"], "run"),
        placement=data["placement"],
        stages={name: _stage(entry, f"stages.{name}") for name, entry in stages.items()},
        launcher=data["launcher"],
        mlflow_run_id=data["mlflow_run_id"],
        ok=data["ok"],
        run_dir=data["run_dir"],
    )


def _stage(entry: Any, path: str) -> StageRecord:
    _check_keys(StageRecord, entry, path)
    if entry["status"] not in STATUSES:
        raise ValueError(f"{path}.status={entry['status']!r}: must be one of {', '.join(STATUSES)}")
    fn, result = entry["fn"], entry["result"]
    if not isinstance(fn, str):
        raise ValueError(f"{path}.fn={fn!r}: must name the stage's function as `module:function`")
    if result is not None:
        result = _build(result_type(fn), result, f"{path}.result")
    reason = entry["reason"]
    if reason is not None and reason not in list(SkipReason):
        raise ValueError(f"{path}.reason={reason!r}: must be one of {', '.join(SkipReason)}")
    return StageRecord(**{**entry, "result": result, "reason": None if reason is None else SkipReason(reason)})


def _check_keys(cls: type, data: Any, path: str, skip: frozenset[str] = frozenset()) -> None:
    """Every required field of `cls` present and no other: a ValueError naming the first that isn't."""
    where = f"{path} " if path else ""
    if not isinstance(data, dict):
        raise ValueError(f"{where}must be a mapping of {cls.__name__} fields, not {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    missing = [n for n, f in fields.items() if n not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where}lacks {', '.join(missing)}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}holds unknown keys {', '.join(unknown)}; known: {', '.join(fields)}")


def _build(cls: type, data: Any, path: str) -> Any:
    _check_keys(cls, data, path)
    try:
        return from_dict(cls, data, path)
    except (TypeError, AttributeError) as err:  # a nested dataclass lacks a field, a list or dict is not one
        raise ValueError(f"{path} does not match {cls.__name__} ({err})") from None


VERSION_1_SKIPS = (("not selected by only=[...]", SkipReason.NOT_SELECTED), ("not asked for", SkipReason.NOT_ASKED))
"""How version 1 said why a stage was skipped by choice: in its error's words, exactly these."""


def _from_version_1(data: dict[str, Any]) -> dict[str, Any]:
    """Version 1 data in version 2's shape. Users' MLflow stores hold such runs, and compare and
    calibration read them; they named no stage functions, gave a skip's reason only in its error,
    and the oldest lack the run's `layout`. Each stage's function comes from the pipeline file the
    run names (conf/pipeline/<pipeline>.yaml)."""
    run = data.get("run")
    pipeline = run.get("pipeline") if isinstance(run, dict) else None
    fns = pipeline_functions(pipeline)
    stages = {}
    for name, entry in (data.get("stages") or {}).items():
        if name not in fns or not isinstance(entry, dict):
            raise ValueError(f"stages.{name}: no stage of that name in conf/pipeline/{pipeline}.yaml to type it")
        error = entry.get("error") or ""
        reason = next((r for words, r in VERSION_1_SKIPS if entry.get("status") == "skipped"
                       and error.startswith(words)), None)
        stages[name] = {**entry, "fn": fns[name], "reason": reason}
    return {**data, "run": {"layout": "", **run}, "stages": stages}


def pipeline_functions(pipeline: Any) -> dict[str, str]:
    """Stage name -> `module:function` in conf/pipeline/<pipeline>.yaml (uninterpolated)."""
    from omegaconf import OmegaConf

    path = CONF_DIR / "pipeline" / f"{pipeline}.yaml"
    if not isinstance(pipeline, str) or not path.is_file():
        raise ValueError(f"it has no version and its run.pipeline={pipeline!r} names no file in "
                         f"{CONF_DIR / 'pipeline'} to type its stages by")
    stages = OmegaConf.to_container(OmegaConf.load(path), resolve=False)["stages"]
    return {name: spec["fn"] for name, spec in stages.items()}
