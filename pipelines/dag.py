"""The stage DAG: built from `conf/pipeline/<name>.yaml`, checked before anything runs.

A stage is a plain function `fn(cfg: <StageInputs>, *, <one keyword per need>, [artifacts],
[baseline]) -> <frozen result>`. The build imports each function and checks its signature against
the declared `needs`, so that a typo fails at start-up with the right form spelled out, as Kedro's
nodes do, instead of mid-run.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from common.errors import ConfigError
from common.functions import import_function
from pipelines.schema import PipelineConfig, StageSpec

RESERVED = ("artifacts", "checkpoints", "baseline", "history")
"""Parameters the engine fills: a directory for artifacts, a stable directory for checkpoints that
a re-run of the same key finds again, the 1-device baseline result, and earlier runs' measured
steps from MLflow (empty unless the stage's spec sets `history`)."""


@dataclass(frozen=True)
class Stage:
    name: str
    spec: StageSpec
    fn: Any
    inputs: type
    """The dataclass of the first parameter: its fields name the top-level config keys it reads."""
    result_type: type
    """The frozen dataclass it returns (how its cached result is read back)."""

    @property
    def upstream(self) -> list[str]:
        return [*self.spec.needs, *self.spec.after]

    @property
    def wants_artifacts(self) -> bool:
        return "artifacts" in inspect.signature(self.fn).parameters

    @property
    def wants_history(self) -> bool:
        return "history" in inspect.signature(self.fn).parameters

    @property
    def wants_checkpoints(self) -> bool:
        return "checkpoints" in inspect.signature(self.fn).parameters


@dataclass(frozen=True)
class Dag:
    stages: dict[str, Stage]
    order: list[str]
    """Topological order; ties keep the order of the pipeline file."""

    def closure(self, names: list[str]) -> list[str]:
        """`names` and everything upstream of them, in run order."""
        wanted: set[str] = set()
        stack = list(names)
        while stack:
            name = stack.pop()
            if name not in wanted:
                wanted.add(name)
                stack.extend(self.stages[name].upstream)
        return [n for n in self.order if n in wanted]

    def uses(self, key: str) -> bool:
        """Whether any stage reads the top-level config key `key` (e.g. `model`)."""
        return any(key in {f.name for f in dataclasses.fields(s.inputs)} for s in self.stages.values())

    def downstream(self, name: str) -> list[str]:
        """Every stage that depends on `name`, directly or not."""
        out: set[str] = set()
        for other in self.order:
            if any(up == name or up in out for up in self.stages[other].upstream):
                out.add(other)
        return [n for n in self.order if n in out]


def build(pipeline: PipelineConfig) -> Dag:
    """Import, check and order the stages; any mistake is a ConfigError naming the stage."""
    if not pipeline.stages:
        raise ConfigError("pipeline", pipeline.name, "has no stages")
    stages = {name: _load(name, spec, pipeline) for name, spec in pipeline.stages.items()}
    return Dag(stages=stages, order=_topological_order(stages))


def _load(name: str, spec: StageSpec, pipeline: PipelineConfig) -> Stage:
    key = f"pipeline.stages.{name}"
    for dep in [*spec.needs, *spec.after]:
        if dep not in pipeline.stages:
            raise ConfigError(f"{key}.needs", dep, f"is not a stage; stages: {', '.join(pipeline.stages)}")
        if dep == name:
            raise ConfigError(f"{key}.needs", dep, "a stage cannot depend on itself")
    try:
        fn = import_function(spec.fn)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{key}.fn", spec.fn, f"cannot be imported ({err})") from None
    inputs, result_type = _check_signature(name, spec, fn)
    return Stage(name=name, spec=spec, fn=fn, inputs=inputs, result_type=result_type)


def _check_signature(name: str, spec: StageSpec, fn: Any) -> tuple[type, type]:
    params = list(inspect.signature(fn).parameters.values())
    wanted = [*spec.needs, *(["baseline"] if spec.baseline else [])]
    right_form = f"def {fn.__name__}(cfg: <Inputs>, *, {', '.join([*wanted, 'artifacts'])})"
    key = f"pipeline.stages.{name}.needs"
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise ConfigError(key, spec.needs, f"{spec.fn} must take its config first: {right_form}")
    hints = typing.get_type_hints(fn)
    inputs = hints.get(params[0].name)
    if not (isinstance(inputs, type) and dataclasses.is_dataclass(inputs)):
        raise ConfigError(key, spec.needs, f"{spec.fn}'s first parameter must be annotated with a dataclass: {right_form}")
    takes = [p.name for p in params[1:] if p.name not in ("artifacts", "checkpoints", "history")]
    if sorted(takes) != sorted(wanted):
        raise ConfigError(
            key,
            spec.needs,
            f"does not match {spec.fn}, which takes ({', '.join(takes) or 'nothing'}); "
            f"declare needs: [{', '.join(n for n in takes if n not in RESERVED)}] or write {right_form}",
        )
    result_type = hints.get("return")
    if not (isinstance(result_type, type) and dataclasses.is_dataclass(result_type)):
        raise ConfigError(f"pipeline.stages.{name}.fn", spec.fn, "must declare a dataclass as its return type")
    return inputs, result_type


def _topological_order(stages: dict[str, Stage]) -> list[str]:
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            cycle = " -> ".join([*path[path.index(name):], name])
            raise ConfigError(f"pipeline.stages.{name}.needs", stages[name].upstream, f"forms a cycle ({cycle})")
        state[name] = "visiting"
        for dep in stages[name].upstream:
            visit(dep, [*path, name])
        state[name] = "done"
        order.append(name)

    for name in stages:
        visit(name, [])
    return order


@runtime_checkable
class DerivedInputs(Protocol):
    """A stage input class that derives its fields from the whole config instead of naming them."""

    @classmethod
    def from_config(cls, cfg: Any) -> Any: ...


def stage_inputs(stage: Stage, cfg: Any) -> Any:
    """The stage's own frozen config: the top-level fields its input dataclass names, or what its
    `from_config` derives (lr_find keys on its batch, not on the strategy that implies it)."""
    if isinstance(stage.inputs, DerivedInputs):
        return stage.inputs.from_config(cfg)
    return stage.inputs(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(stage.inputs)})
