"""The rulers for mixtures of experts against hand numbers: states per rank under ep x dp_shard, the
active parameters' FLOPs, the all-to-all's bytes and calls per layer, the imbalance term, and the
search over ep (no processes; the trainer's side is tests/dist/test_memory_budget.py's)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from training.config import ModelConfig
from training.contract.calls import build_model, model_loss
from training.contract.experts import dropped_share, rank_held_imbalance, rank_imbalance, step_imbalance
from training.contract.spec import model_spec
from training.data import first_samples, markov
from training.parallel.dims import ParallelDims
from training.planner.anatomy import measure_anatomy
from training.planner.calibration import MeasuredStep, measured_imbalance
from training.planner.comm import Group, Link, all_to_all_bytes, comm_time, group_of
from training.planner.memory import state_memory
from training.planner.shape import Activations, Shape
from training.planner.step import StepPrediction
from training.planner.workload import Workload, feasible

# A model of 1000 dense parameters in its blocks beside 8000 of experts: 2 MoE layers of 8 experts.
SHAPE = Shape(params=10_000, layers=2, block_linear_params=0, hidden=64, seq_len=32, heads=4,
              first_stage_params=1000, last_stage_params=0, experts=(8, 8), expert_params=8000, top_k=2,
              expert_flops_share=0.5)
DENSE, EXPERTS = 2000, 8000  # the embeddings sit with the blocks' dense part in these counts


def states(strategy: str, d: ParallelDims, precision: str = "fp32") -> float:
    return state_memory(SHAPE, strategy, d, precision).states


def test_states_per_rank_under_ep_and_dp_shard_are_the_hand_count():
    # DDP, fp32 (4 + 4 + 8 bytes a parameter): each rank holds its 8/ep experts whole.
    assert states("ddp", ParallelDims(dp_replicate=4)) == 16 * (DENSE + EXPERTS)
    assert states("ddp", ParallelDims(dp_replicate=4, ep=2)) == 16 * (DENSE + EXPERTS / 2)
    assert states("ddp", ParallelDims(dp_replicate=4, ep=4)) == 16 * (DENSE + EXPERTS / 4)
    # bf16 under DDP: 2 + 2 + 12.
    assert states("ddp", ParallelDims(dp_replicate=4, ep=4), "bf16") == 16 * (DENSE + EXPERTS / 4)
    # FSDP over 4: the rest sharded over dp_shard, the experts (8/ep of them) over their dp/ep
    # replicas: 16/4 of every parameter whatever ep is.
    for ep in (1, 2, 4):
        assert states("zero3", ParallelDims(dp_shard=4, ep=ep)) == pytest.approx(16 * (DENSE + EXPERTS) / 4)
    # HSDP 2 x 2: the rest sharded over dp_shard=2 only; split experts over all 4 / ep replicas.
    hsdp = ParallelDims(dp_replicate=2, dp_shard=2)
    assert states("zero3", hsdp) == pytest.approx(16 * (DENSE + EXPERTS) / 2)
    assert states("zero3", dataclasses.replace(hsdp, ep=2)) == pytest.approx(16 * DENSE / 2 + 16 * EXPERTS / 4)
    # ZeRO-2 also keeps each unit's gathered compute copy: this rank's experts, 8/ep of them.
    assert states("zero2", ParallelDims(dp_shard=4, ep=2)) == pytest.approx(16 * (DENSE + EXPERTS) / 4
                                                                           + 4 * (DENSE + EXPERTS / 2))
    # With cp=2 the context-parallel ranks hold the same weights: the rest sharded over dp_shard x cp
    # = 4, the experts split over ep=2 of those 4 and sharded over the other 2 (their replicas).
    assert states("zero3", ParallelDims(dp_shard=2, cp=2, ep=2)) == pytest.approx(16 * DENSE / 4 + 16 * EXPERTS / 2 / 2)
    assert states("ddp", ParallelDims(dp_replicate=1, cp=2, ep=2)) == 16 * (DENSE + EXPERTS / 2)
    # zero1 at dp 4, ep 2: the optimizer's fp32 masters and moments (12 bytes in bf16, the moments' 8
    # in fp32) shared out over the 4 data-parallel ranks for the rest, over the 2 replicas of the
    # rank's 4000 experts' parameters for those.
    zero1 = ParallelDims(dp_replicate=4, ep=2)
    assert states("zero1", zero1, "bf16") == pytest.approx((4 + 12 / 4) * DENSE + (4 + 12 / 2) * EXPERTS / 2)
    assert states("zero1", zero1) == pytest.approx((8 + 8 / 4) * DENSE + (8 + 8 / 2) * EXPERTS / 2)


def test_the_active_parameters_flops_of_a_top_2_of_8_layer():
    """One MoE layer of 8 experts (64 -> 256 -> 64), 2 a token: the experts' FLOPs are 6 x 2 of the
    8 experts' parameters per token, the share of the model's the plan records."""
    d, seq, vocab = 64, 32, 256
    cfg = ModelConfig(kwargs=dict(vocab_size=vocab, seq_len=seq, d_model=d, n_layers=1, n_heads=4, n_experts=8,
                                  top_k=2))
    with torch.device("meta"):
        model = build_model(cfg, seed=0)
    batch = tuple(t.to("meta") for t in first_samples(markov(4, seq, vocab), 2))
    counted = measure_anatomy(model, model_spec(model, cfg), model_loss(cfg), batch)
    shape = counted.anatomy.shape
    per_expert = 2 * d * 4 * d
    assert shape.experts == (8,) and shape.top_k == 2 and shape.expert_params == 8 * per_expert
    active = 6 * 2 * per_expert * seq  # per sample
    assert shape.expert_flops_share * counted.anatomy.flops_per_sample == pytest.approx(active)


def test_all_to_all_bytes_and_calls_per_layer():
    """ep=2 over a 1 GB/s wire with 1 ms a call: per MoE layer and micro-batch, forward the counts'
    all-to-all and two of the tokens (dispatch, combine), backward two; each of the 4 is micro x seq
    x top_k x hidden x 2 bytes in bf16, of which (n - 1)/n leave the rank."""
    wire = Link(alpha_s=1e-3, busbw_gbps=1.0, world=2)
    micro = 4
    one = all_to_all_bytes(SHAPE, micro * SHAPE.seq_len, "bf16")
    assert one == micro * 32 * 2 * 64 * 2
    d = ParallelDims(dp_shard=2, ep=2)  # ep = dp: no expert replicas to reduce over
    comm = comm_time(SHAPE, "zero3", d, micro, 1, 1, "bf16", lambda c, g: wire)
    layers = 2
    tokens_s = 4 * layers * one * (1 / 2) / 1e9 + 4 * layers * 1e-3
    counts_s = layers * 8 * 8 * (1 / 2) / 1e9 + layers * 1e-3
    assert comm.expert_parallel_s == pytest.approx(tokens_s + counts_s)
    # Full recomputation repeats the forward's three; two accumulation steps double everything.
    full = comm_time(SHAPE, "zero3", d, micro, 2, 1, "bf16", lambda c, g: wire, recompute="full")
    assert full.expert_parallel_s == pytest.approx(2 * (6 * layers * one / 2 / 1e9 + 6 * layers * 1e-3)
                                                   + 2 * (2 * layers * 64 / 2 / 1e9 + 2 * layers * 1e-3))
    # Routing that sends the busiest rank 1.5x the mean: each all-to-all of tokens moves 1.5x
    # (the counts' all-to-all does not change).
    skewed = comm_time(SHAPE, "zero3", d, micro, 1, 1, "bf16", lambda c, g: wire, imbalance=1.5)
    assert skewed.expert_parallel_s == pytest.approx(1.5 * 4 * layers * one / 2 / 1e9 + 4 * layers * 1e-3 + counts_s)
    # With cp=2 each rank routes half of each sequence: half the tokens in each all-to-all, as many calls.
    halves = comm_time(SHAPE, "zero3", ParallelDims(cp=2, ep=2), micro, 1, 1, "bf16", lambda c, g: wire)
    assert halves.expert_parallel_s == pytest.approx(4 * layers * one / 2 / 2 / 1e9 + 4 * layers * 1e-3 + counts_s)
    # With tp=2 each TP rank routes half of the tokens (half of each all-to-all, as many calls), and
    # the halves are all-gathered over the 2 TP ranks: forward the experts' output (micro x seq x
    # hidden), backward the tokens' gradients and their routing weights' (x (hidden + top_k)), three
    # calls a layer, 1/2 of each crossing the wire.
    tp = comm_time(SHAPE, "zero3", ParallelDims(dp_shard=2, tp=2, ep=2), micro, 1, 1, "bf16", lambda c, g: wire)
    gathers_s = layers * micro * 32 * 2 * (64 + 64 + 2) / 2 / 1e9 + 3 * layers * 1e-3
    assert tp.expert_parallel_s == pytest.approx(4 * layers * one / 2 / 2 / 1e9 + 4 * layers * 1e-3 + counts_s
                                                 + gathers_s)
    # Without expert parallelism there is no all-to-all.
    assert comm_time(SHAPE, "zero3", ParallelDims(dp_shard=2), micro, 1, 1, "bf16",
                     lambda c, g: wire).expert_parallel_s == 0


def test_split_experts_are_reduced_over_their_replicas_alone():
    """DDP at dp 4, ep 2: the experts' gradients (4000 fp32 parameters here) all-reduced over the 2
    replicas, one call per weight (2 a layer), after backward; the rest over all 4 in DDP's buckets."""
    wire = Link(alpha_s=0.0, busbw_gbps=1.0, world=2)
    seen = []

    def link(collective, group):
        seen.append((collective, group.ranks))
        return wire

    d = ParallelDims(dp_replicate=4, ep=2)
    comm = comm_time(SHAPE, "ddp", d, 1, 1, 1, "fp32", link)
    dense = 4 * DENSE * 2 * 3 / 4 / 1e9
    experts = 4 * EXPERTS / 2 * 2 * 1 / 2 / 1e9
    assert comm.data_parallel_s == pytest.approx(dense + experts)
    assert ("all_reduce", 2) in seen and ("all_reduce", 4) in seen
    assert comm.tail_s >= experts


