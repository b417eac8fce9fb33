"""Where a training step's time goes: torch.profiler over a few real steps, by kind of work.

The seed asked "how many ms all_reduce vs matmul vs memcpy"; this answers it from the run itself
(steps between the memory probe and the timed window), summed per kind and divided per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


KINDS = {
    "communication": ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "reducescatter",
                      "broadcast", "nccl", "gloo", "send", "recv", "c10d", "all_to_all", "alltoall"),
    "matmul": ("mm", "matmul", "linear", "addmm", "bmm", "baddbmm", "attention", "sdpa"),
    "memcpy": ("copy_", "memcpy", "to_copy", "cat", "clone", "contiguous"),
}


@dataclass(frozen=True)
class TimeSplit:
    kind: str
    ms_per_step: float
    percent: float


def kind_of(op: str) -> str:
    """The kind of work an operator name denotes (communication is checked first)."""
    name = op.lower()
    for kind, needles in KINDS.items():
        if any(needle in name for needle in needles):
            return kind
    return "other"


class StepProfiler:
    """Profile the steps in [first, first + count) of the loop."""

    def __init__(self, first: int, count: int, device: torch.device):
        from torch.profiler import ProfilerActivity, profile

        self.first, self.count = first, count
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._profile = profile(activities=activities)
        self.split: list[TimeSplit] = []

    def covers(self, step: int) -> bool:
        return self.first <= step < self.first + self.count

    def start(self) -> None:
        self._profile.__enter__()

    def stop(self) -> None:
        self._profile.__exit__(None, None, None)
        self.split = summarize(self._profile.key_averages(), self.count)


def summarize(events, steps: int) -> list[TimeSplit]:  # noqa: ANN001 - torch's EventList
    """Self time (device time where there is a device, else CPU) per kind, per step."""
    totals: dict[str, float] = {}
    for event in events:
        device_us = getattr(event, "self_device_time_total", 0) or 0
        us = device_us if device_us > 0 else event.self_cpu_time_total
        totals[kind_of(event.key)] = totals.get(kind_of(event.key), 0.0) + us
    whole = sum(totals.values()) or 1.0
    return [TimeSplit(kind, us / 1e3 / steps, 100 * us / whole) for kind, us in sorted(totals.items(), key=lambda kv: -kv[1])]


def split_table(split: list[TimeSplit]) -> str:
    rows = ["| kind | ms per step | share |", "|---|---:|---:|"]
    rows += [f"| {s.kind} | {s.ms_per_step:.2f} | {s.percent:.1f} % |" for s in split]
    return "\n".join(rows) + "\n"
