"""plan: the three rulers, measured, and a recommendation with its reasons.

Ruler 1, memory: the peak of one forward + backward + optimizer step on one device, against
`plan.memory_fraction` of the device. Ruler 2, bandwidth: the all_reduce busbw the probe measured
at its largest size, against the bandwidth ruler. Ruler 3, compute density: FLOPs per sample and
per byte the strategy moves, and the measured compute time of a step against the time its
gradient all-reduce would take at the measured busbw.

The cost model that predicts step time and efficiency for every strategy and size builds on
`Rulers`: it consumes the same measurements.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from stages.bandwidth import BandwidthResult
from stages.common import log, workbench
from stages.lr_find import LrFindResult
from training.config import DataConfig, ModelConfig, PlanConfig, StrategyConfig, TrainConfig
from training.dist import synchronize
from training.flops import flops_per_sample
from training.memory import device_memory_bytes, measure_step
from training.models import loss_fn
from training.parallel.compose import resolve_dims

GIB = 1024**3
TIMED_STEPS = 3


@dataclass(frozen=True)
class PlanInputs:
    plan: PlanConfig
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    strategy: StrategyConfig
    nodes: int
    procs_per_node: int
    seed: int


@dataclass(frozen=True)
class Rulers:
    params: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    activation_bytes: int
    peak_memory_bytes: int
    memory_source: str
    device_memory_bytes: int
    flops_per_sample: float
    step_compute_s: float
    """Median measured time of one micro-batch forward + backward + step on one device."""
    busbw_gbps: float | None
    """Measured all_reduce busbw at the probe's largest size; None when not measured."""
    ruler_gbps: float


@dataclass(frozen=True)
class PlanResult:
    recommended_strategy: str
    reasons: list[str]
    peak_memory_bytes: int
    flops_per_sample: float
    rulers: Rulers
    world_size: int
    grad_allreduce_bytes: int
    """Bytes each rank's gradient all-reduce carries per optimizer step under ddp."""
    comm_to_compute: float | None
    """Predicted all-reduce time / measured compute time per optimizer step."""
    lr: float
    lr_rule: str

    def metrics(self) -> list[tuple[str, float, int]]:
        r = self.rulers
        out = [
            ("memory/peak_gib", self.peak_memory_bytes / GIB, 0),
            ("memory/param_bytes", float(r.param_bytes), 0),
            ("memory/grad_bytes", float(r.grad_bytes), 0),
            ("memory/optim_bytes", float(r.optim_bytes), 0),
            ("memory/activation_bytes", float(r.activation_bytes), 0),
            ("memory/device_gib", r.device_memory_bytes / GIB, 0),
            ("plan/flops_per_sample", self.flops_per_sample, 0),
            ("plan/step_compute_ms", r.step_compute_s * 1e3, 0),
        ]
        if self.comm_to_compute is not None:
            out.append(("plan/comm_to_compute", self.comm_to_compute, 0))
        return out

    def headline(self) -> str:
        r = self.rulers
        busbw = f"{r.busbw_gbps:.2f} GB/s" if r.busbw_gbps is not None else "not measured"
        ratio = f", comm/compute {self.comm_to_compute:.2f}" if self.comm_to_compute is not None else ""
        return (f"{self.recommended_strategy}: peak {self.peak_memory_bytes / GIB:.3f} GiB per device, "
                f"busbw {busbw}{ratio}")


def data_parallel_size(cfg: PlanInputs) -> int:
    return resolve_dims(cfg.strategy, cfg.nodes * cfg.procs_per_node).dp_size


