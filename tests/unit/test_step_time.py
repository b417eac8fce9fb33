"""A step's time from its parts (training/planner/step.py), with hand numbers: data-parallel traffic
hides behind backward (two thirds of compute, for forward 1 : backward 2) up to `overlap`, except
its last bucket's or unit's reduction; tensor-, expert- and pipeline-parallel traffic is on the
critical path; each collective call pays the host's call cost; the pipeline bubble stretches the
busy time by idle / (1 - idle)."""

from __future__ import annotations

import pytest

from training.parallel.dims import ParallelDims
from training.planner.comm import Comm
from training.planner.step import step_time

MS = 1e-3


def test_data_parallel_traffic_hides_behind_two_thirds_of_compute():
    """3 ms of compute hides 2 ms of a 5 ms reduction under full overlap: 3 ms exposed."""
    comm = Comm(data_parallel_s=5 * MS, tensor_parallel_s=0.0, pipeline_s=0.0, tail_s=0.5 * MS)
    full = step_time(3 * MS, comm, ParallelDims(dp_replicate=2), 1, overlap=1.0)
    assert full.exposed_comm_s == pytest.approx(3 * MS) and full.step_s == pytest.approx(6 * MS)
    half = step_time(3 * MS, comm, ParallelDims(dp_replicate=2), 1, overlap=0.5)
    assert half.exposed_comm_s == pytest.approx(4 * MS), "half the overlap hides 1 ms"
    none = step_time(3 * MS, comm, ParallelDims(dp_replicate=2), 1, overlap=0.0)
    assert none.exposed_comm_s == pytest.approx(5 * MS), "gloo on a CPU host: nothing hides"


def test_the_last_reduction_is_never_hidden_and_model_parallel_traffic_never_is():
    """A 1 ms reduction under 2 ms of hiding room still exposes its last bucket (0.5 ms); TP's 1 ms,
    EP's 0.25 ms and 4 calls at 0.1 ms each are all on the critical path."""
    comm = Comm(data_parallel_s=1 * MS, tensor_parallel_s=1 * MS, pipeline_s=0.0, calls=4, tail_s=0.5 * MS,
                expert_parallel_s=0.25 * MS)
    step = step_time(3 * MS, comm, ParallelDims(dp_replicate=2, tp=2), 1, overlap=1.0, call_cost_s=0.1 * MS)
    assert step.exposed_comm_s == pytest.approx((0.5 + 1 + 0.25 + 0.4) * MS)
    assert step.collective_calls == 4


def test_the_bubble_stretches_the_busy_time_by_idle_over_busy():
    """pp 2 with 2 microbatches under 1F1B idles (p - 1) / (m + p - 1) = 1/3 of the step: the bubble
    is half the busy time (4 ms of compute, 1 ms overhead, 1 ms sends: 3 ms of bubble)."""
    comm = Comm(data_parallel_s=0.0, tensor_parallel_s=0.0, pipeline_s=1 * MS)
    step = step_time(4 * MS, comm, ParallelDims(pp=2), 2, overlap=1.0, overhead_s=1 * MS)
    assert step.bubble_s == pytest.approx(3 * MS) and step.step_s == pytest.approx(9 * MS)