def test_zero1_broadcasts_the_experts_shares_over_their_replicas():
    """zero1 at dp 4, ep 2, fp32: DDP's all-reduces as above, then each rank broadcasts the share it
    updated: the rest's over all 4 (4 calls), the experts' over their 2 replicas (2 calls), after
    the step (in the tail: nothing left to hide behind)."""
    wire = Link(alpha_s=0.0, busbw_gbps=1.0, world=2)
    seen = []

    def link(collective, group):
        seen.append((collective, group.ranks))
        return wire

    comm = comm_time(SHAPE, "zero1", ParallelDims(dp_replicate=4, ep=2), 1, 1, 1, "fp32", link)
    dense = 4 * DENSE * 2 * 3 / 4 / 1e9 + 4 * DENSE / 1e9
    experts = 4 * EXPERTS / 2 * 2 * 1 / 2 / 1e9 + 4 * EXPERTS / 2 / 1e9
    assert comm.data_parallel_s == pytest.approx(dense + experts)
    assert ("broadcast", 4) in seen and ("broadcast", 2) in seen
    assert comm.tail_s >= experts


def test_the_groups_of_an_expert_layout_and_the_tier_they_ride():
    """ep is carved out of dp (and cp and tp), its ranks neighbours: ep=8 on nodes of 8 stays inside
    one, beside TP too, ep=16 crosses; the replicas are ep ranks apart."""
    d = ParallelDims(dp_shard=64, ep=8)
    assert group_of(d, "ep", 8) == Group(8, 8)
    assert group_of(dataclasses.replace(d, ep=16), "ep", 8).nodes == 2
    assert group_of(d, "edp", 8) == Group(8, 1)  # one per node: 8 ranks apart
    assert group_of(ParallelDims(dp_shard=4, ep=2), "edp", 8) == Group(2, 2)
    # Beside TP the TP ranks, which split their tokens, are in the expert group: EP 8 beside TP 2 is
    # one node (Megatron-Core's intra-node EP), its replicas 8 ranks apart (before: ep's ranks tp apart, 2 nodes).
    assert group_of(ParallelDims(dp_shard=128, tp=2, ep=8), "ep", 8) == Group(8, 8)
    assert group_of(ParallelDims(dp_shard=128, tp=2, ep=8), "edp", 8) == Group(32, 1)
    # With cp, ep is carved out of dp x cp x tp (a sequence's CP ranks neighbours, TP innermost): an
    # expert group of 4 is 4 neighbouring ranks; its replicas one in each of the 4 expert groups, 4 apart.
    cp = ParallelDims(dp_shard=4, cp=2, tp=2, ep=4)
    assert group_of(cp, "ep", 8) == Group(4, 4)
    assert group_of(cp, "edp", 8) == Group(4, 2)
    assert group_of(cp, "edp", 16) == Group(4, 4)
    assert group_of(cp, "edp", None) == Group(4, 4)
    assert group_of(ParallelDims(cp=2, ep=2), "ep", 1) == Group(2, 1)  # the two halves of a sequence


