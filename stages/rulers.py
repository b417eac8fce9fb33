"""The plan's three rulers measured on this machine: one step of the run's setting on one device (a
slice of the model when it exceeds one, carried to the full depth), timed, its memory and the
strategies' overheads measured (Rulers); the hardware they and the bandwidth probe describe, and the
rulers as sentences.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stages.bandwidth import BandwidthResult
from stages.common import Workbench, workbench
from training import strategies
from training.config import StrategyConfig
from training.expert_gemms import MAX_WEIGHT_BYTES, ExpertGemms
from training.memory import AuditRow
from training.planner.advice import (
    PlanInputs,
    budget_bytes,
    data_parallel_size,
    described_hardware,
)
from training.planner.hardware import EXPERT_DISPATCH, Hardware, PassCost, measured_links
from training.planner.shape import Activations, Anatomy

TIMED_STEPS = 5
DISPATCH_SAID = "'s dispatch (its experts split on one rank)"
MAX_TIMED_STEPS = 50
TIMED_BUDGET_S = 1.0


@dataclass(frozen=True)
class Rulers:
    anatomy: Anatomy
    """The model measured from its module: shape, FLOPs, activations and positions per sample."""
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
    """One micro-batch's forward, backward and optimizer step on one device, as the trainer's loop
    runs it: its mean step (loop_step_s)."""
    strategy_overhead_s: dict[str, float]
    """Per strategy: what its wrapper adds to that step, measured on a one-rank process group; for
    a mixture of experts also `ep`: what expert parallelism's dispatch adds (training/overhead.py)."""
    overhead_not_measured: dict[str, str]
    """Strategy -> why its overhead could not be measured (taken as none)."""
    threads: int
    """CPU threads the measurement ran with (the launcher gives every rank the same share)."""
    busbw_gbps: float | None
    """Measured all_reduce busbw at the probe's largest size; None when not measured."""
    ruler_gbps: float
    memory_audit: list[AuditRow]
    """Memory in use after each top-level module of one forward and backward of the micro-batch (the
    seed's audit), counted on the meta device in the run's precision, attention as fused kernels run it."""
    sliced_blocks: int | None = None
    """None: the whole model was timed on one device. Else the model exceeds one device's budget:
    a slice of this many blocks (with embeddings and head) was timed, and `step_compute_s` is its
    per-block cost carried to the full depth (and `param_bytes` ... `peak_memory_bytes` the slice's)."""
    expert_gemms: ExpertGemms | None = None
    """A mixture of experts: its experts' GEMMs at their routed rows per expert-parallel degree
    against one GEMM of the same FLOPs, timed on this device (None: a dense model, or experts too
    large to time, which ruler_reasons says)."""
    passes: PassCost | None = None
    """`step_compute_s` split into its part per sample, per forward and backward pass and per
    optimizer step (pass_cost; on a slice, the slice's shares); None where the timings could not
    tell them apart."""


def loop_step_s(bench: Workbench, parallel: Any, optimizer: Any, micro: int, cfg: PlanInputs) -> float:
    """The mean step of the trainer's own loop (training/loop.py) on this device, as the train stage
    reports its step: each step a fresh micro-batch from the run's loader, the LR schedule stepped,
    the losses read once, the window's mean (a stall now and then is part of what a step pays).
    A fixed batch's median step leaves that out: gpt-tiny at micro-batch 8 on the 2-core host this
    was written on timed 5.50-5.63 ms so, its loop 5.82-5.90 ms (four pairs in one process), and
    every prediction scales this one number. At least TIMED_STEPS steps, more (up to
    MAX_TIMED_STEPS) while they add up to under TIMED_BUDGET_S; a first short loop warms up."""
    import math

    import torch

    from training.data import GlobalBatches, loader
    from training.loop import LoopShape, lr_lambda, train_loop

    t, steps, mean = cfg.train, TIMED_STEPS, None
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.warmup_steps, t.steps, t.schedule))
    batches = GlobalBatches(len(bench.dataset), micro, 1, 0, 1, cfg.seed)
    while mean is None or (mean * steps < TIMED_BUDGET_S and steps < MAX_TIMED_STEPS):
        if mean is not None:
            steps = min(MAX_TIMED_STEPS, max(steps + 1, math.ceil(TIMED_BUDGET_S / mean)))
        data = iter(loader(bench.dataset, batches, 0, steps + 1, cfg.data.num_workers, bench.dev))
        shape = LoopShape(steps=steps + 1, accum=1, grad_clip=t.grad_clip, log_every=steps + 1, timing_warmup=1)
        stats = train_loop(parallel, optimizer, scheduler, data, shape, bench.dev)
        mean = stats.timed_seconds / stats.timed_steps
    return mean


