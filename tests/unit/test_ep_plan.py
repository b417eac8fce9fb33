"""The expert-parallel plan (training/contract/spec.py): where each model says its experts are, in
Hugging Face's base_model_ep_plan words, read from the built-in MoE GPT, from transformers' MoE
families and from `model.ep_plan`; what does not fit is one line before anything starts."""

from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError, ContractError
from pipelines.cli import UserError, precheck
from training.config import ModelConfig
from training.contract.spec import model_spec


def sites(model, cfg: ModelConfig):
    spec = model_spec(model, cfg)
    return spec.ep_plan[1], [(s.name, s.n_experts, s.weights) for s in spec.experts(model)]


def test_the_built_in_moe_gpt_declares_its_experts():
    from training.models.gpt import build

    cfg = ModelConfig(kwargs=dict(n_experts=4))
    source, found = sites(build(64, 8, 16, 2, 2, 2, n_experts=4), cfg)
    assert source == "GPT._ep_plan"
    assert found == [(f"layers.{i}.feed_forward.experts", 4, ("w1", "w2")) for i in range(2)]
    dense = build(64, 8, 16, 2, 2, 2)
    assert model_spec(dense, ModelConfig()).experts(dense) == [], "a dense GPT declares none"


@pytest.mark.parametrize(("family", "experts"), [("Mixtral", "num_local_experts"), ("Qwen3Moe", "num_experts")])
def test_a_hugging_face_moe_is_read_from_its_base_model_ep_plan(family, experts):
    import transformers

    config = getattr(transformers, f"{family}Config")(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                       moe_intermediate_size=32, num_hidden_layers=2,
                                                       num_attention_heads=2, num_key_value_heads=2, **{experts: 4})
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    source, found = sites(model, ModelConfig())
    assert source == f"{family}Config.base_model_ep_plan"
    assert found == [(f"model.layers.{i}.mlp.experts", 4, ("gate_up_proj", "down_proj")) for i in range(2)]


def test_model_ep_plan_overrides_the_models_own_and_is_checked():
    from training.models.gpt import build

    model = build(64, 8, 16, 2, 2, 2, n_experts=4)
    only_w1 = {"layers.*.feed_forward.experts": "ep_dispatch_experts", "layers.*.feed_forward.experts.w1": "grouped_gemm"}
    with pytest.raises(ContractError, match=r"model.ep_plan names layers.0.feed_forward.experts \(GroupedExperts\) "
                                            r"ep_dispatch_experts, but layers.0.feed_forward.experts.w2 is not declared"):
        sites(model, ModelConfig(ep_plan=only_w1))
    with pytest.raises(ContractError, match=r"model.ep_plan\['layers.\*.moe'\] matches no module or parameter"):
        sites(model, ModelConfig(ep_plan={"layers.*.moe": "ep_dispatch_experts"}))
    with pytest.raises(ConfigError, match="ep_plan.layers.*.experts"):
        ModelConfig(ep_plan={"layers.*.experts": "colwise"})


def test_experts_stacked_unequally_are_refused():
    from training.models.gpt import build

    model = build(64, 8, 16, 1, 2, 2, n_experts=4)
    experts = model.layers["0"].feed_forward.experts
    experts.w2 = torch.nn.Parameter(torch.zeros(2, 32, 16))
    with pytest.raises(ContractError, match="do not share one number of experts in dim 0"):
        sites(model, ModelConfig())


BAD = [
    (["model=hf-mixtral", "+model.ep_plan={model.layers.*.mlp.experts: ep_dispatch_experts}", "strategy.ep=2"],
     "strategy.ep=2: model.ep_plan names model.layers.0.mlp.experts (MixtralExperts) ep_dispatch_experts, but "
     "model.layers.0.mlp.experts.gate_up_proj is not declared grouped_gemm"),
    (["model=hf-mixtral", "strategy.ep=3", "nodes=3"], "strategy.ep=3: must divide every layer's experts (4)"),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_an_expert_plan_that_does_not_fit_is_one_line(overrides, expected):
    with pytest.raises(UserError) as info:
        precheck([*overrides, "tracking=none"])
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_hugging_face_moe_passes_the_checks_with_ep():
    precheck(["model=hf-mixtral", "strategy.ep=2", "tracking=none"])
