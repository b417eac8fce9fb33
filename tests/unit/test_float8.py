"""Float8 linears (strategy.precision=fp8): what a matmul in float8 computes, forward and backward,
and which linears a model's conversion touches."""

from __future__ import annotations

import torch
from torch import nn

from training.parallel.float8 import (
    BACKWARD,
    FORWARD,
    Float8Linear,
    _mm,
    apply_float8,
    float8_problem,
    to_float8,
)

E4M3_ROUNDOFF = 2.0**-4
"""e4m3's unit roundoff (3 mantissa bits): a product of two such values, summed over many terms,
stays within a few of these relative to the output's scale."""
E5M2_ROUNDOFF = 2.0**-3


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_a_cast_scales_by_the_power_of_two_that_fits_the_largest_magnitude_under_the_formats_largest():
    t = torch.tensor([[-3.0, 0.5], [1.0, 2.0]], dtype=torch.bfloat16)
    t8, inverse = to_float8(t, FORWARD)
    assert t8.dtype is FORWARD and inverse.item() == 2.0**-7, "3 x 128 = 384 <= 448 < 3 x 256"
    assert t8.float().abs().max().item() == 384.0
    assert torch.equal(t8.float() * inverse, t.float()), "these values have 3 mantissa bits or fewer: exact"
    zeros, _ = to_float8(torch.zeros(2, 2), BACKWARD)
    assert torch.equal(zeros.float(), torch.zeros(2, 2)), "an all-zero tensor casts to zeros, not NaN"


def test_a_float8_linear_computes_what_the_bf16_linear_does_within_float8s_roundoff():
    torch.manual_seed(0)
    ref = nn.Linear(64, 32).to(torch.bfloat16)
    f8 = nn.Linear(64, 32).to(torch.bfloat16)
    f8.load_state_dict(ref.state_dict())
    apply_float8([nn.Sequential(f8)])
    assert type(f8) is Float8Linear
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    x8 = x.detach().clone().requires_grad_()
    out, out8 = ref(x), f8(x8)
    assert out8.shape == out.shape and out8.dtype is torch.bfloat16
    assert 0 < relative(out8, out) < E4M3_ROUNDOFF, "float8, not bf16, and close to it"
    grad = torch.randn_like(out)
    out.backward(grad)
    out8.backward(grad)
    # The gradients multiply an e5m2 gradient with an e4m3 operand.
    assert relative(x8.grad, x.grad) < E5M2_ROUNDOFF
    assert relative(f8.weight.grad, ref.weight.grad) < E5M2_ROUNDOFF
    assert torch.equal(f8.bias.grad, ref.bias.grad), "the bias adds in bf16"
    assert f8.weight.grad.dtype is torch.bfloat16


class Block(nn.Module):
    def __init__(self, moe: bool = False):
        super().__init__()
        self.attn = nn.Linear(32, 96)
        self.odd = nn.Linear(32, 10)  # not a multiple of 16: the fp8 kernels refuse it
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        if moe:
            self.moe = nn.Module()
            self.moe.router = nn.Linear(32, 16)
            self.moe.experts = nn.Module()


def test_the_blocks_linears_of_a_multiple_of_16_are_converted_and_the_rest_stay():
    blocks = [Block(), Block(moe=True)]
    head = nn.Linear(32, 64)
    model = nn.Sequential(*blocks, head)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_float8(blocks, experts=[blocks[1].moe.experts]) == 6
    for b in blocks:
        assert [type(m) for m in (b.attn, b.mlp[0], b.mlp[2])] == [Float8Linear] * 3
        assert type(b.odd) is nn.Linear
    assert type(blocks[1].moe.router) is nn.Linear, "a mixture's layer stays in bf16: its router picks the experts"
    assert type(head) is nn.Linear, "the head is outside the blocks"
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()), "the same parameters and names"


