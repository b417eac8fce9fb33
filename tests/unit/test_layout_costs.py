"""The cost model's terms for today's layouts, against hand counts and the trainer's own
measurements (the numbers quoted are what tests/dist measured on the test GPT: d=32, 4 heads, 2
layers, s=64, b=4, fp32)."""

from __future__ import annotations

import dataclasses

import pytest

from training.collectives import bus_factor
from training.parallel.dims import ParallelDims
from training.planner.comm import Group, Link, comm_time
from training.planner.memory import activation_memory
from training.planner.shape import Activations, Shape
from training.planner.workload import Workload, feasible

D, HEADS, LAYERS, SEQ, B, FP32 = 32, 4, 2, 64, 4, 4
SHAPE = Shape(params=30_000, layers=LAYERS, block_linear_params=2 * 12 * D * D, hidden=D, seq_len=SEQ, heads=HEADS,
              first_stage_params=256 * D + SEQ * D, last_stage_params=2 * D + D * 256, tp_sizes=(D, HEADS))
MEASURED_CP1_BLOCKS = 1_064_960
"""The blocks' saved activations of one rank at cp=1 for b=4 (tests/dist/test_context_parallel.py)."""
MEASURED_CP2_BLOCKS = 634_880
"""The same at cp=2: half, the peer's K and V kept for backward, the chunks' attention outputs
beside their join, and the CPU's causal mask of rank 0's last chunk (CPU_CP2_MASK)."""
CPU_CP2_MASK = 16 * 64 * 4
"""The mask a CPU keeps for rank 0's last chunk (its 16 queries against 64 keys, fp32), shared by
the layers; CUDA's kernels apply the lower-right triangle without one, and the plan counts none."""
MEASURED_KV_GATHER_PER_LAYER = 32_768
"""Bytes each rank receives in the K/V all-gather of one layer at cp=2."""


def workload(**changes) -> Workload:
    base = dict(shape=SHAPE, micro_batch=B, grad_accum=1, microbatches=1, precision="fp32", checkpointing="none",
                tokens_per_sample=SEQ, activations=Activations(MEASURED_CP1_BLOCKS / B))
    return Workload(**{**base, **changes})


def test_cp_activations_are_the_trainers_measured_bytes():
    assert activation_memory(workload(), ParallelDims()) == MEASURED_CP1_BLOCKS
    assert activation_memory(workload(), ParallelDims(cp=2)) == MEASURED_CP2_BLOCKS - CPU_CP2_MASK


def test_checkpointed_blocks_keep_no_gathered_k_and_v_between_forward_and_backward():
    """Under full or selective checkpointing the all-gather is redone in backward (tests/dist
    measured 4 gathers for 2 layers), so only the recomputing layer's peer K/V are held, and its
    chunks' attention outputs beside their join."""
    per_layer = 2 * SEQ * D * FP32 * B // 2 + SEQ // 2 * D * FP32 * B  # the peer's K and V, the extra output; b=4
    none = activation_memory(workload(), ParallelDims(cp=2))
    blocks = none - LAYERS * per_layer
    for mode in ("full", "selective"):
        assert activation_memory(workload(checkpointing=mode), ParallelDims(cp=2)) == blocks + per_layer


