"""Checks that span several config groups, run on the driver before anything is launched.

Single-field checks live in each dataclass's `__post_init__`; these need two fields at once or a
fact of the machine (how many GPUs there are). All raise ConfigError: one sentence, the key, the
value, what is allowed.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from pipelines.redact import redact_text
from pipelines.schema import Config
from training.config import ConfigError
from training.parallel.dims import ParallelDims

TOKEN_DATA = ("markov", "text")
FEATURE_DATA = ("blobs",)
TEXT_VOCAB = 256


def cuda_device_count() -> int:
    """Visible CUDA devices; imports torch, so call it only once the config composed."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(cfg: Config, gpus_per_node: int | None = None) -> Config:
    """Fill in what defaults to the machine (procs_per_node) and check the cross-field rules."""
    gpus = cuda_device_count() if gpus_per_node is None else gpus_per_node
    # A what-if plan of a described cluster fills its nodes with that cluster's devices.
    procs = cfg.procs_per_node or (cfg.cluster.devices_per_node if not cfg.cluster.measured else max(gpus, 1))
    cfg = dataclasses.replace(cfg, procs_per_node=procs)
    if cfg.cluster.measured:  # a what-if plan launches nothing: this machine's limits don't apply
        _check_world(cfg, gpus)
    _check_model_data(cfg)
    dims = _check_strategy(cfg, gpus)
    _check_batches(cfg, dims)
    _check_stage_names(cfg)
    _check_outputs(cfg)
    _check_no_secrets_in_scripts(cfg)
    _check_compare(cfg)
    _check_calibrate(cfg)
    return cfg


def _check_calibrate(cfg: Config) -> None:
    if cfg.plan.calibrate and cfg.tracking.name != "mlflow":
        raise ConfigError("plan.calibrate", True, "reads earlier runs from MLflow: use tracking=mlflow")


def _check_compare(cfg: Config) -> None:
    """pipeline=compare reads a study back from MLflow: it needs both."""
    if cfg.pipeline.name != "compare":
        return
    if cfg.study is None:
        raise ConfigError("study", None, "pipeline=compare needs study=<study id or MLflow experiment name>")
    if cfg.tracking.name != "mlflow":
        raise ConfigError("tracking", cfg.tracking.name, "pipeline=compare reads MLflow: use tracking=mlflow")


def _check_world(cfg: Config, gpus: int) -> None:
    world = cfg.nodes * cfg.procs_per_node
    if cfg.launcher.backend == "nccl" and gpus == 0:
        raise ConfigError("launcher.backend", "nccl", "needs CUDA GPUs and none are visible; use auto or gloo")
    if cfg.launcher.name == "local" and gpus and world > gpus and not cfg.dry_run:
        raise ConfigError(
            "nodes",
            cfg.nodes,
            f"nodes x procs_per_node = {world} ranks, but launcher=local has {gpus} GPUs on this host; "
            f"use nodes=1 procs_per_node<={gpus}, or launcher=ray/slurm for more hosts",
        )


def _check_model_data(cfg: Config) -> None:
    model, data = cfg.model, cfg.data
    if model.kind == "gpt" and data.kind not in TOKEN_DATA:
        raise ConfigError("data", data.name, f"model={model.name} (gpt) needs token data: one of {', '.join(TOKEN_DATA)}")
    if model.kind == "mlp" and data.kind not in FEATURE_DATA:
        raise ConfigError("data", data.name, f"model={model.name} (mlp) needs feature data: one of {', '.join(FEATURE_DATA)}")
    if data.kind == "text" and model.vocab_size < TEXT_VOCAB:
        raise ConfigError("model.vocab_size", model.vocab_size, f"data=text is byte-level and needs >= {TEXT_VOCAB}")
    if data.kind == "markov" and data.branching > model.vocab_size:
        raise ConfigError("data.branching", data.branching, f"must be <= model.vocab_size={model.vocab_size}")


def _check_strategy(cfg: Config, gpus: int) -> ParallelDims:
    """Degrees against the world, and against what the model can be split into."""
    s, model = cfg.strategy, cfg.model
    world = cfg.nodes * cfg.procs_per_node
    try:
        dims = ParallelDims.resolve(**s.degrees(), world_size=world)
    except ValueError as err:
        raise ConfigError("strategy", s.name, str(err)) from None
    if dims.tp > 1:
        if model.kind != "gpt":
            raise ConfigError("strategy.tp", dims.tp, f"model={model.name} ({model.kind}) has no attention or "
                              "feed-forward projections to split; use ddp, zero1/2/3 or pp")
        for what, size in (("model.n_heads", model.n_heads), ("model.d_model", model.d_model),
                           ("model.d_model x ffn_mult", model.d_model * model.ffn_mult)):
            if size % dims.tp:
                raise ConfigError("strategy.tp", dims.tp, f"must divide {what}={size}")
    if dims.pp > model.n_layers:
        raise ConfigError("strategy.pp", dims.pp, f"more pipeline stages than model.n_layers={model.n_layers}")
    if s.precision == "fp16" and gpus == 0:
        raise ConfigError("strategy.precision", "fp16", "needs CUDA (loss scaling); use bf16 or fp32 on CPU")
    return dims


def _check_batches(cfg: Config, dims: ParallelDims) -> None:
    t, s = cfg.train, cfg.strategy
    micro = t.micro_batch_for(dims.dp_size)
    if dims.pp > 1 and micro % s.microbatches:
        raise ConfigError("strategy.microbatches", s.microbatches, f"must divide the micro-batch of {micro} samples")
    global_batch = micro * t.grad_accum * dims.dp_size
    if cfg.cluster.measured and cfg.data.num_samples < global_batch:
        raise ConfigError(
            "data.num_samples",
            cfg.data.num_samples,
            f"must hold at least one global batch (micro_batch x grad_accum x data-parallel size = {global_batch})",
        )
    finder_batch = cfg.lr_find.batch or micro
    if cfg.data.num_samples < finder_batch:
        raise ConfigError("lr_find.batch", finder_batch, f"must be <= data.num_samples={cfg.data.num_samples}")


def _check_stage_names(cfg: Config) -> None:
    known = sorted(cfg.pipeline.stages)
    for key in ("only", "force"):
        for name in getattr(cfg, key):
            if name not in cfg.pipeline.stages:
                raise ConfigError(key, name, f"is not a stage of pipeline={cfg.pipeline.name}; stages: {', '.join(known)}")


def _check_no_secrets_in_scripts(cfg: Config) -> None:
    """Setup lines go into generated sbatch scripts: a secret there would sit in clear on disk."""
    for line in cfg.launcher.setup:
        if redact_text(line) != line:
            raise ConfigError("launcher.setup", redact_text(line), "would write a secret into generated job scripts; "
                              "export it in the submitting shell instead (Slurm passes the environment on)")


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
