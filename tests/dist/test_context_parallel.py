"""Context parallelism on real gloo ranks: each sequence split over the cp ranks (load-balanced
chunks, K/V all-gathered per layer) trains as one process does, alone and composed with FSDP,
DDP, TP, PP (one or two stages a rank) and activation checkpointing; each rank keeps about 1/cp
of the blocks' activations; the K/V exchange moves what the cost model is told it moves."""

from __future__ import annotations

import pytest

from tests.dist.test_strategies import TOL, reference, run
from tests.helpers import run_world
from training.config import ModelConfig, StrategyConfig

WORLD2 = {
    "hybrid-cp2": StrategyConfig(name="hybrid", cp=2),
    "zero3-cp2": StrategyConfig(name="zero3", cp=2),
    "ddp-cp2": StrategyConfig(name="ddp", cp=2),
    "cp2-ac": StrategyConfig(name="hybrid", cp=2, activation_checkpointing="full"),
}


@pytest.mark.parametrize("name", list(WORLD2))
def test_cp2_at_world_2_matches_one_process(name):
    """FSDP over dp_shard x cp (hybrid, zero3) or DDP over the CP ranks (ddp); with full
    checkpointing, attention is recomputed in backward through the same all-gather."""
    result = run(WORLD2[name], 2)
    assert result.world_size == 2 and result.cp == 2
    assert result.global_batch == 8, "CP ranks see the same samples: the data-parallel size stays 1"
    assert result.losses == pytest.approx(reference().losses, **TOL)
    assert result.ranks_in_sync


@pytest.mark.slow
@pytest.mark.parametrize(
    "degrees",
    [dict(dp_shard=2), dict(dp_shard=1, tp=2), dict(dp_shard=1, pp=2)],
    ids=["cp2xfsdp2", "cp2xtp2", "cp2xpp2"],
)
def test_cp2_on_four_ranks_matches_one_process(degrees):
    result = run(StrategyConfig(name="hybrid", cp=2, **degrees), 4)
    assert result.cp == 2
    assert result.dims == [degrees.get(k, 1) for k in ("dp_replicate", "dp_shard", "tp", "pp")]
    assert result.losses == pytest.approx(reference().losses, **TOL)
    assert result.ranks_in_sync


@pytest.mark.slow
def test_cp2_with_two_pipeline_stages_per_rank_matches_one_process():
    """cp=2 x pp=2 interleaved, two stages a rank: each stage's attention gathers K/V over the same
    CP group, stage after stage, microbatch after microbatch. (The split-backward schedules, zbv and
    zero_bubble, are refused with CP as with any data parallelism: the CP ranks' gradients are
    reduced by DDP's or FSDP's hooks, which their weight passes miss.)"""
    from tests.dist.test_pipeline_schedules import GPT4
    from tests.dist.test_pipeline_schedules import reference as reference4

    strategy = StrategyConfig(name="hybrid", cp=2, dp_shard=1, pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2,
                              microbatches=4)
    result = run(strategy, 4, GPT4)
    assert (result.cp, result.dims) == (2, [1, 1, 1, 2])
    assert result.losses == pytest.approx(reference4().losses, **TOL)
    assert result.ranks_in_sync


LONG = ModelConfig(name="gpt", kwargs=dict(vocab_size=256, d_model=32, n_layers=2, n_heads=4, seq_len=64))
"""Four chunks of 16 tokens at cp=2: the activations are the sequence's, not the embeddings'."""
BATCH, SEQ = 4, 64
_MEASURED: dict = {}


def measured(cp: int) -> dict:
    """The blocks' saved bytes and the K/V traffic of one step on each rank, DDP over the CP ranks
    (its parameters are the module's own: nothing gathered is mistaken for an activation)."""
    if cp not in _MEASURED:
        strategy = StrategyConfig(name="ddp", cp=cp if cp > 1 else None)
        _MEASURED[cp] = run_world("tests.dist.cp_workers:block_activations", (LONG, strategy, BATCH, SEQ), world=cp)
    return _MEASURED[cp]


