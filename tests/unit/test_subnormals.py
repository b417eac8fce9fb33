"""CPU ranks compute subnormal floats as zero: the thread a stage runs in is set up so by
select_device (x86 takes a slow path for each operation on a subnormal, and a training model's
softmaxes soon hold them: pipelines/launchers/worker.py flush_subnormals)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from pipelines.launchers.worker import select_device
from training.envinfo import subnormals_flushed


def in_a_thread(fn: Callable[[], object]) -> dict[str, object]:
    """`fn`'s result from a thread of its own: the setting is per thread, and pytest's own thread
    must keep IEEE arithmetic for the tests that follow."""
    out: dict[str, object] = {}
    thread = threading.Thread(target=lambda: out.update(result=fn()))
    thread.start()
    thread.join()
    return out


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA select_device picks the GPU and leaves the CPU as is")


@CPU_ONLY
def test_a_cpu_rank_flushes_subnormals_in_the_thread_that_selected_its_device():
    def after_select() -> tuple[bool, bool]:
        before = subnormals_flushed()
        assert select_device() is None
        return before, subnormals_flushed()

    assert in_a_thread(after_select)["result"] == (False, True)
    # The result is read off arithmetic: a thread that did not select a device keeps subnormals.
    assert in_a_thread(lambda: (torch.tensor([1e-39]) * 1.0).item())["result"] == pytest.approx(1e-39, rel=1e-3)
    assert not subnormals_flushed()


@CPU_ONLY
def test_threads_started_after_the_setting_inherit_it():
    """torch's intra-op pool starts its threads after select_device ran in the stage's thread:
    they compute as it does (x86 threads inherit the floating-point control word)."""
    def child_of_a_flushing_thread() -> bool:
        select_device()
        return in_a_thread(subnormals_flushed)["result"]

    assert in_a_thread(child_of_a_flushing_thread)["result"] is True
