"""The three rulers turned into predictions: memory, communication and step time per strategy.

Pure arithmetic on shapes and measurements (no torch), so that `pipeline=plan` answers what-if
questions for a 70B model on 512 GPUs in milliseconds. Sources of the formulas:
- memory: what the trainer allocates, term by term (states_per_param, fsdp_working_set,
  activations): bf16 holds 2Ψ + 2Ψ + 12Ψ bytes (bf16 params and grads, fp32 master + two moments)
  as the ZeRO paper counts, with the 12Ψ sharded under zero1 (training/optim.py) and all 16Ψ under
  FSDP; fp32 Adam 4Ψ + 4Ψ + 8Ψ.
- activations: measured (the bytes autograd saves, per sample) and divided as the layout divides
  them: over pipeline stages by blocks and the schedule's microbatches in flight, over
  tensor-parallel ranks only the part its plan splits (no sequence parallelism: the norms' and
  the split linears' inputs stay whole on every rank).
- collectives: nccl-tests' bus-bandwidth factors; time = α + bus bytes / busbw (an α–β model
  fitted to the bandwidth probe).
- pipeline bubble: (p − 1) / (m + p − 1) of the step for GPipe and 1F1B (Narayanan et al. 2021).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from training import strategies
from training.collectives import bus_factor
from training.parallel.dims import DIM_NAMES, ParallelDims, expert_parallel_problem
from training.parallel.schedules import SINGLE, V_SHAPED, stage_blocks
from training.shared_cores import SharedCores, time_share

if TYPE_CHECKING:
    from training.config import StrategyConfig

COSTMODEL_VERSION = 3
"""Bumped when the predicted components change meaning (2: per-call latency, measured strategy
overhead; 3: FSDP gathers per micro-batch, the last bucket's reduction never hidden, recomputation
in compute): plan.calibrate only fits runs predicted by the same version."""

STEP_CHUNK_BYTES = 16 * 1024**2
"""The optimizer steps this many bytes of fp32 parameters at a time (training/optim.py): its
temporaries (a gradient cast to fp32, the moments' square root) are at most twice that."""
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}
"""Bytes of a parameter or activation as the step computes with it. fp8 (Float8 linears) holds and
communicates bf16: torchao casts each linear's weight and input to fp8 inside the matmul, with
dynamic scales (FSDP's optional fp8 all-gather is not assumed)."""
BF16_PARAMS = ("bf16", "fp8")
"""Precisions whose parameters and gradients are bf16, beside the optimizer's fp32 masters."""
MASTER_BYTES = 4
"""FSDP's sharded parameters, their gradients (reduce_dtype) and a master weight: fp32."""
MOMENT_BYTES = 8
"""AdamW's two fp32 moments."""
LOSS_PARALLEL_TEMPS = 1.5
"""The loss's temporaries under loss parallelism, in units of the fused kernels' two copies of the
logits: three copies of the rank's share (Workload.loss_temps)."""


@dataclass(frozen=True)
class Shape:
    """What the cost model needs to know of a model, measured from the built module
    (training/anatomy.py): nothing here is derived from one model family's shape."""

    params: int
    layers: int
    """Repeated blocks (the FSDP, checkpointing and pipeline unit)."""
    block_linear_params: int
    """Parameters of the layers the model's tensor-parallel plan splits (0: no plan)."""
    hidden: int
    """Width of a block's output: the activation tensor-parallel and pipeline stages exchange."""
    seq_len: int
    """Positions per sample in a block's output (tokens; 1 for a feature row)."""
    heads: int
    """The largest head count the model declares (1 if none)."""
    first_stage_params: int
    """Parameters only the first pipeline stage holds (embeddings), or all non-block parameters."""
    last_stage_params: int
    """Parameters only the last pipeline stage holds (final norm, head)."""
    tp_sizes: tuple[int, ...] = ()
    """Every width and head count the tensor-parallel degree must divide."""
    pipeline: bool = True
    """Whether the model declares a pipeline layout."""
    context_parallel: bool = False
    """Whether its attention can be split over the sequence (it calls scaled_dot_product_attention
    and takes position_ids: training/parallel/cp.py)."""
    kv_width: int = 0
    """Width per token of the keys its attention passes to scaled_dot_product_attention (heads x
    head dim, counted on the meta device): what context parallelism gathers, an eighth of `hidden`
    for Llama 3 70B (8 K/V heads for 64 query heads); 0: `hidden` (no attention seen)."""
    head_params: int = 0
    """Parameters of the output head tensor parallelism splits by vocabulary, its logits kept
    split into the loss (training/parallel/tp.py); 0: the model has none it can split, and TP
    leaves the head whole on every rank."""

    experts: tuple[int, ...] = ()
    """Each mixture-of-experts layer's experts that expert parallelism can split (training/models/
    moe.py's MoE), in block order; (): none (a dense model, or experts the trainer can't split)."""
    expert_params: int = 0
    """Parameters of those layers' experts, every expert counted: what `ep` divides among its ranks
    (the rest of a block is held as the other degrees say)."""
    top_k: int = 0
    """Experts each token is sent to in every MoE layer: its dispatch is top_k copies of `hidden`."""
    expert_flops_share: float = 0.0
    """Of the model's FLOPs, the share its routed experts compute: forward and backward, 6 x the
    active expert parameters (top_k of each layer's) per token over the FLOPs per token counted on
    the meta device. What a busier expert-parallel rank makes everyone wait for."""

    @property
    def kv(self) -> int:
        return self.kv_width or self.hidden

    @property
    def moe_layers(self) -> int:
        return len(self.experts)


@dataclass(frozen=True)
class Activations:
    """What one sample's step keeps for backward, in bytes, and the parts of it each way of splitting
    a layer leaves whole: counted on the meta device (training/anatomy.py) or measured from a real
    step, in one precision and activation checkpointing. The one record of them: a model's anatomy,
    a searched setting and a workload each hold one (activation_memory divides it)."""

    saved: float = 0.0
    """Saved for backward (parameters excluded), the loss's gradient temporaries included."""
    tp_replicated: float = 0.0
    """The part tensor parallelism leaves whole on every rank without sequence parallelism (what is
    saved outside the layers its plan splits: norms, residuals, the split linears' inputs); 0: all
    of it splits, or not measured."""
    outside_blocks: float = 0.0
    """The part saved outside the blocks (embeddings, head, loss): on the first and last pipeline
    stage, not spread over the blocks."""
    loss_temp: float = 0.0
    """Of `saved`, the loss's gradient temporaries at the start of backward (two fp32 copies of the
    model's output, not saved tensors): gone once backward reaches the blocks."""
    sp_replicated: float = 0.0
    """The part sequence parallelism leaves whole on every TP rank (outside the blocks and the final
    norm: the head's input, the logits, the loss's temporaries). For a model that declares no
    sequence-parallel norms, `tp_replicated`."""
    head: float = 0.0
    """Of `outside_blocks`, what is saved after the head (its logits, the loss's softmax): split with
    the loss's temporaries over the TP ranks where the head is split (Shape.head_params)."""

    def extended(self, two: Activations, layers: int) -> Activations:
        """These (at one layer) and `two` (the same model at two) at `layers` alike layers."""
        return Activations(*(extended(one, at_two, layers)
                             for one, at_two in zip(dataclasses.astuple(self), dataclasses.astuple(two), strict=True)))


def extended(one: float, two: float, layers: int) -> float:
    """A count of a model of alike blocks at `layers` layers from its counts at one and two: what
    lies outside the blocks plus `layers` times one block's."""
    return one + (layers - 1) * (two - one)


@dataclass(frozen=True)
class Anatomy:
    """A model as the plan measured it (training/anatomy.py): its shape, and per sample its FLOPs,
    the bytes it saves for backward and its positions."""

    shape: Shape
    flops_per_sample: float
    """Forward + backward FLOPs of one sample (counted on the meta device, causal attention's score
    and value products as half the matrix: the plan records the convention; activation
    checkpointing's recomputation not counted, as MFU conventions do)."""
    activations: Activations
    """What a sample saves for backward, in the measured precision and activation checkpointing."""
    tokens_per_sample: int
    """Positions per sample (an integer input's length), 1 for feature or image inputs."""


