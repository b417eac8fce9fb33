"""What the planner knows of a model: its shape (counted from the built module by training/planner/anatomy.py),
what one sample saves for backward, and the bytes a precision computes with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}
"""Bytes of a parameter or activation as the step computes with it. fp8 (Float8 linears) holds and
communicates bf16: torchao casts each linear's weight and input to fp8 inside the matmul, with
dynamic scales (FSDP's optional fp8 all-gather is not assumed)."""


BF16_PARAMS = ("bf16", "fp8")
"""Precisions whose parameters and gradients are bf16, beside the optimizer's fp32 masters."""


def kept_share(capacity_factor: float | None) -> float:
    """Of the slots routed, the share balanced routing keeps under `capacity_factor` (None: all)."""
    return 1.0 if capacity_factor is None else min(1.0, capacity_factor)


@dataclass(frozen=True)
class Shape:
    """What the cost model needs to know of a model, measured from the built module
    (training/planner/anatomy.py): nothing here is derived from one model family's shape."""

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
    tp_whole_params: int = 0
    """Parameters the tensor-parallel plan keeps whole inside a split region
    (`replicated_with_grad_allreduce`: Qwen3's per-head q/k norms), over all blocks."""
    sequence_norm_params: int = 0
    """Parameters of the norms sequence parallelism runs by position (the plan's `sequence_parallel`
    entries). With `tp_whole_params`: gradients that are partial sums over the TP ranks, summed in
    one all-reduce a step where no FSDP does (training/parallel/tp.py sum_partial_grads)."""
    tp_whole_tensors: int = 0
    """The parameter tensors of `tp_whole_params`: FSDP sums each one's partial gradient over the
    TP ranks in a call of its own before its reduce-scatter (FSDPParam._get_grad_inner_tensor
    redistributes it to Replicate)."""
    sequence_norm_tensors: int = 0
    """The parameter tensors of `sequence_norm_params`, the same way."""
    tp_column_linears: int = 0
    """The linears fp8 runs in float8 (training/parallel/float8.py float8_linears) that the TP plan
    splits by output columns, over all blocks: under fp8 each split operand's scale costs a scalar
    all-reduce over the TP ranks (training/planner/comm.py)."""
    tp_row_linears: int = 0
    """The same, split by input rows."""
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
    capacity_factor: float | None = None
    """The experts' capacity factor c (training/contract/experts.py capacity_factor_of): no expert
    keeps more than c times a balanced expert's slots, so no rank holds or computes more than c
    times a balanced rank's (Workload.imbalance_at); the meta count already keeps balanced
    routing's share when c < 1. None: nothing dropped, no bound."""
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
    a layer leaves whole: counted on the meta device (training/planner/anatomy.py) or measured from a real
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
    experts: float = 0.0
    """Of `tp_replicated`, what the experts modules save (the routed tokens, the experts' hidden
    activations): split over the TP ranks under expert parallelism, which splits their tokens
    (training/parallel/ep.py)."""
    moe: float = 0.0
    """Of `saved`, what the mixture-of-experts layers save (router, experts, combine; `experts` among
    it): whole on every TP rank under sequence parallelism too, which hands them whole tokens."""
    weight_outputs: float = 0.0
    """Not saved: the bytes of the outputs of the ops where a weight meets the activations (a
    linear's, a norm's), whose gradients a split-backward pipeline schedule keeps from a
    microbatch's input-gradient pass to its weight pass (training/activations.py WeightOutputs)."""
    tail_weight_outputs: float = 0.0
    """Of `weight_outputs`, those after the blocks but the head's logits (whose gradient is the
    loss's temporary, `loss_temp`): the final norm's, on the last stage."""
    block_backward: float = 0.0
    """Not saved, made by backward: per sample, what one block's backward holds while it runs (its
    activations' gradients; training/activations.py BackwardTemporaries), beside the rest of the
    step's activations. One block's, however many blocks."""
    block_backward_fixed: float = 0.0
    """Not per sample: what one block's backward holds whatever the batch (a weight-sized scratch,
    e.g. an expert's gradient made whole before it is added: the memory ruler divides a mixture of
    experts' by ep, a rank's experts being E/ep)."""

    def extended(self, two: Activations, layers: int) -> Activations:
        """These (at one layer) and `two` (the same model at two) at `layers` alike layers; one
        block's backward the larger of the two."""
        grown = Activations(*(extended(one, at_two, layers)
                              for one, at_two in zip(dataclasses.astuple(self), dataclasses.astuple(two), strict=True)))
        return dataclasses.replace(grown, block_backward=max(self.block_backward, two.block_backward),
                                   block_backward_fixed=max(self.block_backward_fixed, two.block_backward_fixed))


def extended(one: float, two: float, layers: int) -> float:
    """A count of a model of alike blocks at `layers` layers from its counts at one and two: what
    lies outside the blocks plus `layers` times one block's."""
    return one + (layers - 1) * (two - one)


@dataclass(frozen=True)
class Anatomy:
    """A model as the plan measured it (training/planner/anatomy.py): its shape, and per sample its FLOPs,
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
