"""Ruler 2, communication: the collectives a step of a layout issues, and their time on the
links it crosses. nccl-tests' bus-bandwidth factors; time = α + bus bytes / busbw (an α–β model
fitted to the bandwidth probe), per tier (inside a node, across nodes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from training import strategies
from training.collectives import bus_factor
from training.parallel.dims import DIM_NAMES, ParallelDims
from training.planner.memory import (
    MASTER_BYTES,
    activation_tensor_bytes,
    expert_replicas,
    fsdp_wraps,
    stage_params,
)
from training.planner.shape import BF16_PARAMS, COMPUTE_BYTES, Shape


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
    an expert's replicas, carved out of those and the TP ranks) in the layout
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
    elif dim == "ep":  # an expert group: ep neighbouring data-, context- or tensor-parallel ranks (training/parallel/ep.py)
        ranks, inner = d.ep, []
    elif dim == "edp":  # an expert's replicas: one in each expert group, ep of those ranks apart
        ranks, inner, spacing = expert_replicas(d), [], d.ep
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
              recompute: str = "none", virtual: int = 1, imbalance: float = 1.0, v_shaped: bool = False,
              rerun: tuple[float, float] = (0.0, 0.0)) -> Comm:
    """Per-step communication of each strategy in seconds (ZeRO's, Megatron's and GPipe's
    volumes, in the calls each implementation makes: every call pays the link's latency, which is
    what dominates a small model or a slow link); `link(collective, group)` is the α–β model of
    that collective over that group, on the tier it crosses (Hardware.link). Each collective runs
    over its own mesh dimension's group (group_of) on nodes of `devices_per_node` ranks.
    `imbalance`: the busiest expert-parallel rank's routed tokens over the mean rank's
    (Workload.imbalance_at); `v_shaped`: a V-shaped pipeline schedule, whose rank 0 holds both ends
    (memory.stage_params); `rerun`: the share of its layer runs a split backward's weight pass runs
    again on the rank holding the head and on the busiest other rank (pipeline.rerun_shares)."""
    dense, expert_psi = stage_params(shape, d, v_shaped)
    split_experts = d.ep > 1 and expert_psi > 0  # then the experts' traffic goes over their replicas
    psi = dense if split_experts else dense + expert_psi
    dtype_bytes = COMPUTE_BYTES[precision]
    # The gradients as reduced: FSDP's reduce_dtype is fp32; DDP reduces the parameters' dtype
    # (bf16 parameters; fp32 ones under fp32 and fp16's autocast), as do zero1's broadcasts.
    stored = dtype_bytes if precision in BF16_PARAMS else MASTER_BYTES
    grads = (MASTER_BYTES if fsdp_wraps(strategy, d) else stored) * psi
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
    # Each layer runs once per pipeline microbatch (and micro-batch), a collective per run: the
    # calls below are per `chunk`, each moving a chunk's share of the micro-batch's activation.
    chunks = grad_accum * (microbatches if d.pp > 1 else 1)
    chunk = activation * grad_accum / chunks
    per_layer = layers * chunks
    # TP, inside its group: Megatron's collectives of one b x s x h activation each, counted on the
    # trainer's step (a fake process group, every checkpointing mode, with and without SP:
    # tests/unit/test_loss_parallel.py). Per layer: forward two all-reduces (the row-split
    # outputs), backward two (the input gradients of q, k and v together and of the MLP's first
    # linear). With sequence parallelism: forward two all-gathers and two reduce-scatters; backward
    # two reduce-scatters and four all-gathers (two the reduce-scatters' gradients, two re-gather a
    # column split's input: its saved shard without checkpointing, in the recomputed forward with
    # it). Full checkpointing recomputes the row split inside the block (attention's output) and
    # so its reduction, not the block's last (nothing the block saves is computed from that one);
    # selective keeps both reductions (its policy saves them: training/parallel/ac.py).
    rereduced = 1 if recompute == "full" else 0
    # A MoE layer is in no TP plan: its feed-forward makes none of these (its attention's do).
    moe = math.ceil(shape.moe_layers / d.pp) * chunks
    # A split backward's weight pass runs the backward of some layer runs again (`rerun`: the share,
    # on the rank holding the head and on the busiest other; planner/pipeline.py rerun_shares), and
    # with it what that backward gathers (SP: each column split's saved shard and each row split's
    # output gradient, 4 a layer) and, under full checkpointing, the forward it recomputes (SP 16
    # gathers and 8 reduce-scatters a layer, TP alone 8 all-reduces). Counted at pp=2 x tp=2
    # (zero_bubble, zbv, dualpipev: tests/dist/test_pp_tp_collectives.py).
    def layer_calls(again: float) -> dict[str, int]:
        again = math.ceil(per_layer * again)
        if sequence_parallel:
            # Outside the blocks, each module a rank runs gathers twice a micro-batch: the whole
            # model (pp=1) the final norm's output for the head and the embedding's gradient (its
            # output is cut by position); a pipeline stage its output, sent whole, and its input's
            # gradient (the input is cut by position), whichever stage it is. Under SP a MoE layer
            # takes the gathered norm output whole and cuts its output by position
            # (training/parallel/sp.py), so its feed-forward reduce-scatters nothing, in forward or
            # backward, nor re-gathers a saved shard.
            ends = 2 * (virtual if d.pp > 1 else 1)
            return {"all_gather": per_layer * 6 + ends * chunks + again * (16 if recompute == "full" else 4)
                    - moe * (1 if recompute == "none" else 0),
                    "reduce_scatter": per_layer * (4 + rereduced) + again * (8 if recompute == "full" else 0) - moe * 2}
        return {"all_reduce": per_layer * (4 + rereduced) - moe * 2 + again * (8 if recompute == "full" else 0)}

    # Loss parallelism (training/parallel/tp.py), per micro-batch on the last stage, measured:
    # forward all-reduces three fp32 values per position (the max, the sum of exponentials, the
    # target's logit), backward the head's input gradient (a column split's partial sums).
    head = 4 * chunks if shape.head_params and d.tp > 1 else 0
    # The step waits for the busier of the rank holding the head and the busiest other rank.
    held = layer_calls(rerun[0])
    other = layer_calls(rerun[1]) if d.pp > 1 else held
    with_head = sum(other.values()) <= sum(held.values()) + head
    tp_s = sum(call(kind, chunk * n, tp_group, n) for kind, n in (held if with_head else other).items())
    if with_head and head:
        positions = micro_batch * shape.seq_len / d.cp * grad_accum
        tp_s += (call("all_reduce", 3 * 4 * positions, tp_group, 3 * chunks)
                 + call("all_reduce", activation * grad_accum, tp_group, chunks))
    if precision == "fp8" and d.tp > 1:
        # Float8 linears under TP (training/parallel/float8.py): each cast's per-tensor scale is the
        # amax of the whole tensor, one scalar all-reduce over the TP group for each split operand:
        # a column split's weight in forward, its weight and output gradient in backward; a row
        # split's input and weight in forward and again in backward. Checkpointing (either mode)
        # casts the forward's operands again (torchao's tensorwise scaling under TP, the same calls).
        share = layers / max(shape.layers, 1)
        column, row = shape.tp_column_linears * share, shape.tp_row_linears * share
        scales = math.ceil((column + 2 * row) * (2 if recompute != "none" else 1) + 2 * column + 2 * row) * chunks
        tp_s += call("all_reduce", 4 * scales, tp_group, scales)
    whole = shape.tp_whole_params + (shape.sequence_norm_params if sequence_parallel else 0)
    if whole and d.tp > 1:
        # Parameters kept whole beside split activations get partial gradients, summed over the TP
        # ranks: without FSDP in one all-reduce a step, in the parameters' dtype
        # (training/parallel/tp.py sum_partial_grads); under FSDP one all-reduce per tensor before
        # its reduce-scatter, in the compute dtype FSDP unshards them in (measured, fake process
        # group: tests/unit/test_parallel_options.py).
        share = layers / max(shape.layers, 1)
        if fsdp_wraps(strategy, d):
            tensors = shape.tp_whole_tensors + (shape.sequence_norm_tensors if sequence_parallel else 0)
            tp_s += call("all_reduce", dtype_bytes * whole * share, tp_group, math.ceil(tensors * share))
        else:
            tp_s += call("all_reduce", stored * whole * share, tp_group)
    # CP: each block all-gathers this rank's K and V over the cp group in forward (again in backward
    # under full recomputation) and reduce-scatters their gradients in backward: 2 x s x b x kv / tp
    # gathered per layer and micro-batch (training/parallel/cp.py; the gathered K/V are the
    # heads SDPA sees: Shape.kv_width, all of them where a model expands grouped K/V heads first).
    cp_s = 0.0
    if d.cp > 1:
        kv = 2 * activation_tensor_bytes(micro_batch, shape.seq_len, shape.kv, dtype_bytes) / d.tp * grad_accum / chunks
        # Collectives are recomputed under selective checkpointing too (its policy keeps no all-gather).
        gathers = per_layer * (2 if recompute in ("full", "selective") else 1)
        cp_group = group_of(d, "cp", devices_per_node)
        cp_s = (call("all_gather", kv * gathers, cp_group, gathers)
                + call("reduce_scatter", kv * per_layer, cp_group, per_layer))
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


def routed_tokens(shape: Shape, micro_batch: int, d: ParallelDims) -> float:
    """The tokens one rank routes in a micro-batch under expert parallelism: its samples' tokens,
    its part of each sequence under context parallelism, its TP rank's part of those under tensor
    parallelism (training/parallel/ep.py)."""
    return micro_batch * shape.seq_len / d.cp / d.tp


def expert_traffic(shape: Shape, strategy: str, d: ParallelDims, micro_batch: int, grad_accum: int,
                   microbatches: int, precision: str, expert_psi: float, moe_layers: int,
                   call: Callable[..., float], link: Callable[[str, Group], Link], devices_per_node: int | None,
                   recompute: str, imbalance: float = 1.0) -> tuple[float, float, float]:
    """(the experts' data-parallel seconds, the part of it after backward, the dispatch's seconds)
    of one step on one rank under expert parallelism (training/parallel/ep.py), in the calls it
    makes. Every MoE layer, per micro-batch (and pipeline microbatch): forward one all-to-all of
    the expert counts and two of the tokens (dispatch, combine), backward two of their gradients;
    recomputation (full or selective: its policy keeps no collective) repeats the forward's three.
    Under TP each TP rank routes its part of the tokens, and the parts are all-gathered (forward
    one, backward two). The experts' replicas (dp·cp·tp / ep ranks) reduce-scatter and gather them under FSDP, once per MoE
    layer (their own unit), or all-reduce their gradients after backward under DDP (one call per
    weight, two a layer: nothing left to hide behind), and under zero1 broadcast each replica's
    updated share after the step.

    Routing decides how much each all-to-all moves: a rank sends its own tokens' slots one way and
    the slots its experts were sent the other (dispatch and its gradient, combine and its), so in
    every one of them the busiest expert rank moves `imbalance` times a balanced rank's volume,
    and the call ends with it."""
    ep_group, edp_group = group_of(d, "ep", devices_per_node), group_of(d, "edp", devices_per_node)
    chunks = grad_accum * (microbatches if d.pp > 1 else 1)
    forwards = 1 + (1 if recompute in ("full", "selective") else 0)
    tokens = (all_to_all_bytes(shape, routed_tokens(shape, micro_batch, d), precision) * grad_accum * moe_layers
              * imbalance)
    calls = moe_layers * chunks
    a2a_s = (call("all_to_all", tokens * (2 * forwards + 2), ep_group, calls * (2 * forwards + 2))
             + call("all_to_all", 8 * max(shape.experts) * calls * forwards, ep_group, calls * forwards))
    if d.tp > 1:
        # The TP ranks' parts of each MoE layer's tokens gathered whole again: forward the experts'
        # output (again under recomputation), backward the tokens' gradients and their routing
        # weights' (training/parallel/ep.py; the gathers are padded to the largest part).
        whole = micro_batch * shape.seq_len / d.cp * COMPUTE_BYTES[precision] * grad_accum * moe_layers
        a2a_s += call("all_gather", whole * (shape.hidden * forwards + shape.hidden + shape.top_k),
                      group_of(d, "tp", devices_per_node), calls * (forwards + 2))
    if expert_replicas(d) == 1:
        return 0.0, 0.0, a2a_s
    dtype_bytes = COMPUTE_BYTES[precision]
    if fsdp_wraps(strategy, d):
        gathers = 2 if strategies.get(strategy).reshard_after_forward else 1
        dp_s = (call("all_gather", dtype_bytes * expert_psi * grad_accum * gathers, edp_group,
                     moe_layers * grad_accum * gathers)
                + call("reduce_scatter", MASTER_BYTES * expert_psi, edp_group, moe_layers))
        return dp_s, 0.0, a2a_s
    stored = dtype_bytes if precision in BF16_PARAMS else MASTER_BYTES
    reduce_s = call("all_reduce", stored * expert_psi, edp_group, 2 * moe_layers)
    if strategies.get(strategy).shards_optimizer_only:  # each replica broadcasts the experts' share it updated
        reduce_s += call("broadcast", stored * expert_psi, edp_group, edp_group.ranks)
    return reduce_s, reduce_s, a2a_s
