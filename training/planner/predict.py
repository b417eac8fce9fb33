"""Ruler 3 joined to the others: step time, throughput, memory and scaling efficiency of a layout
(predict_layout, the planner's evaluate), from a Workload on a Hardware.
"""

from __future__ import annotations

from dataclasses import dataclass

from training import strategies
from training.parallel.dims import ParallelDims
from training.planner.calibration import Calibration
from training.planner.comm import comm_time
from training.planner.hardware import EXPERT_DISPATCH, Hardware
from training.planner.memory import memory_per_device
from training.planner.pipeline import rerun_shares
from training.planner.step import StepPrediction, step_time
from training.planner.workload import Workload, feasible

COSTMODEL_VERSION = 5
"""Bumped when the predicted components change meaning (2: per-call latency, measured strategy
overhead; 3: FSDP gathers per micro-batch, the last bucket's reduction never hidden, recomputation
in compute; 4: FSDP2's overhead timed with its copies, on a fake group of two; 5: compute timed as
the trainer's loop runs it, its loader and schedule included): plan.calibrate only fits runs
predicted by the same version."""


@dataclass(frozen=True)
class Prediction:
    strategy: str
    devices: int
    fits: bool
    memory_per_device_bytes: float
    step_time_s: float
    tokens_per_s: float
    scaling_efficiency: float
    samples_per_s: float
    exposed_comm_s: float
    """The model's exposed communication, before calibration."""
    bubble_s: float
    """The model's pipeline bubble, before calibration."""
    compute_s: float = 0.0
    """The model's compute per step, before calibration (step_time_s = their sum uncalibrated)."""
    overhead_s: float = 0.0
    """The strategy's measured per-step overhead, before calibration."""
    collective_calls: int = 0
    """Collective calls per step in the model."""
    seconds_per_sample: float = 0.0
    """The hardware's measured compute per sample these components were computed from."""
    threads: int = 0
    """The threads that compute per sample was timed with (StepPrediction.threads)."""
    expert_parallel_s: float = 0.0
    """Of the communication, expert parallelism's all-to-alls a step (Comm.expert_parallel_s),
    uncalibrated: what the advisor reports for an expert layout."""

    @property
    def components(self) -> StepPrediction:
        """The uncalibrated components, with their basis: what calibration fits a measured step to."""
        return StepPrediction(self.compute_s, self.exposed_comm_s, self.bubble_s, self.overhead_s,
                              self.collective_calls, self.seconds_per_sample, self.threads)


def predict(w: Workload, hw: Hardware, strategy: str, devices: int, memory_limit: float, overlap: float,
            single_device_samples_per_s: float, calibration: Calibration | None = None) -> Prediction | None:
    """A pure strategy on `devices` (its preset degrees); see predict_layout."""
    return predict_layout(w, hw, strategy, ParallelDims(**strategies.get(strategy).degrees_on(devices)), memory_limit, overlap,
                          single_device_samples_per_s, calibration)


def predict_layout(w: Workload, hw: Hardware, flavour: str, d: ParallelDims, memory_limit: float, overlap: float,
                   single_device_samples_per_s: float, calibration: Calibration | None = None,
                   name: str | None = None) -> Prediction | None:
    """Step time, throughput, memory and efficiency of the layout `d` whose data parallelism is
    `flavour` (ddp, zero1, zero2 or zero3); None if the model can't be laid out so. `name` is the
    strategy it is reported as (default: the flavour). With a `calibration`, the step time is its
    refinement of the model's components."""
    if not feasible(w.shape, d, w):
        return None
    name = name or flavour
    devices = d.world_size
    comm = comm_time(w.shape, flavour, d, w.micro_batch, w.grad_accum, w.microbatches, w.precision, hw.link,
                     w.bucket_cap_bytes, w.clip, hw.devices_per_node, w.sequence_parallel and d.tp > 1,
                     w.checkpointing, w.pp_virtual_stages, w.imbalance_at(d.ep), w.v_shaped,
                     rerun_shares(w.pp_schedule, d.pp, w.microbatches, w.pp_virtual_stages))
    per_sample = w.seconds_per_sample if w.seconds_per_sample is not None else hw.seconds_per_sample
    passes = w.grad_accum * (w.microbatches if d.pp > 1 else 1)  # a pipeline cuts each micro-batch
    compute = (hw.compute_s(per_sample, w.micro_batch * w.grad_accum, passes, d) * hw.contention(devices)
               * w.expert_straggler(d) * w.tp_unsplit(d))
    overhead = hw.strategy_overhead(flavour, devices) * w.grad_accum
    if d.ep > 1:  # the dispatch's host work: per MoE layer and call, a stage's layers for each of its microbatches
        calls = w.microbatches / d.pp if d.pp > 1 else 1
        overhead += hw.strategy_overhead(EXPERT_DISPATCH, devices) * w.grad_accum * calls
    # Each collective follows its share of the step's compute: the stretch the ranks drift over.
    step = step_time(compute, comm, d, w.microbatches, overlap, overhead, w.pp_schedule, w.pp_virtual_stages,
                     hw.call_cost(devices, (compute + overhead) / max(comm.calls, 1)))
    step_s = step.step_s
    if calibration is not None:
        step_s = calibration.step_s(name, step)
    samples_per_s = w.micro_batch * w.grad_accum * d.dp_size / step_s
    memory = memory_per_device(w, flavour, d)
    return Prediction(
        strategy=name,
        devices=devices,
        fits=memory <= memory_limit,
        memory_per_device_bytes=memory,
        step_time_s=step_s,
        tokens_per_s=samples_per_s * w.tokens_per_sample,
        scaling_efficiency=samples_per_s / (devices * single_device_samples_per_s),
        samples_per_s=samples_per_s,
        exposed_comm_s=step.exposed_comm_s,
        bubble_s=step.bubble_s,
        compute_s=step.compute_s,
        overhead_s=step.overhead_s,
        collective_calls=step.collective_calls,
        seconds_per_sample=hw.seconds_per_sample,
        threads=hw.threads_per_device,
        expert_parallel_s=comm.expert_parallel_s,
    )


def device_counts(max_devices: int, requested: int) -> list[int]:
    """1, 2, 4 ... up to max_devices, plus the requested world."""
    counts = {requested}
    n = 1
    while n <= max_devices:
        counts.add(n)
        n *= 2
    return sorted(counts)
