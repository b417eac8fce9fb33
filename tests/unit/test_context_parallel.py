"""Context parallelism without processes: the load-balanced split, the degrees and the mesh layout,
the wrappers it picks, the checks before anything starts, and the dry run that shows it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.errors import ContractError
from pipelines.cli import UserError, precheck
from training.config import ModelConfig, StrategyConfig
from training.parallel.compose import techniques
from training.parallel.cp import ContextParallel, SequenceSplit
from training.parallel.dims import ParallelDims, resolve_dims
from training.strategies.base import Strategy


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_each_rank_holds_an_early_and_a_late_chunk_and_as_much_causal_work(cp):
    seq = 8 * cp
    held = [SequenceSplit(r, cp).positions(seq) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq)), "disjoint, and the whole sequence"
    c = seq // (2 * cp)
    assert held[0].tolist() == [*range(c), *range(seq - c, seq)], "rank 0: the first and the last chunk"
    # Under a causal mask a query at position p attends p + 1 keys: every rank the same sum.
    work = {int((positions + 1).sum()) for positions in held}
    assert len(work) == 1, work


def test_unshard_puts_every_ranks_tokens_back_in_sequence_order():
    cp, seq = 3, 12
    x = torch.arange(2 * seq * 5, dtype=torch.float32).view(2, seq, 5)  # (batch, sequence, width)
    shards = torch.stack([SequenceSplit(r, cp).shard(x, dim=1) for r in range(cp)])  # what an all-gather gives
    assert torch.equal(SequenceSplit(0, cp).unshard(shards, dim=1), x)


def test_a_sequence_that_does_not_cut_into_2_cp_chunks_is_refused():
    with pytest.raises(ValueError, match=r"strategy.cp=2: the sequence length 18 must be a multiple of 2 x cp = 4"):
        SequenceSplit(0, 2).positions(18)


class NoAttention(nn.Module):
    """A token model that mixes nothing across positions: no SDPA for context parallelism to split."""

    def __init__(self, vocab_size: int = 256, seq_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16)])
        self.head = nn.Linear(16, vocab_size)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.layers[0](self.embed(tokens)))


def no_attention(vocab_size: int = 256, seq_len: int = 64) -> NoAttention:
    return NoAttention(vocab_size, seq_len)


def test_a_step_whose_model_never_called_sdpa_is_refused():
    """The run-time guard behind the config check: nothing was dispatched, so nothing was gathered
    (no process group is touched before the refusal)."""
    model = NoAttention()
    cp = ContextParallel(group=None, rank=0, size=2)
    cp.install(model)

    def step(batch, scale):
        inputs, targets = batch
        return nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    tokens = torch.randint(256, (2, 8))
    with pytest.raises(ContractError, match="never called torch.nn.functional.scaled_dot_product_attention"):
        cp.wrap(step)((tokens, tokens), 1.0)


def test_the_model_is_called_with_its_tokens_true_positions():
    seen = {}
    model = NoAttention()
    cp = ContextParallel(group=None, rank=1, size=2)
    cp.install(model)
    model.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)  # after CP's own
    inputs, _ = cp.shard_batch((torch.arange(16).view(1, 16), torch.arange(16).view(1, 16)))
    model(inputs)
    assert inputs.tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert seen["position_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]


def test_cp_is_a_degree_like_the_others():
    assert resolve_dims(StrategyConfig(name="hybrid", cp=2), 8) == ParallelDims(dp_shard=4, cp=2)
    assert StrategyConfig(name="zero3").cp_degree == 1 and StrategyConfig(name="zero3", cp=4).cp_degree == 4
    assert "cp" not in StrategyConfig(name="hybrid", cp=2).degrees(), "the four older degrees read as before"
    assert resolve_dims(StrategyConfig(name="hybrid", dp_shard=2, tp=2, cp=-1), 8).cp == 2
    dims = ParallelDims.resolve(1, 2, 2, 1, 8, cp=2)
    assert dims.world_size == 8 and dims.dp_size == 2
    # CP ranks hold the same parameters: FSDP shards over dp_shard x cp, a DDP strategy replicates over them.
    assert dims.gradient_ranks("fsdp") == dims.gradient_ranks(None) == (1, 4) and dims.gradient_ranks("ddp") == (2, 2)
    assert ParallelDims(cp=2).uses_fsdp("fsdp") and not ParallelDims(cp=2).uses_fsdp("ddp")
    # torchtitan's layout, outermost first: (pp, dp_replicate, dp_shard, cp, tp).
    assert dims.coordinates(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1, "dp": 1}
    assert dims.coordinates(6)["cp"] == 1 and dims.coordinates(6)["dp"] == 1
    with pytest.raises(ValueError, match=r"dp_shard x cp x tp = 1 x 1 x 3 x 2 x 1 = 6, but the world size is 4"):
        ParallelDims.resolve(1, 3, 1, 1, 4, cp=2)
    assert ParallelDims(1, 2, 1, 1) == ParallelDims(dp_shard=2, cp=1), "positional and older calls: cp=1"


def test_a_declaration_without_cp_presets_it_to_one():
    old = Strategy(name="mine", summary="", degrees={"dp_replicate": -1, "dp_shard": 1, "tp": 1, "pp": 1}, wrapper=None)
    assert old.degrees["cp"] == 1 and old.degrees_on(4) == {"dp_replicate": 4, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1}


@pytest.mark.parametrize(("strategy", "world", "fsdp", "ddp", "cp_replicates"), [
    (StrategyConfig(name="hybrid", cp=2), 2, True, False, False),  # FSDP over dp_shard x cp
    (StrategyConfig(name="zero3", cp=2), 4, True, False, False),
    (StrategyConfig(name="tp", cp=2), 4, True, False, False),  # nothing else reduces over the CP ranks
    (StrategyConfig(name="ddp", cp=2), 4, False, True, True),  # DDP: the CP ranks are more replicas
    (StrategyConfig(name="zero1", cp=2), 2, False, True, True),
    (StrategyConfig(name="ddp", tp=2, cp=2), 4, True, False, True),  # a TP model replicated by HSDP
    (StrategyConfig(name="ddp"), 2, False, True, False),
    (StrategyConfig(name="hybrid", tp=2), 2, False, False, False),
])
def test_the_gradient_wrapper_reduces_over_the_cp_ranks(strategy, world, fsdp, ddp, cp_replicates):
    use = techniques(strategy, resolve_dims(strategy, world))
    assert (use.fsdp, use.ddp, use.cp_replicates) == (fsdp, ddp, cp_replicates)


def test_the_dry_run_shows_cp_and_shards_over_dp_shard_x_cp():
    from training.planner.dryrun import format_layout, plan_layout

    gpt = ModelConfig(name="gpt", kwargs=dict(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4))
    whole = plan_layout(gpt, StrategyConfig(name="ddp"), 1)[0].param_bytes
    strategy = StrategyConfig(name="hybrid", dp_shard=2, cp=2, tp=2)
    (share,) = plan_layout(gpt, strategy, 8)
    assert share.coordinates["cp"] == 0
    assert share.param_bytes < whole / 4, "TP halves the block linears, FSDP shards the rest over 4 ranks"
    text = format_layout([share], strategy, 8)
    assert "dp_shard 2 x cp 2 x tp 2" in text and "each sequence split over 2 ranks" in text


BAD = [
    (["strategy=hybrid", "strategy.cp=2", "model.seq_len=18"],
     "strategy.cp=2: model=gpt-tiny trains on sequences of 18 tokens (seq_len), which must be a multiple of "
     "2 x cp = 4"),
    (["strategy=hybrid", "strategy.cp=2", "model=mlp", "data=blobs"],
     "strategy.cp=2: splits sequences, and the inputs of data=blobs have no sequence dimension"),
    (["strategy=hybrid", "strategy.cp=2", "model=custom", "model._target_=tests.unit.test_context_parallel.no_attention",
      "+model.vocab_size=256", "+model.seq_len=64"],
     "strategy.cp=2: model=custom never calls torch.nn.functional.scaled_dot_product_attention"),
    (["strategy=hybrid", "strategy.dp_shard=1", "strategy.cp=4"],
     "strategy degrees pp x dp_replicate x dp_shard x cp x tp = 1 x 1 x 1 x 4 x 1 = 4, but the world size is 2"),
    (["strategy.cp=0"], "strategy.cp=0: must be >= 1, -1"),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_an_impossible_cp_is_one_line_before_anything_starts(overrides, expected):
    with pytest.raises(UserError) as info:
        precheck(overrides)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_a_cp_layout_that_fits_passes_the_checks():
    precheck(["strategy=hybrid", "strategy.cp=2"])
    precheck(["strategy=hybrid", "strategy.cp=2", "model=hf-llama"])


@pytest.mark.parametrize("fields", [
    dict(name="ddp", cp=2), dict(name="zero1", cp=2), dict(name="zero3", cp=2), dict(name="zero2", cp=2),
    dict(name="hybrid", cp=2), dict(name="hybrid", cp=2, reshard_after_forward=False), dict(name="hybrid", cp=2, tp=2),
    dict(name="hybrid", dp_replicate=2, dp_shard=1, tp=2), dict(name="ddp"), dict(name="tp", cp=2),
    dict(name="ddp", cp=2, tp=2),
], ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()))
def test_the_planner_charges_the_wrapper_the_trainer_applies(fields):
    """The flavour the cost model charges a configured strategy (flavour_of) wraps in FSDP exactly
    when the trainer does (compose.techniques), CP ranks included: a DDP strategy replicates over
    them, any other shards over dp_shard x cp."""
    from training import strategies
    from training.planner.memory import fsdp_wraps, states_per_param
    from training.strategies import flavour_of

    strategy = StrategyConfig(**fields)
    world = fields.get("cp", 1) * fields.get("tp", 1) * fields.get("dp_replicate", 1)  # no data parallelism else
    world = world if world > 1 else 2
    dims = resolve_dims(strategy, world)
    flavour = flavour_of(strategy, dims)
    assert fsdp_wraps(flavour, dims) == techniques(strategy, dims).fsdp
    # The optimizer's moments (8 bytes a parameter) sharded over what FSDP shards over: dp_shard x cp,
    # or dp_shard alone where a DDP strategy's CP ranks are replicas (HSDP for a TP model).
    # (zero1 shards its optimizer over every rank of a replica either way.)
    _, shards = dims.gradient_ranks(strategies.get(strategy.name).wrapper)
    if not strategies.get(flavour).shards_optimizer_only:
        assert states_per_param(flavour, dims, "fp32")[2] == 8 / (shards if fsdp_wraps(flavour, dims) else 1)
    if techniques(strategy, dims).fsdp:
        assert strategies.get(flavour).reshard_after_forward == strategy.reshard
