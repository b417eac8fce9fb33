"""The CPU device-memory tracker and its budget (training/budget.py), in this process: it counts
what tensors hold exactly, each storage once, until it is freed; it keeps the peak; it sees
backward, storage resizes and tensors made before it started; over a budget, the op fails with one
line, as CUDA's out-of-memory would."""

from __future__ import annotations

import pytest
import torch

from pipelines.launchers.base import Task
from pipelines.launchers.worker import MEMORY_FILE, peak_memory, run_task
from training.budget import DeviceMemory, DeviceOutOfMemory, StorageTracker
from training.units import GIB

F32 = 4


def test_a_known_allocation_counts_exactly_and_freeing_it_subtracts():
    with StorageTracker() as tracker:
        before = tracker.current_bytes
        x = torch.empty(1000)
        assert tracker.current_bytes - before == 1000 * F32
        y = torch.zeros(10, 10, dtype=torch.float64)
        assert tracker.current_bytes - before == 1000 * F32 + 100 * 8
        del x
        assert tracker.current_bytes - before == 100 * 8
        del y
        assert tracker.current_bytes == before


def test_views_of_one_storage_count_once():
    with StorageTracker() as tracker:
        x = torch.empty(100, 10)
        held = tracker.current_bytes
        views = [x[3:7], x.t(), x.view(10, 100), x.reshape(-1), x[:, 2], torch.nn.Parameter(x), x.detach()]
        assert tracker.current_bytes == held == 1000 * F32
        del x
        assert tracker.current_bytes == held, "the views keep the storage alive"
        del views
        assert tracker.current_bytes == 0


def test_the_peak_is_kept_after_what_made_it_is_freed():
    with StorageTracker() as tracker:
        big = torch.empty(5000)
        del big
        small = torch.empty(1000)
        assert tracker.current_bytes == 1000 * F32 and tracker.peak_bytes == 5000 * F32
        del small


def test_tensors_made_before_it_started_count_from_their_first_use():
    made_before = torch.empty(2000)
    with StorageTracker() as tracker:
        assert tracker.current_bytes == 0
        made_before.add_(1.0)  # in place: no new storage, but the tracker now knows this one
        assert tracker.current_bytes == 2000 * F32
        made_before.mul_(2.0)
        assert tracker.current_bytes == 2000 * F32


def test_backward_allocations_are_seen():
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    params = sum(p.numel() * F32 for p in layer.parameters())
    with StorageTracker() as tracker:
        loss = layer(x).square().sum()
        activation = 64 * 256 * F32  # the layer's output, saved for square's backward
        assert tracker.current_bytes == x.numel() * F32 + params + activation + F32
        loss.backward()
        del loss
        # Backward made the gradients (and freed the activation): all of them counted, exactly.
        assert tracker.current_bytes == x.numel() * F32 + params + params
        assert tracker.peak_bytes >= tracker.current_bytes + activation, "backward's own temporaries"


def test_over_the_budget_in_backward_the_same_error_comes_out_of_backward():
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    with StorageTracker(500_000) as tracker:
        loss = layer(x).square().sum()
        assert tracker.current_bytes < 500_000
        with pytest.raises(DeviceOutOfMemory, match=r"^rank 0: device memory budget exceeded: [^\n]+$"):
            loss.backward()


def test_storage_resizes_are_counted_as_fsdp_frees_and_regathers_parameters():
    with StorageTracker() as tracker:
        x = torch.empty(1000)
        x.untyped_storage().resize_(0)
        assert tracker.current_bytes == 0
        x.untyped_storage().resize_(1000 * F32)
        assert tracker.current_bytes == 1000 * F32
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_, "restored when the tracker ends"


def test_over_the_budget_the_op_fails_with_one_line_as_cuda_out_of_memory_would():
    budget = 10_000
    with StorageTracker(budget, rank=3, budget_gib=budget / GIB) as tracker:
        kept = torch.empty(2000)
        with pytest.raises(torch.OutOfMemoryError) as failed:
            torch.ones(1000)
        assert failed.type is DeviceOutOfMemory
        assert str(failed.value) == ("rank 3: device memory budget exceeded: 12000 bytes in use > 10000 bytes "
                                     f"(cluster.device_memory_gib={budget / GIB:g})")
        # The op that failed returned nothing: its bytes are freed, and the peak stays in budget.
        assert tracker.current_bytes == 2000 * F32 and tracker.peak_bytes == 2000 * F32
        kept.add_(1.0)  # what fits still runs
        del kept


def test_the_message_speaks_in_gib_at_device_sizes():
    with StorageTracker(GIB // 100, rank=0, budget_gib=0.01) as tracker, pytest.raises(DeviceOutOfMemory) as failed:
        torch.empty(GIB // 64, dtype=torch.uint8)
    assert tracker.current_bytes == 0
    assert str(failed.value) == "rank 0: device memory budget exceeded: 16.00 MiB in use > 10.24 MiB (cluster.device_memory_gib=0.01)"
    big = StorageTracker(int(1.25 * GIB), rank=3, budget_gib=1.25)
    big.current_bytes = int(1.31 * GIB)
    assert str(big._over_budget()) == ("rank 3: device memory budget exceeded: 1.31 GiB in use > 1.25 GiB "
                                       "(cluster.device_memory_gib=1.25)")


def test_on_cpu_only_a_budget_turns_tracking_on():
    with DeviceMemory(None) as unbudgeted:
        torch.empty(1000)
    assert unbudgeted.peak_bytes is None, "no budget on CPU: nothing tracked, nothing slowed"
    with DeviceMemory(1.0) as budgeted:
        torch.empty(1000)
    assert budgeted.peak_bytes == 1000 * F32


def allocate(n: int) -> int:
    """A stage function: holds n float32 numbers for a moment."""
    return int(torch.ones(n).sum())


def test_run_task_leaves_the_peak_for_the_driver_also_when_the_stage_fails(tmp_path):
    task = Task(stage="t", fn="tests.unit.test_budget:allocate", inputs=1000, workdir=tmp_path, memory_budget_gib=1.0)
    assert run_task(task) == 1000
    assert (tmp_path / MEMORY_FILE.format(rank=0)).exists()
    assert peak_memory(tmp_path) == 1000 * F32 + F32, "the numbers and their sum"
    over = Task(stage="t", fn="tests.unit.test_budget:allocate", inputs=10**6, workdir=tmp_path,
                memory_budget_gib=1000 * F32 / GIB)
    with pytest.raises(DeviceOutOfMemory):
        run_task(over)
    assert peak_memory(tmp_path) == 0, "the failed allocation is not in the peak"