def test_the_emulated_product_is_what_torchs_scaled_mm_computes():
    """The CPU's product (fp32 sums of the widened float8 values, scaled, rounded once) against
    torch's own `_scaled_mm` on the same operands (its CPU kernel: a reference loop, fine at this
    size): the same bf16 numbers (measured: all of the forward's, 99.97 % of the backward's; the
rest one rounding apart, where the order of the fp32 sums differs)."""
    torch.manual_seed(0)
    x, w, g = torch.randn(48, 64), torch.randn(32, 64) * 0.01, torch.randn(48, 32) * 1e-3
    x8, x_inv = to_float8(x, FORWARD)
    w8, w_inv = to_float8(w, FORWARD)
    g8, g_inv = to_float8(g, BACKWARD)
    for a, a_inv, b, b_inv in ((x8, x_inv, w8.t(), w_inv), (g8, g_inv, w8, w_inv)):
        ours = _mm(a, a_inv, b, b_inv, torch.bfloat16)
        torchs = torch._scaled_mm(a, b.t().contiguous().t(), scale_a=a_inv, scale_b=b_inv, out_dtype=torch.bfloat16)
        assert ours.dtype is torchs.dtype is torch.bfloat16
        assert (ours == torchs).float().mean() > 0.999, "bit for bit but for a few sums' order"
        assert ((ours.float() - torchs.float()).abs().max() / torchs.float().abs().max()) < 2.0**-8
    assert float8_problem(torch.device("cpu")) is None


def test_a_strategy_in_fp8_trains_its_blocks_linears_in_float8_and_its_head_in_bf16():
    """One process, no wrapper: parallelize converts what apply_float8 says, the parameters in bf16
    (the optimizer's fp32 masters beside them), and a step's gradients reach every parameter."""
    from training.config import ModelConfig, StrategyConfig
    from training.contract.calls import build_model, model_loss
    from training.contract.spec import model_spec
    from training.parallel.compose import parallelize

    cfg = ModelConfig(name="gpt", kwargs=dict(vocab_size=256, d_model=32, n_layers=2, n_heads=4, seq_len=16))
    model = build_model(cfg, 0)
    spec = model_spec(model, cfg)
    parallel = parallelize(model, spec, StrategyConfig(name="ddp", precision="fp8"), torch.device("cpu"),
                           model_loss(cfg))
    in_blocks = {id(m) for b in spec.blocks for m in b.module.modules()}
    linears = [m for m in parallel.model.modules() if isinstance(m, nn.Linear)]
    assert {type(m) for m in linears if id(m) in in_blocks} == {Float8Linear}
    assert {type(m) for m in linears if id(m) not in in_blocks} == {nn.Linear}, "the head stays in bf16"
    assert {p.dtype for p in parallel.model.parameters()} == {torch.bfloat16} and parallel.masters
    tokens = torch.randint(0, 256, (2, 16))
    loss = parallel.forward_backward((tokens, tokens), 1.0)
    assert torch.isfinite(loss) and all(p.grad is not None for p in parallel.model.parameters())


def test_on_the_meta_device_the_linears_run_torchs_float8_kernel_padding_the_tokens_to_16():
    """The plan counts a Float8Linear on the meta device as a GPU runs it (`torch._scaled_mm`, whose
    shape rules the meta kernel enforces): the weight's gradient sums over the tokens, the inner
    dimension the kernel wants a multiple of 16, so 20 tokens are padded with zeros to 32."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        linear = nn.Linear(32, 48, bias=False).to(torch.bfloat16)
        x = torch.empty(20, 32, dtype=torch.bfloat16, requires_grad=True)
    apply_float8([nn.Sequential(linear)])
    with FlopCounterMode(display=False) as flops:
        linear(x).sum().backward()
    counts = flops.get_flop_counts()["Global"]
    assert set(counts) == {torch.ops.aten._scaled_mm}
    assert counts[torch.ops.aten._scaled_mm] == 2 * 20 * 32 * 48 * 2 + 2 * 32 * 32 * 48, "forward, input's, weight's"
    assert x.grad.shape == (20, 32) and linear.weight.grad.shape == (48, 32)
