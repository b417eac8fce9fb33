"""The memory ruler's terms, each against a hand count (no processes: the meta device)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from training.activations import measure_tp_split
from training.anatomy import fused_attention_on_meta
from training.config import ModelConfig
from training.costmodel import (
    Shape,
    Workload,
    activation_memory,
    fsdp_root_reduce,
    fsdp_working_set,
    memory_breakdown,
)
from training.models import batch_loss, build_model, model_loss
from training.models.spec import model_spec
from training.parallel.dims import ParallelDims

B, S, H = 2, 16, 64
SBH = S * B * H


def gpt(layers: int) -> ModelConfig:
    # vocab = 4h, as GPT's own are wide: what the head saves is then easy to tell from a block.
    return ModelConfig(name="gpt", kwargs=dict(vocab_size=4 * H, d_model=H, n_layers=layers, n_heads=4, seq_len=S))


def saved_in_bf16(layers: int, checkpointing: bool = False):
    """The TpSplit of one bf16 forward + backward of a GPT on the meta device."""
    from training.parallel.ac import apply_ac

    cfg = gpt(layers)
    with torch.device("meta"):
        model = build_model(cfg, 0).to(torch.bfloat16)
    spec = model_spec(model, cfg)
    plan = spec.tp_plan(model)
    if checkpointing:
        apply_ac(spec.blocks)
        plan = {}  # only the blocks' inputs are saved: nothing is split
    x = torch.zeros(B, S, dtype=torch.long, device="meta")
    with fused_attention_on_meta():
        split = measure_tp_split(model, plan, lambda: batch_loss(model, (x, x), model_loss(cfg)))
    return split


def per_layer(field: str, checkpointing: bool = False) -> float:
    """One block's share: three layers less two (what embeddings and head save cancels)."""
    return (getattr(saved_in_bf16(3, checkpointing), field) - getattr(saved_in_bf16(2, checkpointing), field)) / SBH


def test_tp_without_sequence_parallelism_keeps_the_norms_and_linear_inputs_whole():
    """Korthikanti et al. Table 2, TP without SP: sbh(10 + 24/t) bytes per layer in 16-bit, where
    the 10 holds two 1-byte dropout masks; this GPT has no dropout, so sbh(8 + 24/t): the two norm
    inputs and the two column-split linears' inputs (2 sbh each) whole, q/k/v, attention's output,
    the MLP's 4h hidden twice (24 sbh) split. LayerNorm's statistics and attention's log-sum-exp
    add a little."""
    replicated = per_layer("replicated_bytes")
    split = per_layer("saved_bytes") - replicated
    assert replicated == pytest.approx(8, rel=0.05) and split == pytest.approx(24, rel=0.05)
    t = 8
    assert replicated + split / t == pytest.approx(8 + 24 / t, rel=0.10)


def test_full_recomputation_saves_each_blocks_input():
    """Full activation checkpointing keeps one block input per layer: 2 sbh in bf16."""
    assert per_layer("saved_bytes", checkpointing=True) == pytest.approx(2, rel=0.02)


SHAPE = Shape(params=1000, layers=4, block_linear_params=400, hidden=H, seq_len=S, heads=4,
              first_stage_params=100, last_stage_params=100)


def test_zero3s_working_set_is_the_root_two_gathered_blocks_and_one_blocks_gradients():
    """bf16 zero3 on 8 ranks: blocks of (1000 - 200) / 4 = 200 parameters. At the peak of backward
    the root (embeddings + head, 200) is gathered (never resharded after forward), the block in
    backward and the prefetched one (2 x 200), in 2 bytes; that block's unsharded bf16 gradients
    and their fp32 reduce-scatter buffer (200 x (2 + 4))."""
    d = ParallelDims(dp_shard=8)
    assert fsdp_working_set(SHAPE, "zero3", d, "bf16") == 2 * (200 + 2 * 200) + (2 + 4) * 200
    # ZeRO-2 holds its gathered copies in its states; only the gradients are transient.
    assert fsdp_working_set(SHAPE, "zero2", d, "bf16") == (2 + 4) * 200
    # TP 2 splits the block linears (400 / 4 = 100 per block): a block is 150 on each rank.
    assert fsdp_working_set(SHAPE, "zero3", ParallelDims(dp_shard=4, tp=2), "fp32") == (
        4 * (200 + 2 * 150) + (4 + 4) * 150)
    assert fsdp_working_set(SHAPE, "ddp", ParallelDims(dp_replicate=8), "bf16") == 0


