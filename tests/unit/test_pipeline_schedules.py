"""Pipeline schedules without ranks: which stages a rank holds, what each schedule asks of its
microbatches (torch 2.13's rules, refused in one line before anything runs), and the chunks a model
is cut into — the project's layout and Hugging Face's base_model_pp_plan — composing to its forward."""

from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError, ContractError
from pipelines.cli import UserError, precheck
from training.config import ModelConfig, StrategyConfig
from training.contract.blocks import Skipped
from training.contract.spec import model_spec
from training.parallel.chunks import PipelineChunks, chunk_blocks, parts, split
from training.parallel.schedules import (
    PP_SCHEDULES,
    checkpointing_problem,
    data_parallel_problem,
    microbatches_problem,
    rank_stages,
)


def test_looped_and_v_shaped_stage_assignment():
    assert [rank_stages("1f1b", r, 4, 1) for r in range(4)] == [[0], [1], [2], [3]]
    assert [rank_stages("interleaved_1f1b", r, 2, 3) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert [rank_stages("zbv", r, 4, 2) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    for schedule in PP_SCHEDULES:  # every stage held by exactly one rank
        v = 1 if schedule in ("gpipe", "1f1b") else 2
        held = sorted(s for r in range(4) for s in rank_stages(schedule, r, 4, v))
        assert held == list(range(4 * v)), schedule


@pytest.mark.parametrize(("schedule", "pp", "m", "ok"), [
    ("gpipe", 4, 1, True), ("1f1b", 4, 3, False), ("1f1b", 4, 4, True),
    # interleaved: max(1, m // pp) rounds, m a multiple of them (torch 2.13; 5 at pp=2 raised on gloo)
    ("interleaved_1f1b", 2, 1, True), ("interleaved_1f1b", 2, 3, True), ("interleaved_1f1b", 2, 5, False),
    ("interleaved_1f1b", 2, 6, True), ("zero_bubble", 4, 9, False), ("zero_bubble", 4, 6, True),
    ("zbv", 2, 1, True), ("dualpipev", 2, 3, False), ("dualpipev", 2, 4, True),
])
def test_microbatch_rules_are_torchs(schedule, pp, m, ok):
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    assert (microbatches_problem(schedule, pp, v, m) is None) == ok


def test_split_backward_schedules_refuse_replicas_and_selective_checkpointing():
    assert data_parallel_problem("zbv", 1) is None and data_parallel_problem("interleaved_1f1b", 4) is None
    for schedule in ("zero_bubble", "zbv", "dualpipev"):
        assert "input and weight passes" in data_parallel_problem(schedule, 2)
        assert "selective checkpointing forbids" in checkpointing_problem(schedule, "selective")
        assert checkpointing_problem(schedule, "full") is None
    assert checkpointing_problem("interleaved_1f1b", "selective") is None


@pytest.mark.parametrize(("kwargs", "expected"), [
    (dict(pp_schedule="zbv"), "pp_virtual_stages=1: pp_schedule=zbv holds exactly two stages per rank"),
    (dict(pp_schedule="interleaved_1f1b"), "pp_virtual_stages=1: pp_schedule=interleaved_1f1b interleaves"),
    (dict(pp_schedule="1f1b", pp_virtual_stages=2), "pp_virtual_stages=2: pp_schedule=1f1b runs one stage"),
    (dict(pp_schedule="dualpipev", pp_virtual_stages=3), "pp_virtual_stages=3: pp_schedule=dualpipev holds"),
    (dict(pp_virtual_stages=0), "pp_virtual_stages=0: must be an integer >= 1"),
    (dict(pp_schedule="looped_bfs"), "pp_schedule='looped_bfs': must be one of gpipe, 1f1b, interleaved_1f1b"),
])
def test_a_schedule_and_its_stages_per_rank_are_one_line(kwargs, expected):
    with pytest.raises(ConfigError) as info:
        StrategyConfig(name="pp", **kwargs)
    assert str(info.value).startswith(expected)


BAD = [
    (["strategy=pp", "strategy.pp_schedule=interleaved_1f1b", "strategy.pp_virtual_stages=2"],
     "strategy.pp_virtual_stages=2: pp x pp_virtual_stages = 4 stages, more than the 2 blocks of model=gpt-tiny"),
    (["strategy=pp", "model.n_layers=4", "strategy.pp_schedule=dualpipev", "strategy.pp_virtual_stages=2"],
     "strategy.microbatches=2: pp_schedule=dualpipev needs at least as many microbatches as stages, pp x 2 = 4"),
    (["strategy=pp", "strategy.pp_schedule=1f1b", "strategy.microbatches=1"],
     "strategy.microbatches=1: pp_schedule=1f1b needs at least pp=2 microbatches"),
    (["strategy=hybrid", "nodes=4", "strategy.pp=2", "strategy.dp_shard=2", "model.n_layers=4",
      "strategy.pp_schedule=zbv", "strategy.pp_virtual_stages=2"],
     "strategy.pp_schedule='zbv': pp_schedule=zbv splits backward into input and weight passes"),
    (["strategy=pp", "model.n_layers=4", "strategy.pp_schedule=zero_bubble", "strategy.pp_virtual_stages=2",
      "strategy.activation_checkpointing=selective"],
     "strategy.pp_schedule='zero_bubble': pp_schedule=zero_bubble backwards each region twice"),
    (["strategy=pp", "model.n_layers=4", "strategy.pp_schedule=interleaved_1f1b", "strategy.pp_virtual_stages=2",
      "strategy.microbatches=5", "train.micro_batch=10"],
     "strategy.microbatches=5: pp_schedule=interleaved_1f1b runs max(1, microbatches // pp) = 2 rounds"),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD, ids=[" ".join(o[1:]) for o, _ in BAD])
def test_cross_field_pipeline_rules_are_one_line(overrides, expected):
    with pytest.raises(UserError) as info:
        precheck(overrides)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_valid_interleaved_layout_passes_the_checks(compose_cfg):
    cfg = compose_cfg("strategy=pp", "model.n_layers=4", "strategy.pp_schedule=interleaved_1f1b",
                      "strategy.pp_virtual_stages=2", "strategy.microbatches=4", "tracking=none")
    assert (cfg.strategy.pp_schedule, cfg.strategy.pp_virtual_stages) == ("interleaved_1f1b", 2)


def _gpt(n_layers: int = 4) -> torch.nn.Module:
    from training.models.gpt import build

    torch.manual_seed(0)
    return build(vocab_size=64, seq_len=8, d_model=16, n_layers=n_layers, n_heads=2)


def _llama(n_layers: int = 4, **config: object) -> torch.nn.Module:
    from training.models.hf import causal_lm

    torch.manual_seed(0)
    return causal_lm("transformers.LlamaForCausalLM", "transformers.LlamaConfig", vocab_size=64, hidden_size=32,
                     intermediate_size=64, num_hidden_layers=n_layers, num_attention_heads=2, num_key_value_heads=2,
                     max_position_embeddings=32, **config)


def _composed(chunks: list[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    h = tokens
    for chunk in chunks:
        h = chunk(h)
    return h


@pytest.mark.parametrize("build", [_gpt, _llama], ids=["gpt", "hf-llama"])
def test_stages_cut_from_the_layout_compose_to_the_whole_forward(build):
    model = build()
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        whole = model(tokens)
        whole = getattr(whole, "logits", whole)
    spec = model_spec(model, ModelConfig())
    layout = spec.layout(model)
    names = {n for n, _ in model.named_parameters()}
    chunks = split(model, layout, [0, 1, 2, 3], 4)
    with torch.no_grad():
        assert torch.equal(_composed(chunks, tokens), whole)
    # Every parameter in exactly one chunk, under its name in the whole model; the model emptied.
    per_chunk = [{n for n, _ in c.named_parameters()} for c in chunks]
    assert set().union(*per_chunk) == names and sum(map(len, per_chunk)) == len(names)
    assert not list(model.parameters())
    assert [len(chunk_blocks(c, layout)) for c in chunks] == [1, 1, 1, 1]


def test_chunks_share_the_models_modules_rather_than_copying_them():
    model = _gpt()
    blocks = [b.module for b in model_spec(model, ModelConfig()).blocks]
    layout = model_spec(model, ModelConfig()).layout(model)
    first, second = split(model, layout, [0, 2], 4)
    assert first.layers["0"] is blocks[0] and second.layers["2"] is blocks[2]
    assert first.output is None and second.tok_embeddings is None and second.output is None
    container = PipelineChunks([first, second], [0, 2])
    assert parts(container) == [first, second] and parts(first) == [first]
    assert sum(p.numel() for p in container.parameters()) == sum(p.numel() for c in (first, second)
                                                                 for p in c.parameters())


def test_hugging_face_layout_is_read_from_its_pp_plan():
    model = _llama()
    layout = model_spec(model, ModelConfig()).layout(model)
    assert (layout.container, layout.first, layout.last) == ("model.layers", ("model.embed_tokens",),
                                                             ("model.norm", "lm_head"))
    assert layout.source == "LlamaConfig.base_model_pp_plan" and layout.placeholders
    middle = split(model, layout, [1, 2], 4)[0]
    assert isinstance(middle.model.embed_tokens, Skipped) and isinstance(middle.lm_head, Skipped)
    assert isinstance(middle.model.layers[0], Skipped) and not isinstance(middle.model.layers[1], Skipped)


def test_tied_embeddings_are_refused_for_pipelines():
    model = _llama(tie_word_embeddings=True)
    with pytest.raises(ContractError, match="ties lm_head.weight to a parameter of model.embed_tokens"):
        model_spec(model, ModelConfig()).layout(model)


def test_a_model_without_a_layout_is_still_refused_in_one_line():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ContractError, match="declares no pipeline layout"):
        model_spec(model, ModelConfig()).layout(model)


def _hf_config(model_class: str, config_class: str, **extra: object) -> ModelConfig:
    kwargs = dict(model_class=f"transformers.{model_class}", config_class=f"transformers.{config_class}",
                  vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=32, **extra)
    return ModelConfig(name=model_class, target="training.models.hf.causal_lm", kwargs=kwargs)


@pytest.mark.parametrize(("model", "problem"), [
    (_hf_config("LlamaForCausalLM", "LlamaConfig"), None),
    # Its head soft-caps the logits in the model's forward: once cut, every stage would.
    (_hf_config("Gemma2ForCausalLM", "Gemma2Config", head_dim=16, tie_word_embeddings=False),
     "Gemma2ForCausalLM cut into pipeline stages by its Gemma2Config.base_model_pp_plan computes other outputs"),
], ids=["llama", "gemma2"])
def test_the_contract_check_runs_a_batch_through_the_stages(model, problem):
    from training.config import DataConfig
    from training.contract.check import describe

    data = DataConfig(kwargs=dict(num_samples=8, seq_len=8, vocab_size=64))
    found = describe(model, data, seed=0).pipeline_problem
    assert found == problem if problem is None else found.startswith(problem)


def test_a_dry_run_counts_every_chunk_a_rank_holds():
    """3-D layout dp_shard=2 x tp=2 x pp=2, interleaved over 2 x 2 stages: each rank holds two chunks
    of 3 blocks (of the 12), their FSDP and TP shards together, as much as one stage of 6 blocks."""
    from training.planner.dryrun import plan_layout

    model = ModelConfig(name="gpt-small", kwargs=dict(vocab_size=512, seq_len=32, d_model=64, n_layers=12, n_heads=4))
    looped = StrategyConfig(name="hybrid", dp_shard=2, tp=2, pp=2, pp_schedule="interleaved_1f1b",
                            pp_virtual_stages=2)
    one_stage = StrategyConfig(name="hybrid", dp_shard=2, tp=2, pp=2)
    interleaved, plain = plan_layout(model, looped, 8), plan_layout(model, one_stage, 8)
    assert [s.layers for s in interleaved] == [6, 6]
    assert [s.param_bytes for s in interleaved] == [s.param_bytes for s in plain]


def test_skeletons_leave_the_model_whole_and_share_its_hooks():
    """The composition check cuts skeletons: the model keeps every part; a hook on its root (context
    parallelism's position hook) is the same callable on each chunk, its owner not copied."""
    from training.parallel.chunks import composition_problem, skeleton

    model = _llama(n_layers=2)
    owner = object()

    def hook(module: torch.nn.Module, args: tuple) -> None:
        assert owner is not None

    model.register_forward_pre_hook(hook)
    names = [n for n, _ in model.named_parameters()]
    layout = model_spec(model, ModelConfig()).layout(model)
    assert composition_problem(model, layout, torch.randint(0, 64, (2, 8))) is None
    assert [n for n, _ in model.named_parameters()] == names and model.training
    copy = skeleton(model, layout)
    assert list(copy._forward_pre_hooks.values()) == [hook]
    assert copy.model is not model.model and copy.model.layers is not model.model.layers
    assert copy.model.layers[0] is model.model.layers[0] and copy.lm_head is model.lm_head