def test_the_imbalance_stretches_the_experts_share_of_compute_only_under_ep():
    w = Workload(shape=SHAPE, micro_batch=1, grad_accum=1, microbatches=1, precision="fp32", checkpointing="none",
                 tokens_per_sample=32, activations=Activations(), expert_imbalance=((2, 1.5), (4, 1.8)))
    assert w.expert_straggler(ParallelDims(dp_shard=4)) == 1.0  # one rank runs every expert
    assert w.expert_straggler(ParallelDims(dp_shard=4, ep=2)) == pytest.approx(1 + 0.5 * 0.5)
    assert w.expert_straggler(ParallelDims(dp_shard=4, ep=4)) == pytest.approx(1 + 0.5 * 0.8)
    assert w.expert_straggler(ParallelDims(dp_shard=8, ep=8)) == 1.0  # not measured: balanced
    # A capacity factor of 1.6 bounds the busiest rank at 1.6 x a balanced rank's slots.
    capped = dataclasses.replace(w, shape=dataclasses.replace(SHAPE, capacity_factor=1.6))
    assert capped.expert_straggler(ParallelDims(dp_shard=4, ep=2)) == pytest.approx(1 + 0.5 * 0.5)
    assert capped.expert_straggler(ParallelDims(dp_shard=4, ep=4)) == pytest.approx(1 + 0.5 * 0.6)


