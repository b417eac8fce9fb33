"""Each GPU of the node through NVML, under MLflow's gpu_<i>_... names (an NVML stand-in injected:
no GPU here); without NVML or its driver no GPU metrics and no error."""

from __future__ import annotations

import pickle
import sys
from types import SimpleNamespace

import pytest

from pipelines.configtools import from_dict, to_jsonable
from training.sysmetrics import GpuSample, SystemSample, SystemSampler, open_nvml, sample_metrics


class FakeNvmlError(Exception):
    """pynvml.NVMLError's stand-in."""


def fake_nvml(gpus: list[dict], init_error: bool = False) -> SimpleNamespace:
    """A module with pynvml's surface over `gpus`: used/total bytes, util %, power mW (None: not supported)."""
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_error:
            raise FakeNvmlError("NVML Shared Library Not Found")

    def power(gpu: dict) -> int:
        if gpu["mw"] is None:
            raise FakeNvmlError("Not Supported")
        return gpu["mw"]

    return SimpleNamespace(
        calls=calls,
        NVMLError=FakeNvmlError,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda i: gpus[i],
        nvmlDeviceGetMemoryInfo=lambda g: SimpleNamespace(used=g["used"], total=g["total"], free=g["total"] - g["used"]),
        nvmlDeviceGetUtilizationRates=lambda g: SimpleNamespace(gpu=g["util"], memory=0),
        nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetEnforcedPowerLimit=lambda g: 700_000,
    )


TWO_GPUS = [dict(used=40e9, total=80e9, util=97, mw=350_000), dict(used=8e9, total=80e9, util=3, mw=None)]


def sampled(nvml: SimpleNamespace) -> list[SystemSample]:
    with SystemSampler(3600, "host-node0", nvml=nvml) as sampler:
        pass
    return sampler.samples


def test_two_gpus_give_each_its_utilisation_and_memory_under_mlflows_names():
    nvml = fake_nvml(TWO_GPUS)
    samples = sampled(nvml)
    assert len(samples) == 1 and [g.index for g in samples[0].gpus] == [0, 1]
    metrics = {k: v for k, v, _ in sample_metrics(samples)}
    gpu_metrics = {k.removeprefix("system/host-node0/"): v for k, v in metrics.items() if "/gpu_" in k}
    assert {k: v for k, v in gpu_metrics.items() if "power" not in k} == pytest.approx({
        "gpu_0_utilization_percentage": 97.0, "gpu_0_memory_usage_megabytes": 40_000.0,
        "gpu_0_memory_usage_percentage": 50.0,
        "gpu_1_utilization_percentage": 3.0, "gpu_1_memory_usage_megabytes": 8_000.0,
        "gpu_1_memory_usage_percentage": 10.0,
    })
    # Power where the GPU reports it (MLflow's names too), nothing where it raises NotSupported.
    assert {k: v for k, v in gpu_metrics.items() if "power" in k} == pytest.approx({
        "gpu_0_power_usage_watts": 350.0, "gpu_0_power_usage_percentage": 50.0})
    assert "system/host-node0/cpu_utilization_percentage" in metrics
    assert nvml.calls == ["init", "shutdown"]


def test_no_nvml_package_gives_no_gpu_metrics_and_no_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert open_nvml() is None
    with SystemSampler(3600, "host-node0") as sampler:
        pass
    assert sampler.samples[0].gpus == []
    assert not [k for k, _, _ in sample_metrics(sampler.samples) if "gpu" in k]


def test_nvml_without_a_driver_gives_no_gpu_metrics_and_no_error():
    nvml = fake_nvml(TWO_GPUS, init_error=True)
    assert open_nvml(nvml) is None
    samples = sampled(nvml)
    assert samples[0].gpus == [] and not [k for k, _, _ in sample_metrics(samples) if "gpu" in k]


def test_the_real_nvml_here_gives_the_gpus_or_nothing():
    pynvml = pytest.importorskip("pynvml")
    reader = open_nvml()
    if reader is None:  # no NVIDIA driver, as on the CPU machines
        with pytest.raises(pynvml.NVMLError):
            pynvml.nvmlInit()
        return
    try:
        assert len(reader.read()) == pynvml.nvmlDeviceGetCount() >= 1
    finally:
        reader.close()


def test_a_sample_with_gpus_pickles_and_reads_back_from_json():
    gpu = GpuSample(0, 97.0, 40_000.0, 50.0, None, None)
    sample = SystemSample("host-node0", 1.5, 12.0, 900.0, 30.0, gpus=[gpu])
    assert pickle.loads(pickle.dumps(sample)) == sample
    assert from_dict(SystemSample, to_jsonable(sample)) == sample


def test_a_sample_written_before_nvml_still_reads():
    old = dict(node="host-node0", t_s=1.0, cpu_utilization_percentage=5.0, system_memory_usage_megabytes=1.0,
               system_memory_usage_percentage=2.0, gpu_memory_usage_megabytes=None)
    assert from_dict(SystemSample, old).gpus == []
