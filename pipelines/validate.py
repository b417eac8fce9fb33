"""Checks that span several config groups, run on the driver before anything is launched.

Single-field checks live in each dataclass's `__post_init__`; these need two fields at once, a fact
of the machine (how many GPUs there are) or a fact of the user's model and data (what it declares,
how many samples there are: training/contract/check.py, cached under the cache dir so that a re-run does
not build them again). All raise ConfigError: one sentence, the key, the value, what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from common.errors import ConfigError
from common.files import write_atomic
from pipelines.cache import code_version, digest, targets_code
from pipelines.configtools import from_dict, to_jsonable
from pipelines.schema import Config
from training.contract.check import ContractFacts
from training.layout_checks import check_layout, check_microbatches
from training.parallel.dims import ParallelDims, resolve_dims

if TYPE_CHECKING:
    from pipelines.placement import Placement


def resolve(cfg: Config, gpus_per_node: int | None = None, uses_model: bool = True) -> Config:
    """Fill in what defaults to the workers (procs_per_node, Slurm's GPUs per node) and check the
    cross-field rules. `gpus_per_node`: the workers' GPUs per node when the caller knows them
    (a what-if benchmark); else read from the launcher's resources (pipelines/launchers/resources.py),
    never from the driver's own devices. `uses_model`: some stage builds the model (a pipeline that
    only reads MLflow does not)."""
    from pipelines.launchers.resources import gpus_per_node as launcher_gpus

    gpus = launcher_gpus(cfg) if gpus_per_node is None else gpus_per_node
    cfg = dataclasses.replace(cfg, procs_per_node=_procs_per_node(cfg, gpus))
    if cfg.launcher.name == "slurm" and cfg.cluster.measured:
        gpus = _slurm_gpus(cfg, gpus)
        cfg = dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, gpus_per_node=gpus))
    if cfg.cluster.measured:  # a what-if plan launches nothing: the workers' limits don't apply
        _check_world(cfg, gpus)
    dims = _check_degrees(cfg, gpus)
    _check_float8(cfg)
    _check_stage_names(cfg)
    _check_outputs(cfg)
    _check_study_reading(cfg)
    _check_calibrate(cfg)
    if uses_model:  # last: it builds the model and data
        facts = contract_facts(cfg)
        check_layout(cfg.strategy, dims, facts, cfg.model.name, cfg.data.name)
        _check_batches(cfg, dims, facts)
        _check_memory(cfg, dims)
    return cfg


def _procs_per_node(cfg: Config, gpus: int | None) -> int:
    """procs_per_node, or its default: a described cluster's devices per node (a what-if plan), else
    one rank per GPU of a worker node, else one rank per node."""
    if cfg.procs_per_node:
        return cfg.procs_per_node
    if not cfg.cluster.measured:
        return cfg.cluster.devices_per_node
    if gpus is None and cfg.cluster.accelerator == "cuda":
        raise ConfigError("procs_per_node", None, f"launcher={cfg.launcher.name} cannot say how many GPUs a worker "
                          "node has before it runs: give procs_per_node (ranks per node, one per GPU)")
    return max(gpus or 0, 1)


def _slurm_gpus(cfg: Config, gpus: int | None) -> int:
    """The GPUs per node the allocation asks for: launcher.gpus_per_node, else one per task on a
    cuda cluster (cluster=gpu), else none."""
    if gpus is not None:
        return gpus
    return cfg.procs_per_node if cfg.cluster.accelerator == "cuda" else 0


def check_placement(cfg: Config, placement: Placement) -> None:
    """The workers as they reported themselves (the placement probe, run before any stage): a run
    that needs a GPU per rank (backend nccl, a cuda cluster, fp16) on a node that shows none, or
    fewer than its ranks, is refused in one line before any stage runs, never run on the CPU."""
    needs = ("launcher.backend", placement.backend) if placement.backend == "nccl" else \
        ("cluster", cfg.cluster.name) if cfg.cluster.accelerator == "cuda" else \
        ("strategy.precision", "fp16") if cfg.strategy.precision == "fp16" else None
    if needs is None:
        return
    for node in placement.nodes:
        usable = node.usable_gpus
        if usable == 0:
            raise ConfigError(*needs, f"needs a CUDA GPU for every rank, but node {node.name} of launcher="
                              f"{placement.launcher} shows none to its ranks ({node.describe_gpus()}); "
                              "ask the launcher for GPUs (launcher.gpus_per_node / launcher.use_gpu) or use "
                              "cluster=cpu-local with backend gloo")
        if 1 < usable < cfg.procs_per_node:  # one each (--gpu-bind) is env's check: distinct bus ids
            raise ConfigError("procs_per_node", cfg.procs_per_node, f"node {node.name} of launcher="
                              f"{placement.launcher} has {usable} GPU(s) for {cfg.procs_per_node} ranks: "
                              "give each rank its own GPU")


def _stages_to_run(cfg: Config) -> set[str]:
    """The stages `only` asks for and everything upstream of them (all, without `only`)."""
    stages = cfg.pipeline.stages
    todo, seen = list(cfg.only or stages), set()
    while todo:
        name = todo.pop()
        if name in seen or name not in stages:
            continue
        seen.add(name)
        todo += [*stages[name].needs, *stages[name].after]
    return seen


def _check_memory(cfg: Config, dims: ParallelDims) -> None:
    """The memory ruler before any rank starts: under a per-rank budget (cluster.device_memory_gib
    on a measured cluster) a layout whose predicted peak exceeds it is refused, with the layout
    that would hold the model (training/planner/fit.py counts the model on the meta device)."""
    budget_gib = cfg.cluster.device_memory_gib
    s = cfg.strategy
    if not cfg.cluster.measured or budget_gib is None or s.from_plan or cfg.dry_run:
        return
    if not {"train", "trials"} & _stages_to_run(cfg):
        return  # the layout is not trained: the stages asked for size themselves (their `fits`)
    from training.planner.fit import SHARDED, counted, rank_memory, smallest_world
    from training.strategies import flavour_of
    from training.units import GIB

    world = cfg.nodes * cfg.procs_per_node
    c = counted(cfg.model, cfg.data, cfg.seed, s.precision, s.activation_checkpointing)
    micro = cfg.train.micro_batch_for(dims.dp_size)
    memory = rank_memory(c, s, flavour_of(s, dims), world, micro)
    if memory.total <= budget_gib * GIB:
        return
    fit = smallest_world(c, dataclasses.replace(s, name=SHARDED), micro * world, budget_gib * GIB, world)
    fix = (f"shard the model: strategy={SHARDED} holds it at world {world} ({fit.describe(budget_gib * GIB)})"
           if fit is not None and fit.ranks <= world else
           f"not even strategy={SHARDED} over {world} ranks holds it: add nodes, lower train.micro_batch or "
           "use strategy.activation_checkpointing=full")
    raise ConfigError("strategy", s.name, f"each of the {world} ranks needs {memory.total / GIB:.2f} GiB "
                      f"(states {memory.states / GIB:.2f}, activations {memory.activation_bytes / GIB:.2f}, "
                      f"FSDP working set {max(memory.working_bytes, memory.tail_bytes) / GIB:.2f}) > "
                      f"cluster.device_memory_gib={budget_gib:g}, the memory ruler; {fix}")


def _check_calibrate(cfg: Config) -> None:
    if cfg.plan.calibrate and cfg.tracking.name != "mlflow":
        raise ConfigError("plan.calibrate", True, "reads earlier runs from MLflow: use tracking=mlflow")


def _check_study_reading(cfg: Config) -> None:
    """A pipeline that reads a study back from MLflow (pipeline=compare) needs both."""
    if not cfg.pipeline.reads_study:
        return
    if cfg.study is None:
        raise ConfigError("study", None, f"pipeline={cfg.pipeline.name} needs study=<study id or MLflow experiment name>")
    if cfg.tracking.name != "mlflow":
        raise ConfigError("tracking", cfg.tracking.name, f"pipeline={cfg.pipeline.name} reads MLflow: use tracking=mlflow")


def _check_world(cfg: Config, gpus: int | None) -> None:
    """What the workers' GPUs allow, where the launcher's resources say (None: the placement check)."""
    world = cfg.nodes * cfg.procs_per_node
    where = "this machine shows" if cfg.launcher.name == "local" else f"launcher={cfg.launcher.name} asks for"
    if cfg.launcher.backend == "nccl" and gpus == 0:
        raise ConfigError("launcher.backend", "nccl", f"needs a CUDA GPU per rank and {where} none; use auto or gloo"
                          + ("" if cfg.launcher.name == "local" else ", or ask for GPUs (cluster=gpu)"))
    if cfg.cluster.accelerator == "cuda" and gpus == 0:
        raise ConfigError("cluster", cfg.cluster.name, f"computes on CUDA GPUs and {where} none; use cluster=cpu-local"
                          + ("" if cfg.launcher.name == "local" else " or launcher.gpus_per_node=<GPUs per node>"))
    if cfg.launcher.name == "slurm" and gpus and cfg.procs_per_node > gpus and cfg.launcher.gpu_bind is None:
        raise ConfigError("procs_per_node", cfg.procs_per_node, f"ranks per node, but launcher.gpus_per_node={gpus}: "
                          "give each rank its own GPU (procs_per_node <= gpus_per_node)")
    if cfg.launcher.name == "local" and gpus and world > gpus and not cfg.dry_run:
        raise ConfigError(
            "nodes",
            cfg.nodes,
            f"nodes x procs_per_node = {world} ranks, but launcher=local has {gpus} GPUs on this host; "
            f"use nodes=1 procs_per_node<={gpus}, or launcher=ray/slurm for more hosts",
        )


_LEARNT: dict[Path, ContractFacts] = {}
"""Facts checked in this process, not yet kept on disk (the pre-check and the run share them)."""


def _contract_path(cfg: Config) -> Path:
    targets = [cfg.model.target, cfg.data.target, cfg.model.loss.target if cfg.model.loss else ""]
    key = digest({"model": to_jsonable(cfg.model), "data": to_jsonable(cfg.data), "seed": cfg.seed,
                  "code": code_version(), "targets": targets_code(targets)})[:24]
    return Path(cfg.cache_dir) / "contract" / f"{key}.json"


def contract_facts(cfg: Config) -> ContractFacts:
    """The user's model and data checked (training/contract/check.py), or what this process or an
    earlier invocation learnt of the same model, data and code: the check builds both, which a
    re-run should not pay."""
    from training.contract.check import describe

    path = _contract_path(cfg)
    if path in _LEARNT:
        return _LEARNT[path]
    try:
        return from_dict(ContractFacts, json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        _LEARNT[path] = describe(cfg.model, cfg.data, cfg.seed)
        return _LEARNT[path]


def keep_contract_facts(cfg: Config) -> None:
    """Keep what the checks learnt for the next invocation; called once the run starts, so that an
    invocation stopped by bad input leaves nothing written."""
    path = _contract_path(cfg)
    if path in _LEARNT and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(to_jsonable(_LEARNT[path])))


def _check_degrees(cfg: Config, gpus: int | None) -> ParallelDims:
    s = cfg.strategy
    try:
        dims = resolve_dims(s, cfg.nodes * cfg.procs_per_node)
    except ValueError as err:
        raise ConfigError("strategy", s.name, str(err)) from None
    if s.precision == "fp16" and gpus == 0 and cfg.cluster.measured:
        # A what-if plan of a named cluster runs nothing: fp16 is a fact of the run it describes.
        raise ConfigError("strategy.precision", "fp16", "needs CUDA (loss scaling); use bf16 or fp32 on CPU")
    return dims


def _check_float8(cfg: Config) -> None:
    """fp8 (bf16 with float8 linears: training/parallel/float8.py) is trained on CPUs (emulated) and
    GPUs of compute capability 8.9+, under every layout, and predicted on a described cluster with
    an fp8 peak. A measured cluster plans it only from a run in it: its speed is measured."""
    asked = [("strategy.precision", cfg.strategy.precision)]
    asked += [("plan.precisions", p) for p in cfg.plan.precisions or []]
    for key, precision in asked:
        if precision != "fp8":
            continue
        if not cfg.cluster.measured:
            if cfg.cluster.fp8_peak_flops is None:
                raise ConfigError(key, precision, f"cluster={cfg.cluster.name} has no fp8 tensor cores "
                                  "(cluster.fp8_peak_flops is null); use bf16")
            continue
        if cfg.strategy.precision != "fp8":
            raise ConfigError(key, precision, "is measured on this cluster only by a run in it: set "
                              "strategy.precision=fp8, or plan it on a described cluster (e.g. cluster=h100-80g-ndr)")
        if cfg.cluster.accelerator == "cuda":  # where this machine shows the GPUs (else each rank checks its own)
            import torch

            from training.parallel.float8 import float8_problem

            problem = float8_problem(torch.device("cuda", 0)) if torch.cuda.is_available() else None
            if problem is not None:
                raise ConfigError(key, precision, f"{problem}; use bf16")


def _check_batches(cfg: Config, dims: ParallelDims, facts: ContractFacts) -> None:
    t = cfg.train
    micro = t.micro_batch_for(dims.dp_size)
    check_microbatches(cfg.strategy, dims, micro)
    global_batch = micro * t.grad_accum * dims.dp_size
    if cfg.cluster.measured and facts.num_samples < global_batch:
        raise ConfigError("data", cfg.data.name, f"holds {facts.num_samples} samples, fewer than one global batch "
                          f"(micro_batch x grad_accum x data-parallel size = {global_batch})")
    finder_batch = cfg.lr_find.batch or micro
    if facts.num_samples < finder_batch:
        raise ConfigError("lr_find.batch", finder_batch, f"must be <= the {facts.num_samples} samples of "
                          f"data={cfg.data.name}")


def _check_stage_names(cfg: Config) -> None:
    known = sorted(cfg.pipeline.stages)
    for key, names in (("only", cfg.only), ("force", cfg.force), ("launcher.stage_timeout_s", cfg.launcher.stage_timeout_s)):
        for name in names:
            if name not in cfg.pipeline.stages:
                raise ConfigError(key, name, f"is not a stage of pipeline={cfg.pipeline.name}; stages: {', '.join(known)}")


def _check_outputs(cfg: Config) -> None:
    path = Path(cfg.cache_dir).resolve()
    existing = next(p for p in [path, *path.parents] if p.exists())
    try:
        if not existing.is_dir():
            raise OSError(f"{existing} is not a directory")
        # A real write, not os.access: root passes access checks on read-only filesystems.
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ConfigError("cache_dir", cfg.cache_dir, f"must be a writable directory ({err})") from None
