"""Where a training step's time goes: torch.profiler over a few real steps, by kind of work.

The seed asked "how many ms all_reduce vs matmul vs memcpy"; this answers it from the run itself
(steps between the memory probe and the timed window), summed per kind and divided per step.
On CUDA it is the GPU's own work: each kernel, memcpy and memset once, by its name. On CPU it is
each operator's self CPU time, by the operator's name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


KINDS = {
    "communication": ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "reducescatter",
                      "broadcast", "nccl", "gloo", "send", "recv", "c10d", "all_to_all", "alltoall"),
    "matmul": ("mm", "matmul", "linear", "addmm", "bmm", "baddbmm", "attention", "sdpa"),
    "memcpy": ("copy_", "memcpy", "to_copy", "cat", "clone", "contiguous"),
}


# GPU activity rows (device_type CUDA) are named by the kernel, not the operator, so they get their
# own needles: an operator needle like "mm" or "cat" would also hit kernel names' template text
# ("scatter_gather_elementwise_kernel<...>").
KERNEL_KINDS = {
    # NCCL's kernels: ncclDevKernel_AllReduce_Sum_bf16_RING_LL, ncclKernel_AllGather_..., SendRecv.
    "communication": ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                      "reducescatter", "alltoall"),
    # cuBLAS/CUTLASS GEMMs (sm90_xmma_gemm_..., ampere_bf16_s16816gemm_..., cutlass::Kernel, Hopper's
    # nvjet_..., cublasLt::splitKreduce_kernel), Triton matmul templates, and attention kernels:
    # flash-attention (flash_fwd_kernel, flash_bwd_...), xformers/mem-efficient fmha_cutlassF/B,
    # cuDNN's ..._sdpa_... .
    "matmul": ("gemm", "gemv", "xmma", "cutlass", "nvjet", "cublas", "triton_tem", "flash_fwd", "flash_bwd",
               "fmha", "sdpa", "attention"),
    # The copy engines' rows ("Memcpy HtoD (Pageable -> Device)", "Memset (Device)") and copy kernels.
    "memcpy": ("memcpy", "memset", "copy_kernel", "catarraybatchedcopy"),
}


@dataclass(frozen=True)
class TimeSplit:
    kind: str
    ms_per_step: float
    percent: float


def kind_of(op: str, kinds: dict[str, tuple[str, ...]] = KINDS) -> str:
    """The kind of work a name denotes, by `kinds`' needles (communication is checked first)."""
    name = op.lower()
    for kind, needles in kinds.items():
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
        self.on_gpu = device.type == "cuda"
        self.split: list[TimeSplit] = []

    def covers(self, step: int) -> bool:
        return self.first <= step < self.first + self.count

    def start(self) -> None:
        self._profile.__enter__()

    def stop(self) -> None:
        self._profile.__exit__(None, None, None)
        self.split = summarize(self._profile.key_averages(), self.count, self.on_gpu)


def summarize(events: Iterable[Any], steps: int, on_gpu: bool) -> list[TimeSplit]:
    """Time per kind per step: GPU activity's device time on CUDA, else operators' self CPU time."""
    totals: dict[str, float] = {}
    for kind, us in (gpu_times(events) if on_gpu else cpu_times(events)):
        totals[kind] = totals.get(kind, 0.0) + us
    whole = sum(totals.values()) or 1.0
    return [TimeSplit(kind, us / 1e3 / steps, 100 * us / whole) for kind, us in sorted(totals.items(), key=lambda kv: -kv[1])]


def gpu_times(events: Iterable[Any]) -> Iterator[tuple[str, float]]:
    """(kind, us) of each GPU activity row: kernels, memcpy and memset, each once."""
    from torch.autograd import DeviceType

    # An operator's row also carries its kernels' time (self_device_time_total), and each kernel
    # has its own row: counting only the device rows counts every kernel once. Host-only operators
    # (the optimizer's Python, a CPU-side wait) are not GPU work and are left out. A user
    # annotation's GPU row spans the kernels inside it, so it is left out too, as torch's own
    # table total does (profiler_util._build_table). Kernels on other streams overlap (NCCL
    # beside compute), so the kinds may add up to more than a step.
    for event in events:
        if event.device_type == DeviceType.CUDA and not event.is_user_annotation:
            yield kind_of(event.key, KERNEL_KINDS), event.self_device_time_total
        elif event.device_type == DeviceType.CPU and event.is_legacy:
            # Without CUPTI, torch gives an operator its kernels' time and no kernel rows.
            yield kind_of(event.key), event.self_device_time_total


def cpu_times(events: Iterable[Any]) -> Iterator[tuple[str, float]]:
    """(kind, us) of each operator row: its self CPU time, by the operator's name."""
    for event in events:
        yield kind_of(event.key), event.self_cpu_time_total


def split_table(split: list[TimeSplit]) -> str:
    rows = ["| kind | ms per step | share |", "|---|---:|---:|"]
    rows += [f"| {s.kind} | {s.ms_per_step:.2f} | {s.percent:.1f} % |" for s in split]
    return "\n".join(rows) + "\n"