# ---- memory ---------------------------------------------------------------------------------


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


def params_per_rank(shape: Shape, d: ParallelDims) -> float:
    """Parameters one rank holds before data-parallel sharding: TP splits the block linears and
    the head; EP the experts; PP gives each stage its run of blocks (training/parallel/schedules.py),
    the first stage the embeddings and the last the head: the fullest stage's."""
    return sum(stage_params(shape, d))


def stage_params(shape: Shape, d: ParallelDims) -> tuple[float, float]:
    """(the rest, the experts) of what one rank of the fullest pipeline stage holds before
    data-parallel sharding: its blocks' dense parameters with TP's split, its E/ep experts of each
    MoE layer, and its end's embeddings or head. Blocks are taken as equal (experts spread evenly)."""
    linears = shape.block_linear_params
    blocks = shape.params - shape.first_stage_params - shape.last_stage_params
    dense = (blocks - shape.expert_params - linears) + linears / d.tp
    experts = shape.expert_params / d.ep
    first, last = _ends(shape, d)
    if d.pp == 1:
        return first + last + dense, experts
    layers = list(range(shape.layers))
    count = [len(stage_blocks(layers, i, d.pp)) / max(shape.layers, 1) for i in range(d.pp)]
    ends = [first, *[0.0] * (d.pp - 2), last]
    i = max(range(d.pp), key=lambda k: count[k] * (dense + experts) + ends[k])
    return count[i] * dense + ends[i], count[i] * experts


def expert_replicas(d: ParallelDims) -> int:
    """Ranks holding the same experts (one in each expert group): FSDP shards the experts over
    them, DDP all-reduces their gradients over them (training/parallel/ep.py)."""
    return d.dp_size // d.ep

def _ends(shape: Shape, d: ParallelDims) -> tuple[float, float]:
    """Parameters of the first and the last stage's own parts on one rank: the head split by TP."""
    return shape.first_stage_params, shape.last_stage_params - shape.head_params * (1 - 1 / d.tp)


def keeps_gathered(strategy: str, reshard: bool = True) -> bool:
    """FSDP keeps each unit's gathered parameters from forward to backward (ZeRO-2), or frees
    and gathers them again (ZeRO-3)."""
    return not (reshard and strategies.get(strategy).reshard_after_forward)


def states_per_param(strategy: str, d: ParallelDims, precision: str, reshard: bool = True,
                     shards: int | None = None) -> tuple[float, float, float]:
    """Bytes per parameter of this rank's share for (parameters, gradients, optimizer), as the
    trainer allocates them (training/parallel/compose.py):

    - FSDP (d.uses_fsdp): fp32 parameters, gradients and moments sharded over dp_shard (16 / N), in
      any precision (MixedPrecisionPolicy computes with gathered copies); ZeRO-2 keeps the gathered
      compute copy of every unit through backward (+ 2 or 4). `shards`: another N (split experts
      are sharded over their replicas).
    - otherwise, bf16: bf16 parameters and gradients, the optimizer's fp32 master and moments
      (2 + 2 + 12), the 12 sharded over the data-parallel ranks by zero1 (the ZeRO paper's P_os);
      fp16 runs autocast over fp32 parameters, whose fp16 weight copies live until backward
      (4 + 2, 4, 8); fp32: 4 + 4 + 8. DDP's gradients are views of its buckets: no second copy."""
    c = COMPUTE_BYTES[precision]
    if d.uses_fsdp:
        n = shards or d.shard_degree  # dp_shard x cp: context-parallel ranks hold the same parameters
        gathered = c if keeps_gathered(strategy, reshard) else 0.0
        return MASTER_BYTES / n + gathered, MASTER_BYTES / n, MOMENT_BYTES / n
    sharded = d.dp_size * d.cp if strategies.get(strategy).shards_optimizer_only else 1
    if precision in BF16_PARAMS:
        return c, c, (MASTER_BYTES + MOMENT_BYTES) / sharded
    autocast_copies = c if precision == "fp16" else 0
    return MASTER_BYTES + autocast_copies, MASTER_BYTES, MOMENT_BYTES / sharded


def state_memory(shape: Shape, strategy: str, d: ParallelDims, precision: str, reshard: bool = True) -> Memory:
    """Parameters, gradients and optimizer state of one rank (states_per_param x its parameters);
    under expert parallelism with FSDP the experts sharded over their replicas, the rest as usual."""
    dense, experts = stage_params(shape, d)
    p, g, o = states_per_param(strategy, d, precision, reshard)
    pe, ge, oe = (states_per_param(strategy, d, precision, reshard, expert_replicas(d)) if d.ep > 1
                  else (p, g, o))
    return Memory(p * dense + pe * experts, g * dense + ge * experts, o * dense + oe * experts, 0)


def _unit_params(shape: Shape, d: ParallelDims) -> tuple[float, float]:
    """(a block's parameters on this rank, split by TP and its experts by EP; the root unit's:
    embeddings and head, or the heavier end on a pipeline stage)."""
    block = (shape.params - shape.first_stage_params - shape.last_stage_params) / max(shape.layers, 1)
    block -= shape.block_linear_params / max(shape.layers, 1) * (1 - 1 / d.tp)
    block -= shape.expert_params / max(shape.layers, 1) * (1 - 1 / d.ep)  # gathered: this rank's experts
    first, last = _ends(shape, d)
    return block, max(first, last) if d.pp > 1 else first + last


def fsdp_gathered_root(shape: Shape, strategy: str, d: ParallelDims, precision: str, reshard: bool = True) -> float:
    """FSDP2's root unit (embeddings, head), gathered in the compute dtype for forward and kept
    through backward (FSDP2 never reshards the root after forward); ZeRO-2 counts it in its states."""
    if not d.uses_fsdp or keeps_gathered(strategy, reshard):
        return 0.0
    return COMPUTE_BYTES[precision] * _unit_params(shape, d)[1]


def fsdp_working_set(shape: Shape, strategy: str, d: ParallelDims, precision: str, reshard: bool = True) -> float:
    """FSDP2's transient bytes while a block runs backward, beyond the states and the gathered
    root: under ZeRO-3 the block gathered and the next one prefetched, in the compute dtype; and
    that block's gradients in the fp32 buffer they are reduce-scattered from (measured: the
    compute-dtype gradients are freed as they are copied in)."""
    if not d.uses_fsdp:
        return 0.0
    block, _ = _unit_params(shape, d)
    gathered = 0.0 if keeps_gathered(strategy, reshard) else 2 * COMPUTE_BYTES[precision] * block
    return gathered + MASTER_BYTES * block


def fsdp_root_reduce(shape: Shape, d: ParallelDims, precision: str) -> float:
    """The root unit's reduction at the end of backward (FSDP2 reshards its parameters first): its
    unsharded gradients in the compute dtype and the fp32 buffer they are reduce-scattered from.
    For a model whose embeddings and head outweigh a block this, not a block's, is the peak."""
    if not d.uses_fsdp:
        return 0.0
    return (COMPUTE_BYTES[precision] + MASTER_BYTES) * _unit_params(shape, d)[1]


def optimizer_step_bytes(updated: float) -> float:
    """The optimizer step's temporaries for a rank that updates `updated` parameters: two fp32
    chunks (STEP_CHUNK_BYTES), or two copies of what it updates when that is smaller."""
    return 2 * min(STEP_CHUNK_BYTES, MASTER_BYTES * updated)


def activation_tensor_bytes(batch: int, seq: int, hidden: int, dtype_bytes: int) -> int:
    """One b x s x h activation (the seed's 32 x 512 x 1024 x 4 B = 64 MiB)."""
    return batch * seq * hidden * dtype_bytes


