"""The mixture-of-experts layer (training/models/moe.py) against hand computations: top-k routing
token by token, the capacity factor's dropping, the load-balancing loss in the gradient and not in
the output, and FLOPs on the meta device by active parameters (no processes)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from training.contract.experts import LoadCounter, load_imbalance
from training.models.gpt import build
from training.models.moe import MoE
from training.planner.counting import FlopCount

D, HIDDEN, E = 8, 16, 4


def layer(top_k: int = 2, capacity_factor: float | None = None, aux_loss_coef: float = 0.0) -> MoE:
    torch.manual_seed(0)
    moe = MoE(D, HIDDEN, E, top_k, capacity_factor, aux_loss_coef)
    for w in (moe.experts.w1, moe.experts.w2):
        torch.nn.init.normal_(w, std=0.5)
    moe.counter = LoadCounter(moe.experts, E)
    return moe


def by_hand(moe: MoE, x: torch.Tensor, dropped: set[tuple[int, int]] = frozenset()) -> torch.Tensor:
    """Token by token: the top-k experts by router probability, weighted by those probabilities over
    their sum; (token, expert) pairs in `dropped` contribute nothing."""
    tokens = x.reshape(-1, D)
    out = torch.zeros_like(tokens)
    for i, t in enumerate(tokens):
        probs = F.softmax(moe.router(t), dim=-1)
        weights, chosen = probs.topk(moe.top_k)
        for w, e in zip(weights / weights.sum(), chosen.tolist(), strict=True):
            if (i, e) not in dropped:
                out[i] += w * (F.gelu(t @ moe.experts.w1[e]) @ moe.experts.w2[e])
    return out.reshape(x.shape)


@pytest.mark.parametrize("top_k", [1, 2])
def test_each_token_is_the_weighted_sum_of_its_top_k_experts(top_k):
    moe = layer(top_k)
    x = torch.randn(2, 5, D)
    assert torch.allclose(moe(x), by_hand(moe, x), atol=1e-6)
    assert int(moe.counter.take().sum()) == 10 * top_k


def test_routing_is_deterministic_given_the_weights():
    moe, x = layer(), torch.randn(3, 7, D)
    first, load = moe(x), moe.counter.take()
    assert torch.equal(moe(x), first) and torch.equal(moe.counter.take(), load)


def test_a_capacity_factor_drops_each_experts_latest_slots():
    """Capacity ceil(0.5 x 12 tokens x 2 / 4) = 3 slots an expert: an expert routed more keeps its
    first three tokens; the later ones lose that expert (not their other one)."""
    moe, x = layer(capacity_factor=0.5), torch.randn(1, 12, D)
    chosen = F.softmax(moe.router(x.reshape(-1, D)), dim=-1).topk(2).indices
    capacity = math.ceil(0.5 * 12 * 2 / E)
    seen: dict[int, int] = {}
    dropped = set()
    for i, pair in enumerate(chosen.tolist()):
        for e in pair:
            seen[e] = seen.get(e, 0) + 1
            if seen[e] > capacity:
                dropped.add((i, e))
    assert dropped, "the seed routes more than the capacity to some expert"
    assert torch.allclose(moe(x), by_hand(moe, x, dropped), atol=1e-6)
    kept = [min(seen.get(e, 0), capacity) for e in range(E)]
    assert moe.counter.take().tolist() == [*kept, 12 * 2 - sum(kept)], "each expert's kept slots, then the dropped"


def test_the_balance_loss_is_one_when_balanced_and_reaches_only_the_gradient():
    """Switch's E x sum f_e P_e: 1 for uniform probabilities over evenly chosen experts. The layer's
    output is the same with and without it; the router's gradient differs by its gradient."""
    moe = layer()
    uniform = torch.full((8, E), 1 / E)
    chosen = torch.tensor([[0, 1], [2, 3]] * 4)
    assert moe.balance_loss(uniform, chosen).item() == pytest.approx(1.0)

    x = torch.randn(2, 6, D)
    grads = {}
    for coef in (0.0, 0.5):
        moe = layer(aux_loss_coef=coef)
        moe.train()
        y = moe(x)
        grads[coef] = (y.detach(), *torch.autograd.grad(y.sum(), [moe.router.weight]))
    assert torch.equal(grads[0.0][0], grads[0.5][0]), "the logged output does not carry the loss"
    moe = layer(aux_loss_coef=0.5)
    probs = F.softmax(moe.router(x.reshape(-1, D)), dim=-1)
    (aux_grad,) = torch.autograd.grad(0.5 * moe.balance_loss(probs, probs.topk(2).indices), [moe.router.weight])
    assert torch.allclose(grads[0.5][1] - grads[0.0][1], aux_grad, atol=1e-6)


