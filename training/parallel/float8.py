"""Float8 linears (strategy.precision=fp8): bf16 training with every eligible linear's three matmuls
in float8, scaled dynamically per tensor, as torchao's Float8Linear runs them in torchtitan's
Float8 recipe ("tensorwise").

Forward: the input and the weight cast to e4m3 (3 mantissa bits, max 448), each with a scale (a
power of two) that puts its largest magnitude near e4m3's largest; `torch._scaled_mm` multiplies
them and undoes both scales into a bf16 output. Backward: the output's gradient cast to e5m2 (2 mantissa bits, max
57344: gradients need range more than precision) and multiplied with the e4m3 weight (the input's
gradient) and with the e4m3 input (the weight's gradient). The parameters stay what bf16 keeps
(bf16 compute copies, fp32 masters), so FSDP, DDP, checkpoints and the optimizer see no difference,
and so is what backward keeps: the bf16 input and the weight, cast again in backward (the memory
of a step is bf16's; the plan's memory ruler measures it so).

Which linears: those inside the model's blocks whose widths are multiples of 16 (what the fp8
tensor cores' matmul needs, applied on every device so that a CPU runs the program a GPU does).
The output head stays in bf16, as torchtitan leaves it (the logits' precision matters for the
loss), and so does a mixture's layer (its router, and its experts: grouped weights, not nn.Linear).

Under tensor parallelism a split linear's weight and input are DTensors, and so is everything
here: the scale of a split operand is the amax of the whole tensor (one scalar all-reduce over the
TP ranks, by DTensor's reduction: forward a column split's weight, a row split's input and weight;
backward those again and a column split's output gradient), so every TP rank casts with the scale
one process would use, and the products run as DTensor's matmul (torch._scaled_mm has a sharding
rule). torchao's Float8Linear under torchtitan's TP makes the same reductions.

Where: CUDA GPUs of compute capability 8.9 and later (Ada, Hopper, Blackwell) multiply with
`torch._scaled_mm`; a CPU computes the same numbers with an emulated product (`_mm`), at about
bf16's speed: a CPU run rehearses fp8's numerics and memory, not a GPU's fp8 speed-up.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

FORWARD = torch.float8_e4m3fn
BACKWARD = torch.float8_e5m2
DIM_MULTIPLE = 16
EPS = 1e-12
"""The smallest amax a scale is taken from: an all-zero tensor casts to zeros, not to NaN."""


def to_float8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` in `dtype`, scaled by the power of two that puts its largest magnitude nearest below the
    format's largest, and the inverse scale that `torch._scaled_mm` multiplies back.

    A power of two (torchao's `round_scales_to_power_of_2`), so that scaling is exact in `t`'s own
    dtype: the one rounding is float8's, as in fp32, and the cast's temporary is the size of `t`
    (bf16: 2 bytes an element), not an fp32 copy (4 bytes): measured on torchtitan's Llama 3.1 405B
    layout at 256K tokens (docs/published.md), the plan's memory per device 75.6 GiB against 102.4."""
    top = torch.finfo(dtype).max
    low, high = torch.aminmax(t.detach())  # no |t| materialised
    amax = torch.maximum(-low, high).float().clamp(min=EPS)
    scale = torch.exp2(torch.floor(torch.log2(top / amax)))
    scaled = t.detach() * scale.to(t.dtype)
    return scaled.clamp_(-top, top).to(dtype), scale.reciprocal()


