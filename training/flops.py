"""The peak FLOP/s MFU divides by (the FLOPs themselves are counted from the module: training/planner/anatomy.py).

Peaks are per exact device model and form factor, and per precision: an H100 PCIe is ~24 % slower
than an H100 SXM, and an fp32 run's matmuls go at the TF32 rate when TF32 is enabled and at a
seventh of it when not. Dividing by the wrong one makes MFU wrong by that much.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch

TERA = 1e12


@dataclass(frozen=True)
class DevicePeaks:
    """One GPU model's dense (no 2:4 sparsity) datasheet peaks, in FLOP/s per precision."""

    pattern: str
    """An anchored regex on the name torch.cuda.get_device_name reports."""
    fp32: float
    tf32: float
    bf16: float
    fp16: float
    fp8: float | None
    """None where the device has no fp8 tensor cores (A100)."""
    source: str
    """The datasheet the figures are from."""

    def for_column(self, column: str) -> float | None:
        """The peak of one precision column (`fp32`, `tf32`, `bf16`, `fp16` or `fp8`)."""
        return getattr(self, column)


def _peaks(pattern: str, fp32: float, tf32: float, bf16: float, fp16: float, fp8: float | None,
           source: str) -> DevicePeaks:
    """A table row from TFLOP/s figures."""
    return DevicePeaks(pattern, fp32 * TERA, tf32 * TERA, bf16 * TERA, fp16 * TERA,
                       None if fp8 is None else fp8 * TERA, source)


# Datasheets print tensor-core figures "with sparsity" (2:4 structured sparsity, twice dense); a
# dense training run can reach at most half of those, so the dense figures are listed here.
H100_SXM = "NVIDIA H100 Tensor Core GPU datasheet, SXM column (dense = half the sparse figures)"
H100_PCIE = "NVIDIA H100 Tensor Core GPU datasheet, PCIe column (dense = half the sparse figures)"
H100_NVL = "NVIDIA H100 NVL datasheet: sparse 835 TF32 / 1671 BF16, FP16 / 3341 FP8; dense is half"
H200_SXM = "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: same compute as H100 SXM"
H200_NVL = "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column: sparse 835 / 1671 / 3341; dense is half"
GH200 = "NVIDIA GH200 Grace Hopper Superchip datasheet: the H100 SXM's compute, whatever its memory"
A100 = "NVIDIA A100 Tensor Core GPU datasheet: SXM and PCIe, 40 and 80 GB alike; no fp8"
L40S = "NVIDIA L40S datasheet (dense = half the sparse figures)"
L4 = "NVIDIA L4 datasheet (dense = half the sparse figures)"

# Most specific first, each anchored at both ends: "NVIDIA H200 NVL" must not take the H200 SXM's
# figures, nor "NVIDIA L40S" the L4's. The names are what torch.cuda.get_device_name reports
# (nvidia-smi's product names); an SXM H100 reports its memory, not its form factor.
PEAK_TABLE: tuple[DevicePeaks, ...] = (
    _peaks(r"NVIDIA H100 NVL", 60, 417.5, 835.5, 835.5, 1670.5, H100_NVL),
    _peaks(r"NVIDIA H100 PCIe", 51.2, 378, 756, 756, 1513, H100_PCIE),
    _peaks(r"NVIDIA H100 80GB HBM3", 67, 494.7, 989.4, 989.4, 1978.9, H100_SXM),
    _peaks(r"NVIDIA H200 NVL", 60, 417.5, 835.5, 835.5, 1670.5, H200_NVL),
    _peaks(r"NVIDIA H200", 67, 494.7, 989.4, 989.4, 1978.9, H200_SXM),
    _peaks(r"NVIDIA GH200( .+)?", 67, 494.7, 989.4, 989.4, 1978.9, GH200),
    _peaks(r"NVIDIA A100-SXM4-(40|80)GB", 19.5, 156, 312, 312, None, A100),
    _peaks(r"NVIDIA A100 80GB PCIe|NVIDIA A100-PCIE-40GB", 19.5, 156, 312, 312, None, A100),
    _peaks(r"NVIDIA L40S", 91.6, 183, 362, 362, 733, L40S),
    _peaks(r"NVIDIA L4", 30.3, 60, 121, 121, 242.5, L4),
)

_warned: set[str] = set()
"""Unknown device names already warned about: one line per process, not one per stage or step."""


def device_peaks(name: str) -> DevicePeaks | None:
    """The table row whose pattern matches the whole device name, the first in table order."""
    return next((row for row in PEAK_TABLE if re.fullmatch(row.pattern, name.strip())), None)


def peak_column(precision: str, tf32: bool) -> str:
    """The datasheet column a run's matmuls go at: bf16 and fp16 at their own, fp32 at TF32's when
    TF32 matmuls are enabled (set_tf32), else at plain fp32's."""
    if precision == "fp32":
        return "tf32" if tf32 else "fp32"
    return precision


def peak_for_name(name: str, precision: str, tf32: bool) -> float | None:
    """The dense datasheet peak of the GPU named `name` in the run's precision; None (and one
    warning per process) for a GPU not in PEAK_TABLE, None for a precision it lacks."""
    row = device_peaks(name)
    if row is None:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"no datasheet peak FLOP/s for GPU {name!r}: MFU is not reported; "
                          f"set train.peak_flops to the device's peak FLOP/s to report it", stacklevel=2)
        return None
    return row.for_column(peak_column(precision, tf32))


def peak_flops(dev: torch.device, precision: str, override: float | None, tf32: bool) -> float | None:
    """Peak FLOP/s of one device for MFU: train.peak_flops when set, else the datasheet peak of
    this CUDA device in `precision` (None on a CPU: it has no reliable peak)."""
    if override is not None:
        return override
    if dev.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(dev), precision, tf32)


def set_tf32(dev: torch.device, enabled: bool) -> None:
    """Let fp32 matmuls and convolutions on a CUDA device use TF32 tensor cores, or not (train.tf32)."""
    if dev.type != "cuda":
        return
    # Set both ways, every time: the flags are process-wide, and stages sharing a process
    # (launcher=ray) must each run as configured. These are the allow_tf32 flags of torch's CUDA
    # notes; nothing here uses the newer fp32_precision API, which is not to be mixed with them.
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