def test_tensor_parallel_ranks_run_the_experts_whole_unless_expert_parallelism_splits_their_tokens():
    """The experts are in no tensor-parallel plan (training/models/gpt.py leaves them out): without
    expert parallelism every TP rank runs them on the same tokens, so of a sample's compute only the
    dense half here divides by tp; with it the TP ranks split the tokens (training/parallel/ep.py),
    and all of it does. An expert group beside tp=4 is 4 neighbouring ranks, the TP group's own:
    one node of 8."""
    w = Workload(shape=SHAPE, micro_batch=1, grad_accum=1, microbatches=1, precision="fp32", checkpointing="none",
                 tokens_per_sample=32, activations=Activations())
    assert SHAPE.expert_flops_share == 0.5
    assert w.tp_unsplit(ParallelDims(dp_shard=4)) == 1.0
    assert w.tp_unsplit(ParallelDims(dp_shard=2, tp=2)) == pytest.approx(1.5)  # (0.5 + 0.5 x 2) / 1
    assert w.tp_unsplit(ParallelDims(dp_shard=4, tp=4)) == pytest.approx(2.5)
    assert w.tp_unsplit(ParallelDims(dp_shard=2, tp=4, ep=2)) == 1.0
    dense = dataclasses.replace(w, shape=dataclasses.replace(SHAPE, expert_flops_share=0.0))
    assert dense.tp_unsplit(ParallelDims(tp=8)) == 1.0
    assert group_of(ParallelDims(dp_shard=8, tp=4, ep=4), "ep", 8) == Group(4, 4)


def test_the_imbalance_each_degree_would_see_is_measured_from_the_routed_slots():
    """Two steps of one layer of 4 experts (each step's counts: the experts' kept slots, then the
    dropped, none here): at ep=4 the busiest expert over the mean, at ep=2 the busier pair over the
    mean pair; a plan takes the median of the runs' figures."""
    counts = {"layers.0": [[6, 2, 0, 0, 0], [2, 2, 2, 2, 0]]}
    assert step_imbalance(counts) == [3.0, 1.0]
    assert step_imbalance(counts, 2) == [2.0, 1.0]
    assert rank_imbalance(counts) == {"2": 1.5, "4": 2.0}  # 3 does not divide 4
    # What the ranks hold adds up over the layers: a second layer busiest where the first is idlest
    # evens the ranks out (ep=2: 8 slots on each rank; ep=4: [6, 2, 2, 6], the busiest 6 over the
    # mean 4), where in time each layer still waits for its own busiest rank.
    two = {"layers.0": [[6, 2, 0, 0, 0]], "layers.1": [[0, 0, 2, 6, 0]]}
    assert rank_held_imbalance(two) == {"2": 1.0, "4": 1.5}
    assert rank_imbalance(two) == {"2": 2.0, "4": 3.0}
    assert rank_held_imbalance(counts) == {"2": 2.0, "4": 3.0}  # one layer: the worst step's
    # A capacity of 2 slots an expert (c = 1 over 8 routed slots) dropped 4 of the first step's:
    # against a balanced share of the 8 routed, the busiest expert's 2 are 1.0, the busier pair's
    # 4 over 4 at ep=2 is 1.0: a capacity factor c bounds every figure by c.
    dropped = {"layers.0": [[2, 2, 0, 0, 4], [2, 2, 2, 2, 0]]}
    assert step_imbalance(dropped) == [1.0, 1.0]
    assert rank_imbalance(dropped) == {"2": 1.0, "4": 1.0}
    assert rank_held_imbalance(dropped) == {"2": 1.0, "4": 1.0}
    assert dropped_share(dropped) == pytest.approx(4 / 16)
    step = StepPrediction(1.0, 0.0, 0.0)
    runs = [MeasuredStep("ddp", 2, step, 1.0, ((2, x),)) for x in (1.2, 1.5, 1.4)]
    assert measured_imbalance(runs) == ((2, 1.4),)