def _mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """a @ b of float8 operands, both scales undone, in `out`. On a GPU `torch._scaled_mm` (`a`
    row-major, `b` column-major, as its kernels require). Elsewhere emulated, as torchao's
    `emulate=True` does: the float8 values widened to fp32 (exactly: 3 mantissa bits fit), their
    products summed in fp32 and the scales applied before one rounding to `out`, which is what
    `torch._scaled_mm` computes (tests/unit/test_float8.py holds the two side by side). CPUs have
    no float8 units, and torch 2.13's CPU `_scaled_mm` is a reference loop: measured 10.9 s for a
    512 x 256 x 1024 product that bf16 runs in 0.26 ms."""
    if a.device.type in ("cuda", "meta"):  # meta: what the plan counts, as a GPU runs it
        pad = -a.shape[1] % DIM_MULTIPLE
        if pad:  # the kernels want the inner dimension (for the weight's gradient: the tokens) a multiple of 16
            a = torch.cat([a, a.new_zeros(a.shape[0], pad)], 1)
            b = torch.cat([b, b.new_zeros(pad, b.shape[1])], 0)
        return torch._scaled_mm(a, b.t().contiguous().t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out)
    return (torch.mm(a.float(), b.float()) * (a_inv * b_inv)).to(out)


class _Float8Matmul(torch.autograd.Function):
    """x @ w.T with its forward and both backward matmuls in float8."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x8, x_inv = to_float8(x.reshape(-1, x.shape[-1]), FORWARD)
        w8, w_inv = to_float8(w, FORWARD)
        ctx.save_for_backward(x, w)
        return _mm(x8, x_inv, w8.t(), w_inv, x.dtype).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        # Both cast again rather than saved in float8: what is saved is what bf16 saves (one input
        # shared by the linears that read it, as q, k and v do; the weight FSDP gathers again).
        x8, x_inv = to_float8(x.reshape(-1, x.shape[-1]), FORWARD)
        w8, w_inv = to_float8(w, FORWARD)
        g8, g_inv = to_float8(grad.reshape(-1, grad.shape[-1]), BACKWARD)
        grad_x = _mm(g8, g_inv, w8, w_inv, x.dtype).reshape(x.shape)
        grad_w = _mm(g8.t().contiguous(), g_inv, x8, x_inv, w.dtype)
        return grad_x, grad_w


class Float8Linear(nn.Linear):
    """An nn.Linear whose matmuls run in float8 (the same parameters, names and state)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Float8Matmul.apply(x, self.weight)
        return out if self.bias is None else out + self.bias


def eligible(module: nn.Module) -> bool:
    return (type(module) in (nn.Linear, Float8Linear) and module.in_features % DIM_MULTIPLE == 0
            and module.out_features % DIM_MULTIPLE == 0)


def float8_linears(blocks: Iterable[nn.Module], experts: Iterable[nn.Module] = ()) -> list[nn.Module]:
    """The linears fp8 runs in float8: every eligible one inside `blocks` (the model's repeated
    blocks: the embeddings and the output head, outside them, stay in bf16) but those of a layer
    holding one of `experts` (a mixture's layer: its router and experts), which stays in bf16
    whole: a router's scores pick the experts, and float8 would change which."""
    experts = set(experts)
    found = []
    for block in blocks:
        kept = {id(m) for layer in block.modules() if experts & set(layer.children()) for m in layer.modules()}
        found += [m for m in block.modules() if id(m) not in kept and eligible(m)]
    return found


def apply_float8(blocks: Iterable[nn.Module], experts: Iterable[nn.Module] = (),
                 device: torch.device | None = None) -> int:
    """Each of float8_linears(blocks, experts) made a Float8Linear in place: its class swapped,
    its parameters, hooks and names kept. Before tensor parallelism, checkpointing and FSDP wrap
    the blocks, as torchtitan converts a model. Returns how many were converted; raises ValueError
    where `device` runs no float8 matmul."""
    problem = float8_problem(device) if device is not None else None
    if problem is not None:
        raise ValueError(f"strategy.precision=fp8 {problem}; use bf16")
    linears = float8_linears(blocks, experts)
    for m in linears:
        m.__class__ = Float8Linear
    return len(linears)


def float8_problem(device: torch.device) -> str | None:
    """Why float8 matmuls cannot run on `device`, or None (a CPU always can: `_mm` emulates them)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"needs a GPU of compute capability 8.9 or later (this one is {major}.{minor})"
    return None