def workload(schedule: str, microbatches: int) -> Workload:
    return Workload(SHAPE, micro_batch=8, grad_accum=1, microbatches=microbatches, precision="bf16",
                    checkpointing=False, tokens_per_sample=S, activation_bytes_per_sample=1000.0,
                    pp_schedule=schedule)


def test_gpipe_keeps_every_microbatch_and_1f1b_at_most_the_stages():
    """pp 2 over 4 layers: a stage holds 2 of them, half the per-sample bytes. 8 samples in 4
    microbatches of 2: GPipe keeps all 4 until the backward (8 samples); 1F1B on the first stage
    min(4, 2) = 2 microbatches (4 samples)."""
    d = ParallelDims(pp=2)
    assert activation_memory(workload("gpipe", 4), d) == 1000.0 * 8 * 0.5
    assert activation_memory(workload("1f1b", 4), d) == 1000.0 * 4 * 0.5
    assert activation_memory(workload("1f1b", 1), d) == 1000.0 * 8 * 0.5


def test_the_breakdown_peaks_in_backward_or_at_the_roots_reduction():
    """States, then the higher of: backward (activations + the working set) and the root unit's
    reduction after it (its 200 parameters' bf16 gradients and fp32 buffer: 200 x 6)."""
    w = workload("1f1b", 1)
    d = ParallelDims(dp_shard=8)
    m = memory_breakdown(w, "zero3", d)
    assert m.states == 1000 * 16 / 8 and m.activation_bytes == 8000.0
    assert m.working_bytes == fsdp_working_set(SHAPE, "zero3", d, "bf16")
    assert m.tail_bytes == fsdp_root_reduce(SHAPE, d, "bf16") == 200 * (2 + 4)
    assert m.total == m.states + m.activation_bytes + m.working_bytes
    # Embeddings and head of 600 over blocks of 100: the root's reduction (600 x 6 = 3600) outweighs
    # backward's working set (2 x (600 + 2 x 100) + 6 x 100 = 2200) once activations are small.
    heavy_ends = dataclasses.replace(SHAPE, first_stage_params=300, last_stage_params=300)
    small = memory_breakdown(dataclasses.replace(w, shape=heavy_ends, activation_bytes_per_sample=0.01), "zero3", d)
    assert (small.working_bytes, small.tail_bytes) == (2200, 3600)
    assert small.total == small.states + small.tail_bytes


def test_tp_divides_only_the_split_part_of_the_activations():
    w = Workload(SHAPE, micro_batch=1, grad_accum=1, microbatches=1, precision="bf16", checkpointing=False,
                 tokens_per_sample=S, activation_bytes_per_sample=1000.0, activation_replicated_bytes_per_sample=250.0)
    assert activation_memory(w, ParallelDims(tp=4)) == 250.0 + 750.0 / 4


def test_the_optimizer_steps_each_parameter_once_however_many_chunks():
    """AdamW steps every parameter that has a gradient: stepping a chunk at a time must not step
    the others again (a fp32 master is the parameter, which has its gradient all along)."""
    from torch import nn

    import training.optim as optim

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    reference = [p.detach().clone() for p in model.parameters()]
    chunked = optim.MasterAdamW(list(model.parameters()), {}, lr=0.1, weight_decay=0.0)
    plain = torch.optim.AdamW([nn.Parameter(p.clone()) for p in reference], lr=0.1, weight_decay=0.0)
    for p, q in zip(model.parameters(), plain.param_groups[0]["params"], strict=True):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    saved, optim.CHUNK_BYTES = optim.CHUNK_BYTES, 64 * 64 * 4  # a chunk per weight matrix
    try:
        chunked.step()
    finally:
        optim.CHUNK_BYTES = saved
    plain.step()
    for p, q in zip(model.parameters(), plain.param_groups[0]["params"], strict=True):
        assert torch.equal(p, q)
    assert all(state["step"] == 1 for state in chunked.state.values())
