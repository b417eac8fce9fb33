"""The built-in mixture-of-experts GPT (model=gpt-moe-tiny's layer, training/models/moe.py) on real
gloo ranks, its experts replicated or FSDP-sharded like any weight: the same losses as one process
at the same global batch, and the routed load per expert, summed over the ranks' tokens, what one
process routes; and with the experts split over ranks (strategy.ep), the same again."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.test_strategies import GPT, TOL, run
from training.config import ModelConfig, StrategyConfig

MOE = dataclasses.replace(GPT, kwargs={**GPT.kwargs, "n_experts": 4, "top_k": 2, "aux_loss_coef": 0.0})
"""gpt-tiny's test shape with 4 experts a block, 2 a token. The load-balancing loss is off: each rank
computes it on its own tokens (Megatron's per-micro-batch loss), so it would differ from one
process's at the same global batch by construction."""


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_a_moe_gpt_at_world_2_matches_one_process(name):
    one, two = run(StrategyConfig(name="ddp"), 1, MOE), run(StrategyConfig(name=name), 2, MOE)
    assert two.losses == pytest.approx(one.losses, **TOL)
    assert two.ranks_in_sync
    assert set(two.expert_load) == {"layers.0.feed_forward.experts", "layers.1.feed_forward.experts"}
    assert two.expert_load == one.expert_load, "each rank routes its half of the batch as one process does"
    tokens = 10 * 8 * 16  # steps x global batch x sequence
    assert all(sum(load) == 2 * tokens for load in two.expert_load.values()), "top 2: two slots a token"
    assert len(two.expert_imbalance) == 10 and all(x >= 1.0 for x in two.expert_imbalance)
    assert two.expert_imbalance == pytest.approx(one.expert_imbalance)
    names = {name for name, _, _ in two.metrics()}
    assert {"moe/imbalance", "moe/imbalance_mean", "moe/dropped_share", "moe/load/layers.0.feed_forward.experts"} <= names


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero3", "tp"])
def test_experts_split_over_2_ranks_match_one_process(name):
    """strategy.ep=2 at world 2: each rank holds 2 of the 4 experts of every layer, tokens sent to
    them and back by all-to-all; under DDP their gradients are left out of DDP's buckets, under FSDP
    sharded over their own (one-rank) replica mesh, both divided by the 2 data-parallel ranks. Under
    tp=2 (one data-parallel rank) the expert group is the TP pair: each routes its half of the
    tokens they share (ep is carved out of dp x cp x tp)."""
    one, two = run(StrategyConfig(name="ddp"), 1, MOE), run(StrategyConfig(name=name, ep=2), 2, MOE)
    assert two.ep == 2
    assert two.losses == pytest.approx(one.losses, **TOL)
    assert two.ranks_in_sync, "ranks holding the same experts end equal"
    assert two.expert_load == one.expert_load
    assert two.param_bytes < one.param_bytes, "each rank holds half of the experts"


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_experts_split_over_the_two_halves_of_each_sequence_match_one_process(name):
    """cp=2 x ep=2 at world 2: each rank holds half of each sequence (context parallelism) and half
    of the experts; ep is carved out of the CP ranks, which see different tokens of the same
    samples. Each rank routes its half of the tokens to the experts' ranks; the experts' gradients
    are divided by dp x cp = 2, as DDP (over the CP ranks) and FSDP (over dp_shard x cp) average
    the rest."""
    one, two = run(StrategyConfig(name="ddp"), 1, MOE), run(StrategyConfig(name=name, cp=2, ep=2), 2, MOE)
    assert (two.cp, two.ep, two.global_batch) == (2, 2, one.global_batch)
    assert two.losses == pytest.approx(one.losses, **TOL)
    assert two.ranks_in_sync
    assert two.expert_load == one.expert_load, "the two halves' routed tokens are one process's"
    assert two.param_bytes < one.param_bytes, "each rank holds half of the experts"


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [StrategyConfig(name="ddp", ep=2), StrategyConfig(name="zero1", ep=2), StrategyConfig(name="zero3", ep=2),
     StrategyConfig(name="zero3", ep=4),
     StrategyConfig(name="hybrid", dp_shard=2, cp=2, ep=2), StrategyConfig(name="hybrid", dp_shard=2, cp=2, ep=4),
     StrategyConfig(name="hybrid", dp_shard=2, pp=2, ep=2, microbatches=2),
     StrategyConfig(name="hybrid", dp_shard=2, tp=2, ep=2),
     StrategyConfig(name="hybrid", dp_replicate=2, dp_shard=1, tp=2, ep=2),
     StrategyConfig(name="hybrid", dp_shard=2, tp=2, ep=4),
     StrategyConfig(name="hybrid", dp_shard=1, cp=2, tp=2, ep=2),
     StrategyConfig(name="hybrid", dp_shard=1, cp=2, tp=2, ep=4)],
    ids=["ddp4-ep2", "zero1-4-ep2", "fsdp4-ep2", "fsdp4-ep4", "fsdp2xcp2-ep2", "fsdp2xcp2-ep4", "pp2xfsdp2-ep2",
         "fsdp2xtp2-ep2", "hsdp2xtp2-ep2", "fsdp2xtp2-ep4", "cp2xtp2-ep2", "cp2xtp2-ep4"],
)
def test_experts_split_on_four_ranks_match_one_process(strategy):
    """At world 4: two expert groups of 2 whose replicas reduce the experts' gradients (DDP: by hand;
    zero1: the experts' optimizer state shared out over the 2 replicas, the rest over all 4 ranks;
    FSDP: sharded over the 2 replicas), one group of 4, a pipeline of 2 stages, each with its own
    expert groups (its first step's loads not counted: torch also runs its shape inference through
    the experts then), and tensor parallelism of 2 beside ep=2 (the ranks of a TP group split the
    tokens they share, and an expert group is 2 neighbouring ranks: the TP pair) and ep=4 (one
    group of every rank, wider than the 2 data-parallel ranks); and context
    parallelism of 2 beside FSDP of 2, with ep=2 (two expert groups, each the halves of a sequence;
    the experts FSDP-sharded over their 2 replicas) and ep=4 (one group of every rank); and CP of 2
    beside TP of 2 with no data parallelism, ep carved out of both: ep=2 (each CP half's TP pair)
    and ep=4 (every rank)."""
    one, four = run(StrategyConfig(name="ddp"), 1, MOE), run(strategy, 4, MOE)
    assert four.ep == strategy.ep
    assert four.losses == pytest.approx(one.losses, **TOL)
    assert four.ranks_in_sync
    skipped = four.expert_first_step - 1
    assert skipped == (1 if strategy.pp else 0)
    assert four.expert_imbalance == pytest.approx(one.expert_imbalance[skipped:])
    if not skipped:
        assert four.expert_load == one.expert_load


