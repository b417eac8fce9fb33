"""The plan counts on the meta device: attention as the fused kernels run it, causal attention's
FLOPs as half of the score matrix (and it says so), any sequence length without memory, and the
memory audit in the run's precision (no processes)."""

from __future__ import annotations

import dataclasses
import resource

import pytest
import torch
import torch.nn.functional as F

from stages.plan import counted_on_meta, whatif
from training.config import ModelConfig
from training.data import first_samples, markov
from training.planner.advice import PlanInputs
from training.planner.anatomy import meta_memory_audit
from training.planner.counting import FlopCount

MIB = 1024**2


def plan_inputs(compose_cfg, *overrides: str) -> PlanInputs:
    cfg = compose_cfg("tracking=none", *overrides)
    return PlanInputs(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(PlanInputs)})


@pytest.mark.parametrize("causal", [True, False])
def test_attention_flops_are_the_hand_count_causal_half_and_full(causal):
    """One attention call, forward and backward, on the meta device. Forward: the score product
    q k^T and the value product p v, 2 * s * s * d FLOPs each per (sample, head); backward: two for
    each (the gradients of p and v, then of q and k), the kernel's recomputed scores not counted.
    12 * b * h * s^2 * d in all; causal attention counts half of the matrix."""
    b, h, s, d = 2, 4, 128, 16
    q, k, v = (torch.empty(b, h, s, d, device="meta", requires_grad=True) for _ in range(3))
    with FlopCount() as flops:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
    full = 12 * b * h * s * s * d
    assert flops.total == (full // 2 if causal else full)
    assert flops.convention == ("causal_half" if causal else "full")


def test_a_4096_token_gpt_is_counted_on_meta_without_its_attention_matrices(compose_cfg):
    """At seq 4096 and micro-batch 8 the math kernel's score matrices alone are 8 x 4 heads x 4096^2
    x 4 bytes = 2 GiB a block: the plan's count allocates none of it;
    what it counts saved is what a fused kernel saves (no s x s matrix)."""
    seq, heads, layers, width = 4096, 4, 2, 64
    counted_on_meta(plan_inputs(compose_cfg))  # torch's one-off imports for the meta device (~1 s, ~80 MiB)
    cfg = plan_inputs(compose_cfg, f"model.seq_len={seq}", "data.num_samples=16", "train.micro_batch=8")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    counted = counted_on_meta(cfg)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grew < 64 * MIB, f"the process grew by {grew / MIB:.0f} MiB"
    anatomy = counted.anatomy
    assert anatomy.shape.seq_len == seq and counted.flops_convention == "causal_half"
    assert anatomy.activations.saved < heads * seq * seq * 4, "one block's score matrix"
    # gpt-tiny's linears (2 blocks of 12 d^2, a d x 256 head), then causal attention, as hand-counted
    # in test_costmodel.
    weights = layers * 12 * width**2 + width * 256
    assert anatomy.flops_per_sample == 6 * weights * seq + 6 * layers * width * seq * seq


def test_the_plan_records_its_flops_convention(compose_cfg):
    gpt = whatif(plan_inputs(compose_cfg, "pipeline=plan", "cluster=h100-80g-ndr", "nodes=1"))
    mlp = whatif(plan_inputs(compose_cfg, "pipeline=plan", "cluster=h100-80g-ndr", "nodes=1", "model=mlp",
                             "data=blobs"))
    assert (gpt.flops_convention, mlp.flops_convention) == ("causal_half", "full")


def test_the_memory_audit_counts_the_runs_precision():
    """gpt-tiny at 2 x 64 tokens (N = 128, d = 64, 4 heads), audited on the meta device. Each block
    saves 16 N d values in the compute precision: the two norms' inputs and outputs (4), q, k, v (3),
    attention's output, which is also wo's input (1), the first feed-forward linear's input and the
    block's residual (2), the GELU's input and output (2 x 4); and in fp32 whatever the precision:
    the two norms' mean and rstd (4 N) and attention's log-sum-exp (N x heads). Parameters take 4 or
    2 bytes each; the first row also holds the token indices (int64)."""
    n, d, heads, params = 2 * 64, 64, 4, 135_808
    cfg = ModelConfig(kwargs=dict(vocab_size=256, seq_len=64, d_model=d, n_layers=2, n_heads=heads))
    batch = tuple(t.to("meta") for t in first_samples(markov(4, 64, 256), 2))
    rows = {p: meta_memory_audit(cfg, 0, batch, p) for p in ("fp32", "bf16")}
    fp32_stats = 4 * (4 * n + n * heads)
    for precision, size in (("fp32", 4), ("bf16", 2)):
        by_module = {r.module: r.live_bytes for r in rows[precision] if r.phase == "forward"}
        assert by_module["tok_embeddings"] == size * params + 8 * n
        assert by_module["layers.0"] - by_module["pos_embeddings"] == size * 16 * n * d + fp32_stats
        assert by_module["layers.1"] - by_module["layers.0"] == size * 16 * n * d + fp32_stats
    assert max(r.peak_bytes for r in rows["bf16"]) < 0.52 * max(r.peak_bytes for r in rows["fp32"])


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_fp8_counts_the_blocks_linears_matmuls_as_float8(checkpointing):
    """strategy.precision=fp8 moves the blocks' linears' matmuls to fp8 tensor cores, nothing else:
    the plan counts the model the trainer converts (training/parallel/float8.py), the head in bf16.
    gpt-tiny at seq 64: its blocks' linears (2 blocks of 12 d^2) take 2 FLOPs per weight and token
    forward and 4 backward; the d x 256 head's are bf16's. Full checkpointing recomputes each block's
    forward whole: torch's non-reentrant checkpoint stops once backward's tensors are recomputed, which
    in bf16 spares the last linear (4 d^2 of the 12), but a Float8Linear's matmul runs inside one
    autograd Function, whose saved tensors are packed only when it returns. Attention (causal half, 6 * layers * d * s^2 per sample, a
    third more when recomputed) stays bf16, and bf16 itself has no Float8 FLOPs."""
    from training.planner.anatomy import measure_variant

    seq, layers, d = 64, 2, 64
    cfg = ModelConfig(kwargs=dict(vocab_size=256, seq_len=seq, d_model=d, n_layers=layers, n_heads=4))
    sample = tuple(t.to("meta") for t in first_samples(markov(4, seq, 256), 1))
    fp8, bf16 = (measure_variant(cfg, 0, sample, p, checkpointing) for p in ("fp8", "bf16"))
    full = checkpointing == "full"
    weights = layers * 12 * d**2
    assert fp8.float8_flops_per_sample == 6 * weights * seq + full * 2 * weights * seq
    assert fp8.executed_flops_per_sample == bf16.executed_flops_per_sample + full * 2 * layers * 4 * d**2 * seq
    rest = fp8.executed_flops_per_sample - fp8.float8_flops_per_sample
    assert rest == 6 * layers * d * seq * seq * (4 / 3 if full else 1) + 6 * d * 256 * seq, "attention and head"
    assert bf16.float8_flops_per_sample == 0.0


def test_an_fp8_plan_runs_its_linears_at_the_fp8_peak_and_the_rest_at_bf16s(compose_cfg):
    """A what-if plan in fp8 on H100s: a sample's compute is its Float8 FLOPs at the datasheet's fp8
    peak plus the rest at the bf16 peak, both at the cluster's achievable fraction; MFU divides by
    the bf16 peak (torchtitan's convention)."""
    from training.planner.anatomy import measure_variant

    inputs = plan_inputs(compose_cfg, "pipeline=plan", "cluster=h100-80g-ndr", "nodes=1", "strategy=ddp",
                         "strategy.precision=fp8", "train.micro_batch=1")
    plan = whatif(inputs)
    fp8 = next(v for v in plan.variants if (v.precision, v.activation_checkpointing) == ("fp8", "none"))
    sample = tuple(t.to("meta") for t in first_samples(markov(4, 64, 256), 1))
    cost = measure_variant(inputs.model, inputs.seed, sample, "fp8", "none")
    rest = cost.executed_flops_per_sample - cost.float8_flops_per_sample
    assert fp8.seconds_per_sample == pytest.approx((rest / 989e12 + cost.float8_flops_per_sample / 1978.9e12) / 0.4)
    assert fp8.peak_flops == 989e12
    assert plan.requested is not None and plan.requested.precision == "fp8"


def test_the_search_offers_fp8_with_tp(compose_cfg):
    """The trainer runs fp8 under TP (its scales reduced over the TP ranks: training/parallel/
    float8.py), so the search offers it there (its reductions priced as the trainer makes them:
    tests/unit/test_loss_parallel.py)."""
    inputs = plan_inputs(compose_cfg, "pipeline=plan", "cluster=h100-80g-ndr", "nodes=1", "procs_per_node=4",
                         "strategy=tp", "strategy.precision=fp8", "plan.precisions=[fp8,bf16]", "train.micro_batch=1",
                         "plan.strategies=[tp]")
    plan = whatif(inputs)
    ranked = [plan.recommended, *plan.candidates, *plan.layouts]
    with_tp = {c.precision: c for c in ranked if c.dims["tp"] == 4}
    assert set(with_tp) == {"fp8", "bf16"}
    assert plan.requested.precision == "fp8" and plan.requested.dims["tp"] == 4


MOE_GPT = ModelConfig(kwargs=dict(vocab_size=256, seq_len=64, d_model=64, n_layers=4, n_heads=4, n_experts=4, top_k=2))
HF_LLAMA = ModelConfig(target="training.models.hf.causal_lm", name="hf-llama", kwargs=dict(
    model_class="transformers.LlamaForCausalLM", config_class="transformers.LlamaConfig", vocab_size=256,
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64))


@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("cfg", [MOE_GPT, HF_LLAMA], ids=["moe-gpt", "hf-llama"])
def test_a_model_of_alike_blocks_is_counted_from_one_layer_and_two_as_its_whole_forward(cfg, checkpointing):
    """A model whose blocks are all alike (the built-in GPT, a Hugging Face Llama) is counted at one
    and two layers and extended to its depth (a DeepSeek-V3-shaped forward on the meta device
    takes minutes, Llama 3 405B's ~13 s a variant): every count equals the full forward's at four
    layers."""
    import dataclasses

    from training.planner.anatomy import _by_layers, _measure_variant, _uniform_depth

    assert _uniform_depth(cfg) == 4
    sample = tuple(t.to("meta") for t in first_samples(markov(4, 64, 256), 1))
    whole = _measure_variant(cfg, 0, sample, "bf16", checkpointing)
    extended = _by_layers(cfg, 0, sample, "bf16", checkpointing)
    assert whole.executed_flops_per_sample > 0 and whole.activations.saved > 0
    counts = [f.name for f in dataclasses.fields(whole) if isinstance(getattr(whole, f.name), float)]
    assert len(counts) == 2
    assert {n: getattr(extended, n) for n in counts} == pytest.approx({n: getattr(whole, n) for n in counts}, rel=1e-9)
    assert dataclasses.asdict(extended.activations) == pytest.approx(dataclasses.asdict(whole.activations), rel=1e-9)


@pytest.mark.parametrize("unlike", [
    dict(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16,
         model_class="transformers.Qwen2ForCausalLM", config_class="transformers.Qwen2Config", use_sliding_window=True),
    dict(model_class="transformers.Qwen3MoeForCausalLM", config_class="transformers.Qwen3MoeConfig",
         mlp_only_layers=[0], num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
], ids=["per-layer-config-list", "dense-first-layer"])
def test_a_model_whose_layers_differ_is_counted_whole(unlike):
    """Layers that differ by a per-layer list in the config (sliding-window layer types) or by
    their modules (an MLP-only first layer of a mixture of experts) are not extended from one."""
    import dataclasses

    from training.planner.anatomy import _uniform_depth

    cfg = dataclasses.replace(HF_LLAMA, kwargs=dict(HF_LLAMA.kwargs, **unlike))
    assert _uniform_depth(cfg) is None


def test_a_mixture_of_experts_anatomy_from_one_layer_and_two_is_its_whole_forwards():
    """The plan's anatomy of the built-in MoE GPT (count_on_meta) counted at one and two layers and
    extended, its Shape read from the whole model: the same FLOPs, saved bytes and Shape as a
    counted forward of the whole model at four layers, the experts' share of FLOPs included."""
    from training.contract.calls import model_loss
    from training.planner.anatomy import build_on_meta, count_on_meta, measure_anatomy

    cfg = MOE_GPT
    sample = tuple(t.to("meta") for t in first_samples(markov(4, 64, 256), 1))
    model, spec = build_on_meta(cfg, 0)
    whole = measure_anatomy(model, spec, model_loss(cfg), sample)
    extended = count_on_meta(cfg, 0, sample)
    assert extended.flops_convention == whole.flops_convention
    a, b = extended.anatomy, whole.anatomy
    assert a.flops_per_sample == pytest.approx(b.flops_per_sample, rel=1e-9)
    assert a.activations.saved == pytest.approx(b.activations.saved, rel=1e-9)
    assert a.tokens_per_sample == b.tokens_per_sample
    assert b.shape.experts == (4,) * 4 and b.shape.top_k == 2 and 0 < b.shape.expert_flops_share < 1
    assert a.shape.expert_flops_share == pytest.approx(b.shape.expert_flops_share, rel=1e-9)
    assert dataclasses.replace(a.shape, expert_flops_share=0.0) == dataclasses.replace(b.shape, expert_flops_share=0.0)