# ---- communication --------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """An α–β model of one collective over one kind of link."""

    alpha_s: float
    """Latency per call at `world`."""
    busbw_gbps: float
    """Asymptotic bus bandwidth (GB/s, 1e9 bytes)."""
    world: int
    """The world size the fit was measured at."""

    def alpha_at(self, n: int) -> float:
        """The latency of one call over `n` ranks: latency_hops(n) hops, scaled from the `world` it
        was measured at."""
        return self.alpha_s * latency_hops(n) / latency_hops(max(self.world, 2)) if n > 1 else 0.0

    def time(self, collective: str, nbytes: float, n: int, calls: int = 1) -> float:
        """Seconds for `nbytes` over `n` ranks moved in `calls` calls: each call pays the latency,
        the bytes pay the bandwidth once."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return calls * self.alpha_at(n) + nbytes * bus_factor(collective, n) / (self.busbw_gbps * 1e9)


@dataclass(frozen=True)
class Group:
    """The ranks one collective runs over, as the mesh lays them out (ranks fill a node before the
    next, the innermost dimension on neighbouring ranks): how many, and how many of them share
    each node the group spans."""

    ranks: int
    per_node: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / max(self.per_node, 1))

    def describe(self) -> str:
        return f"{self.ranks} ranks" + (f" on {self.nodes} nodes ({self.per_node} per node)" if self.nodes > 1 else
                                        " in one node")


def group_of(d: ParallelDims, dim: str, devices_per_node: int | None) -> Group:
    """The group of mesh dimension `dim` (`dp`: dp_replicate x dp_shard, flattened; `grad`: those
    and cp, the ranks whose gradients are reduced together; `ep` and `edp`: an expert group and
    an expert's replicas, carved out of dp) in the layout
    `d` on nodes of `devices_per_node` ranks (None: one node holds them all). Its ranks are
    `stride` apart, stride being the product of the dimensions inside it, so a node holds
    devices_per_node // stride of them (at least one)."""
    names = list(DIM_NAMES)
    sizes = {name: getattr(d, name) for name in names}
    spacing = 1
    if dim == "dp":
        ranks, inner = d.dp_size, names[names.index("dp_shard") + 1:]
    elif dim == "grad":  # every rank that holds the same parameters: the data-parallel and cp ranks
        ranks, inner = d.dp_size * d.cp, names[names.index("cp") + 1:]
    elif dim == "ep":  # an expert group: ep neighbouring data-parallel ranks (training/parallel/ep.py)
        ranks, inner = d.ep, names[names.index("dp_shard") + 1:]
    elif dim == "edp":  # an expert's replicas: one in each expert group, ep data-parallel ranks apart
        ranks, inner, spacing = expert_replicas(d), names[names.index("dp_shard") + 1:], d.ep
    else:
        ranks, inner = sizes[dim], names[names.index(dim) + 1:]
    if devices_per_node is None:
        return Group(ranks, ranks)
    stride = spacing * math.prod(sizes[name] for name in inner)
    return Group(ranks, max(1, min(ranks, devices_per_node // stride)))


def latency_hops(n: int) -> float:
    """Sequential hops in one small-message collective over n ranks: a ring's n − 1, until the
    tree (NCCL's double binary tree, gloo's halving-doubling) is shorter at 2·log2(n); the
    libraries switch to it at scale."""
    return min(n - 1, 2 * math.log2(n))


def fit_link(points: list[tuple[int, float]], collective: str, world: int) -> Link:
    """Fit α and busbw to measured (bytes, seconds) of one collective at `world` ranks: α from the
    smallest messages, the bandwidth by least squares through the large ones."""
    if len(points) < 2:
        raise ValueError(f"need at least 2 measured sizes of {collective} to fit latency and bandwidth")
    points = sorted(points)
    alpha = sorted(t for _, t in points[:3])[len(points[:3]) // 2]
    factor = bus_factor(collective, world)
    large = points[len(points) // 2:]
    xs = [b * factor for b, _ in large]
    ys = [max(t - alpha, 1e-12) for _, t in large]
    slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return Link(alpha_s=alpha, busbw_gbps=1 / slope / 1e9, world=world)


ZERO_BUBBLE = ("zero_bubble", "zbv", "dualpipev")
"""Schedules that split backward into input- and weight-gradient passes and fill the bubble with
the weight passes (Qi et al. 2023, 2024; DeepSeek-V3's DualPipe)."""


def pipeline_bubble(pp: int, microbatches: int, schedule: str = "1f1b", virtual: int = 1) -> float:
    """Idle fraction of a step. GPipe and 1F1B: (p − 1) / (m + p − 1) (Narayanan et al. 2021);
    interleaved 1F1B with v stages per rank: the warm-up shrinks by v, (p − 1) / (v·m + p − 1) (same
    paper). The zero-bubble family: ZB-H1's bubble, a third of its interleaved base with equal
    forward, input- and weight-gradient times (Qi et al. 2023). These closed forms are torch's own
    action tables played out (training/parallel/bubble.py) once the pipeline is full: m >= p for a
    looped schedule, m >= 2p for a V; below that the tables themselves are read (a looped schedule
    then waits a loop per microbatch: pp=4, v=2, m=2 is 0.56 idle, not 0.43). No schedule was timed
    on GPUs here."""
    if pp <= 1:
        return 0.0
    filled = microbatches >= pp * (2 if schedule in V_SHAPED else 1)
    if schedule not in SINGLE and not filled:
        from training.parallel.bubble import table_bubble

        return table_bubble(schedule, pp, microbatches, virtual)
    idle = (pp - 1) / (3 if schedule in ZERO_BUBBLE else 1)
    return idle / (virtual * microbatches + idle)


def in_flight(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> tuple[float, float]:
    """Microbatches whose activations the first and the last pipeline rank hold at their peak, in
    units of one microbatch through one stage of a one-stage-per-rank pipeline (as measured by
    training/parallel/inflight.py at pp=2, m=4): GPipe m and m; 1F1B min(m, p) and 1; interleaved
    1F1B Megatron's min(m, p)·(1 + (p − 1)/(p·v)) and, as measured, 1 + (p − 1)/p; DualPipeV p + 1
    (DeepSeek-V3) on both; torch 2.13's zero-bubble and ZB-V p + 1 on the first rank and, as
    measured, every microbatch on the last (their weight passes keep saved tensors to the end of
    the step)."""
    m = microbatches
    if schedule == "gpipe":
        return m, m
    if schedule == "interleaved_1f1b":
        return min(m, pp) * (1 + (pp - 1) / (pp * virtual)), 1 + (pp - 1) / pp
    if schedule == "dualpipev":
        return min(m, pp + 1), min(m, pp + 1)
    if schedule in ZERO_BUBBLE:
        return min(m, pp + 1), m
    return min(m, pp), 1


@dataclass(frozen=True)
class Comm:
    """Seconds per optimizer step one rank spends in each kind of communication."""

    data_parallel_s: float
    """Gradient reduction and parameter gathering: can overlap with backward."""
    tensor_parallel_s: float
    """Activation collectives inside every block (TP's all-reduces, or all-gathers and
    reduce-scatters with sequence parallelism; CP's K/V all-gathers): on the critical path."""
    pipeline_s: float
    """Activations and their gradients sent between stages."""
    calls: int = 0
    """Collective calls per step: each one a point where this rank may wait for its peers."""
    tail_s: float = 0.0
    """The data-parallel reduction that cannot hide behind backward: the last bucket's (DDP) or the
    last unit's (FSDP), launched when the backward pass has nothing left to do; under DDP with
    expert parallelism also the experts' gradients, all-reduced over their replicas after it."""
    expert_parallel_s: float = 0.0
    """Expert parallelism's all-to-alls (each MoE layer's tokens to their experts' ranks and back,
    and the counts that announce them): on the critical path."""


DDP_FIRST_BUCKET_BYTES = 1024**2
"""DDP closes its first gradient bucket at 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES),
so that the first all-reduce starts early in backward; later buckets fill to bucket_cap_mb."""


def ddp_buckets(grad_bytes: float, bucket_cap_bytes: float) -> int:
    """All-reduce calls DDP makes per step for `grad_bytes` of gradients."""
    rest = max(grad_bytes - DDP_FIRST_BUCKET_BYTES, 0.0)
    return 1 + math.ceil(rest / bucket_cap_bytes)


def fsdp_units(shape: Shape) -> int:
    """FSDP units (training/parallel/fsdp.py): one per block, and the root's (embeddings, head)."""
    return shape.layers + 1


def comm_time(shape: Shape, strategy: str, d: ParallelDims, micro_batch: int, grad_accum: int, microbatches: int,
              precision: str, link: Callable[[str, Group], Link], bucket_cap_bytes: float = 25 * 1024**2,
              clip: bool = False, devices_per_node: int | None = None, sequence_parallel: bool = False,
              recompute: str = "none", virtual: int = 1, imbalance: float = 1.0) -> Comm:
    """Per-step communication of each strategy in seconds (ZeRO's, Megatron's and GPipe's
    volumes, in the calls each implementation makes: every call pays the link's latency, which is
    what dominates a small model or a slow link); `link(collective, group)` is the α–β model of
    that collective over that group, on the tier it crosses (Hardware.link). Each collective runs
    over its own mesh dimension's group (group_of) on nodes of `devices_per_node` ranks.
    `imbalance`: the busiest expert-parallel rank's routed tokens over the mean rank's
    (Workload.imbalance_at)."""
    dense, expert_psi = stage_params(shape, d)
    split_experts = d.ep > 1 and expert_psi > 0  # then the experts' traffic goes over their replicas
    psi = dense if split_experts else dense + expert_psi
    dtype_bytes = COMPUTE_BYTES[precision]
    # The gradients as reduced: FSDP's reduce_dtype is fp32; DDP reduces the parameters' dtype
    # (bf16 parameters; fp32 ones under fp32 and fp16's autocast), as do zero1's broadcasts.
    stored = dtype_bytes if precision in BF16_PARAMS else MASTER_BYTES
    grads = (MASTER_BYTES if d.uses_fsdp else stored) * psi
    params = dtype_bytes * psi
    n = d.dp_size * d.cp  # context-parallel ranks' gradients are reduced with the data-parallel ones'
    units = fsdp_units(shape)
    dp_group, tp_group = group_of(d, "grad", devices_per_node), group_of(d, "tp", devices_per_node)
    # Neighbouring pipeline stages: two ranks a pp stride apart (another node once it exceeds one).
    pp_group = Group(2, 2 if group_of(d, "pp", devices_per_node).per_node > 1 else 1)

    made = 0

    def call(collective: str, nbytes: float, group: Group, calls: int = 1) -> float:
        """`calls` calls moving `nbytes` in all over `group`, on the tier it crosses."""
        nonlocal made
        if group.ranks > 1 and nbytes > 0:
            made += calls
        return link(collective, group).time(collective, nbytes, group.ranks, calls)

    tail = 0.0
    if n == 1:
        dp_s = 0.0
    elif d.dp_shard > 1:
        # FSDP2, per unit: an all-gather before its forward, a reduce-scatter after its backward,
        # and under ZeRO-3 (reshard after forward) another all-gather before its backward -
        # except the root's, which FSDP keeps from forward to backward. The gathers come back
        # for every micro-batch of an accumulating step; the reduce-scatter once per step.
        resharded = strategies.get(strategy).reshard_after_forward
        regathered = shape.params - shape.first_stage_params - shape.last_stage_params if resharded else 0
        regathered -= shape.expert_params if resharded and split_experts else 0
        dp_s = (call("all_gather", params * grad_accum, dp_group, units * grad_accum)
                + call("all_gather", dtype_bytes * regathered / d.tp / d.pp * grad_accum, dp_group,
                       (units - 1) * grad_accum)
                + call("reduce_scatter", grads, dp_group, units))
        tail = link("reduce_scatter", dp_group).time("reduce_scatter", grads / units, n)
        if clip:  # the global gradient norm of sharded gradients: one scalar all-reduce
            dp_s += call("all_reduce", 4, dp_group)
    else:
        buckets = ddp_buckets(grads, bucket_cap_bytes)
        dp_s = call("all_reduce", grads, dp_group, buckets)
        tail = link("all_reduce", dp_group).time("all_reduce", min(grads, bucket_cap_bytes), n)
        if strategies.get(strategy).shards_optimizer_only:  # then each rank broadcasts the partition it updated
            dp_s += call("broadcast", stored * psi, dp_group, n)
    ep_s = 0.0
    if split_experts:
        moe = math.ceil(shape.moe_layers / d.pp)
        edp_s, edp_tail, ep_s = expert_traffic(shape, strategy, d, micro_batch, grad_accum, microbatches, precision,
                                               expert_psi, moe, call, link, devices_per_node, recompute, imbalance)
        dp_s += edp_s
        tail += edp_tail
    activation = activation_tensor_bytes(micro_batch, shape.seq_len, shape.hidden, dtype_bytes) / d.cp
    layers = math.ceil(shape.layers / d.pp)
    # TP, inside its group: Megatron's collectives of one b x s x h activation each.
    # Per layer and micro-batch: forward two all-reduces, backward two; full recomputation repeats
    # the forward's. With sequence parallelism (measured: tests/dist/test_sequence_parallel.py)
    # forward is two all-gathers and two reduce-scatters, backward two reduce-scatters and four
    # all-gathers (two re-gather the saved shards, as Megatron does); full recomputation repeats the
    # forward's four, selective its two all-gathers (the reduce-scatters' outputs are kept).
    per_layer = layers * grad_accum
    if sequence_parallel:
        gathers = per_layer * (6 + {"full": 2, "selective": 2}.get(recompute, 0))
        scatters = per_layer * (4 + (2 if recompute == "full" else 0))
        tp_s = (call("all_gather", activation * gathers, tp_group, gathers)
                + call("reduce_scatter", activation * scatters, tp_group, scatters))
    else:
        reduces = per_layer * (4 + (2 if recompute == "full" else 0))
        tp_s = call("all_reduce", activation * reduces, tp_group, reduces)
    if shape.head_params and d.tp > 1:
        # Loss parallelism (training/parallel/tp.py), per micro-batch on the last stage, measured:
        # forward all-reduces three fp32 values per position (the max, the sum of exponentials,
        # the target's logit), backward the head's input gradient (a column split's partial sums).
        positions = micro_batch * shape.seq_len / d.cp * grad_accum
        heads = grad_accum * (microbatches if d.pp > 1 else 1)  # the head runs once per microbatch
        tp_s += (call("all_reduce", 3 * 4 * positions, tp_group, 3 * heads)
                 + call("all_reduce", activation * grad_accum, tp_group, heads))
    # CP: each block all-gathers this rank's K and V over the cp group in forward (again in backward
    # under full recomputation) and reduce-scatters their gradients in backward: 2 x s x b x kv / tp
    # gathered per layer and micro-batch (training/parallel/cp.py; the gathered K/V are the
    # heads SDPA sees: Shape.kv_width, all of them where a model expands grouped K/V heads first).
    cp_s = 0.0
    if d.cp > 1:
        kv = 2 * activation_tensor_bytes(micro_batch, shape.seq_len, shape.kv, dtype_bytes) / d.tp
        # Collectives are recomputed under selective checkpointing too (its policy keeps no all-gather).
        gathers = layers * grad_accum * (2 if recompute in ("full", "selective") else 1)
        cp_group = group_of(d, "cp", devices_per_node)
        cp_s = (call("all_gather", kv * gathers, cp_group, gathers)
                + call("reduce_scatter", kv * layers * grad_accum, cp_group, layers * grad_accum))
    # PP: each microbatch's activations forward and their gradients back, between two stages; with
    # v stages per rank every microbatch crosses v times as many stage boundaries.
    pp_calls = 2 * microbatches * grad_accum * virtual
    pp_s = call("broadcast", activation / microbatches * pp_calls, pp_group, pp_calls) if d.pp > 1 else 0.0
    return Comm(dp_s, tp_s + cp_s, pp_s, made, tail, ep_s)


def all_to_all_bytes(shape: Shape, tokens: float, precision: str) -> float:
    """What one rank sends in one of expert parallelism's all-to-alls of one MoE layer: each of its
    `tokens` to top_k experts, `hidden` values each, in the compute dtype (its own experts' share
    included, as nccl-tests counts an all-to-all's size; the bus factor (n − 1)/n leaves it out)."""
    return tokens * shape.top_k * shape.hidden * COMPUTE_BYTES[precision]


def expert_traffic(shape: Shape, strategy: str, d: ParallelDims, micro_batch: int, grad_accum: int,
                   microbatches: int, precision: str, expert_psi: float, moe_layers: int,
                   call: Callable[..., float], link: Callable[[str, Group], Link], devices_per_node: int | None,
                   recompute: str, imbalance: float = 1.0) -> tuple[float, float, float]:
    """(the experts' data-parallel seconds, the part of it after backward, the all-to-alls' seconds)
    of one step on one rank under expert parallelism (training/parallel/ep.py), in the calls it
    makes. Every MoE layer, per micro-batch (and pipeline microbatch): forward one all-to-all of
    the expert counts and two of the tokens (dispatch, combine), backward two of their gradients;
    recomputation (full or selective: its policy keeps no collective) repeats the forward's three.
    The experts' replicas (dp / ep ranks) reduce-scatter and gather them under FSDP, once per MoE
    layer (their own unit), or all-reduce their gradients after backward under DDP (one call per
    weight, two a layer: nothing left to hide behind).

    Routing decides how much each all-to-all moves: a rank sends its own tokens' slots one way and
    the slots its experts were sent the other (dispatch and its gradient, combine and its), so in
    every one of them the busiest expert rank moves `imbalance` times a balanced rank's volume,
    and the call ends with it."""
    ep_group, edp_group = group_of(d, "ep", devices_per_node), group_of(d, "edp", devices_per_node)
    chunks = grad_accum * (microbatches if d.pp > 1 else 1)
    forwards = 1 + (1 if recompute in ("full", "selective") else 0)
    tokens = all_to_all_bytes(shape, micro_batch * shape.seq_len, precision) * grad_accum * moe_layers * imbalance
    calls = moe_layers * chunks
    a2a_s = (call("all_to_all", tokens * (2 * forwards + 2), ep_group, calls * (2 * forwards + 2))
             + call("all_to_all", 8 * max(shape.experts) * calls * forwards, ep_group, calls * forwards))
    if expert_replicas(d) == 1:
        return 0.0, 0.0, a2a_s
    dtype_bytes = COMPUTE_BYTES[precision]
    if d.uses_fsdp:
        gathers = 2 if strategies.get(strategy).reshard_after_forward else 1
        dp_s = (call("all_gather", dtype_bytes * expert_psi * grad_accum * gathers, edp_group,
                     moe_layers * grad_accum * gathers)
                + call("reduce_scatter", MASTER_BYTES * expert_psi, edp_group, moe_layers))
        return dp_s, 0.0, a2a_s
    stored = dtype_bytes if precision in BF16_PARAMS else MASTER_BYTES
    reduce_s = call("all_reduce", stored * expert_psi, edp_group, 2 * moe_layers)
    return reduce_s, reduce_s, a2a_s


# ---- step time ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepPrediction:
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    overhead_s: float = 0.0
    """The strategy's own per-step work besides the model's (hooks, copies, sharded optimizer)."""
    collective_calls: int = 0
    """Collectives per step (Comm.calls): what calibration's per-call cost multiplies."""
    seconds_per_sample: float = 0.0
    """The measured compute per sample (one device, alone) the components were computed from: the
    basis a calibration fitted on them predicts from (Calibration.seconds_per_sample); 0: unknown."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.overhead_s + self.exposed_comm_s + self.bubble_s


def step_time(compute_s: float, comm: Comm, d: ParallelDims, microbatches: int, overlap: float,
              overhead_s: float = 0.0, schedule: str = "1f1b", virtual: int = 1,
              call_cost_s: float = 0.0) -> StepPrediction:
    """compute + the strategy's overhead + exposed communication + pipeline bubble.

    `compute_s` is the whole step's compute on one rank (its share of the model and batch).
    Data-parallel traffic hides behind the backward pass (2/3 of compute) up to `overlap`;
    tensor- and pipeline-parallel traffic is on the critical path. `call_cost_s` is what each
    collective issued between compute costs beyond its probe time (CPU hosts: SharedCores)."""
    hidden = overlap * compute_s * 2 / 3
    dp_exposed = max(comm.data_parallel_s - hidden, min(comm.tail_s, comm.data_parallel_s) if overlap else 0.0, 0.0)
    exposed = (dp_exposed + comm.tensor_parallel_s + comm.expert_parallel_s + comm.pipeline_s
               + comm.calls * call_cost_s)
    busy = compute_s + overhead_s + exposed
    idle = pipeline_bubble(d.pp, microbatches, schedule, virtual)
    bubble = busy * idle / (1 - idle)
    return StepPrediction(compute_s, exposed, bubble, overhead_s, comm.calls)


# ---- predictions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """What the predictions run on: measured (this machine) or described by a cluster preset."""

    device_memory_bytes: float
    devices_per_node: int
    intra: dict[str, Link]
    """α–β per collective inside a node."""
    inter: dict[str, Link]
    """α–β per collective across nodes, every rank of each node in the collective (nccl-tests
    across full nodes: the node's NICs together)."""
    seconds_per_sample: float
    """Forward + backward + step compute of one sample on one device."""
    cores: int | None = None
    """CPU hosts: the cores the ranks share; None for GPUs (every rank has its own device)."""
    threads_per_device: int = 1
    """CPU hosts: threads one rank computes with (the measured "device")."""
    shared: SharedCores | None = None
    """CPU hosts where the bandwidth stage measured it: compute with every rank working, and the
    cost of a collective issued between compute. None: the cores' time-sharing alone, no call cost."""
    overhead_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per strategy: what its wrapper adds to one micro-batch step, measured on one rank
    (training/overhead.py); a strategy not in it (a what-if cluster, pp) is taken to add nothing."""
    inter_single: dict[str, Link] = dataclasses.field(default_factory=dict)
    """α–β per collective across nodes with one rank per node (the data-parallel group of a
    node-local TP layout): what one rank's share of the node's NICs carries. Measured by the
    bandwidth stage where there are several ranks per node; else (a preset) the node's figure over
    its devices: one NIC per GPU, as DGX-class nodes are built."""
    _links: dict[tuple[str, Group], Link] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                              compare=False)
    """link()'s answers, kept: a search asks for the same few millions of times (a copy made by
    dataclasses.replace starts empty)."""

    def contention(self, world: int) -> float:
        """How much slower one rank's CPU work runs when `world` ranks run: 1 on GPUs; on a CPU
        host, once the ranks' threads outnumber its cores they time-share them."""
        if self.cores is None:
            return 1.0
        if self.shared is not None:
            return self.shared.contention(world)
        return time_share(world, self.threads_per_device, self.cores)

    def call_cost(self, world: int, gap_s: float) -> float:
        """What a collective issued after `gap_s` of compute adds at `world` ranks (0 on GPUs and
        where nothing measured it)."""
        return self.shared.call_cost(world, gap_s) if self.shared is not None and self.cores is not None else 0.0

    def compute_per_sample(self, world: int) -> float:
        """Per-sample compute of one rank when `world` ranks run."""
        return self.seconds_per_sample * self.contention(world)

    def strategy_overhead(self, strategy: str, world: int) -> float:
        """The strategy's per-micro-batch overhead on one rank of `world` (none unwrapped, at 1)."""
        return self.overhead_s.get(strategy, 0.0) * self.contention(world) if world > 1 else 0.0

    def link(self, collective: str, group: Group) -> Link:
        """The α–β model of `collective` over `group`, on the tier it crosses. Inside a node: the
        intra-node fit. Across nodes, as NCCL's hierarchical algorithms run it: the bandwidth of the
        NICs the group's ranks of a node bring (each rank its share: inter_single per rank, at most
        the full node's figure), the latency of the hops across nodes. With nothing measured (a
        world of one) only single-rank calls, which cost nothing, can be asked for."""
        key = (collective, group)
        if key not in self._links:
            self._links[key] = self._link(collective, group)
        return self._links[key]

    def _link(self, collective: str, group: Group) -> Link:
        if group.nodes <= 1:
            found = _pick(self.intra, collective) or _pick(self.inter, collective)
        else:
            full = _pick(self.inter, collective) or _pick(self.intra, collective)
            found = None if full is None else self._across(collective, full, group)
        if found is None:
            assert group.ranks <= 1, "no bandwidth measured: nothing to predict beyond one device"
            return Link(alpha_s=0.0, busbw_gbps=float("inf"), world=1)
        return found

    def _across(self, collective: str, full: Link, group: Group) -> Link:
        """A group spanning nodes: `per_node` ranks' NIC shares, at most the full node's busbw;
        the latency of the full-node fit (several ranks per node: a hierarchical ring), or of one
        rank per node, at this group's size."""
        single = _pick(self.inter_single, collective) or Link(
            full.alpha_s, full.busbw_gbps / max(self.devices_per_node, 1), full.world)
        busbw = min(full.busbw_gbps, single.busbw_gbps * group.per_node)
        alpha = (full if group.per_node > 1 else single).alpha_at(group.ranks)
        return Link(alpha_s=alpha, busbw_gbps=busbw, world=group.ranks)


def _pick(links: dict[str, Link], collective: str) -> Link | None:
    """The fit for `collective`, else all_reduce's (the one every probe and preset has)."""
    return links.get(collective) or links.get("all_reduce")


@dataclass(frozen=True)
class Workload:
    shape: Shape
    micro_batch: int
    grad_accum: int
    microbatches: int
    precision: str
    """`fp32`, `bf16`, `fp16` or `fp8`: what the states and activations are held in (states_per_param;
    fp8's in bf16)."""
    checkpointing: str
    """strategy.activation_checkpointing: `none`, `selective` or `full` (what the forward's
    collectives repeat in backward)."""
    tokens_per_sample: int
    activations: Activations
    """What a sample saves for backward in this precision and checkpointing."""
    bucket_cap_bytes: float = 25 * 1024**2
    """DDP's gradient bucket size (strategy.bucket_cap_mb)."""
    seconds_per_sample: float | None = None
    """This workload's compute per sample on one device when it differs from the hardware's
    measured one (another precision or activation checkpointing); None: the hardware's."""
    clip: bool = False
    """Gradient clipping (train.grad_clip): sharded gradients need one more all-reduce for the norm."""
    pp_schedule: str = "1f1b"
    """GPipe keeps every microbatch's activations until the backward; 1F1B at most one per stage."""
    sequence_parallel: bool = False
    """strategy.sequence_parallel: TP's activations sharded but `Activations.sp_replicated`,
    its all-reduces all-gathers and reduce-scatters."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank (interleaved and V-shaped schedules)."""
    expert_imbalance: tuple[tuple[int, float], ...] = ()
    """(ep, measured imbalance) pairs: the busiest expert-parallel rank's routed tokens over the
    mean rank's, per step, averaged (stages/train.py's TrainResult.expert_rank_imbalance); an ep
    not in it is predicted balanced (1.0)."""

    def imbalance_at(self, ep: int) -> float:
        return dict(self.expert_imbalance).get(ep, 1.0) if ep > 1 else 1.0

    def expert_straggler(self, d: ParallelDims) -> float:
        """How much longer the busiest expert-parallel rank computes than the mean: its experts'
        share of the FLOPs times the excess of tokens it got (the all-to-alls make every rank wait
        for it). 1 without expert parallelism: one rank runs every expert, whatever the routing."""
        return 1.0 + self.shape.expert_flops_share * (self.imbalance_at(d.ep) - 1.0)

    def tp_unsplit(self, d: ParallelDims) -> float:
        """How much more than 1/tp of a sample's compute each tensor-parallel rank runs: the routed
        experts are in no tensor-parallel plan, so every rank of a TP group runs them whole on the
        same tokens (1 + share x (tp - 1)); 1 for a dense model or tp = 1."""
        return 1.0 + self.shape.expert_flops_share * (d.tp - 1)

    def head_split(self, d: ParallelDims) -> int:
        """Over how many ranks the head's logits and the loss's temporaries are split."""
        return d.tp if self.shape.head_params else 1

    def loss_temps(self, d: ParallelDims) -> float:
        """The loss's temporaries per sample on one rank at the start of backward: two fp32 copies of
        the whole logits (the fused kernels'), or where the head is split, three of this rank's
        share (torch's loss-parallel backward holds the one-hot zeros, the softmax, their sum and
        then the product beside the saved log-softmax; measured at tp=2: tests/dist/test_memory_budget.py)."""
        split = self.head_split(d)
        return self.activations.loss_temp * (LOSS_PARALLEL_TEMPS / split if split > 1 else 1)


def strategy_workload(shape: Shape, activations: Activations, strategy: StrategyConfig, micro_batch: int,
                      grad_accum: int, tokens_per_sample: int, clip: bool) -> Workload:
    """The Workload of a run of `strategy` (its precision, checkpointing, pipeline schedule,
    sequence parallelism and DDP buckets): the plan's own run and a fit's, built the one way."""
    return Workload(shape=shape, micro_batch=micro_batch, grad_accum=grad_accum, microbatches=strategy.microbatches,
                    precision=strategy.precision, checkpointing=strategy.activation_checkpointing,
                    tokens_per_sample=tokens_per_sample, activations=activations,
                    bucket_cap_bytes=strategy.bucket_cap_mb * 1024**2, clip=clip, pp_schedule=strategy.pp_schedule,
                    sequence_parallel=strategy.sequence_parallel, pp_virtual_stages=strategy.pp_virtual_stages)


@dataclass(frozen=True)
class Prediction:
    strategy: str
    devices: int
    fits: bool
    memory_per_device_bytes: float
    step_time_s: float
    tokens_per_s: float
    scaling_efficiency: float
    samples_per_s: float
    exposed_comm_s: float
    """The model's exposed communication, before calibration."""
    bubble_s: float
    """The model's pipeline bubble, before calibration."""
    compute_s: float = 0.0
    """The model's compute per step, before calibration (step_time_s = their sum uncalibrated)."""
    overhead_s: float = 0.0
    """The strategy's measured per-step overhead, before calibration."""
    collective_calls: int = 0
    """Collective calls per step in the model."""
    seconds_per_sample: float = 0.0
    """The hardware's measured compute per sample these components were computed from."""
    expert_parallel_s: float = 0.0
    """Of the communication, expert parallelism's all-to-alls a step (Comm.expert_parallel_s),
    uncalibrated: what the advisor reports for an expert layout."""

    @property
    def components(self) -> StepPrediction:
        """The uncalibrated components, with their basis: what calibration fits a measured step to."""
        return StepPrediction(self.compute_s, self.exposed_comm_s, self.bubble_s, self.overhead_s,
                              self.collective_calls, self.seconds_per_sample)


# ---- calibration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredStep:
    """One earlier run: the model's uncalibrated components for it, and its measured step time."""

    strategy: str
    devices: int
    predicted: StepPrediction
    """The model's components for that run, uncalibrated."""
    measured_step_s: float
    expert_imbalance: tuple[tuple[int, float], ...] = ()
    """(ep, imbalance) the run measured (TrainResult.expert_rank_imbalance); () for a dense model."""


def measured_imbalance(points: list[MeasuredStep]) -> tuple[tuple[int, float], ...]:
    """Per expert-parallel degree, the median imbalance earlier runs of the model measured
    (Workload.expert_imbalance); () when none did."""
    seen: dict[int, list[float]] = {}
    for point in points:
        for ep, x in point.expert_imbalance:
            seen.setdefault(ep, []).append(x)
    return tuple((ep, statistics.median(xs)) for ep, xs in sorted(seen.items()))


@dataclass(frozen=True)
class Calibration:
    """Scales fitted to earlier runs: step = compute_scale x (compute + overhead + bubble) +
    comm_scale[strategy] x exposed communication + call_s x collective calls. One compute scale
    for the host's CPU-side work (contention, kernels the single-device timing missed); one
    communication scale per strategy, since the α–β terms miss different things for each; and a
    cost per collective call, shared: what a rank waits at each one for a peer that is still busy
    (an idle probe never sees it; FSDP's many calls per step pay it many times)."""

    compute_scale: float
    comm_scale: dict[str, float]
    points: int
    error_before_pct: float
    """Root-mean-square of (measured - predicted) / measured over the points, uncalibrated."""
    error_after_pct: float
    """The same, calibrated (in-sample: the fit's own points)."""
    call_s: float = 0.0
    """Seconds each collective call costs beyond the α–β model."""
    seconds_per_sample: float | None = None
    """The median compute per sample the points' components were computed from: the basis the
    scales were fitted on. A calibrated plan predicts from it rather than from its own fresh timing
    (one timing on a busy host moves by a third; the scales would carry that into every
    prediction). None where the points don't record it."""

    def step_s(self, strategy: str, step: StepPrediction) -> float:
        comm = self.comm_scale.get(strategy, self.default_comm_scale)
        return (self.compute_scale * (step.compute_s + step.overhead_s + step.bubble_s) + comm * step.exposed_comm_s
                + self.call_s * step.collective_calls)

    def on_basis(self, hw: Hardware) -> Hardware:
        """`hw` with the compute timing the scales were fitted on, where the points recorded one:
        the scales apply to components computed as theirs were."""
        return dataclasses.replace(hw, seconds_per_sample=self.seconds_per_sample) if self.seconds_per_sample else hw

    @property
    def default_comm_scale(self) -> float:
        """For a strategy no earlier run measured: the median of the fitted ones, else 1."""
        values = sorted(self.comm_scale.values())
        return values[len(values) // 2] if values else 1.0

    def describe(self) -> str:
        comm = ", ".join(f"{k} x{v:.2f}" for k, v in sorted(self.comm_scale.items())) or "none measured"
        basis = (f" on their plans' compute timing ({self.seconds_per_sample * 1e3:.3f} ms a sample, median)"
                 if self.seconds_per_sample else "")
        return (f"calibration: {self.points} earlier runs; compute x{self.compute_scale:.2f}{basis}, communication "
                f"{comm}, +{self.call_s * 1e3:.2f} ms per collective call; rms step-time error on them "
                f"{self.error_before_pct:.0f} % -> {self.error_after_pct:.0f} %")


def nonnegative_least_squares(a, b):  # noqa: ANN001, ANN201 - numpy arrays
    """argmin |a x - b| over x >= 0, exactly, by trying every set of free columns (a calibration
    has a handful: 2^k small solves); a negative scale would be noise, not physics."""
    import itertools

    import numpy as np

    best, best_x = float("inf"), np.zeros(a.shape[1])
    for k in range(1, a.shape[1] + 1):
        for free in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
            if (x < 0).any():
                continue
            residual = float(np.sum((a[:, free] @ x - b) ** 2))
            if residual < best - 1e-15:
                best, best_x = residual, np.zeros(a.shape[1])
                best_x[list(free)] = x
    return best_x


PRIOR_WEIGHT = 0.2
"""How many runs' worth of evidence the model's own communication terms (scale 1 for each
strategy, no cost per call) count for in a fit. A handful of runs leaves those resting on one
point each: with one zero3 run at world 2 beside world 1's, its communication scale and the cost
per call trade off freely. Measured on this project's 2-core host (bench_planner's points, three
sets, 2026-12-03), each point predicted from a fit to the five others: without the prior zero3 at
world 4 read 1.26, 1.76 and 1.59x its measured step (5, 3 and 5 of 6 points within 15 %); with
it 1.09, 0.88 and 0.96 (6, 5 and 6 of 6); of the other points the most moved was zero3 at world 2
in the second set, 0.83 -> 0.90, the rest by at most 0.03. Compute has a
column in every run, so it has no prior: one run at world 1 sets it exactly."""


def fit_calibration(points: list[MeasuredStep]) -> Calibration | None:
    """Least squares on relative error: minimise sum(((kc (c + o + b) + km[s] m + kn n - t) / t)^2)
    over the points, with kc and kn (per call) shared and km per strategy, all >= 0, plus a prior
    toward the model's communication (PRIOR_WEIGHT): each km's distance from 1 and kn's from 0, in
    units of its column's typical size, counts as PRIOR_WEIGHT points' relative error. None
    without points."""
    import numpy as np

    points = [p for p in points if p.measured_step_s > 0 and p.predicted.step_s > 0]
    if not points:
        return None
    comm_strategies = sorted({p.strategy for p in points if p.predicted.exposed_comm_s > 0})
    columns = ["compute", *comm_strategies, "calls"]
    a = np.zeros((len(points), len(columns)))
    for i, p in enumerate(points):
        a[i, 0] = (p.predicted.compute_s + p.predicted.overhead_s + p.predicted.bubble_s) / p.measured_step_s
        if p.predicted.exposed_comm_s > 0:
            a[i, columns.index(p.strategy)] = p.predicted.exposed_comm_s / p.measured_step_s
        a[i, -1] = p.predicted.collective_calls / p.measured_step_s
    prior = np.array([1.0] * (len(columns) - 1) + [0.0])
    # Ridge rows: one per communication scale, sqrt(w) x its column's rms (so the pull is
    # unit-free) x (k - prior); none for compute.
    weight = math.sqrt(PRIOR_WEIGHT) * np.sqrt((a ** 2).mean(axis=0))
    weight[0] = 0.0
    ridge = np.diag(weight)
    scales = nonnegative_least_squares(np.vstack([a, ridge]), np.concatenate([np.ones(len(points)), ridge @ prior]))
    bases = [p.predicted.seconds_per_sample for p in points if p.predicted.seconds_per_sample > 0]
    calibration = Calibration(
        compute_scale=float(scales[0]),
        comm_scale={s: float(scales[1 + i]) for i, s in enumerate(comm_strategies)},
        points=len(points),
        error_before_pct=0.0,
        error_after_pct=0.0,
        call_s=float(scales[-1]),
        seconds_per_sample=statistics.median(bases) if bases else None,
    )

    def rms_error(step: Callable[[MeasuredStep], float]) -> float:
        # Never worse after than before: the fit minimises this plus the prior's pull, which is
        # zero at the model's scales (1, 1, 0), a feasible point; a median of a handful of points could be.
        return 100 * math.sqrt(sum(((p.measured_step_s - step(p)) / p.measured_step_s) ** 2 for p in points)
                               / len(points))

    return dataclasses.replace(
        calibration,
        error_before_pct=rms_error(lambda p: p.predicted.step_s),
        error_after_pct=rms_error(lambda p: calibration.step_s(p.strategy, p.predicted)),
    )


def feasible(shape: Shape, d: ParallelDims, w: Workload) -> bool:
    """Whether the model can be laid out so: TP needs a plan whose widths and heads it divides; PP
    a declared layout, a block per stage and microbatches that divide the micro-batch."""
    if d.tp > 1 and (shape.block_linear_params == 0 or any(size % d.tp for size in shape.tp_sizes)):
        return False
    if d.pp > 1 and (not shape.pipeline or d.pp * w.pp_virtual_stages > shape.layers
                     or w.micro_batch % w.microbatches or pipeline_problem(w, d) is not None):
        return False
    if d.cp > 1 and shape.seq_len % (2 * d.cp):  # two load-balanced chunks per cp rank
        return False
    return expert_parallel_problem(d, False, shape.experts) is None


def pipeline_problem(w: Workload, d: ParallelDims) -> str | None:
    """Why the schedule can't run this pipeline (torch 2.13's rules: training/parallel/schedules.py)."""
    from training.parallel.schedules import checkpointing_problem, data_parallel_problem, microbatches_problem

    return (microbatches_problem(w.pp_schedule, d.pp, w.pp_virtual_stages, w.microbatches)
            or data_parallel_problem(w.pp_schedule, d.dp_size * d.cp)
            or checkpointing_problem(w.pp_schedule, w.checkpointing))


def activation_memory(w: Workload, d: ParallelDims) -> float:
    """The activations one rank holds at the start of backward, the loss's temporaries included.

    TP divides what its plan splits, and the head's logits and the loss's temporaries where it
    splits the head by vocabulary; with sequence parallelism the blocks' rest too (norms,
    residuals and the split linears' inputs are sharded over the sequence: Korthikanti et al.'s
    32sbh/t without dropout; measured within 0.2 %), all but the head's input. CP
    divides every token's activations by cp and adds the peers' K and V its attention keeps for
    backward ((cp − 1)/cp of 2·s·kv/t per layer and sample, kv the keys' width SDPA sees; under
    full or selective checkpointing one layer's, the one recomputing: the all-gather is redone in
    backward, measured) and one causal mask of (s/cp)·s per micro-batch (training/parallel/cp.py). A pipeline stage holds its share of the blocks'
    activations for the microbatches its schedule keeps in flight (GPipe: all m; 1F1B: min(m, p)
    on the first stage, one on the last), and the last stage also what is saved outside the blocks
    (the head, the loss) and the loss's temporaries, per microbatch in flight; the higher of the
    first and the last stage."""
    a = w.activations
    per_sample = a.saved
    split = w.head_split(d)
    if d.tp > 1:
        kept = a.sp_replicated if w.sequence_parallel else a.tp_replicated
        if split > 1:  # the head's logits and the loss's temporaries are this rank's share
            kept = max(kept - a.head - a.loss_temp, 0.0)
            per_sample -= a.loss_temp
        per_sample = kept + (per_sample - kept) / d.tp + (w.loss_temps(d) if split > 1 else 0.0)
    dtype = COMPUTE_BYTES[w.precision]
    kv = mask = 0.0
    if d.cp > 1:
        per_sample /= d.cp
        kv = 2 * w.shape.seq_len * w.shape.kv / d.tp * dtype * (d.cp - 1) / d.cp  # per layer and sample
        mask = w.shape.seq_len / d.cp * w.shape.seq_len * dtype
    layers = math.ceil(w.shape.layers / d.pp)
    kept_kv, recomputing_kv = (kv * layers, 0.0) if w.checkpointing == "none" else (0.0, kv)
    if d.pp == 1:
        return (per_sample + kept_kv + recomputing_kv) * w.micro_batch + mask
    tail = a.outside_blocks - a.head * (1 - 1 / split)
    ends = min(tail + w.loss_temps(d), per_sample)
    blocks = (per_sample - ends) * layers / max(w.shape.layers, 1) + kept_kv
    per_micro = w.micro_batch / w.microbatches
    first, last = in_flight(w.pp_schedule, d.pp, w.microbatches, w.pp_virtual_stages)
    return per_micro * (max(blocks * first, (blocks + ends) * last) + recomputing_kv) + mask


def memory_breakdown(w: Workload, strategy: str, d: ParallelDims) -> Memory:
    """One rank's memory at the peak of a step, term by term, as the trainer allocates it."""
    # The loss's temporaries: on the stage that computes the loss, per microbatch in flight there.
    temps = w.loss_temps(d) * w.micro_batch / (w.microbatches if d.pp > 1 else 1)
    return dataclasses.replace(layout_memory(w.shape, strategy, d, w.precision),
                               activation_bytes=activation_memory(w, d), loss_temp_bytes=temps)


@functools.lru_cache(maxsize=4096)
def layout_memory(shape: Shape, strategy: str, d: ParallelDims, precision: str) -> Memory:
    """The terms of one rank's peak that the batch doesn't change (states, FSDP's gathered root and
    working set, what is reduced or updated after backward): kept per layout, since the search
    holds every micro-batch, schedule and checkpointing of a layout against them."""
    states = state_memory(shape, strategy, d, precision)
    masters = precision in BF16_PARAMS and not d.uses_fsdp  # the optimizer holds fp32 masters beside the moments
    per_updated = MOMENT_BYTES + (MASTER_BYTES if masters else 0)
    buckets = d.dp_replicate_enabled and not d.uses_fsdp  # DDP: gradients are views of its buckets
    return dataclasses.replace(states, grads_in_backward=states.grad_bytes if buckets else 0.0,
                               gathered_root_bytes=fsdp_gathered_root(shape, strategy, d, precision),
                               working_bytes=fsdp_working_set(shape, strategy, d, precision),
                               tail_bytes=max(fsdp_root_reduce(shape, d, precision),
                                              optimizer_step_bytes(states.optim_bytes / per_updated)))


def memory_per_device(w: Workload, strategy: str, d: ParallelDims) -> float:
    return memory_breakdown(w, strategy, d).total


def predict(w: Workload, hw: Hardware, strategy: str, devices: int, memory_limit: float, overlap: float,
            single_device_samples_per_s: float, calibration: Calibration | None = None) -> Prediction | None:
    """A pure strategy on `devices` (its preset degrees); see predict_layout."""
    return predict_layout(w, hw, strategy, ParallelDims(**strategies.get(strategy).degrees_on(devices)), memory_limit, overlap,
                          single_device_samples_per_s, calibration)


def predict_layout(w: Workload, hw: Hardware, flavour: str, d: ParallelDims, memory_limit: float, overlap: float,
                   single_device_samples_per_s: float, calibration: Calibration | None = None,
                   name: str | None = None) -> Prediction | None:
    """Step time, throughput, memory and efficiency of the layout `d` whose data parallelism is
    `flavour` (ddp, zero1, zero2 or zero3); None if the model can't be laid out so. `name` is the
    strategy it is reported as (default: the flavour). With a `calibration`, the step time is its
    refinement of the model's components."""
    if not feasible(w.shape, d, w) or (d.ep > 1 and strategies.get(flavour).shards_optimizer_only):
        return None  # zero1 with split experts: expert_parallel_problem's refusal
    name = name or flavour
    devices = d.world_size
    comm = comm_time(w.shape, flavour, d, w.micro_batch, w.grad_accum, w.microbatches, w.precision, hw.link,
                     w.bucket_cap_bytes, w.clip, hw.devices_per_node, w.sequence_parallel and d.tp > 1,
                     w.checkpointing, w.pp_virtual_stages, w.imbalance_at(d.ep))
    per_sample = w.seconds_per_sample if w.seconds_per_sample is not None else hw.seconds_per_sample
    compute = (per_sample * hw.contention(devices) * w.micro_batch * w.grad_accum / (d.tp * d.pp * d.cp)
               * w.expert_straggler(d) * w.tp_unsplit(d))
    overhead = hw.strategy_overhead(flavour, devices) * w.grad_accum
    # Each collective follows its share of the step's compute: the stretch the ranks drift over.
    step = step_time(compute, comm, d, w.microbatches, overlap, overhead, w.pp_schedule, w.pp_virtual_stages,
                     hw.call_cost(devices, (compute + overhead) / max(comm.calls, 1)))
    step_s = step.step_s
    if calibration is not None:
        step_s = calibration.step_s(name, step)
    samples_per_s = w.micro_batch * w.grad_accum * d.dp_size / step_s
    memory = memory_per_device(w, flavour, d)
    return Prediction(
        strategy=name,
        devices=devices,
        fits=memory <= memory_limit,
        memory_per_device_bytes=memory,
        step_time_s=step_s,
        tokens_per_s=samples_per_s * w.tokens_per_sample,
        scaling_efficiency=samples_per_s / (devices * single_device_samples_per_s),
        samples_per_s=samples_per_s,
        exposed_comm_s=step.exposed_comm_s,
        bubble_s=step.bubble_s,
        compute_s=step.compute_s,
        overhead_s=step.overhead_s,
        collective_calls=step.collective_calls,
        seconds_per_sample=hw.seconds_per_sample,
        expert_parallel_s=comm.expert_parallel_s,
    )


def device_counts(max_devices: int, requested: int) -> list[int]:
    """1, 2, 4 ... up to max_devices, plus the requested world."""
    counts = {requested}
    n = 1
    while n <= max_devices:
        counts.add(n)
        n *= 2
    return sorted(counts)