def test_load_imbalance_is_the_busiest_expert_over_the_mean():
    assert load_imbalance(torch.tensor([4, 4, 4, 4])) == 1.0
    assert load_imbalance(torch.tensor([10, 2, 2, 2])) == 2.5
    # 24 slots routed, 8 of them dropped: the busiest kept 6 against a balanced expert's 24 / 4,
    # not against the kept mean of 4 (a capacity factor of 1 keeps the figure at most 1).
    assert load_imbalance(torch.tensor([6, 6, 2, 2]), routed=24) == 1.0


def test_on_meta_a_capacity_factor_keeps_balanced_routings_share():
    """The plan's count (no router values: slots spread evenly) of a layer whose experts keep at
    most ceil(0.5 x 12 tokens x 2 / 4) = 3 slots each: 12 of the 24 slots, so half the experts'
    FLOPs; without a capacity factor, or at 1.5, all 24."""
    def expert_flops(capacity_factor: float | None) -> int:
        with torch.device("meta"):
            moe = MoE(D, HIDDEN, E, 2, capacity_factor)
            x = torch.zeros(1, 12, D)
        with FlopCount() as flops:
            moe(x)
        return flops.total - 2 * 12 * D * E  # the router's

    per_slot = 2 * 2 * D * HIDDEN  # two matmuls of d x h, 2 FLOPs a weight
    assert expert_flops(None) == expert_flops(1.5) == 24 * per_slot
    assert expert_flops(0.5) == 12 * per_slot


def test_flops_on_meta_count_the_active_parameters():
    """gpt-moe-tiny's shape at seq 64, 4 experts, top 2, counted on the meta device (no router values:
    the slots spread evenly). Per token and layer: attention's 4 d^2, the router's d x E and two
    experts of 8 d^2 each; the head d x V; 6 FLOPs a weight and token forward and backward, plus
    causal attention's 6 d s per token and layer: the dense model's count with 2 experts' weights."""
    seq, layers, d, vocab = 64, 2, 64, 256
    with torch.device("meta"):
        model = build(vocab, seq, d, layers, 4, 4, n_experts=E, top_k=2)
        tokens = torch.zeros(1, seq, dtype=torch.long)
    with FlopCount() as flops:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    active = layers * (4 * d * d + d * E + 2 * 8 * d * d) + d * vocab
    assert flops.total == 6 * active * seq + 6 * layers * d * seq * seq
    assert flops.linear == 6 * active * seq


def test_the_load_counts_each_forward_once_not_checkpointings_recomputation():
    """Two forwards (two micro-batches) add up; a checkpointed forward recomputed in backward does not
    count again; take() resets."""
    from torch.utils.checkpoint import checkpoint

    moe, x = layer(), torch.randn(2, 5, D, requires_grad=True)
    moe(x)
    first = moe.counter.take()
    moe(x)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert torch.equal(moe.counter.take(), 2 * first), "2 forwards of 10 tokens x 2 slots"
    assert int(moe.counter.take().sum()) == 0


@pytest.mark.parametrize("preset", ["hf-mixtral", "hf-qwen3-moe"])
def test_a_hugging_face_moe_counts_its_active_parameters_on_meta(compose_cfg, preset):
    """The plan's count of Mixtral's and Qwen3-MoE's presets at seq 16: per token and layer q, k, v,
    o (k and v at the key-value heads' width), the router's d x E and top-k SwiGLU experts of 3 d I
    each; the head d x V; causal attention's 6 d s per token and layer (q/k norms are not matmuls)."""
    from training.planner.anatomy import build_on_meta

    cfg = compose_cfg(f"model={preset}", "tracking=none").model
    c = cfg.kwargs
    d, vocab, layers, seq = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], 16
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = d // heads
    experts, k = c["num_local_experts"], c["num_experts_per_tok"]
    expert = 3 * d * c.get("moe_intermediate_size", c["intermediate_size"])
    model, _ = build_on_meta(cfg, 0)
    tokens = torch.zeros(1, seq, dtype=torch.long, device="meta")
    with FlopCount() as flops:
        model(tokens).logits.float().sum().backward()
    attention = 2 * d * heads * head_dim + 2 * d * kv * head_dim
    active = layers * (attention + d * experts + k * expert) + d * vocab
    assert flops.total == 6 * active * seq + 6 * layers * heads * head_dim * seq * seq
    assert flops.linear == 6 * active * seq


@pytest.mark.parametrize(("preset", "expert_width"), [("hf-mixtral", "model.intermediate_size=1024"),
                                                     ("hf-qwen3-moe", "model.moe_intermediate_size=1024")])
