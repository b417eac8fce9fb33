"""A step's time from its parts: compute, the communication not hidden behind it, the strategy's
overhead and the pipeline bubble.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.parallel.dims import ParallelDims
from training.planner.comm import Comm
from training.planner.pipeline import pipeline_bubble


@dataclass(frozen=True)
class StepPrediction:
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    overhead_s: float = 0.0
    """The strategy's own per-step work besides the model's (hooks, copies, sharded optimizer)."""
    collective_calls: int = 0
    """Collectives per step (Comm.calls): what the shared-cores line's cost per call multiplies
    (Hardware.call_cost, already in exposed_comm_s)."""
    seconds_per_sample: float = 0.0
    """The measured compute per sample (one device, alone) the components were computed from: the
    basis a calibration fitted on them predicts from (Calibration.bases); 0: unknown."""
    threads: int = 0
    """The threads that timing ran with (a CPU rank's: 2 alone on this 2-core host, 1 a rank at
    world 2); 0: unknown."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.overhead_s + self.exposed_comm_s + self.bubble_s


def step_time(compute_s: float, comm: Comm, d: ParallelDims, microbatches: int, overlap: float,
              overhead_s: float = 0.0, schedule: str = "1f1b", virtual: int = 1,
              call_cost_s: float = 0.0) -> StepPrediction:
    """compute + the strategy's overhead + exposed communication + pipeline bubble.

    `compute_s` is the whole step's compute on one rank (its share of the model and batch).
    Data-parallel traffic hides behind the backward pass (2/3 of compute) up to `overlap`;
    tensor- and pipeline-parallel traffic is on the critical path. `call_cost_s` is what each
    collective issued between compute costs beyond its probe time (CPU hosts: SharedCores)."""
    hidden = overlap * compute_s * 2 / 3
    dp_exposed = max(comm.data_parallel_s - hidden, min(comm.tail_s, comm.data_parallel_s) if overlap else 0.0, 0.0)
    exposed = (dp_exposed + comm.tensor_parallel_s + comm.expert_parallel_s + comm.pipeline_s
               + comm.calls * call_cost_s)
    busy = compute_s + overhead_s + exposed
    idle = pipeline_bubble(d.pp, microbatches, schedule, virtual)
    bubble = busy * idle / (1 - idle)
    return StepPrediction(compute_s, exposed, bubble, overhead_s, comm.calls)