def test_the_search_offers_ep_where_the_trainer_can_split_the_experts():
    from training.planner.space import layouts

    found = {(flavour, d) for flavour, d in layouts(8, SHAPE)}
    split = {(flavour, d) for flavour, d in found if d.ep > 1}
    assert {d.ep for _, d in split} == {2, 4, 8}
    assert all(d.cp == 1 and d.dp_size % d.ep == 0 for flavour, d in split)
    assert ("zero1", ParallelDims(dp_replicate=8, ep=4)) in split  # the experts' optimizer over their 2 replicas
    # A model context parallelism can split: ep is also carved out of the CP ranks.
    with_cp = {(flavour, d) for flavour, d in layouts(8, SHAPE, max_cp=8) if d.ep > 1 and d.cp > 1}
    assert ("zero3", ParallelDims(dp_shard=2, cp=4, ep=8)) in with_cp
    assert all((d.dp_size * d.cp) % d.ep == 0 for _, d in with_cp)
    assert ("zero3", ParallelDims(dp_shard=8, ep=8)) in split
    assert ("ddp", ParallelDims(dp_replicate=4, pp=2, ep=4)) in split
    dense = dataclasses.replace(SHAPE, experts=(), expert_params=0)
    assert not any(d.ep > 1 for _, d in layouts(8, dense))
    splittable = dataclasses.replace(SHAPE, block_linear_params=1000, tp_sizes=(4, 64))
    assert feasible(splittable, ParallelDims(dp_shard=2, tp=2), None)
    assert feasible(splittable, ParallelDims(dp_shard=2, tp=2, ep=2), None)  # ep beside tp trains
    assert feasible(dataclasses.replace(splittable, context_parallel=True),
                    ParallelDims(dp_shard=2, cp=2, ep=2), None)  # ep with cp trains


