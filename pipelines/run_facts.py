"""What an invocation is, in the terms summary.json's run block, MLflow's params and a study's rows
use: its requested layout, global batch, world and where it ran.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pipelines.placement import Placement
from pipelines.schema import Config


def global_batch(cfg: Config) -> int:
    """Samples per optimizer step of the scaled run: micro-batch x grad_accum x data-parallel size."""
    from training.parallel.dims import resolve_dims

    dp = resolve_dims(cfg.strategy, cfg.nodes * cfg.procs_per_node).dp_size
    return cfg.train.global_batch_for(dp)


def requested_layout(cfg: Config) -> str:
    """What this invocation asked to train: its degrees, micro-batch x accumulation, precision and
    checkpointing, or `auto` (the plan's recommendation, measured by trials when plan.trials > 0)."""
    from training.parallel.dims import resolve_dims
    from training.planner.ranking import setting_label

    if cfg.strategy.from_plan:
        name = cfg.strategy.name
        return f"{name}, {cfg.plan.trials} trials" if cfg.plan.trials else name
    dims = resolve_dims(cfg.strategy, cfg.nodes * cfg.procs_per_node)
    s = cfg.strategy
    return setting_label(dataclasses.asdict(dims), cfg.train.micro_batch_for(dims.dp_size),
                         cfg.train.grad_accum, s.precision, s.activation_checkpointing)


def run_facts(cfg: Config, placement: Placement | None = None) -> dict[str, Any]:
    """What this invocation was, for summary.json's `run` block and a study's rows."""
    return {
        "study": cfg.study,
        "pipeline": cfg.pipeline.name,
        "strategy": cfg.strategy.name,
        "layout": requested_layout(cfg),
        "nodes": cfg.nodes,
        "procs_per_node": cfg.procs_per_node,
        "world_size": cfg.nodes * cfg.procs_per_node,
        "global_batch": global_batch(cfg),
        "model": cfg.model.name,
        "data": cfg.data.name,
        "cluster": cfg.cluster.name,
        "launcher": cfg.launcher.name,
        # Where its measurements were made: the same sweep on two clusters is two variants.
        "placement": None if placement is None else f"{placement.launcher}@{placement.fingerprint[:12]}",
        "seed": cfg.seed,
        "finished_at": round(time.time(), 3),
    }
