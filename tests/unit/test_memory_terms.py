"""The memory ruler's terms, each against a hand count (no processes: the meta device)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from training.activations import measure_tp_split
from training.config import ModelConfig
from training.contract.calls import batch_loss, build_model, model_loss
from training.contract.spec import model_spec
from training.parallel.dims import ParallelDims
from training.planner.counting import fused_attention_on_meta
from training.planner.memory import (
    activation_memory,
    fsdp_gathered_root,
    fsdp_root_reduce,
    fsdp_working_set,
    memory_breakdown,
)
from training.planner.shape import Activations, Shape
from training.planner.workload import Workload

B, S, H = 2, 16, 64
SBH = S * B * H


def gpt(layers: int, dropout: float = 0.0) -> ModelConfig:
    # vocab = 4h, as GPT's own are wide: what the head saves is then easy to tell from a block.
    return ModelConfig(name="gpt", kwargs=dict(vocab_size=4 * H, d_model=H, n_layers=layers, n_heads=4, seq_len=S,
                                               dropout=dropout))


def saved_in_bf16(layers: int, checkpointing: bool = False, dropout: float = 0.0):
    """The TpSplit of one bf16 forward + backward of a GPT on the meta device."""
    from training.parallel.ac import apply_ac

    cfg = gpt(layers, dropout)
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


def per_layer(field: str, checkpointing: bool = False, dropout: float = 0.0) -> float:
    """One block's share: three layers less two (what embeddings and head save cancels)."""
    return (getattr(saved_in_bf16(3, checkpointing, dropout), field)
            - getattr(saved_in_bf16(2, checkpointing, dropout), field)) / SBH


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


def test_tp_without_sequence_parallelism_is_korthikantis_with_dropout():
    """With Megatron's hidden dropout the two 1-byte masks (CUDA's fused dropout, as the meta count
    takes it) join what stays whole: sbh(10 + 24/t) bytes per layer (Korthikanti et al. 2022,
    Table 2, TP without SP, flash attention), at t = 8 13 sbh, within 10 %."""
    replicated = per_layer("replicated_bytes", dropout=0.1)
    split = per_layer("saved_bytes", dropout=0.1) - replicated
    assert replicated == pytest.approx(10, rel=0.05) and split == pytest.approx(24, rel=0.05)
    t = 8
    assert replicated + split / t == pytest.approx(10 + 24 / t, rel=0.10)


def test_full_recomputation_saves_each_blocks_input():
    """Full activation checkpointing keeps one block input per layer: 2 sbh in bf16."""
    assert per_layer("saved_bytes", checkpointing=True) == pytest.approx(2, rel=0.02)


SHAPE = Shape(params=1000, layers=4, block_linear_params=400, hidden=H, seq_len=S, heads=4,
              first_stage_params=100, last_stage_params=100)


def test_zero3_holds_the_root_gathered_and_in_backward_two_blocks_and_one_blocks_gradients():
    """bf16 zero3 on 8 ranks: blocks of (1000 - 200) / 4 = 200 parameters. The root (embeddings +
    head, 200) stays gathered from forward through backward (2 bytes: FSDP2 never reshards the
    root after forward). While a block runs backward: it and the prefetched next one gathered
    (2 x 200 x 2) and its gradients in the fp32 buffer they are reduce-scattered from (200 x 4: the
    bf16 ones are freed as they are copied in)."""
    d = ParallelDims(dp_shard=8)
    assert fsdp_gathered_root(SHAPE, "zero3", d, "bf16") == 2 * 200
    assert fsdp_working_set(SHAPE, "zero3", d, "bf16") == 2 * 2 * 200 + 4 * 200
    # ZeRO-2 holds its gathered copies in its states; only the gradient buffer is transient.
    assert fsdp_gathered_root(SHAPE, "zero2", d, "bf16") == 0
    assert fsdp_working_set(SHAPE, "zero2", d, "bf16") == 4 * 200
    # TP 2 splits the block linears (400 / 4 = 100 per block): a block is 150 on each rank.
    assert fsdp_working_set(SHAPE, "zero3", ParallelDims(dp_shard=4, tp=2), "fp32") == 2 * 4 * 150 + 4 * 150
    assert fsdp_working_set(SHAPE, "ddp", ParallelDims(dp_replicate=8), "bf16") == 0


def workload(schedule: str, microbatches: int) -> Workload:
    return Workload(SHAPE, micro_batch=8, grad_accum=1, microbatches=microbatches, precision="bf16",
                    checkpointing="none", tokens_per_sample=S, activations=Activations(1000.0),
                    pp_schedule=schedule)