def test_the_expert_dispatchs_measured_host_work_is_added_under_ep_only():
    """Expert parallelism's dispatch, measured on one rank (Hardware.overhead_s[EXPERT_DISPATCH], per
    micro-batch step), joins the overhead of every layout that splits the experts: once per
    accumulation step, and on a pipeline stage once per microbatch for its share of the layers
    (microbatches / pp); a layout with the experts whole pays none of it."""
    from training.planner.hardware import EXPERT_DISPATCH, Hardware
    from training.planner.predict import predict_layout

    links = {c: Link(alpha_s=1e-5, busbw_gbps=10.0, world=8)
             for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")}
    bare = Hardware(80e9, 8, links, links, seconds_per_sample=1e-3, overhead_s={"zero3": 1e-3})
    measured = dataclasses.replace(bare, overhead_s={"zero3": 1e-3, EXPERT_DISPATCH: 4e-3})

    def overhead(hw, d, accum=1, microbatches=1):
        w = Workload(shape=SHAPE, micro_batch=4, grad_accum=accum, microbatches=microbatches, precision="fp32",
                     checkpointing="none", tokens_per_sample=32, activations=Activations(1e3))
        return predict_layout(w, hw, "zero3", d, float("inf"), 0.0, 1.0).overhead_s

    assert overhead(measured, ParallelDims(dp_shard=4)) == overhead(bare, ParallelDims(dp_shard=4)) == pytest.approx(1e-3)
    assert overhead(measured, ParallelDims(dp_shard=4, ep=2)) == pytest.approx(1e-3 + 4e-3)
    assert overhead(measured, ParallelDims(dp_shard=4, ep=2), accum=2) == pytest.approx(2 * (1e-3 + 4e-3))
    staged = ParallelDims(dp_shard=2, pp=2, ep=2)
    assert overhead(measured, staged, microbatches=4) - overhead(bare, staged, microbatches=4) == pytest.approx(
        4e-3 * 4 / 2)


def test_the_experts_activations_are_counted_apart_and_split_over_tp_under_ep():
    """What the experts modules save is counted apart (training/activations.py): for one layer of 4
    experts of 64 -> 256 -> 64, top 2, 64 tokens a sample in fp32, the 128 routed slots' inputs,
    outputs and weighted outputs (index_add keeps its source; 128 x 64 x 4 bytes each), their
    hidden activations before and after GELU (128 x 256 x 4 each), three slot indices (128 x 8)
    and the slots' weights (128 x 4); a dense model's is 0. Under tp=2 the ruler keeps it whole
    on each rank without ep, and divides it by tp with ep (its TP ranks split the tokens)."""
    from training.planner.anatomy import _measure_variant
    from training.planner.memory import activation_memory
    from training.planner.shape import Activations
    from training.planner.workload import Workload

    moe = ModelConfig(kwargs=dict(vocab_size=256, seq_len=64, d_model=64, n_layers=1, n_heads=4, n_experts=4, top_k=2))
    sample = tuple(t.to("meta") for t in first_samples(markov(4, 64, 256), 2))
    a = _measure_variant(moe, 0, sample, "fp32", "none").activations
    slots = 64 * 2
    assert a.experts == 3 * slots * 64 * 4 + 2 * slots * 256 * 4 + 3 * slots * 8 + slots * 4
    assert a.experts <= a.tp_replicated
    dense = ModelConfig(kwargs=dict(vocab_size=256, seq_len=64, d_model=64, n_layers=1, n_heads=4))
    assert _measure_variant(dense, 0, sample, "fp32", "none").activations.experts == 0
    w = Workload(shape=SHAPE, micro_batch=1, grad_accum=1, microbatches=1, precision="fp32", checkpointing="none",
                 tokens_per_sample=32, activations=Activations(1000.0, tp_replicated=400.0, experts=300.0))
    assert activation_memory(w, ParallelDims(dp_shard=2, tp=2)) == pytest.approx(400.0 + 600.0 / 2)
    assert activation_memory(w, ParallelDims(dp_shard=2, tp=2, ep=2)) == pytest.approx(100.0 + 900.0 / 2)
    # A measured imbalance of what the ranks hold (1.5 at ep=2): the busiest rank's experts keep
    # half as much again, its TP rank's part of them (300 / 2 x 0.5); none at an ep not measured.
    skewed = dataclasses.replace(w, expert_held_imbalance=((2, 1.5),))
    assert activation_memory(skewed, ParallelDims(dp_shard=2, tp=2, ep=2)) == pytest.approx(100.0 + 900.0 / 2 + 75.0)
    assert activation_memory(skewed, ParallelDims(dp_shard=4, ep=2)) == pytest.approx(1000.0 + 150.0)
    assert activation_memory(skewed, ParallelDims(dp_shard=4, ep=4)) == pytest.approx(1000.0)
    assert activation_memory(skewed, ParallelDims(dp_shard=4)) == pytest.approx(1000.0)
    # A capacity factor bounds it: at c = 1.2 no rank holds more than 1.2 x a balanced rank's
    # slots (300 / 2 x 0.2 more); at c = 0.5 the meta count already kept half the slots, so a
    # rank measured holding 0.4 of a balanced share of the routed slots holds 0.8 of that count.
    capped = dataclasses.replace(skewed, shape=dataclasses.replace(SHAPE, capacity_factor=1.2))
    assert activation_memory(capped, ParallelDims(dp_shard=2, tp=2, ep=2)) == pytest.approx(100.0 + 900.0 / 2 + 30.0)
    halved = dataclasses.replace(w, shape=dataclasses.replace(SHAPE, capacity_factor=0.5),
                                 expert_held_imbalance=((2, 0.4), (4, 0.9)))
    assert activation_memory(halved, ParallelDims(dp_shard=4, ep=2)) == pytest.approx(1000.0 - 300.0 * 0.2)
    assert activation_memory(halved, ParallelDims(dp_shard=4, ep=4)) == pytest.approx(1000.0)  # 0.9 capped at 0.5
