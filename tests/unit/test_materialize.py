"""Nobody holds the whole model: built on the meta device, then each module initialised alone,
seeded by its name, so a shard's values don't depend on the layout that holds it."""

from __future__ import annotations

import torch

from training.config import ModelConfig
from training.parallel.materialize import UNDECLARED, build_on_device, declared_init, materialize

GPT = ModelConfig(name="gpt", kwargs=dict(vocab_size=64, d_model=32, n_layers=3, n_heads=4, seq_len=16))
CPU = torch.device("cpu")


def built(seed: int = 0, blocks: int | None = None) -> dict[str, torch.Tensor]:
    model, spec = build_on_device(GPT, seed, CPU)
    assert spec.pending is not None and all(p.is_meta for p in model.parameters())
    if blocks is not None:
        spec.keep_first_blocks(blocks)
    materialize(model, spec.pending.names, spec.pending.init, CPU, seed)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_declared_model_is_built_on_meta_and_initialised_as_declared():
    params = built()
    assert not any(p.is_meta for p in params.values())
    weight = params["layers.0.attention.wq.weight"]
    assert abs(weight.std().item() - 0.02) < 0.005, "GPT-2's normal(0, 0.02), its init_module"
    assert torch.equal(params["layers.0.attention_norm.weight"], torch.ones(32)), "LayerNorm's own reset"
    again = built()
    assert all(torch.equal(value, again[name]) for name, value in params.items())


def test_each_module_is_seeded_by_its_name_not_by_what_else_is_built():
    whole, slice_ = built(), built(blocks=1)
    assert set(slice_) < set(whole)
    for name, value in slice_.items():
        assert torch.equal(value, whole[name]), name
    other = built(seed=1)
    assert not torch.equal(other["layers.0.attention.wq.weight"], whole["layers.0.attention.wq.weight"])


def test_a_model_that_declares_nothing_is_built_whole_on_the_host():
    mlp = ModelConfig(name="seq", target="torch.nn.Sequential")
    model, spec = build_on_device(mlp, 0, CPU)
    assert declared_init(model) is UNDECLARED and spec.pending is None


def test_a_checkpoint_tensor_is_read_block_by_block(tmp_path):
    from safetensors.torch import save_file

    from training.contract.weights import Weights

    full = torch.arange(24.0).reshape(6, 4)
    save_file({"w": full, "b": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    weights = Weights(tmp_path)
    assert "w" in weights and "missing" not in weights
    assert torch.equal(weights.read("w", (3, 0), (3, 4)), full[3:6])  # a dp_shard rank's Shard(0)
    assert torch.equal(weights.read("w", (0, 2), (6, 2)), full[:, 2:4])  # a TP rank's Shard(1)
    assert torch.equal(weights.read("b", (0,), (4,)), torch.ones(4))
