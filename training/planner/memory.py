"""Ruler 1, memory: one rank's peak, term by term, as the trainer allocates it.

bf16 holds 2Ψ + 2Ψ + 12Ψ bytes (bf16 params and grads, fp32 master + two moments) as the ZeRO
paper counts, with the 12Ψ sharded under zero1 (training/optim.py) and all 16Ψ under FSDP; fp32
Adam 4Ψ + 4Ψ + 8Ψ. Activations are measured (the bytes autograd saves, per sample) and divided as
the layout divides them: over pipeline stages by blocks and the schedule's microbatches in
flight, over tensor-parallel ranks only the part its plan splits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from training import strategies
from training.parallel.dims import ParallelDims
from training.parallel.schedules import stage_blocks
from training.planner.pipeline import Waiting, in_flight, receive_buffers, waiting_weight_passes
from training.planner.shape import BF16_PARAMS, COMPUTE_BYTES, Shape
from training.planner.workload import Workload

STEP_CHUNK_BYTES = 16 * 1024**2
"""The optimizer steps this many bytes of fp32 parameters at a time (training/optim.py): its
temporaries (a gradient cast to fp32, the moments' square root) are at most twice that."""


MASTER_BYTES = 4
"""FSDP's sharded parameters, their gradients (reduce_dtype) and a master weight: fp32."""


MOMENT_BYTES = 8
"""AdamW's two fp32 moments."""


@dataclass(frozen=True)
class Memory:
    param_bytes: float
    grad_bytes: float
    optim_bytes: float
    """The optimizer's own tensors: Adam's moments, and the fp32 masters of bf16 parameters."""
    activation_bytes: float
    """Saved for backward at its start (activation_memory), with the loss's temporaries."""
    loss_temp_bytes: float = 0.0
    """Of the activations, the loss's gradient temporaries: gone once backward reaches the blocks."""
    gathered_root_bytes: float = 0.0
    """FSDP: the root unit's gathered parameters, held from forward through backward (ZeRO-3;
    ZeRO-2's gathered copies are in its states)."""
    working_bytes: float = 0.0
    """FSDP's working set while a block runs backward: that block and the prefetched next one
    gathered, and the fp32 buffer its gradients are reduce-scattered from (fsdp_working_set)."""
    tail_bytes: float = 0.0
    """After backward, once the activations are freed: FSDP's last reduction (the root unit's
    unsharded gradients and their fp32 reduce-scatter buffer, fsdp_root_reduce), or the optimizer
    step's temporaries (optimizer_step_bytes), whichever is larger."""
    grads_in_backward: float = -1.0
    """Gradient bytes already held when backward starts: all of them where DDP's buckets hold them
    from construction, none where they are made during backward (FSDP, a TP or PP model without
    DDP: its gradients appear as its activations go); -1: grad_bytes."""

    @property
    def states(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optim_bytes

    @property
    def total(self) -> float:
        """The peak, the highest of three moments: backward's start (every activation and the
        loss's temporaries), a block's backward (the temporaries gone, FSDP's working set there),
        and after backward (every gradient, and the root's reduction or the optimizer's step)."""
        early = self.grad_bytes if self.grads_in_backward < 0 else self.grads_in_backward
        held = self.param_bytes + self.optim_bytes + early + self.activation_bytes + self.gathered_root_bytes
        return max(held, held - self.loss_temp_bytes + self.working_bytes, self.states + self.tail_bytes)


def params_per_rank(shape: Shape, d: ParallelDims, v_shaped: bool = False) -> float:
    """Parameters one rank holds before data-parallel sharding: TP splits the block linears and
    the head; EP the experts; PP gives each stage its run of blocks (training/parallel/schedules.py),
    the first stage the embeddings and the last the head: the fullest rank's."""
    return sum(stage_params(shape, d, v_shaped))


def stage_params(shape: Shape, d: ParallelDims, v_shaped: bool = False) -> tuple[float, float]:
    """(the rest, the experts) of what the fullest pipeline rank holds before data-parallel
    sharding: its blocks' dense parameters with TP's split, its E/ep experts of each MoE layer, and
    its ends' embeddings or head. Blocks are taken as equal (experts spread evenly). `v_shaped`: a
    V-shaped schedule's two stages a rank (r and 2p − 1 − r of 2p), rank 0 holding both ends."""
    linears = shape.block_linear_params
    blocks = shape.params - shape.first_stage_params - shape.last_stage_params
    dense = (blocks - shape.expert_params - linears) + linears / d.tp
    experts = shape.expert_params / d.ep
    first, last = _ends(shape, d)
    if d.pp == 1:
        return first + last + dense, experts
    layers = list(range(shape.layers))
    stages = 2 * d.pp if v_shaped else d.pp
    held = [(r, stages - 1 - r) if v_shaped else (r,) for r in range(d.pp)]
    count = [sum(len(stage_blocks(layers, s, stages)) for s in held[r]) / max(shape.layers, 1) for r in range(d.pp)]
    ends = [(first if 0 in held[r] else 0.0) + (last if stages - 1 in held[r] else 0.0) for r in range(d.pp)]
    i = max(range(d.pp), key=lambda k: count[k] * (dense + experts) + ends[k])
    return count[i] * dense + ends[i], count[i] * experts


def expert_replicas(d: ParallelDims) -> int:
    """Ranks holding the same experts, each routing tokens of its own (one in each expert group,
    carved out of the data-, context- and tensor-parallel ranks: the TP ranks split their tokens
    under expert parallelism): FSDP shards the experts over them, DDP all-reduces their gradients
    over them (training/parallel/ep.py)."""
    return d.dp_size * d.cp * d.tp // d.ep if d.ep > 1 else d.dp_size * d.cp


def _ends(shape: Shape, d: ParallelDims) -> tuple[float, float]:
    """Parameters of the first and the last stage's own parts on one rank: the head split by TP."""
    return shape.first_stage_params, shape.last_stage_params - shape.head_params * (1 - 1 / d.tp)


def keeps_gathered(strategy: str, reshard: bool = True) -> bool:
    """FSDP keeps each unit's gathered parameters from forward to backward (ZeRO-2), or frees
    and gathers them again (ZeRO-3)."""
    return not (reshard and strategies.get(strategy).reshard_after_forward)


def fsdp_wraps(strategy: str, d: ParallelDims) -> bool:
    """Whether the trainer wraps `strategy` at `d` in FSDP2 (ParallelDims.uses_fsdp: a DDP strategy
    with cp replicates over the CP ranks instead)."""
    return d.uses_fsdp(strategies.get(strategy).wrapper)


def gradient_ranks(strategy: str, d: ParallelDims) -> tuple[int, int]:
    """(replicas, shards): the ranks `strategy`'s gradient wrapper replicates and shards over at `d`
    (ParallelDims.gradient_ranks)."""
    return d.gradient_ranks(strategies.get(strategy).wrapper)


def states_per_param(strategy: str, d: ParallelDims, precision: str, reshard: bool = True,
                     shards: int | None = None) -> tuple[float, float, float]:
    """Bytes per parameter of this rank's share for (parameters, gradients, optimizer), as the
    trainer allocates them (training/parallel/compose.py):

    - FSDP (fsdp_wraps): fp32 parameters, gradients and moments sharded over dp_shard (16 / N), in
      any precision (MixedPrecisionPolicy computes with gathered copies); ZeRO-2 keeps the gathered
      compute copy of every unit through backward (+ 2 or 4). `shards`: another N (split experts
      are sharded over their replicas).
    - otherwise, bf16: bf16 parameters and gradients, the optimizer's fp32 master and moments
      (2 + 2 + 12), the 12 sharded over the data-parallel ranks by zero1 (the ZeRO paper's P_os;
      split experts' over their `shards` replicas);
      fp16 runs autocast over fp32 parameters, whose fp16 weight copies live until backward
      (4 + 2, 4, 8); fp32: 4 + 4 + 8. DDP's gradients are views of its buckets: no second copy."""
    c = COMPUTE_BYTES[precision]
    if fsdp_wraps(strategy, d):
        n = shards or gradient_ranks(strategy, d)[1]  # dp_shard, x cp unless DDP's replicas
        gathered = c if keeps_gathered(strategy, reshard) else 0.0
        return MASTER_BYTES / n + gathered, MASTER_BYTES / n, MOMENT_BYTES / n
    sharded = (shards or d.dp_size * d.cp) if strategies.get(strategy).shards_optimizer_only else 1
    if precision in BF16_PARAMS:
        return c, c, (MASTER_BYTES + MOMENT_BYTES) / sharded
    autocast_copies = c if precision == "fp16" else 0
    return MASTER_BYTES + autocast_copies, MASTER_BYTES, MOMENT_BYTES / sharded


def state_memory(shape: Shape, strategy: str, d: ParallelDims, precision: str, reshard: bool = True,
                 v_shaped: bool = False) -> Memory:
    """Parameters, gradients and optimizer state of one rank (states_per_param x its parameters);
    under expert parallelism with FSDP or zero1 the experts sharded over their replicas, the rest as usual."""
    dense, experts = stage_params(shape, d, v_shaped)
    p, g, o = states_per_param(strategy, d, precision, reshard)
    pe, ge, oe = (states_per_param(strategy, d, precision, reshard, expert_replicas(d)) if d.ep > 1
                  else (p, g, o))
    return Memory(p * dense + pe * experts, g * dense + ge * experts, o * dense + oe * experts, 0)


def _unit_params(shape: Shape, d: ParallelDims, v_shaped: bool = False) -> tuple[float, float]:
    """(a block's parameters on this rank, split by TP and its experts by EP; the root unit's:
    embeddings and head, or the heavier end on a pipeline stage, both on a V's rank 0)."""
    block = (shape.params - shape.first_stage_params - shape.last_stage_params) / max(shape.layers, 1)
    block -= shape.block_linear_params / max(shape.layers, 1) * (1 - 1 / d.tp)
    block -= shape.expert_params / max(shape.layers, 1) * (1 - 1 / d.ep)  # gathered: this rank's experts
    first, last = _ends(shape, d)
    return block, max(first, last) if d.pp > 1 and not v_shaped else first + last


def fsdp_gathered_root(shape: Shape, strategy: str, d: ParallelDims, precision: str, reshard: bool = True,
                       v_shaped: bool = False) -> float:
    """FSDP2's root unit (embeddings, head), gathered in the compute dtype for forward and kept
    through backward (FSDP2 never reshards the root after forward); ZeRO-2 counts it in its states."""
    if not fsdp_wraps(strategy, d) or keeps_gathered(strategy, reshard):
        return 0.0
    return COMPUTE_BYTES[precision] * _unit_params(shape, d, v_shaped)[1]


def fsdp_working_set(shape: Shape, strategy: str, d: ParallelDims, precision: str, reshard: bool = True) -> float:
    """FSDP2's transient bytes while a block runs backward, beyond the states and the gathered
    root: under ZeRO-3 the block gathered and the next one prefetched, in the compute dtype; and
    that block's gradients in the fp32 buffer they are reduce-scattered from (measured: the
    compute-dtype gradients are freed as they are copied in)."""
    if not fsdp_wraps(strategy, d):
        return 0.0
    block, _ = _unit_params(shape, d)
    gathered = 0.0 if keeps_gathered(strategy, reshard) else 2 * COMPUTE_BYTES[precision] * block
    return gathered + MASTER_BYTES * block


def fsdp_root_reduce(shape: Shape, strategy: str, d: ParallelDims, precision: str, v_shaped: bool = False) -> float:
    """The root unit's reduction at the end of backward (FSDP2 reshards its parameters first): its
    unsharded gradients in the compute dtype and the fp32 buffer they are reduce-scattered from.
    For a model whose embeddings and head outweigh a block this, not a block's, is the peak."""
    if not fsdp_wraps(strategy, d):
        return 0.0
    return (COMPUTE_BYTES[precision] + MASTER_BYTES) * _unit_params(shape, d, v_shaped)[1]


def optimizer_step_bytes(updated: float) -> float:
    """The optimizer step's temporaries for a rank that updates `updated` parameters: two fp32
    chunks (STEP_CHUNK_BYTES), or two copies of what it updates when that is smaller."""
    return 2 * min(STEP_CHUNK_BYTES, MASTER_BYTES * updated)


def activation_tensor_bytes(batch: int, seq: int, hidden: int, dtype_bytes: int) -> int:
    """One b x s x h activation (the seed's 32 x 512 x 1024 x 4 B = 64 MiB)."""
    return batch * seq * hidden * dtype_bytes


def activation_memory(w: Workload, d: ParallelDims) -> float:
    """The activations one rank holds at the start of backward, the loss's temporaries included.

    TP divides what its plan splits, and the head's logits and the loss's temporaries where it
    splits the head by vocabulary, and under expert parallelism what the experts save (its TP ranks
    split their tokens); with sequence parallelism the blocks' rest too (norms,
    residuals and the split linears' inputs are sharded over the sequence: Korthikanti et al.'s
    32sbh/t without dropout; measured within 0.2 %), all but the head's input. CP
    divides every token's activations by cp and adds the peers' K and V its attention keeps for
    backward ((cp − 1)/cp of 2·s·kv/t per layer and sample, kv the keys' width SDPA sees; under
    full or selective checkpointing one layer's, the one recomputing: the all-gather is redone in
    backward, measured), and one attention output more per layer (its two chunks' SDPA calls keep
    their outputs, the layer goes on with their join: s/cp·h/t per sample), both for every layer
    without checkpointing and for the recomputing one with it; no causal mask: a chunk of a rank's
    queries is the last of the keys up to its end, a lower-right triangle CUDA's kernels apply
    without one (training/parallel/cp.py; on a CPU the trainer keeps each chunk's mask, c x (i+1)c
    for chunk i of c = s/2cp tokens, one set for every layer: not counted). A pipeline stage holds its share of the blocks'
    activations for the microbatches its schedule keeps in flight (GPipe: all m; 1F1B: min(m, p)
    on the first stage, one on the last: planner/pipeline.in_flight), and the last stage also what
    is saved outside the blocks (the head, the loss) and the loss's temporaries, for the
    microbatches in flight there (GPipe m, zero bubble min(m, p), the others one); the higher of
    the first and the last stage (and a V's bottom rank). A split-backward schedule's rank also
    keeps, for each microbatch whose weight pass waits, the gradients of the outputs where its
    weights meet the activations (planner/pipeline.waiting_weight_passes): the highest of the points
    its schedule passes through. Under expert parallelism the busiest rank's: its experts keep the
    slots routed to them, the measured routing imbalance of what ranks hold times a balanced rank's."""
    return stage_activations(w, d).peak


@dataclass(frozen=True)
class StageActivations:
    first: float
    """The first pipeline rank's activations at its peak (any rank's without a pipeline)."""
    last: float
    """The activations of the rank holding the last stage, the loss's temporaries included."""
    share: float
    """Of a sample's activations, the part one rank keeps under TP and CP."""
    middle: float = 0.0
    """Under a V-shaped schedule, the bottom of the V's (rank p − 1, holding neither end); 0 otherwise."""

    @property
    def peak(self) -> float:
        return max(self.first, self.last, self.middle)


def stage_activations(w: Workload, d: ParallelDims) -> StageActivations:
    """activation_memory's count for the first pipeline rank and for the rank holding the last stage."""
    a = w.activations
    per_sample = a.saved
    split = w.head_split(d)
    if d.tp > 1:
        # Sequence parallelism hands the MoE layers whole tokens (training/parallel/sp.py): they
        # keep what they save whole, as under TP alone.
        kept = a.sp_replicated + a.moe if w.sequence_parallel else a.tp_replicated
        if d.ep > 1:  # the TP ranks split the experts' tokens (training/parallel/ep.py)
            kept = max(kept - a.experts, 0.0)
        if split > 1:  # the head's logits and the loss's temporaries are this rank's share
            kept = max(kept - a.head - a.loss_temp, 0.0)
            per_sample -= a.loss_temp
        per_sample = kept + (per_sample - kept) / d.tp + (w.loss_temps(d) if split > 1 else 0.0)
    if d.ep > 1:
        # The busiest expert-parallel rank's experts keep every slot routed to them: the measured
        # imbalance of what ranks hold times a balanced rank's (its TP rank's part of them).
        per_sample += a.experts / d.tp * (w.held_imbalance_at(d.ep) - 1.0)
    dtype = COMPUTE_BYTES[w.precision]
    kv = 0.0
    if d.cp > 1:
        per_sample /= d.cp
        # Per layer and sample: the peers' K and V, and the attention output the chunks' join adds.
        kv = (2 * w.shape.seq_len * w.shape.kv / d.tp * dtype * (d.cp - 1) / d.cp
              + w.shape.seq_len / d.cp * w.shape.hidden / d.tp * dtype)
    share = per_sample / a.saved if a.saved else 1.0
    layers = math.ceil(w.shape.layers / d.pp)
    kept_kv, recomputing_kv = (kv * layers, 0.0) if w.checkpointing == "none" else (0.0, kv)
    if d.pp == 1:
        whole = (per_sample + kept_kv + recomputing_kv) * w.micro_batch
        return StageActivations(whole, whole, share)
    tail = a.outside_blocks - a.head * (1 - 1 / split)
    ends = min((tail + w.loss_temps(d)) / d.cp, per_sample)  # a CP rank's head and loss see its part of each sequence
    blocks = (per_sample - ends) * layers / max(w.shape.layers, 1) + kept_kv
    per_micro = w.micro_batch / w.microbatches
    held = in_flight(w.pp_schedule, d.pp, w.microbatches, w.pp_virtual_stages)
    # A stage's boundary, received into a buffer per microbatch: a microbatch's hidden states (the
    # residual stream: the compute dtype with bf16 parameters, fp32 under fp16's autocast), split
    # by CP and, under sequence parallelism, by TP.
    boundary = (per_micro * w.shape.seq_len * w.shape.hidden * (dtype if w.precision in BF16_PARAMS else 4)
                / d.cp / (d.tp if w.sequence_parallel else 1))
    first_buffers, last_buffers = receive_buffers(w.pp_schedule, w.microbatches, w.pp_virtual_stages)
    # A split-backward schedule keeps, for each microbatch whose weight pass waits, the gradients of
    # the outputs where its stage's weights meet the activations (planner/pipeline.waiting_weight_passes),
    # split as the activations are; the last stage's also its final norm's (its logits' gradient is
    # the loss's temporary, in `ends`).
    waits = (a.weight_outputs - a.tail_weight_outputs) * share * layers / max(w.shape.layers, 1)
    waits_ends = a.tail_weight_outputs * share
    first_points, last_points = waiting_weight_passes(w.pp_schedule, d.pp, w.microbatches, w.pp_virtual_stages)

    def peak(points: tuple[Waiting, ...], ends_held: float, buffers: float) -> float:
        """A rank's highest point: its blocks' microbatches in flight, the last stage's part for
        `ends_held` of them where it holds that stage, and the gradients its waiting passes keep."""
        return max(per_micro * (blocks * at.in_flight + ends * ends_held + waits * at.waiting
                                + (waits_ends * at.waiting_ends if ends_held else 0.0) + recomputing_kv)
                   for at in points) + boundary * buffers

    if w.v_shaped:
        # Rank 0 holds both ends of the V (`first` without the last stage's part, `last` with it);
        # rank p − 1 its bottom, whose weight passes wait longest.
        return StageActivations(peak(first_points, 0.0, first_buffers), peak(first_points, held.ends, last_buffers),
                                share, peak(last_points, 0.0, first_buffers))
    return StageActivations(peak(first_points, 0.0, first_buffers), peak(last_points, held.ends, last_buffers), share)


def memory_breakdown(w: Workload, strategy: str, d: ParallelDims) -> Memory:
    """One rank's memory at the peak of a step, term by term, as the trainer allocates it."""
    samples = w.micro_batch / (w.microbatches if d.pp > 1 else 1)  # in a microbatch
    held = stage_activations(w, d)
    # The loss's temporaries: on the stage that computes the loss, per microbatch in flight there, of
    # this rank's part of each sequence under cp (as activation_memory counts them). Once they are
    # gone the rank holding the last stage may hold less than the first: the peak then is the first's.
    temps = w.loss_temps(d) * samples / d.cp
    if d.pp > 1:
        temps = max(0.0, min(temps, held.last - max(held.first, held.middle)))
    layout = layout_memory(w.shape, strategy, d, w.precision, d.pp > 1 and w.v_shaped)
    # A pipeline schedule that runs a microbatch's backward before the last forward (all but GPipe)
    # reaches its peak with the stage's gradients made by the first backward still held: 1F1B's
    # first rank forwards its pp-th microbatch after its first backward, the last rank each after one.
    early = layout.grad_bytes if d.pp > 1 and w.pp_schedule != "gpipe" and w.microbatches > 1 else None
    # While a block runs backward it also holds its activations' gradients (split as its saved
    # activations are), one microbatch's, and its weight-sized scratch: in a mixture of experts the
    # experts' gradients made whole-sized before they are added (a dense GPT's is 0), of the E/ep
    # experts this rank holds (measured at world 2 and 4 with ep=2: ddp 1.00 -> 0.98 and 1.075 ->
    # 1.05, zero1 1.10 -> 1.06).
    a = w.activations
    backward = a.block_backward * samples * held.share + a.block_backward_fixed / d.ep  # ep > 1 only with experts
    return dataclasses.replace(layout, activation_bytes=held.peak, loss_temp_bytes=temps,
                               working_bytes=layout.working_bytes + backward,
                               grads_in_backward=layout.grads_in_backward if early is None else early)


@functools.lru_cache(maxsize=4096)
def layout_memory(shape: Shape, strategy: str, d: ParallelDims, precision: str, v_shaped: bool = False) -> Memory:
    """The terms of one rank's peak that the batch doesn't change (states, FSDP's gathered root and
    working set, what is reduced or updated after backward): kept per layout and pipeline shape
    (`v_shaped`: rank 0 holds both ends), since the search holds every micro-batch, schedule and
    checkpointing of a layout against them."""
    states = state_memory(shape, strategy, d, precision, v_shaped=v_shaped)
    fsdp = fsdp_wraps(strategy, d)
    masters = precision in BF16_PARAMS and not fsdp  # the optimizer holds fp32 masters beside the moments
    per_updated = MOMENT_BYTES + (MASTER_BYTES if masters else 0)
    buckets = gradient_ranks(strategy, d)[0] > 1 and not fsdp  # DDP: gradients are views of its buckets
    return dataclasses.replace(states, grads_in_backward=states.grad_bytes if buckets else 0.0,
                               gathered_root_bytes=fsdp_gathered_root(shape, strategy, d, precision,
                                                                      v_shaped=v_shaped),
                               working_bytes=fsdp_working_set(shape, strategy, d, precision),
                               tail_bytes=max(fsdp_root_reduce(shape, strategy, d, precision, v_shaped),
                                              optimizer_step_bytes(states.optim_bytes / per_updated)))


def memory_per_device(w: Workload, strategy: str, d: ParallelDims) -> float:
    return memory_breakdown(w, strategy, d).total