def test_a_hugging_face_moe_too_large_to_run_here_passes_the_contract_check_on_meta(compose_cfg, preset,
                                                                                     expert_width):
    """A Hugging Face MoE past the real-forward limit (here 2 layers of 128 experts of 3 x 1024 x 1024,
    0.8 G parameters) is checked on the meta device. transformers' default grouped GEMM takes only
    bf16 there, so this used to fail as "a batch of markov does not fit" before any layout check."""
    from training.contract.check import REAL_FORWARD_MAX_BYTES, describe

    cfg = compose_cfg(f"model={preset}", "tracking=none", "model.hidden_size=1024", expert_width,
                      "model.num_local_experts=128",
                      "model.num_attention_heads=8", "model.num_key_value_heads=2")
    facts = describe(cfg.model, cfg.data, seed=0)
    assert facts.checked_on == "meta"
    assert facts.params * 4 > REAL_FORWARD_MAX_BYTES


def test_the_counting_experts_forward_computes_what_transformers_does():
    """routed_experts_forward (what the plan counts with) against transformers' own experts forward,
    on real values: the same output and the same gradients."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from training.contract.hf import count_experts_as_routed

    config = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    theirs = MixtralForCausalLM(MixtralConfig(**config))
    ours = MixtralForCausalLM(MixtralConfig(**config))
    ours.load_state_dict(theirs.state_dict())
    count_experts_as_routed(ours)
    tokens = torch.randint(0, 64, (2, 8))
    a, b = theirs(tokens).logits, ours(tokens).logits
    assert torch.allclose(a, b, atol=1e-5)
    a.sum().backward()
    b.sum().backward()
    for (name, p), q in zip(theirs.named_parameters(), ours.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name


@pytest.mark.parametrize("family", ["builtin", "mixtral"])
def test_experts_that_get_no_token_stay_in_the_graph(family):
    """Under expert parallelism a rank whose experts receive nothing (routing collapsed elsewhere)
    must still run the all-to-all's backward its peers wait in, and hand its replicas a gradient:
    the local run's output depends on the input and every expert, with zero gradients, for the
    built-in experts and for Mixtral's (whose forward skips experts no token chose)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from training.contract.spec import ExpertSite
    from training.models.moe import GroupedExperts
    from training.parallel.ep import ExpertGroups, ExpertParallel

    if family == "builtin":
        module, weights = GroupedExperts(2, D, HIDDEN), ("w1", "w2")
    else:
        config = MixtralConfig(hidden_size=D, intermediate_size=HIDDEN, num_local_experts=2)
        module, weights = MixtralExperts(config), ("gate_up_proj", "down_proj")
        for w in weights:
            torch.nn.init.normal_(getattr(module, w))
    local = ExpertParallel(ExpertSite("experts", module, 2, weights), ExpertGroups(mesh=None, ep=1, data_parallel=1, replicas=None))
    x = torch.zeros(0, D, requires_grad=True)
    out = local._run_local(x, [0, 0])
    assert out.shape == (0, D) and out.grad_fn is not None
    out.sum().backward()
    assert x.grad is not None
    for w in weights:
        grad = getattr(module, w).grad
        assert grad is not None and not grad.any()


def test_the_meta_count_is_what_a_real_forward_and_backward_executes():
    """The plan's count on the meta device (slots spread evenly) against FLOPs counted on a real CPU
    step of the same model, whose router spreads them unevenly: the experts' FLOPs depend on the
    number of slots, not on their spread."""
    seq = 64
    torch.manual_seed(0)
    real = build(256, seq, 64, 2, 4, 4, n_experts=E, top_k=2)
    routed = LoadCounter(real.layers["0"].feed_forward.experts, E)
    with torch.device("meta"):
        meta = build(256, seq, 64, 2, 4, 4, n_experts=E, top_k=2)
    tokens = torch.randint(0, 256, (1, seq))
    counts = {}
    for name, model, t in (("real", real, tokens), ("meta", meta, tokens.to("meta"))):
        with FlopCount() as flops:
            F.cross_entropy(model(t).flatten(0, 1), t.flatten()).backward()
        counts[name] = flops.total
    assert routed.take().tolist() != [seq * 2 // E] * E, "routing is uneven"
    assert counts["real"] == counts["meta"]


def test_a_hugging_face_config_takes_the_fields_its_model_reads_and_refuses_a_misspelt_one():
    """Qwen3-MoE's config class declares no `head_dim`, which its attention reads (getattr(config,
    "head_dim", hidden // heads)) and Qwen3-235B's config sets to 128 against 4096 / 64: taken. A
    field neither declared nor read is a typo: refused."""
    from training.models.hf import causal_lm

    small = dict(model_class="transformers.Qwen3MoeForCausalLM", config_class="transformers.Qwen3MoeConfig",
                 vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = causal_lm(**small, head_dim=16)
        assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 16, "not 32 / 4"
        with pytest.raises(TypeError, match="Qwen3MoeConfig has no field 'hidden_sise'"):
            causal_lm(**small, hidden_sise=32)