def test_gpipe_keeps_every_microbatch_and_1f1b_at_most_the_stages():
    """pp 2 over 4 layers: a stage holds 2 of them. Per sample 1000 bytes, of which 200 are saved
    outside the blocks (head, loss) and so on the last stage only: 800 x 2/4 = 400 per sample of
    blocks on each stage. 8 samples in 4 microbatches of 2: GPipe keeps all 4 on every stage (the
    last: (400 + 200) x 8); 1F1B min(4, 2) = 2 on the first stage (400 x 4) and one on the last
    ((400 + 200) x 2). Each rank also keeps a receive buffer per microbatch for each boundary it
    receives over (planner/pipeline.receive_buffers), a microbatch's hidden states: 2 samples x 16
    positions x 64 wide in bf16, 4096 bytes; 4 of them at one stage a rank, 12 at two."""
    buffer = 2 * S * H * 2
    d = ParallelDims(pp=2)
    w = dataclasses.replace(workload("gpipe", 4), activations=Activations(1000.0, outside_blocks=200.0))
    assert activation_memory(w, d) == 600.0 * 8 + 4 * buffer
    w = dataclasses.replace(w, pp_schedule="1f1b")
    assert activation_memory(w, d) == max(400.0 * 4, 600.0 * 2) + 4 * buffer
    one = dataclasses.replace(w, microbatches=1)
    assert activation_memory(one, d) == 600.0 * 8 + 4 * buffer, "one buffer of 8 samples"
    # Interleaved over 2 stages a rank: 2.5 on the first rank, 1.5 on the last with one microbatch of
    # the last stage's 200 (2 samples a microbatch); zero bubble: 2 on each, the last stage's part 2.
    looped = dataclasses.replace(w, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
    assert activation_memory(looped, d) == 2 * max(400 * 2.5, 400 * 1.5 + 200) + 12 * buffer == 2000 + 12 * buffer
    zero_bubble = dataclasses.replace(looped, pp_schedule="zero_bubble")
    assert activation_memory(zero_bubble, d) == 2 * (400 * 2 + 200 * 2) + 12 * buffer


def test_a_schedule_that_backwards_before_its_last_forward_holds_the_gradients_at_its_peak():
    """GPipe forwards every microbatch before the first backward: its peak (backward's start)
    holds no gradient of a pipeline stage that isn't DDP's. 1F1B (and every other schedule)
    forwards a microbatch after a backward has made the stage's gradients: they are in its peak.
    One microbatch has nothing after its backward."""
    d = ParallelDims(pp=2)
    w = dataclasses.replace(workload("gpipe", 4), activations=Activations(10000.0))  # activations make the peak
    gpipe = memory_breakdown(w, "ddp", d)
    assert gpipe.grads_in_backward == 0
    assert gpipe.total == gpipe.param_bytes + gpipe.optim_bytes + gpipe.activation_bytes
    for schedule in ("1f1b", "interleaved_1f1b", "zbv"):
        m = memory_breakdown(dataclasses.replace(w, pp_schedule=schedule), "ddp", d)
        assert m.grads_in_backward == m.grad_bytes > 0, schedule
        assert m.total == m.states + m.activation_bytes, schedule
    assert memory_breakdown(dataclasses.replace(w, pp_schedule="1f1b", microbatches=1), "ddp", d).grads_in_backward == 0


def test_a_blocks_backward_holds_its_gradients_beside_the_activations_and_the_loss_is_on_the_last_rank():
    """A block's backward holds 150 bytes a sample and 30 whatever the batch: at 8 samples 1230,
    more than the loss's temporaries (100 a sample) gone by then. On a pipeline (pp 2 over 4
    layers, 1F1B, 4 microbatches of 2; of 1000 bytes a sample, the last stage's own 200 and the
    loss's 100, the blocks' 700) the first rank holds 2 microbatches of its blocks (350 a sample)
    and no loss, more than the last rank's one (350 + 300): the loss's temporaries are not
    subtracted from the first rank's count."""
    w = dataclasses.replace(workload("1f1b", 1), activations=Activations(
        1000.0, loss_temp=100.0, block_backward=150.0, block_backward_fixed=30.0))
    m = memory_breakdown(w, "ddp", ParallelDims(dp_replicate=8))
    assert m.working_bytes == 150 * 8 + 30 and m.loss_temp_bytes == 800
    assert m.total == m.states + m.activation_bytes - 800 + 1230
    piped = dataclasses.replace(w, microbatches=4, activations=Activations(
        1000.0, outside_blocks=200.0, loss_temp=100.0, block_backward=150.0))
    p = memory_breakdown(piped, "ddp", ParallelDims(pp=2))
    buffers = 4 * 2 * S * H * 2  # a receive buffer per microbatch on each (receive_buffers)
    first, last = 2 * 350 * 2 + buffers, 2 * (350 + 300) + buffers  # 1F1B: 2 in flight on the first, 1 on the last
    assert p.activation_bytes == max(first, last) == 1400 + buffers
    assert p.loss_temp_bytes == 0 and p.working_bytes == 150 * 2, "the first rank's peak: no loss there"


def test_the_peak_is_the_highest_of_backwards_start_a_blocks_backward_and_after():
    """Backward's start: parameters, optimizer, the gradients that exist by then (DDP's buckets:
    all; FSDP: none yet), every activation with the loss's temporaries, the gathered root. A
    block's backward: the temporaries gone, FSDP's working set there. After backward: every state,
    and the root's reduction (its 200 parameters' bf16 gradients and fp32 buffer: 200 x 6) or the
    optimizer's chunked step."""
    d = ParallelDims(dp_shard=8)
    w = dataclasses.replace(workload("1f1b", 1), activations=Activations(1000.0, loss_temp=100.0))
    m = memory_breakdown(w, "zero3", d)
    assert m.states == 1000 * 16 / 8 and m.activation_bytes == 8000.0 and m.loss_temp_bytes == 800.0
    assert m.grads_in_backward == 0 and m.gathered_root_bytes == 400
    assert m.tail_bytes == fsdp_root_reduce(SHAPE, "zero3", d, "bf16") == 200 * (2 + 4)
    start = m.param_bytes + m.optim_bytes + 8000 + 400
    assert m.working_bytes == 2 * 2 * 200 + 4 * 200 > 800  # here a block's backward is the peak
    assert m.total == max(start, start - 800 + m.working_bytes) == start - 800 + 1600
    ddp = memory_breakdown(w, "ddp", ParallelDims(dp_replicate=8))
    assert ddp.grads_in_backward == ddp.grad_bytes == 2 * 1000 and ddp.total == ddp.states + ddp.activation_bytes
    # ddp with cp=2 replicates over the two CP ranks as the trainer does (DDP, whole states, its
    # buckets), where zero3 with cp=2 shards over them.
    replicas = memory_breakdown(w, "ddp", ParallelDims(cp=2))
    assert replicas.states == ddp.states and replicas.grads_in_backward == 2 * 1000 and replicas.gathered_root_bytes == 0
    assert memory_breakdown(w, "zero3", ParallelDims(cp=2)).states == 1000 * 16 / 2
    # Embeddings and head of 600 over blocks of 100: the root's reduction (600 x 6 = 3600) outweighs
    # the gathered root and a block's working set (600 x 2 + 2 x 100 x 2 + 100 x 4) beside tiny activations.
    heavy_ends = dataclasses.replace(SHAPE, first_stage_params=300, last_stage_params=300)
    small = memory_breakdown(dataclasses.replace(w, shape=heavy_ends, activations=Activations(0.01)), "zero3", d)
    assert (small.gathered_root_bytes, small.working_bytes, small.tail_bytes) == (1200, 800, 3600)
    assert small.total == small.states + small.tail_bytes


def test_tp_divides_only_the_split_part_of_the_activations():
    w = Workload(SHAPE, micro_batch=1, grad_accum=1, microbatches=1, precision="bf16", checkpointing="none",
                 tokens_per_sample=S, activations=Activations(1000.0, tp_replicated=250.0))
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


def test_the_outputs_where_weights_meet_the_activations_are_counted_per_layer_and_after_the_blocks():
    """What a split-backward pipeline schedule keeps the gradients of until a microbatch's weight
    pass (training/activations.py WeightOutputs), in bf16: per block the two norms' outputs (h
    each), q, k, v and attention's output projection (h each), the MLP's 4h hidden and its output
    (h): 11 h, 22 bytes a token; after the blocks the final norm's (h) and the head's logits (4h),
    10 bytes a token and h, of which the last stage's part beside the loss's temporaries (the
    logits' gradient is one) is the final norm's, 2. The embeddings' indices need no gradient."""
    def weight_outputs(layers: int):
        cfg = gpt(layers)
        with torch.device("meta"):
            model = build_model(cfg, 0).to(torch.bfloat16)
        x = torch.zeros(B, S, dtype=torch.long, device="meta")
        with fused_attention_on_meta():
            return measure_tp_split(model, {}, lambda: batch_loss(model, (x, x), model_loss(cfg)),
                                    blocks=[b.module for b in model_spec(model, cfg).blocks])

    two, three = weight_outputs(2), weight_outputs(3)
    assert (three.weight_output_bytes - two.weight_output_bytes) / SBH == 22
    assert three.tail_weight_output_bytes / SBH == two.tail_weight_output_bytes / SBH == 2
    assert three.weight_output_bytes == 3 * 22 * SBH + 10 * SBH
