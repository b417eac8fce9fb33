"""training/shared_cores.py: the line of what a collective issued after compute costs is held
against the bandwidth probe's fit, which the plan charges the call first (a one-rank gloo group:
the arithmetic of the measurement, not the host's numbers, which tests/dist/test_bandwidth.py
and `make bench` take at 2 and 4 ranks)."""

from __future__ import annotations

import datetime

import pytest


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    yield
    dist.destroy_process_group()


def test_the_line_is_the_call_after_compute_beyond_the_probes_fit(one_rank):
    """A fit that gives each call a second (far more than any call takes here) leaves no line; a
    fit that gives it nothing leaves the whole call, timed after compute, in the line. The fit is
    asked at the sizes the measurement calls."""
    from training.collectives import element_count
    from training.shared_cores import SIZES, measure

    asked: list[int] = []

    def fit(seconds: float):  # noqa: ANN202
        def expected(nbytes: int) -> float:
            asked.append(nbytes)
            return seconds
        return expected

    max_bytes = 1 << 20
    slow = measure(max_bytes, 10, 1, fit(1.0))
    assert (slow.call_s, slow.drift) == (0.0, 0.0)
    assert set(asked) == {4 * element_count(min(s, max_bytes), 1) for s in SIZES}
    free = measure(max_bytes, 10, 1, fit(0.0))
    assert free.call_s + free.drift * free.together_s > 0
