"""Per-node system metrics while `train` runs, named as MLflow's own system metrics.

MLflow's SystemMetricsMonitor logs from the process that owns the run; here the ranks never talk
to MLflow (the driver logs), and the nodes may be other hosts. So one rank per node (local rank
0) samples the same quantities in a thread (psutil for CPU and memory; NVML, as MLflow's GPU
monitor does, for every GPU of the node), the samples travel back with the stage's result, and
the driver logs them as `system/<node id>/<metric>`, MLflow's layout for a node id.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

MB = 1e6
"""MLflow's GPU monitor reports decimal megabytes (memory.used / 1e6); so do these."""


@dataclass(frozen=True)
class GpuSample:
    """One GPU of the node at one sample, as MLflow's GPU monitor reads it from NVML."""

    index: int
    """NVML's index, as MLflow's gpu_<i>_... names use it (PCI bus order; CUDA's may differ)."""
    utilization_percentage: float | None
    """Percent of the last sample period in which a kernel ran (nvmlDeviceGetUtilizationRates)."""
    memory_usage_megabytes: float | None
    """Memory in use on the device by every process, not only this one."""
    memory_usage_percentage: float | None
    power_usage_watts: float | None
    """None where the GPU does not report power."""
    power_usage_percentage: float | None
    """Of the enforced power limit."""

    METRICS = ("utilization_percentage", "memory_usage_megabytes", "memory_usage_percentage", "power_usage_watts",
               "power_usage_percentage")


@dataclass(frozen=True)
class SystemSample:
    node: str
    """`<host>-node<N>`: the host name alone would merge the emulated nodes of one machine."""
    t_s: float
    """Seconds since sampling started."""
    cpu_utilization_percentage: float
    system_memory_usage_megabytes: float
    system_memory_usage_percentage: float
    gpu_memory_usage_megabytes: float | None = None
    """No longer sampled (it was one process's reserved memory, not the node's: see `gpus`); kept
    so that summaries written with it still read."""
    gpus: list[GpuSample] = field(default_factory=list)
    """Every GPU of the node, through NVML; empty without NVML or a driver."""

    METRICS = ("cpu_utilization_percentage", "system_memory_usage_megabytes", "system_memory_usage_percentage")


class Nvml:
    """This node's GPUs through an initialised NVML module (pynvml, or a test's stand-in)."""

    def __init__(self, nvml: Any):
        self.nvml = nvml
        # NVML sees every GPU of the node, whatever CUDA_VISIBLE_DEVICES hides from this process.
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]

    def read(self) -> list[GpuSample]:
        """One sample of every GPU."""
        return [self._read(index, handle) for index, handle in enumerate(self.handles)]

    def _read(self, index: int, handle: Any) -> GpuSample:
        """One GPU's sample; a quantity the GPU does not report is None, as MLflow skips it."""
        memory = self._query("nvmlDeviceGetMemoryInfo", handle)
        rates = self._query("nvmlDeviceGetUtilizationRates", handle)
        milliwatts = self._query("nvmlDeviceGetPowerUsage", handle)
        limit_milliwatts = self._query("nvmlDeviceGetEnforcedPowerLimit", handle)
        return GpuSample(
            index=index,
            utilization_percentage=float(rates.gpu) if rates is not None else None,
            memory_usage_megabytes=memory.used / MB if memory is not None else None,
            memory_usage_percentage=100 * memory.used / memory.total if memory is not None and memory.total else None,
            power_usage_watts=milliwatts / 1e3 if milliwatts is not None else None,
            power_usage_percentage=100 * milliwatts / limit_milliwatts if milliwatts is not None and limit_milliwatts
            else None,
        )

    def _query(self, function: str, handle: Any) -> Any:
        """An NVML query's answer, or None where it raises NVMLError (e.g. NotSupported)."""
        try:
            return getattr(self.nvml, function)(handle)
        except self.nvml.NVMLError:
            return None

    def close(self) -> None:
        """Shut NVML down (it counts its inits: this undoes this sampler's)."""
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def open_nvml(module: Any = None) -> Nvml | None:
    """NVML over this node's GPUs, or None where nvidia-ml-py or the NVIDIA driver is missing."""
    if module is None:
        try:
            import pynvml as module
        except ImportError:
            return None
    try:
        module.nvmlInit()
    except (module.NVMLError, OSError):  # no driver (NVML Shared Library Not Found), no GPU
        return None
    try:
        return Nvml(module)
    except module.NVMLError:
        module.nvmlShutdown()
        return None


def node_id() -> str:
    host = socket.gethostname().split(".")[0] or "host"
    return f"{host}-node{os.environ.get('GROUP_RANK', '0')}"


class SystemSampler:
    """Samples every `interval_s` in a daemon thread while the block runs, and once at its end,
    so even a run shorter than the interval has a sample (CPU use over its whole length)."""

    def __init__(self, interval_s: float, node: str, nvml: Any = None):
        self.interval_s, self.node = interval_s, node
        self.samples: list[SystemSample] = []
        self._nvml_module = nvml  # a test's stand-in for pynvml; None imports pynvml
        self._gpus: Nvml | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="system-metrics", daemon=True)
        self._t0 = 0.0

    def __enter__(self) -> SystemSampler:
        import psutil

        psutil.cpu_percent(interval=None)  # the first reading is meaningless: prime the counter
        self._gpus = open_nvml(self._nvml_module)
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        if self._gpus is not None:
            self._gpus.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        import psutil

        memory = psutil.virtual_memory()
        self.samples.append(SystemSample(
            node=self.node,
            t_s=round(time.monotonic() - self._t0, 3),
            cpu_utilization_percentage=psutil.cpu_percent(interval=None),
            # As MLflow's own CPU monitor logs it: used memory in decimal megabytes.
            system_memory_usage_megabytes=memory.used / MB,
            system_memory_usage_percentage=memory.percent,
            gpus=self._gpus.read() if self._gpus is not None else [],
        ))


def sample_metrics(samples: list[SystemSample]) -> list[tuple[str, float, int]]:
    """MLflow (key, value, step): `system/<node>/<metric>` at step = the node's sample index."""
    out: list[tuple[str, float, int]] = []
    index: dict[str, int] = {}
    for s in samples:
        step = index[s.node] = index.get(s.node, -1) + 1
        out += [(f"system/{s.node}/{name}", value, step) for name, value in node_values(s)]
    return out


def node_values(s: SystemSample) -> list[tuple[str, float]]:
    """A sample's (metric, value) pairs under MLflow's names: gpu_<i>_<quantity> for each GPU."""
    named = [(name, getattr(s, name)) for name in SystemSample.METRICS]
    named += [(f"gpu_{g.index}_{name}", getattr(g, name)) for g in s.gpus for name in GpuSample.METRICS]
    return [(name, float(value)) for name, value in named if value is not None]
