"""A DDP bucket's all-reduce time covers its completion, not its launch: on 2 real gloo ranks, a
rank that arrives 0.3 s late holds the other's first bucket for those 0.3 s."""

from __future__ import annotations

import pytest

from tests.helpers import run_world

LATE_S = 0.3


def bucket_times_with_a_late_rank(_inputs: object) -> list[list[float]]:
    """Every rank's bucket times of one backward in which rank 1 starts LATE_S late."""
    import time

    import torch
    import torch.distributed as dist

    from training.dist import gather_objects
    from training.parallel.ddp import apply_ddp, time_buckets

    torch.manual_seed(0)
    model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)), torch.device("cpu"),
                      bucket_cap_mb=25, find_unused_parameters=False)
    timer = time_buckets(model)
    loss = model(torch.randn(4, 64)).sum()
    if dist.get_rank() == 1:
        time.sleep(LATE_S)
    loss.backward()
    return gather_objects(timer.ms)


@pytest.mark.slow
def test_the_first_bucket_waits_for_the_late_rank():
    on_time, late = run_world("tests.dist.test_ddp_bucket_times:bucket_times_with_a_late_rank", world=2)
    assert on_time and late, "each rank timed its buckets"
    assert on_time[0] >= (LATE_S - 0.05) * 1e3, f"rank 0's first bucket took {on_time[0]:.1f} ms: launch, not completion"
    assert late[0] < on_time[0], "the late rank found its peer waiting"