class UserExperts(nn.Module):
    """A user's experts module, written as Hugging Face writes theirs (called with each token's
    chosen experts and weights, looping over the experts; its expert count read from its weights)."""

    def __init__(self, n_experts: int, d: int, hidden: int):
        super().__init__()
        self.up = nn.Parameter(torch.randn(n_experts, d, hidden) * 0.3)
        self.down = nn.Parameter(torch.randn(n_experts, hidden, d) * 0.3)

    def forward(self, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(tokens)
        for e in range(self.up.shape[0]):
            token, slot = torch.where(top_k_index == e)
            y = F.relu(tokens[token] @ self.up[e]) @ self.down[e]
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class UserLayer(nn.Module):
    def __init__(self, d: int, n_experts: int, top_k: int):
        super().__init__()
        self.norm, self.router = nn.LayerNorm(d), nn.Linear(d, n_experts, bias=False)
        self.moe, self.top_k = UserExperts(n_experts, d, 2 * d), top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).reshape(-1, x.shape[-1])
        weights, chosen = F.softmax(self.router(h), dim=-1).topk(self.top_k, dim=-1)
        return x + self.moe(h, chosen, weights / weights.sum(-1, keepdim=True)).reshape(x.shape)


class UserMoE(nn.Module):
    def __init__(self, vocab_size: int, d: int, n_experts: int, top_k: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d)
        self.blocks = nn.ModuleList([UserLayer(d, n_experts, top_k) for _ in range(2)])
        self.head = nn.Linear(d, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def user_moe(vocab_size: int = 256, d: int = 32, n_experts: int = 4, top_k: int = 2) -> nn.Module:
    return UserMoE(vocab_size, d, n_experts, top_k)


USER_MOE = ModelConfig(name="user-moe", target="tests.dist.test_moe.user_moe",
                       ep_plan={"blocks.*.moe": "ep_dispatch_experts", "blocks.*.moe.up": "grouped_gemm",
                                "blocks.*.moe.down": "grouped_gemm", "blocks.*.router": "ep_router"})
"""A model of the user's that declares nothing itself: its expert plan comes from `model.ep_plan`."""


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_a_users_experts_named_by_model_ep_plan_split_over_2_ranks_match_one_process(name):
    one = run(StrategyConfig(name="ddp"), 1, USER_MOE)
    two = run(StrategyConfig(name=name, ep=2), 2, USER_MOE)
    assert two.ep == 2 and two.ranks_in_sync
    assert two.losses == pytest.approx(one.losses, **TOL)
    assert one.losses[-1] < one.losses[0]
    assert set(two.expert_load) == {"blocks.0.moe", "blocks.1.moe"} and two.expert_load == one.expert_load
    assert two.param_bytes < one.param_bytes, "each rank holds half of the experts"


@pytest.mark.parametrize("strategy", [StrategyConfig(name="zero3", ep=2), StrategyConfig(name="zero3", cp=2, ep=2)],
                         ids=["dp2-ep2", "cp2-ep2"])
def test_the_all_to_alls_move_what_the_cost_model_counts(strategy):
    """ep=2 at world 2, 10 steps of 4 sequences of 16 tokens a rank (dp=2), or of 8 sequences' halves
    (cp=2), top 2 of 4 experts, width 32, fp32: every forward all-to-all of a MoE layer (dispatch,
    combine) sends, summed over the ranks, what the cost model counts for a rank (all_to_all_bytes of
    routed_tokens) times the ranks; and in each combine (what
    a rank's experts were sent, going back) the busiest rank sends the routing imbalance train
    measures (expert_rank_imbalance at ep 2) times the mean: the factor the cost model scales the
    all-to-all time by."""
    import tempfile

    from tests.dist.test_strategies import train_inputs
    from tests.helpers import run_world
    from training.planner.anatomy import build_on_meta, measure_anatomy
    from training.contract.calls import model_loss
    from training.parallel.dims import resolve_dims
    from training.planner.comm import all_to_all_bytes, routed_tokens

    inputs = (train_inputs(strategy, MOE), tempfile.mkdtemp())
    result, sent = run_world("tests.dist.workers:train_counting_all_to_alls", inputs, world=2)
    steps, layers, calls = 10, 2, 2
    assert [len(s) for s in sent] == [steps * layers * calls] * 2, "dispatch and combine, per layer and step"
    model, spec = build_on_meta(MOE, 0)  # the shape as the plan measures it (its top_k counted on meta)
    tokens = torch.zeros(1, 16, dtype=torch.long, device="meta")
    shape = measure_anatomy(model, spec, model_loss(MOE), (tokens, tokens)).anatomy.shape
    dims = resolve_dims(strategy, 2)
    balanced = all_to_all_bytes(shape, routed_tokens(shape, 8 // dims.dp_size, dims), "fp32")
    assert balanced == 4 * 16 * 2 * 32 * 4
    for call in range(steps * layers * calls):
        assert sent[0][call] + sent[1][call] == 2 * balanced
    combines = [max(a, b) / (a + b) * 2 for a, b in zip(sent[0][1::2], sent[1][1::2], strict=True)]
    assert sum(combines) / len(combines) == pytest.approx(result.expert_rank_imbalance["2"], rel=1e-9)
    assert result.expert_rank_imbalance["2"] > 1.0, "the seed routes unevenly"


@pytest.mark.slow
def test_tensor_parallel_ranks_split_the_tokens_they_route():
    """dp_shard=2 x tp=2 with ep=2 at world 4: the two TP ranks of a data-parallel rank see the same
    tokens and route half of them each (training/parallel/ep.py), so every token all-to-all sends,
    summed over the 4 ranks, 4 x what the cost model counts for a rank (all_to_all_bytes of
    routed_tokens, its TP rank's part): half of what the ranks sent when each TP rank routed all of
    its tokens."""
    import tempfile

    from tests.dist.test_strategies import train_inputs
    from tests.helpers import run_world
    from training.contract.calls import model_loss
    from training.parallel.dims import resolve_dims
    from training.planner.anatomy import build_on_meta, measure_anatomy
    from training.planner.comm import all_to_all_bytes, routed_tokens

    strategy = StrategyConfig(name="hybrid", dp_shard=2, tp=2, ep=2)
    _, sent = run_world("tests.dist.workers:train_counting_all_to_alls", (train_inputs(strategy, MOE),
                                                                         tempfile.mkdtemp()), world=4)
    steps, layers, calls = 10, 2, 2
    assert [len(s) for s in sent] == [steps * layers * calls] * 4
    model, spec = build_on_meta(MOE, 0)
    tokens = torch.zeros(1, 16, dtype=torch.long, device="meta")
    shape = measure_anatomy(model, spec, model_loss(MOE), (tokens, tokens)).anatomy.shape
    dims = resolve_dims(strategy, 4)
    balanced = all_to_all_bytes(shape, routed_tokens(shape, 8 // dims.dp_size, dims), "fp32")
    assert balanced == 4 * 16 // 2 * 2 * 32 * 4, "a TP rank's half of 4 sequences of 16 tokens, top 2, width 32"
    for call in range(steps * layers * calls):
        assert sum(s[call] for s in sent) == 4 * balanced


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_sequence_parallelism_hands_the_experts_whole_tokens_and_takes_their_output_by_position(name):
    """tp=2 with sequence parallelism at world 2: the blocks' norms and residual stream split by
    position, each MoE layer given the gathered norm output whole (as under TP alone) and its
    output cut by position again (training/parallel/sp.py): one process's losses and loads."""
    one = run(StrategyConfig(name="ddp"), 1, MOE)
    two = run(StrategyConfig(name=name, dp_replicate=1, dp_shard=1, tp=2, sequence_parallel=True), 2, MOE)
    assert two.losses == pytest.approx(one.losses, **TOL)
    assert two.ranks_in_sync
    assert two.expert_load == one.expert_load


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [StrategyConfig(name="hybrid", dp_shard=2, tp=2, ep=2, sequence_parallel=True),
                                      StrategyConfig(name="hybrid", dp_replicate=2, dp_shard=1, tp=2, ep=2,
                                                     sequence_parallel=True)],
                         ids=["fsdp2xtp2-sp-ep2", "hsdp2xtp2-sp-ep2"])
def test_sequence_parallelism_with_experts_split_over_ranks_matches_one_process(strategy):
    """The same at world 4 with ep=2: each TP rank sends its part of the whole tokens to its
    expert group, and the parts are gathered back before the cut by position."""
    one, four = run(StrategyConfig(name="ddp"), 1, MOE), run(strategy, 4, MOE)
    assert four.losses == pytest.approx(one.losses, **TOL)
    assert four.ranks_in_sync
    assert four.expert_load == one.expert_load