def test_each_rank_keeps_about_one_cp_th_of_the_blocks_activations():
    """Everything a block saves is per token, halved at cp=2, except attention's keys and values,
    which SDPA keeps whole (the all-gathered sequence) for backward; the outputs of attention's two
    calls, one per chunk, beside their join, which the layer goes on with (one attention output a
    layer); and on a CPU the causal masks of rank 0's chunks, shared by the layers: none for its
    first (all of the keys up to its end: `is_causal`), t/4 x t for its last (chunk 3 of 4).
    Measured on rank 0: 634,880 of 1,064,960 bytes (0.596 of cp=1), exactly this sum."""
    one, two = measured(1)["block_saved_bytes"], measured(2)["block_saved_bytes"]
    cp, layers, d = 2, LONG.kwargs["n_layers"], LONG.kwargs["d_model"]
    gathered_kv = layers * 2 * BATCH * SEQ * d * 4 * (cp - 1) // cp  # the other ranks' K and V, fp32
    chunk_outputs = layers * BATCH * SEQ // cp * d * 4
    mask = (SEQ // (2 * cp)) * SEQ * 4
    assert two == one / cp + gathered_kv + chunk_outputs + mask
    assert two / one == pytest.approx(1 / cp, rel=0.2), "the rest is per token"


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_causal_attention_matches_one_process_with_either_mask(heads):
    """Each chunk of a rank's queries against the keys up to its end, its causal mask either a
    tensor made once (a CPU's way) or the lower-right bias CUDA's flash and memory-efficient
    kernels apply without one (on a CPU torch builds it per call): both equal one process's
    attention over the whole sequence, outputs and Q/K/V gradients, grouped K/V heads too; the
    kernel's way builds no mask of its own. World 2, float64."""
    result = run_world("tests.dist.cp_workers:attention_both_ways", heads, world=2)
    for way in ("tensor", "kernel"):
        assert result[way]["error"] < 1e-12, (way, result)
    assert result["kernel"]["masks"] == 0
    assert result["tensor"]["masks"] == 3, "rank 0's last chunk (its first is square) and rank 1's two"


@pytest.mark.slow
def test_causal_attention_matches_one_process_with_either_mask_at_cp4():
    result = run_world("tests.dist.cp_workers:attention_both_ways", (4, 2), world=4)
    assert max(result[way]["error"] for way in ("tensor", "kernel")) < 1e-12, result


def test_the_kv_all_gather_moves_what_the_cost_model_counts():
    """Per layer and rank: 2 x (cp-1)/cp x s x b x h_kv x head_dim x bytes received in forward
    (K and V in one all-gather), as many sent back in backward (the reduce-scatter of their
    gradients). Measured at cp=2, b=4, s=64, 4 heads of 8, fp32: 32,768 bytes a layer."""
    stats = measured(2)
    cp, d, layers = 2, LONG.kwargs["d_model"], LONG.kwargs["n_layers"]
    per_layer = 2 * (cp - 1) * SEQ * BATCH * d * 4 // cp
    assert stats["layers"] == layers
    assert stats["gathered_per_layer"] == [per_layer] * layers == [32768, 32768]
    assert stats["scattered_bytes"] == per_layer * layers



@pytest.mark.slow
@pytest.mark.parametrize("preset", ["hf-llama", "hf-qwen2"])
def test_a_hugging_face_model_with_cp2_matches_one_process(compose_cfg, preset):
    """transformers' sdpa_attention_forward calls torch's function: the swap reaches it; rotary
    embeddings get the true positions through position_ids; the mask the model builds for its
    local tokens (a packed-sequence mask, from positions that jump) is replaced by the causal
    mask of the true positions; Qwen2's grouped K/V heads are gathered as the model passes them."""
    import tempfile

    from stages.train import TrainInputs
    from training.config import TrainConfig

    cfg = compose_cfg(f"model={preset}", "data.num_samples=256", "data.seq_len=16", "tracking=none",
                      "strategy=hybrid", "strategy.cp=2")
    train = TrainConfig(steps=6, global_batch=8, lr=1e-2, log_every=3, timing_warmup=2, warmup_steps=2,
                        schedule="constant", grad_clip=0.5)
    runs = {}
    for name, strategy, world in (("one", StrategyConfig(name="ddp"), 1), ("cp2", cfg.strategy, 2)):
        inputs = TrainInputs(train, cfg.model, cfg.data, strategy, seed=0)
        runs[name] = run_world("tests.dist.workers:train_any", (inputs, tempfile.mkdtemp()), world=world, timeout_s=120)
    assert runs["cp2"].cp == 2 and runs["cp2"].ranks_in_sync
    assert runs["cp2"].losses == pytest.approx(runs["one"].losses, **TOL)


def test_grouped_kv_heads_are_gathered_at_the_width_the_cost_model_counts(compose_cfg):
    """Qwen2 passes SDPA its 2 grouped K/V heads unexpanded (enable_gqa): the all-gather moves
    their width, half of the model's 4 heads, and the anatomy counted on the meta device
    (Shape.kv_width) says so: the cost model's K/V bytes per layer are the measured ones."""
    import torch

    from training.planner.anatomy import measure_anatomy
    from training.planner.memory import activation_tensor_bytes
    from training.contract.calls import build_model, model_loss
    from training.contract.spec import model_spec

    cfg = compose_cfg("model=hf-qwen2", "tracking=none").model
    with torch.device("meta"):
        model = build_model(cfg, seed=0)
        tokens = torch.zeros(BATCH, SEQ + 1, dtype=torch.long)
        shape = measure_anatomy(model, model_spec(model, cfg), model_loss(cfg), (tokens[:, :-1], tokens[:, 1:])).anatomy.shape
    assert shape.kv_width == 2 * 16 < shape.hidden == 64, "2 K/V heads of 16 reach SDPA, of 4 query heads"
    stats = run_world("tests.dist.cp_workers:block_activations", (cfg, StrategyConfig(name="ddp", cp=2), BATCH, SEQ), world=2)
    cp = 2
    per_layer = 2 * activation_tensor_bytes(BATCH, SEQ, shape.kv, 4) * (cp - 1) // cp  # K and V, fp32
    assert stats["gathered_per_layer"] == [per_layer] * shape.layers