def test_grouped_kv_heads_are_gathered_at_their_width():
    """Shape.kv_width (the keys' width SDPA sees, counted on the meta device) sets the K/V bytes."""
    grouped = dataclasses.replace(SHAPE, kv_width=D // 4)
    full = activation_memory(workload(), ParallelDims(cp=2))
    quarter = activation_memory(workload(shape=grouped), ParallelDims(cp=2))
    assert full - quarter == LAYERS * 2 * SEQ * (D - D // 4) * FP32 * B // 2


def test_cp_all_gathers_k_and_v_per_layer_as_measured():
    seen = []

    def link(collective: str, group: Group) -> Link:
        seen.append((collective, group))
        return Link(alpha_s=0.0, busbw_gbps=1.0, world=group.ranks)

    comm = comm_time(SHAPE, "ddp", ParallelDims(cp=2), B, 1, 1, "fp32", link, devices_per_node=8)
    gathered = comm.tensor_parallel_s * 1e9 / 2  # all-gather + reduce-scatter of equal bytes, 1 GB/s
    assert gathered / LAYERS == pytest.approx(MEASURED_KV_GATHER_PER_LAYER)
    assert ("all_gather", Group(2, 2)) in seen and ("reduce_scatter", Group(2, 2)) in seen
    recomputed = comm_time(SHAPE, "ddp", ParallelDims(cp=2), B, 1, 1, "fp32", link, devices_per_node=8,
                           recompute="full")
    assert recomputed.tensor_parallel_s == pytest.approx(comm.tensor_parallel_s * 3 / 2), "full AC gathers again"


def test_cp_needs_two_chunks_per_rank_of_the_sequence():
    assert feasible(SHAPE, ParallelDims(cp=2), workload())
    assert not feasible(SHAPE, ParallelDims(cp=64), workload())


def test_sequence_parallel_moves_tps_bytes_as_all_gathers_and_reduce_scatters():
    def link(collective: str, group: Group) -> Link:
        return Link(alpha_s=1e-6, busbw_gbps=1.0, world=group.ranks)

    d = ParallelDims(tp=2)
    plain = comm_time(SHAPE, "ddp", d, B, 1, 1, "fp32", link).tensor_parallel_s
    sp = comm_time(SHAPE, "ddp", d, B, 1, 1, "fp32", link, sequence_parallel=True).tensor_parallel_s
    activation = B * SEQ * D * FP32
    reduces = 4 * LAYERS  # two forward, two backward
    assert plain == pytest.approx(reduces * (activation * bus_factor("all_reduce", 2) / 1e9 + 1e-6))
    # Forward two all-gathers and two reduce-scatters, backward two reduce-scatters and four
    # all-gathers (the saved shards gathered again), each a whole activation; and two all-gathers
    # outside the blocks (the final norm's output, the embedding's gradient).
    moved = 10 * LAYERS + 2
    assert sp == pytest.approx(moved * (activation * bus_factor("all_gather", 2) / 1e9 + 1e-6))
    full = comm_time(SHAPE, "ddp", d, B, 1, 1, "fp32", link, sequence_parallel=True, recompute="full").tensor_parallel_s
    assert full == pytest.approx(sp * (moved + LAYERS) / moved), "full recomputation repeats attention's reduce-scatter"


def test_a_pipeline_runs_each_layers_collectives_once_per_microbatch():
    """Under PP each stage runs its layers once per microbatch: TP's and CP's calls (each a latency)
    multiply by the microbatches, their bytes (the micro-batch's activations) do not."""
    seen: dict[str, list[tuple[float, int]]] = {}

    class Counting(Link):
        def time(self, collective: str, nbytes: float, n: int, calls: int = 1) -> float:
            seen.setdefault(collective, []).append((nbytes, calls))
            return super().time(collective, nbytes, n, calls)

    def moved(microbatches: int) -> dict[str, tuple[float, int]]:
        seen.clear()
        comm_time(SHAPE, "ddp", ParallelDims(pp=2, tp=2, cp=2), B, 1, microbatches, "fp32",
                  lambda c, g: Counting(alpha_s=1e-6, busbw_gbps=1.0, world=2), sequence_parallel=True)
        return {c: (sum(b for b, _ in v), sum(k for _, k in v)) for c, v in seen.items() if c != "broadcast"}

    one, four = moved(1), moved(4)
    for collective in ("all_gather", "reduce_scatter"):  # SP's and CP's
        assert four[collective][0] == pytest.approx(one[collective][0])
        assert four[collective][1] == 4 * one[collective][1]
    assert four["all_reduce"] == one["all_reduce"], "the gradients' reduction is once a step"


def test_sequence_parallel_shards_what_tp_alone_leaves_whole():
    w = workload(activations=Activations(MEASURED_CP1_BLOCKS / B, tp_replicated=MEASURED_CP1_BLOCKS / B / 2))
    tp = activation_memory(w, ParallelDims(tp=2))
    head = MEASURED_CP1_BLOCKS / B / 8  # what stays whole under SP: the head's input, logits, loss
    sp = activation_memory(dataclasses.replace(w, sequence_parallel=True,
                                               activations=dataclasses.replace(w.activations, sp_replicated=head)),
                           ParallelDims(tp=2))
    assert tp == MEASURED_CP1_BLOCKS * (0.5 + 0.5 / 2)
    assert sp == B * (head + (MEASURED_CP1_BLOCKS / B - head) / 2)


@pytest.mark.parametrize(("schedule", "virtual", "expected"), [
    ("1f1b", 1, 3 / 11),            # (p − 1) / (m + p − 1), p=4, m=8
    ("gpipe", 1, 3 / 11),
    ("interleaved_1f1b", 2, 3 / 19),  # (p − 1) / (v·m + p − 1)
    ("zero_bubble", 2, 1 / 17),     # ZB-H1: a third of the idle time
    ("zbv", 2, 1 / 17),
])
def test_each_schedules_bubble_by_hand(schedule, virtual, expected):
    from training.planner.pipeline import pipeline_bubble

    assert pipeline_bubble(4, 8, schedule, virtual) == pytest.approx(expected)


@pytest.mark.parametrize(("schedule", "pp", "m", "virtual", "counts"), [
    ("gpipe", 2, 4, 1, (4, 4, 4)), ("1f1b", 2, 4, 1, (2, 1, 1)), ("interleaved_1f1b", 2, 4, 2, (2.5, 1.5, 1)),
    ("dualpipev", 2, 4, 2, (2.5, 2.5, 1)), ("zero_bubble", 2, 4, 2, (2, 2, 2)), ("zbv", 2, 4, 2, (2, 2, 1)),
    ("gpipe", 4, 8, 1, (8, 8, 8)), ("1f1b", 4, 8, 1, (4, 1, 1)), ("interleaved_1f1b", 4, 8, 2, (5.5, 2.5, 1)),
    ("dualpipev", 4, 8, 2, (4.5, 4.5, 1)), ("zero_bubble", 4, 8, 2, (4, 4, 4)), ("zbv", 4, 8, 2, (4, 4, 1)),
])
def test_microbatches_in_flight_as_measured(schedule, pp, m, virtual, counts):
    """What tests/dist/test_pipeline_schedules.py measured at pp=2, m=4 and pp=4, m=8 (first rank,
    last rank, the last stage's own part): interleaved 1F1B's last rank p − (p − 1)/v (1.5, then
    2.5, not the 1.75 an earlier formula, right only at pp=2, gave); zero bubble and ZB-V p
    everywhere; DualPipeV p + 1/2; the last stage's part as many as GPipe's m, zero bubble's p, else one."""
    from training.planner.pipeline import in_flight

    assert in_flight(schedule, pp, m, virtual) == counts


@pytest.mark.parametrize(("schedule", "virtual", "buffers"), [
    ("gpipe", 1, 4), ("1f1b", 1, 4), ("interleaved_1f1b", 2, 12), ("zero_bubble", 3, 20), ("zbv", 2, 8),
    ("dualpipev", 2, 8),
])
def test_receive_buffers_by_hand(schedule, virtual, buffers):
    """4 microbatches. One stage a rank: the first rank's stage receives gradients only, the last's
    activations only: 4. Looped over v stages a rank: the first rank's stage 0 receives gradients
    only, its v − 1 others both: 4 + 8(v − 1); the last rank alike. A V's first rank holds stage 0
    (gradients only) and the last stage (activations only): 8."""
    from training.planner.pipeline import receive_buffers

    assert receive_buffers(schedule, 4, virtual) == (buffers, buffers)


def test_the_zero_bubble_family_is_not_laid_out_with_replicas_or_selective_checkpointing():
    w = workload(pp_schedule="zbv", pp_virtual_stages=2, microbatches=2)
    shape = dataclasses.replace(SHAPE, layers=8)
    w = dataclasses.replace(w, shape=shape)
    assert feasible(shape, ParallelDims(pp=2), w)
    assert not feasible(shape, ParallelDims(pp=2, dp_shard=2), w), "its weight passes miss FSDP's reduction"
    assert not feasible(shape, ParallelDims(pp=2), dataclasses.replace(w, checkpointing="selective"))
    assert not feasible(SHAPE, ParallelDims(pp=2), dataclasses.replace(w, pp_virtual_stages=2)), "4 stages, 2 blocks"
