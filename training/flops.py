"""FLOPs counted once, the same way for every strategy: torch's FlopCounterMode on fwd+bwd."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

# Datasheet dense bf16 peaks (FLOP/s) for MFU; a GPU not listed gets no MFU unless
# train.peak_flops is set. NVIDIA H100/H200 SXM: 989 TFLOP/s; A100: 312 TFLOP/s.
KNOWN_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def flops_per_sample(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> float:
    """Forward + backward FLOPs of one sample, from one counted micro-batch.

    The math SDPA backend is forced while counting: the counter sees CPU flash attention as
    0 FLOPs (FACTS.md), and the math path computes the same product."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss_fn(model, inputs, targets).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / inputs.shape[0]


def peak_flops(dev: torch.device, override: float | None) -> float | None:
    """Peak FLOP/s of one device: the override, else the datasheet value for a known GPU."""
    if override is not None:
        return override
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return next((v for k, v in KNOWN_PEAK_FLOPS.items() if k in name), None)
