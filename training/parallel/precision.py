"""Low-precision parameters for the layouts FSDP doesn't wrap (ddp, zero1, tp, pp).

FSDP2's MixedPrecisionPolicy computes with bf16 copies of its sharded fp32 parameters. Without
FSDP the same numerics come from bf16 module parameters, with the fp32 parameters they were cast
from kept as the optimizer's masters (training/optim.py). Autocast, the alternative, keeps fp32
parameters and gradients (4 + 4 bytes) plus a bf16 copy of every weight for backward: more memory
than the scheme the cost model and the ZeRO paper count, and other numerics than FSDP's.
"""

from __future__ import annotations

import torch
from torch import nn

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
"""Each strategy.precision's compute dtype (None: fp32). fp8 computes in bf16 but for the blocks'
linears, which run in float8 (training/parallel/float8.py)."""


def apply_low_precision(model: nn.Module, dtype: torch.dtype) -> dict[nn.Parameter, torch.Tensor]:
    """Replace each floating-point parameter of `model` by a `dtype` copy (tied parameters stay
    tied); returns new parameter -> the fp32 parameter it replaced, the optimizer's master.
    Buffers keep their precision, as under FSDP2; floating-point inputs are cast to `dtype` at the
    model's entry, as FSDP2's cast_forward_inputs does."""
    masters: dict[nn.Parameter, torch.Tensor] = {}
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            new = replaced.get(id(p))
            if new is None:
                new = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                replaced[id(p)] = new
                masters[new] = p
            module._parameters[name] = new
    model.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True)
    return masters


def _cast_inputs(dtype: torch.dtype):  # noqa: ANN202 - a hook
    def cast(value: object) -> object:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        if isinstance(value, tuple | list):
            return type(value)(cast(v) for v in value)
        if isinstance(value, dict):
            return {k: cast(v) for k, v in value.items()}
        return value

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast(args), cast(kwargs)

    return hook