def pass_cost(step: Callable[[list[Any]], Any], batch: Callable[[int], Any], micro: int,
              dev: Any) -> PassCost | None:
    """Split the step of a `micro`-sample batch into its parts (PassCost), from three steps timed in
    turn, round after round (a drift of the host's speed meets all three alike): the step itself;
    the step with a second pass of the batch, which adds one pass (the difference; the rest of the
    step is the optimizer's); and, where the micro-batch halves, the step of half the batch, which
    gives the pass's part per sample and so its fixed part. At a micro-batch of 1 the pass is all
    per sample. None where a difference comes out below zero (the timings' noise exceeds what they
    are meant to tell)."""
    from training.dist import synchronize

    whole = batch(micro)
    turns = {"one": [whole], "two": [whole, whole]}
    if micro >= 2:
        turns["half"] = [batch(micro // 2)]
    times: dict[str, list[float]] = {name: [] for name in turns}
    for batches in turns.values():  # a new shape warms its own kernels and allocations
        step(batches)
    while len(times["one"]) < TIMED_STEPS or (sum(map(sum, times.values())) < TIMED_BUDGET_S
                                              and len(times["one"]) < MAX_TIMED_STEPS):
        for name, batches in turns.items():
            start = time.perf_counter()
            step(batches)
            synchronize(dev)
            times[name].append(time.perf_counter() - start)
    one, two = statistics.median(times["one"]), statistics.median(times["two"])
    one_pass, optimizer_s = two - one, 2 * one - two
    if one_pass <= 0 or optimizer_s < 0:
        return None
    fixed = 0.0
    if "half" in times:
        half = micro // 2
        per_sample = (one - statistics.median(times["half"])) / (micro - half)
        if per_sample <= 0:
            return None
        fixed = min(max(one_pass - per_sample * micro, 0.0), one_pass)
    return PassCost(micro=micro, pass_share=fixed / one, step_share=optimizer_s / one)


def step_strategy(cfg: PlanInputs) -> StrategyConfig:
    """The one-device step the plan measures: the run's precision and activation checkpointing."""
    return StrategyConfig(name="ddp", precision=cfg.strategy.precision,
                          activation_checkpointing=cfg.strategy.activation_checkpointing,
                          bucket_cap_mb=cfg.strategy.bucket_cap_mb)


def measure(cfg: PlanInputs, bandwidth: BandwidthResult, anatomy: Anatomy) -> Rulers:
    """Rulers 1 and 3 on this device, ruler 2 from the probe. The step measured and timed is the
    training step itself (training/step.py), with the run's precision and checkpointing; `anatomy`
    (counted on the meta device: counted_on_meta) takes the activations that step saved."""
    import torch

    from training.contract.calls import to_device
    from training.data import first_samples
    from training.dist import synchronize
    from training.memory import StepProbe, device_memory_bytes
    from training.overhead import measure_overheads
    from training.parallel.compose import trainable
    from training.planner.anatomy import meta_memory_audit
    from training.step import optimizer_step

    micro = cfg.train.micro_batch_for(data_parallel_size(cfg))
    blocks = sliced_to(cfg, micro)
    bench = workbench(cfg.model, cfg.data, cfg.seed, cfg.train.tf32, blocks)
    model, dev = bench.model, bench.dev
    batch = to_device(first_samples(bench.dataset, micro), dev)
    audit = meta_memory_audit(cfg.model, cfg.seed, to_device(batch, torch.device("meta")), cfg.strategy.precision)
    parallel, optimizer = trainable(model, bench.spec, step_strategy(cfg), dev, bench.loss)
    clip = cfg.train.grad_clip

    def step(probe: StepProbe | None = None, held: list | None = None) -> None:
        finish = (lambda: held.append(probe.finish(optimizer))) if probe is not None else None
        optimizer_step(parallel, optimizer, [batch], 1, clip, dev, before_zero=finish)
        synchronize(dev)

    # The first step allocates the optimizer state: measure memory there (gradients still held),
    # time the later ones.
    held: list = []
    with StepProbe(parallel.model, dev) as probe:
        step(probe, held)
    memory = held[0]
    compute = loop_step_s(bench, parallel, optimizer, micro, cfg)
    passes = pass_cost(lambda batches: optimizer_step(parallel, optimizer, batches, len(batches), clip, dev),
                       lambda count: to_device(first_samples(bench.dataset, count), dev), micro, dev)
    overheads = measure_overheads(model, cfg.model, bench.loss, batch, list(cfg.plan.strategies or strategies.pure()), dev, clip,
                                  step_strategy(cfg))
    device_bytes = (budget_bytes(cfg) or cfg.plan.device_memory_bytes
                    or usable_device_bytes(bandwidth, memory.reserve_ratio)
                    or device_memory_bytes(dev, cfg.procs_per_node))
    gemms = expert_gemms(cfg, anatomy, micro, dev)
    if blocks is None:
        anatomy = dataclasses.replace(anatomy, activations=Activations(saved=memory.activation_bytes / micro))
    else:  # the slice's step, carried to the whole depth; the activations stay the meta count's
        del bench, model, parallel, optimizer, step
        compute = extrapolated(cfg, blocks, compute, micro, anatomy)
    return Rulers(
        anatomy=anatomy,
        params=anatomy.shape.params,
        param_bytes=memory.param_bytes,
        grad_bytes=memory.grad_bytes,
        optim_bytes=memory.optim_bytes,
        activation_bytes=memory.activation_bytes,
        peak_memory_bytes=memory.peak_bytes,
        memory_source=memory.source,
        device_memory_bytes=device_bytes,
        flops_per_sample=anatomy.flops_per_sample,
        step_compute_s=compute,
        strategy_overhead_s=overheads.seconds,
        overhead_not_measured=overheads.not_measured,
        threads=torch.get_num_threads(),
        busbw_gbps=bandwidth.largest_all_reduce_busbw_gbps,
        ruler_gbps=bandwidth.ruler_gbps,
        memory_audit=audit,
        sliced_blocks=blocks,
        expert_gemms=gemms,
        passes=passes,
    )


def expert_gemms(cfg: PlanInputs, anatomy: Anatomy, micro: int, dev) -> ExpertGemms | None:  # noqa: ANN001 - a device
    """The experts' GEMMs timed at each expert-parallel degree the world allows (dividing the
    experts and the ranks), in the run's precision, for the tokens a rank routes in a micro-batch."""
    import torch

    from training.expert_gemms import expert_width, measure_expert_gemms
    from training.parallel.precision import DTYPES

    shape = anatomy.shape
    if not shape.experts:
        return None
    experts = max(shape.experts)
    world = cfg.nodes * cfg.procs_per_node
    degrees = [ep for ep in range(1, experts + 1) if experts % ep == 0 and world % ep == 0]
    width = expert_width(shape.expert_params, shape.moe_layers, experts, shape.hidden)
    return measure_expert_gemms(shape.hidden, width, experts, shape.top_k, micro * shape.seq_len, degrees,
                                DTYPES[cfg.strategy.precision] or torch.float32, dev)


def usable_device_bytes(bandwidth: BandwidthResult, reserve_ratio: float) -> int | None:
    """CUDA: the memory the workers found free (context and NCCL buffers held), in the bytes the
    predictions count: allocated ones, of which the caching allocator reserves `reserve_ratio`
    times as many (measured on this plan's step). None elsewhere."""
    if bandwidth.free_device_bytes is None:
        return None
    return int(bandwidth.free_device_bytes / max(reserve_ratio, 1.0))


def sliced_to(cfg: PlanInputs, micro: int) -> int | None:
    """The blocks of the model the plan's one device can hold under a budget (None: all of it)."""
    from training.planner.fit import blocks_that_fit

    budget = budget_bytes(cfg)
    if budget is None:
        return None
    blocks = blocks_that_fit(cfg.model, cfg.data, cfg.seed, cfg.strategy, micro, budget)
    if blocks == 0:
        raise ValueError(f"not even one block of the model and its embeddings and head fits one device's "
                         f"cluster.device_memory_gib={cfg.cluster.device_memory_gib:g} at micro-batch {micro}: "
                         "the plan can't time a step; raise the budget or lower train.micro_batch")
    return blocks


def extrapolated(cfg: PlanInputs, blocks: int, sliced_s: float, micro: int, anatomy: Anatomy) -> float:
    """The whole model's step from a slice of `blocks` blocks timed at `sliced_s`: the per-block
    cost from a second slice of one block, (t_k - t_1) / (k - 1), carried to the full depth; with
    a slice of one block, by the FLOPs the whole executes over the slice's (counted on meta)."""
    layers = anatomy.shape.layers
    if blocks > 1:
        one = _sliced_step_s(cfg, 1, micro)
        per_block = max(sliced_s - one, 0.0) / (blocks - 1)
        return sliced_s + (layers - blocks) * per_block
    from training.contract.calls import batch_loss, model_loss
    from training.planner.anatomy import build_on_meta
    from training.planner.counting import FlopCount

    net, spec = build_on_meta(cfg.model, cfg.seed)
    spec.keep_first_blocks(1)
    with FlopCount() as flops:
        batch_loss(net, meta_sample(cfg), model_loss(cfg.model)).backward()
    return sliced_s * anatomy.flops_per_sample / flops.total


def _sliced_step_s(cfg: PlanInputs, blocks: int, micro: int) -> float:
    """The loop's mean step (loop_step_s) of the model's first `blocks` blocks on this device."""
    from training.parallel.compose import trainable

    bench = workbench(cfg.model, cfg.data, cfg.seed, cfg.train.tf32, blocks)
    parallel, optimizer = trainable(bench.model, bench.spec, step_strategy(cfg), bench.dev, bench.loss)
    return loop_step_s(bench, parallel, optimizer, micro, cfg)


def measured_tiers(bandwidth: BandwidthResult) -> dict[str, Any]:
    """Hardware's links by tier from what the probe measured. One node: its links serve every
    size (launcher=local: every rank on this host's links; nothing measured across nodes). One rank
    per node: every group crosses nodes. Several of each: the node's own ranks (intra), the whole
    world (inter, full nodes) and one rank per node (inter, one rank's share of the NICs)."""
    world = measured_links(bandwidth.results, bandwidth.world_size)
    if bandwidth.nodes <= 1:
        return {"devices_per_node": 10**9, "intra": world, "inter": world}
    if bandwidth.procs_per_node <= 1 or not bandwidth.node_results:
        return {"devices_per_node": bandwidth.procs_per_node, "intra": {}, "inter": world}
    return {"devices_per_node": bandwidth.procs_per_node,
            "intra": measured_links(bandwidth.node_results, bandwidth.procs_per_node), "inter": world,
            "inter_single": measured_links(bandwidth.spread_results, bandwidth.nodes)}


def hardware(cfg: PlanInputs, executed_flops_per_sample: float, rulers: Rulers | None,
             bandwidth: BandwidthResult | None, micro: int) -> Hardware:
    """Measured numbers for cluster=cpu-local (and any `measured` cluster), else the preset's."""
    if not cfg.cluster.measured:
        return described_hardware(cfg, executed_flops_per_sample)
    assert rulers is not None and bandwidth is not None, "a measured cluster needs the measurements"
    cpu = rulers.memory_source != "cuda_allocator"
    # The ranks' own threads and cores as the bandwidth stage found them on every rank; at one
    # rank (nothing probed) this process's.
    shared = bandwidth.shared_cores if cpu else None
    return Hardware(
        device_memory_bytes=rulers.device_memory_bytes,
        **measured_tiers(bandwidth),
        seconds_per_sample=rulers.step_compute_s / micro,
        passes=rulers.passes,
        cores=(shared.cores if shared else os.cpu_count() or 1) if cpu else None,
        threads_per_device=shared.threads_per_rank if shared else rulers.threads,
        overhead_s=rulers.strategy_overhead_s,
        shared=shared,
    )


def ruler_reasons(r: Rulers, cfg: PlanInputs, world: int) -> list[str]:
    """The bandwidth and compute-density rulers as sentences."""
    reasons = []
    if r.sliced_blocks is not None:
        reasons.append(f"compute: the model exceeds one device's budget (cluster.device_memory_gib="
                       f"{cfg.cluster.device_memory_gib:g}): timed a slice of its first {r.sliced_blocks} of "
                       f"{r.anatomy.shape.layers} blocks with embeddings and head, the per-block cost carried to the "
                       "full depth")
    if cfg.cluster.measured and r.passes is not None:
        sample, fixed_pass, fixed_step = r.passes.parts(r.step_compute_s / r.passes.micro)
        reasons.append(f"compute: the {r.step_compute_s * 1e3:.1f} ms step of {r.passes.micro} samples is "
                       f"{sample * 1e3:.2f} ms a sample, {fixed_pass * 1e3:.2f} ms a forward and backward pass "
                       f"whatever its size and {fixed_step * 1e3:.2f} ms for the optimizer step (timed with a second "
                       "pass and at half the micro-batch): microbatches and accumulation pay the pass each")
    elif cfg.cluster.measured:
        reasons.append("compute: the step's parts could not be told apart (its timings' noise exceeds their "
                       "differences): all of it is counted per sample")
    if r.busbw_gbps is None:
        reasons.append("bandwidth: not measured (world size 1): no interconnect to judge, no prediction beyond 1 device")
    elif r.busbw_gbps < r.ruler_gbps:
        reasons.append(
            f"bandwidth: all_reduce busbw {r.busbw_gbps:.2f} GB/s < {r.ruler_gbps:g} GB/s ruler: keep data "
            f"parallelism within {cfg.plan.max_dp_low_bandwidth} devices"
            + (f" (this run asks for {world})" if world > cfg.plan.max_dp_low_bandwidth else "")
        )
    else:
        reasons.append(f"bandwidth: all_reduce busbw {r.busbw_gbps:.2f} GB/s >= {r.ruler_gbps:g} GB/s ruler")
    if r.strategy_overhead_s or r.overhead_not_measured:
        measured = ", ".join(f"{k}{DISPATCH_SAID if k == EXPERT_DISPATCH else ''} +{v * 1e3:.1f} ms"
                             for k, v in sorted(r.strategy_overhead_s.items()))
        missing = "; ".join(f"{k} not measured ({why})" for k, why in sorted(r.overhead_not_measured.items()))
        reasons.append(f"overhead: each strategy's wrapper, measured on one rank, adds to the "
                       f"{r.step_compute_s * 1e3:.1f} ms step: {measured or 'none measured'}"
                       + (f"; {missing}" if missing else ""))
    if r.expert_gemms is not None:
        reasons.append(r.expert_gemms.describe())
    elif r.anatomy.shape.experts:
        reasons.append(f"experts' GEMMs: not timed (one layer's experts outweigh the {MAX_WEIGHT_BYTES // 2**20} MiB "
                       "the measurement allocates)")
    micro = cfg.train.micro_batch_for(data_parallel_size(cfg))
    density = r.flops_per_sample * micro * cfg.train.grad_accum / max(r.grad_bytes, 1)
    reasons.append(f"compute density: {r.flops_per_sample:.3g} FLOPs per sample, {density:.0f} FLOPs per gradient "
                   f"byte all-reduced")
    return reasons


def meta_sample(cfg: PlanInputs, samples: int = 1):  # noqa: ANN201 - a Batch on the meta device
    """The data's first `samples`, on the meta device (what the model is measured on without memory)."""
    import torch

    from training.contract.calls import to_device
    from training.data import build_dataset, first_samples

    return to_device(first_samples(build_dataset(cfg.data), samples), torch.device("meta"))