def measure(cfg: PlanInputs, bandwidth: BandwidthResult) -> Rulers:
    """Rulers 1 and 3 on this device, ruler 2 from the probe."""
    bench = workbench(cfg.model, cfg.data, cfg.seed)
    model, dev = bench.model, bench.dev
    inputs, targets = bench.pool
    micro = cfg.train.micro_batch_for(data_parallel_size(cfg))
    x, y = inputs[:micro], targets[:micro]
    flops = flops_per_sample(model, loss_fn, x, y)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        loss_fn(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    # The first step allocates the optimizer state: measure memory there, time the later ones.
    memory = measure_step(model, optimizer, step, dev)
    times = []
    for _ in range(TIMED_STEPS):
        synchronize(dev)
        start = time.perf_counter()
        step()
        synchronize(dev)
        times.append(time.perf_counter() - start)
    device_bytes = cfg.plan.device_memory_bytes or device_memory_bytes(dev, cfg.procs_per_node)
    return Rulers(
        params=sum(p.numel() for p in model.parameters()),
        param_bytes=memory.param_bytes,
        grad_bytes=memory.grad_bytes,
        optim_bytes=memory.optim_bytes,
        activation_bytes=memory.activation_bytes,
        peak_memory_bytes=memory.peak_bytes,
        memory_source=memory.source,
        device_memory_bytes=device_bytes,
        flops_per_sample=flops,
        step_compute_s=statistics.median(times),
        busbw_gbps=bandwidth.largest_all_reduce_busbw_gbps,
        ruler_gbps=bandwidth.ruler_gbps,
    )


def recommend(r: Rulers, cfg: PlanInputs, lr: LrFindResult) -> PlanResult:
    """The seed's rules, applied to measured rulers, each decision with its reason."""
    world = cfg.nodes * cfg.procs_per_node
    dp = data_parallel_size(cfg)
    limit = cfg.plan.memory_fraction * r.device_memory_bytes
    pct = f"{cfg.plan.memory_fraction:.0%}"
    reasons = []
    if r.peak_memory_bytes > limit:
        choice = "zero3"
        reasons.append(
            f"memory: ddp needs {r.peak_memory_bytes / GIB:.2f} GiB per device > {limit / GIB:.2f} GiB "
            f"({pct} of {r.device_memory_bytes / GIB:.1f} GiB): shard the model"
        )
    else:
        choice = "ddp"
        reasons.append(
            f"memory: ddp needs {r.peak_memory_bytes / GIB:.3f} GiB per device <= {limit / GIB:.2f} GiB "
            f"({pct} of {r.device_memory_bytes / GIB:.1f} GiB): replicating fits"
        )
    if r.busbw_gbps is None:
        reasons.append("bandwidth: not measured (world size 1): no interconnect to judge")
    elif r.busbw_gbps < r.ruler_gbps:
        reasons.append(
            f"bandwidth: all_reduce busbw {r.busbw_gbps:.2f} GB/s < {r.ruler_gbps:g} GB/s ruler: keep data "
            f"parallelism within {cfg.plan.max_dp_low_bandwidth} devices"
            + (f" (this run asks for {world})" if world > cfg.plan.max_dp_low_bandwidth else "")
        )
    else:
        reasons.append(f"bandwidth: all_reduce busbw {r.busbw_gbps:.2f} GB/s >= {r.ruler_gbps:g} GB/s ruler")
    grad_bytes = r.grad_bytes
    ratio = None
    samples_per_step = cfg.train.micro_batch_for(dp) * cfg.train.grad_accum
    density = r.flops_per_sample * samples_per_step / max(grad_bytes, 1)
    if r.busbw_gbps:
        comm_s = grad_bytes * 2 * (dp - 1) / dp / (r.busbw_gbps * 1e9)
        compute_s = r.step_compute_s * cfg.train.grad_accum
        ratio = comm_s / compute_s
        bound = "communication-bound: consider hybrid sharding or more accumulation" if ratio > 1 else "compute-bound: data parallelism can hide its all-reduce"
        reasons.append(
            f"compute density: {density:.0f} FLOPs per gradient byte; all-reduce {comm_s * 1e3:.1f} ms vs "
            f"compute {compute_s * 1e3:.1f} ms per step: {bound}"
        )
    else:
        reasons.append(f"compute density: {density:.0f} FLOPs per gradient byte; no busbw to compare it with")
    reasons.append(f"lr: {lr.scaled_lr:.2e} ({lr.lr_scaling} rule from {lr.suggested_lr:.2e} at batch {lr.finder_batch} "
                   f"to {lr.target_batch}), {lr.warmup_steps} warm-up steps")
    return PlanResult(
        recommended_strategy=choice,
        reasons=reasons,
        peak_memory_bytes=r.peak_memory_bytes,
        flops_per_sample=r.flops_per_sample,
        rulers=r,
        world_size=world,
        grad_allreduce_bytes=grad_bytes,
        comm_to_compute=ratio,
        lr=lr.scaled_lr,
        lr_rule=lr.lr_scaling,
    )


def run(cfg: PlanInputs, *, bandwidth: BandwidthResult, lr_find: LrFindResult) -> PlanResult:
    rulers = measure(cfg, bandwidth)
    result = recommend(rulers, cfg, lr_find)
    for reason in result.reasons:
        log("plan", reason)
    return result
