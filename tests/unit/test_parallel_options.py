"""Selective activation checkpointing's saved bytes per block, measured, and the config checks of
both options of issue #25 (selective checkpointing, sequence parallelism): one process, no ranks."""

from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError, ContractError
from training.activations import measure_tp_split
from training.config import ModelConfig
from training.contract.calls import batch_loss, build_model, model_loss
from training.contract.spec import model_spec
from training.parallel.ac import apply_ac
from training.planner.anatomy import measure_variant

B, S, H, LAYERS = 2, 32, 256, 2
SBH = S * B * H
GPT = ModelConfig(name="gpt", kwargs=dict(vocab_size=256, d_model=H, n_layers=LAYERS, n_heads=4, seq_len=S))


def saved_per_block(mode: str) -> float:
    """Bytes a GPT block saves for backward in one real fp32 forward on the CPU under `mode`."""
    model = build_model(GPT, 0)
    spec = model_spec(model, GPT)
    if mode != "none":
        apply_ac(spec.blocks, mode)
    tokens = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(0))
    split = measure_tp_split(model, {}, lambda: batch_loss(model, (tokens, tokens), model_loss(GPT)),
                             [b.module for b in spec.blocks])
    return (split.saved_bytes - split.outside_blocks_bytes) / LAYERS


def test_selective_checkpointing_saves_between_full_and_none():
    """Measured per block, fp32, b=2, s=32, h=256: none 1,050,624 bytes (16 sbh elements: the norms'
    inputs and outputs, q/k/v, attention's output, the MLP's 4h activation twice), selective
    721,920 (11 sbh: the block's input and every matmul's and attention's output), full 65,536
    (1 sbh: the block's input)."""
    none, selective, full = (saved_per_block(mode) for mode in ("none", "selective", "full"))
    assert full < selective < none
    assert none == pytest.approx(16 * 4 * SBH, rel=0.02)
    assert selective == pytest.approx(11 * 4 * SBH, rel=0.02)
    assert full == 4 * SBH


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_the_plans_count_on_the_meta_device_is_the_measured_one(mode):
    """measure_variant (what the plan reads, one sample on the meta device) per block, per sample,
    against the real CPU step's."""
    tokens = torch.zeros(1, S, dtype=torch.long, device="meta")
    cost = measure_variant(GPT, 0, (tokens, tokens), "fp32", mode)
    in_blocks = cost.activations.saved - cost.activations.loss_temp - cost.activations.outside_blocks
    assert in_blocks / LAYERS == pytest.approx(saved_per_block(mode) / B, rel=0.01)


def test_selective_checkpointing_recomputes_no_matmul():
    """Its executed FLOPs are the model's (full checkpointing's are a forward more)."""
    tokens = torch.zeros(1, S, dtype=torch.long, device="meta")
    none, selective, full = (measure_variant(GPT, 0, (tokens, tokens), "fp32", m).executed_flops_per_sample
                             for m in ("none", "selective", "full"))
    assert selective == none < full


def test_the_gpt_and_hugging_face_presets_declare_their_sequence_parallel_norms(compose_cfg):
    gpt = build_model(GPT, 0)
    assert model_spec(gpt, GPT).sp_norms(gpt) == ["layers.0.attention_norm", "layers.0.ffn_norm",
                                                  "layers.1.attention_norm", "layers.1.ffn_norm", "norm"]
    llama_cfg = compose_cfg("model=hf-llama", "tracking=none").model
    llama = build_model(llama_cfg, 0)
    spec = model_spec(llama, llama_cfg)
    assert len(spec.sp_norms(llama)) == 2 * 2 + 1
    assert "q_proj" in " ".join(spec.tp_plan(llama)), "its own TP plan is kept"


def test_a_model_without_sequence_parallel_norms_is_refused_at_tp_above_1(compose_cfg):
    with pytest.raises(ConfigError, match=r"strategy.sequence_parallel=True: LlamaForCausalLM declares no "
                                          r"sequence-parallel norms: give model.sp_plan"):
        compose_cfg("model=hf-llama", "model.sp_plan=null", "strategy=tp", "nodes=2", "strategy.sequence_parallel=true",
                    "tracking=none")
    # At tp = 1 there is nothing to split: a no-op, not an error.
    compose_cfg("model=hf-llama", "model.sp_plan=null", "strategy=ddp", "nodes=2", "strategy.sequence_parallel=true",
                "tracking=none")


def test_an_sp_plan_entry_must_be_sequence_parallel_and_match_a_module():
    with pytest.raises(ConfigError, match=r"sp_plan.norm='colwise': must be one of sequence_parallel"):
        ModelConfig(sp_plan={"norm": "colwise"})
    cfg = ModelConfig(name="gpt", kwargs=GPT.kwargs, tp_plan={"layers.*.attention.wq": "colwise",
                                                              "layers.*.nrom": "sequence_parallel"})
    model = build_model(cfg, 0)
    with pytest.raises(ContractError, match=r"\['layers.\*.nrom'\] matches no module of GPT"):
        model_spec(model, cfg).sp_norms(model)
