"""Worker functions for the pipeline-schedule tests (importable by the ranks run_world starts)."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from training.config import DataConfig, ModelConfig, StrategyConfig


def in_flight(inputs: tuple[ModelConfig, DataConfig, dict[str, StrategyConfig], int]) -> dict[str, list[dict]]:
    """For each named strategy: two training steps over a micro-batch of `micro` samples, and the
    second one's peak in flight on every pipeline rank (training/parallel/inflight.py), by rank."""
    model_cfg, data_cfg, strategies, micro = inputs
    return {name: _in_flight(model_cfg, data_cfg, strategy, micro) for name, strategy in strategies.items()}


def _in_flight(model_cfg: ModelConfig, data_cfg: DataConfig, strategy: StrategyConfig, micro: int) -> list[dict]:
    from stages.common import workbench
    from training.data import first_samples
    from training.contract.calls import to_device
    from training.parallel.chunks import chunk_blocks, parts
    from training.parallel.compose import build_optimizer, parallelize
    from training.parallel.inflight import InFlight
    from training.step import optimizer_step

    bench = workbench(model_cfg, data_cfg, seed=0)
    blocks = len(bench.spec.blocks)
    layout = bench.spec.layout(bench.model)
    parallel = parallelize(bench.model, bench.spec, strategy, bench.dev, bench.loss)
    optimizer = build_optimizer(parallel, 1e-3, 0.0)
    batch = to_device(first_samples(bench.dataset, micro), bench.dev)
    chunks = parts(parallel.model)
    per_stage = blocks / parallel.dims.pp
    probe = InFlight(chunks, [len(chunk_blocks(c, layout)) / per_stage for c in chunks])
    optimizer_step(parallel, optimizer, [batch], 1, None, bench.dev)  # shape inference, optimizer state
    with probe:
        optimizer_step(parallel, optimizer, [batch], 1, None, bench.dev)
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, dataclasses.asdict(probe.peak))
    return peaks
