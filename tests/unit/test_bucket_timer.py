"""BucketTimer's CUDA path, run here with CUDA events and NCCL's already-completed future faked:
the start is recorded before the launch, the end in the future's callback, both resolved lazily,
and a bucket queued behind the previous one on the NCCL stream is charged only its own time."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from training.parallel import ddp
from training.parallel.ddp import BucketEvents, BucketTimer


class Clock:
    """The GPU's timeline in ms: where the stream recording an event is, and when NCCL's is free."""

    now = 0.0
    nccl_free = 0.0


class FakeEvent:
    """torch.cuda.Event's timing surface on the fake timeline; done once the GPU passes it."""

    gpu_at = float("inf")

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.t: float | None = None

    def record(self) -> None:
        self.t = Clock.now

    def query(self) -> bool:
        return self.t is not None and self.t <= FakeEvent.gpu_at

    def synchronize(self) -> None:
        FakeEvent.gpu_at = max(FakeEvent.gpu_at, self.t)

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.query() and other.query(), "CUDA refuses elapsed_time before both events complete"
        return other.t - self.t


@dataclass
class FakeBucket:
    """A GradBucket whose buffer lives on the GPU, with the duration its fake all-reduce takes."""

    duration_ms: float
    ready_at: float

    def buffer(self):  # noqa: ANN201
        return type("CudaTensor", (), {"is_cuda": True})()


def fake_allreduce(_group, bucket: FakeBucket) -> torch.futures.Future:
    """NCCL's future: completed at enqueue; its callbacks run on a stream that waits for the end."""
    # The NCCL stream starts it once the gradients are ready and the previous all-reduce is done.
    Clock.nccl_free = max(Clock.nccl_free, bucket.ready_at) + bucket.duration_ms
    Clock.now = Clock.nccl_free
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(torch.zeros(1))
    return future


@pytest.fixture
def cuda_faked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(ddp.default_hooks, "allreduce_hook", fake_allreduce)
    Clock.now, Clock.nccl_free, FakeEvent.gpu_at = 0.0, 0.0, float("inf")


def launch(timer: BucketTimer, bucket: FakeBucket) -> None:
    Clock.now = bucket.ready_at  # the compute stream reaches the hook when the gradients are ready
    timer(None, bucket).wait()


def test_each_bucket_is_timed_from_ready_to_completion_and_read_lazily(cuda_faked):
    timer = BucketTimer()
    FakeEvent.gpu_at = -1.0  # the GPU is behind the host: nothing resolves while the step runs
    launch(timer, FakeBucket(duration_ms=10, ready_at=0))
    launch(timer, FakeBucket(duration_ms=4, ready_at=30))
    assert timer._ms == [] and len(timer._pending) == 2, "no wait in the hook"
    assert timer.ms == pytest.approx([10, 4])


def test_a_bucket_queued_behind_the_previous_all_reduce_gets_only_its_own_time(cuda_faked):
    timer = BucketTimer()
    launch(timer, FakeBucket(duration_ms=10, ready_at=0))  # reduces over [0, 10]
    launch(timer, FakeBucket(duration_ms=5, ready_at=2))  # ready at 2, starts at 10, ends at 15
    launch(timer, FakeBucket(duration_ms=3, ready_at=40))  # next step: the stream is idle again
    assert timer.ms == pytest.approx([10, 5, 3])


def test_completed_pairs_resolve_in_the_hook_without_waiting(cuda_faked):
    timer = BucketTimer()
    FakeEvent.gpu_at = 12.0  # the GPU has finished the first all-reduce only
    launch(timer, FakeBucket(duration_ms=10, ready_at=0))
    launch(timer, FakeBucket(duration_ms=10, ready_at=20))
    launch(timer, FakeBucket(duration_ms=10, ready_at=40))
    assert timer._ms == pytest.approx([10]) and len(timer._pending) == 2
    assert timer.ms == pytest.approx([10, 10, 10])


def test_a_previous_end_reported_late_leaves_the_whole_interval():
    start, end, previous = FakeEvent(True), FakeEvent(True), FakeEvent(True)
    start.t, end.t, previous.t = 0.0, 6.0, 7.0
    assert BucketEvents(start, end, previous).ms() == pytest.approx(6.0)
