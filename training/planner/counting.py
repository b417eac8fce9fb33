"""How a forward and backward is counted on the meta device (no memory, no compute): FLOPs by the
convention the plan records (FlopCount: causal attention's score and value products as half the
matrix, as the fused kernels run it), and attention and dropout as a GPU's fused kernels save them
for backward (fused_attention_on_meta).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, bmm_flop, sdpa_backward_flop_count, sdpa_flop_count

LINEAR_OPS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
"""What nn.Linear runs forward and backward (a 3-D input is folded to 2-D), and batched experts.
Attention's products are SDPA's own ops, not these."""
FLOAT8_OPS = (torch.ops.aten._scaled_mm,)
"""What a Float8Linear runs (strategy.precision=fp8: training/parallel/float8.py), on the meta
device as on a GPU."""


class FlopCount:
    """FLOPs counted by torch's FlopCounterMode, attention as the fused kernels run it: a causal
    call (`is_causal=True`) counts half of the s x s score and value products, and a kernel's
    recomputation of the scores in backward is not counted (as activation checkpointing's isn't).
    A call with an explicit mask runs the math path and counts in full: on the meta device a
    mask's values, causal or not, are unknown."""

    def __init__(self) -> None:
        self.causal_calls = 0
        self._mode = FlopCounterMode(display=False, custom_mapping={
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: self._forward,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: self._backward,
        })

    def _share(self, flops: int, is_causal: bool) -> int:
        self.causal_calls += bool(is_causal)
        return flops // 2 if is_causal else flops

    def _forward(self, q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False, *args: Any,
                 out_shape: Any = None, **kwargs: Any) -> int:
        return self._share(sdpa_flop_count(q, k, v), is_causal)

    def _backward(self, grad_out: Any, q: Any, k: Any, v: Any, out: Any, logsumexp: Any, dropout_p: float = 0.0,
                  is_causal: bool = False, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        b, heads, s_q, d = q
        recompute = bmm_flop((b * heads, s_q, d), (b * heads, d, k[-2]))
        return self._share(sdpa_backward_flop_count(grad_out, q, k, v) - recompute, is_causal)

    @property
    def total(self) -> int:
        return self._mode.get_total_flops()

    @property
    def linear(self) -> int:
        """The linears' share of `total` (LINEAR_OPS)."""
        counts = self._mode.get_flop_counts().get("Global", {})
        return sum(counts.get(op, 0) for op in LINEAR_OPS)

    @property
    def float8(self) -> int:
        """The share of `total` run in float8 (FLOAT8_OPS): what fp8 tensor cores run."""
        counts = self._mode.get_flop_counts().get("Global", {})
        return sum(counts.get(op, 0) for op in FLOAT8_OPS)

    @property
    def convention(self) -> str:
        return "causal_half" if self.causal_calls else "full"

    def __enter__(self) -> FlopCount:
        self._attention = fused_attention_on_meta()
        self._attention.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        self._attention.__exit__(*exc)


def _fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    if attn_mask is not None or q.device.type not in ("cpu", "meta"):
        return _MATH_SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                          enable_gqa=enable_gqa)
    if k.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, -3), v.repeat_interleave(repeat, -3)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)[0]


_MATH_SDPA = F.scaled_dot_product_attention
_DROPOUT = F.dropout


def _fused_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """Dropout as CUDA's fused kernel runs it: it saves a 1-byte mask (CPU's path, which the meta
    device follows, keeps a mask in the input's dtype)."""
    if not input.is_meta or not training or p == 0.0:
        return _DROPOUT(input, p, training, inplace)
    return torch.ops.aten.native_dropout(input, p, True)[0]


@contextlib.contextmanager
def fused_attention_on_meta() -> Iterator[None]:
    """Scaled-dot-product attention as a fused (flash) kernel runs it, on the meta device.

    On meta every SDPA backend falls back to the math path, which saves the b x heads x s x s
    attention matrix for backward; the fused kernels GPUs train with save only the output and its
    log-sum-exp. CPU's own flash kernel has a meta implementation, so calls without a mask go
    through it (grouped-query heads repeated first, as the fused kernels do): what a GPU saves is
    what is counted (measured: the same bytes as the CPU's default kernel on real tensors). Dropout
    likewise saves CUDA's 1-byte mask. The functions themselves are swapped, not intercepted by a
    mode, because activation checkpointing recomputes inside the autograd engine, where modes do
    not reach."""
    F.scaled_dot_product_attention = _fused_attention
    F.dropout = _fused_dropout
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _MATH_SDPA
        F.dropout = _DROPOUT
