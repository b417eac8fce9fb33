"""The peak FLOP/s MFU divides by (the FLOPs themselves are counted from the module: training/anatomy.py)."""

from __future__ import annotations

import torch

# Datasheet dense bf16 peaks (FLOP/s) for MFU; a GPU not listed gets no MFU unless
# train.peak_flops is set. NVIDIA H100/H200 SXM: 989 TFLOP/s; A100: 312 TFLOP/s.
KNOWN_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(dev: torch.device, override: float | None) -> float | None:
    """Peak FLOP/s of one device: the override, else the datasheet value for a known GPU."""
    if override is not None:
        return override
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return next((v for k, v in KNOWN_PEAK_FLOPS.items() if k in name), None)
