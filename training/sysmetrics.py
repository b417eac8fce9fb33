"""Per-node system metrics while `train` runs, named as MLflow's own system metrics.

MLflow's SystemMetricsMonitor logs from the process that owns the run; here the ranks never talk
to MLflow (the driver logs), and the nodes may be other hosts. So one rank per node (local rank
0) samples the same quantities with psutil in a thread, the samples travel back with the stage's
result, and the driver logs them as `system/<node id>/<metric>`, MLflow's layout for a node id.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class SystemSample:
    node: str
    """`<host>-node<N>`: the host name alone would merge the emulated nodes of one machine."""
    t_s: float
    """Seconds since sampling started."""
    cpu_utilization_percentage: float
    system_memory_usage_megabytes: float
    system_memory_usage_percentage: float
    gpu_memory_usage_megabytes: float | None
    """Memory held by this node's local-rank-0 process on its GPU; None without CUDA."""

    METRICS = ("cpu_utilization_percentage", "system_memory_usage_megabytes", "system_memory_usage_percentage",
               "gpu_memory_usage_megabytes")


def node_id() -> str:
    host = socket.gethostname().split(".")[0] or "host"
    return f"{host}-node{os.environ.get('GROUP_RANK', '0')}"


class SystemSampler:
    """Samples every `interval_s` in a daemon thread while the block runs, and once at its end,
    so even a run shorter than the interval has a sample (CPU use over its whole length)."""

    def __init__(self, interval_s: float, node: str):
        self.interval_s, self.node = interval_s, node
        self.samples: list[SystemSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="system-metrics", daemon=True)
        self._t0 = 0.0

    def __enter__(self) -> SystemSampler:
        import psutil

        psutil.cpu_percent(interval=None)  # the first reading is meaningless: prime the counter
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        import psutil
        import torch

        memory = psutil.virtual_memory()
        gpu = torch.cuda.memory_reserved() / 2**20 if torch.cuda.is_available() else None
        self.samples.append(SystemSample(
            node=self.node,
            t_s=round(time.monotonic() - self._t0, 3),
            cpu_utilization_percentage=psutil.cpu_percent(interval=None),
            system_memory_usage_megabytes=(memory.total - memory.available) / 2**20,
            system_memory_usage_percentage=memory.percent,
            gpu_memory_usage_megabytes=gpu,
        ))


def sample_metrics(samples: list[SystemSample]) -> list[tuple[str, float, int]]:
    """MLflow (key, value, step): `system/<node>/<metric>` at step = the node's sample index."""
    out: list[tuple[str, float, int]] = []
    index: dict[str, int] = {}
    for s in samples:
        step = index[s.node] = index.get(s.node, -1) + 1
        for name in SystemSample.METRICS:
            value = getattr(s, name)
            if value is not None:
                out.append((f"system/{s.node}/{name}", float(value), step))
    return out
