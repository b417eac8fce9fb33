"""Context parallelism: each sequence split over the `cp` ranks, attention over the whole of it.

The inputs and targets of a micro-batch are split along the sequence before the model runs; every
other layer (embeddings, norms, MLPs, the head, the loss) is per token and runs on this rank's
tokens alone. Attention is the one layer that mixes tokens: while the model runs,
`F.scaled_dot_product_attention` is dispatched to `ContextParallel.attention`, which all-gathers
the keys and values over the CP group (Llama 3's choice: K/V are small next to Q under GQA, and
one all-gather per layer is simpler than a ring), puts them back in sequence order and calls the
real SDPA once per chunk of this rank's queries (below), each against the keys up to its own end.

**Load balancing.** Under a causal mask the last tokens attend to the most keys, so contiguous
chunks would leave the last rank with most of the work. As in torchtitan and Megatron, the
sequence is cut into 2·cp chunks and rank i takes chunks i and 2·cp−1−i: every rank gets one
early and one late chunk, the same number of query-key pairs under the mask. The sequence length
must be a multiple of 2·cp.

**Causal attention without a mask.** A chunk's queries are the last of the keys up to its end,
so their causal mask is the lower-right-aligned triangle over that prefix, which CUDA's flash and
memory-efficient kernels apply themselves (`torch.nn.attention.bias.causal_lower_right`): no mask
tensor, and the kernel skips the masked blocks, so a rank runs the causal half of its
query-key pairs, as the cost model counts them. One call for the rank's two chunks with one
(s/cp) x s mask, as before, ran the memory-efficient kernel over every pair (twice the work) and
kept a mask of 16 GiB at 256K tokens over cp 8. A CPU's kernels take no such alignment (torch
would build the mask on every call): there each chunk's mask is built once and shared by every
layer (c x (i+1)c for chunk i of c tokens), a square one (rank 0's first chunk) needs none.
`ContextParallel.kernel_masks` says which; a test runs both on the CPU and holds them equal. The
price of two calls: each keeps its own output for backward, and the layer goes on with their
join, a copy (one attention output per layer more than one call kept, counted by the plan).

**Positions.** Rank i's tokens are not positions 0..s/cp−1: the model is called with
`position_ids=` (Hugging Face's convention; the GPT takes it too) holding their true positions, so
position embeddings and rotary see where each token really is.

**Loss.** Each rank's loss is the mean over its tokens, as many on every rank; the mean of the CP
ranks' losses is the mean over the sequence, and their gradients are averaged by the wrapper
that reduces over dp_shard x cp (training/parallel/dims.py), so training is one process's.

**Gradients of K/V.** The all-gather's backward is a reduce-scatter (sum): each rank's K/V
receive the gradients every rank's queries sent them.

Why a swap of the function rather than torch's `context_parallel`: torch's (2.13) dispatches
SDPA through DTensor sharding rules that exist for the CUDA kernels only, so it does not run on
the CPU; this path runs on gloo and nccl alike. A swap of `torch.nn.functional`'s attribute, not a
TorchFunctionMode, because a mode would intercept every torch call of the step (a cost on every
op) to catch one; a model that binds SDPA under another name is caught instead: a step whose
model never called the swapped function is refused (`ContractError`). The swap stays in place
through backward, where activation checkpointing recomputes attention.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from common.errors import ContractError
from training.contract.calls import Batch

SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
"""torch.nn.functional.scaled_dot_product_attention's parameters, in order."""


@dataclass(frozen=True)
class SequenceSplit:
    """Which tokens of a sequence each of `size` CP ranks holds (load-balanced for causal masks)."""

    rank: int
    size: int

    def check(self, seq_len: int) -> None:
        if seq_len % (2 * self.size):
            raise ValueError(f"strategy.cp={self.size}: the sequence length {seq_len} must be a multiple of "
                             f"2 x cp = {2 * self.size} (each rank takes chunks i and 2·cp−1−i of 2·cp)")

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        """The two chunk indices (of 2·cp) that `rank` (default: this one) holds, early one first."""
        r = self.rank if rank is None else rank
        return r, 2 * self.size - 1 - r

    def positions(self, seq_len: int, device: torch.device | str = "cpu", rank: int | None = None) -> torch.Tensor:
        """The true positions of `rank`'s tokens, in the order it holds them."""
        self.check(seq_len)
        c = seq_len // (2 * self.size)
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunks(rank)])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `x` along `dim` (the sequence)."""
        return x.index_select(dim, self.positions(x.shape[dim], x.device))

    def unshard(self, gathered: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence in order from every rank's tokens, stacked on a leading rank dim
        (as an all-gather leaves them): one copy, the chunks taken as views."""
        c = gathered.shape[dim + 1] // 2  # each rank holds two chunks along `dim` of its slice
        pieces: list[torch.Tensor | None] = [None] * (2 * self.size)
        for r in range(self.size):
            early, late = self.chunks(r)
            pieces[early] = gathered[r].narrow(dim, 0, c)
            pieces[late] = gathered[r].narrow(dim, c, c)
        return torch.cat(pieces, dim=dim)


@dataclass
class CommStats:
    """What the K/V exchange moved on this rank (for the cost model)."""

    layers: int = 0
    """Attention calls: layers x micro-batches, and again for each one activation checkpointing
    recomputes (its all-gather runs again in backward)."""
    gathered_bytes: int = 0
    """Bytes this rank received from its peers in forward all-gathers: (cp−1)/cp of the
    gathered K and V."""
    scattered_bytes: int = 0
    """Bytes this rank sent to its peers in backward reduce-scatters of the K/V gradients."""
    per_layer: list[int] = field(default_factory=list)
    """The bytes received by each all-gather, in order: one per attention call (K and V stacked),
    two where K and V differ in shape."""


_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""torch 2.13 renamed reduce_scatter_tensor (the old name warns); the same collective."""


class _GatherSequence(torch.autograd.Function):
    """All-gather along a new leading rank dimension; backward: reduce-scatter (sum) of the
    gradients, each rank's share of what every rank's queries sent its keys and values."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int, stats: CommStats) -> torch.Tensor:
        ctx.group, ctx.size, ctx.stats = group, size, stats
        x = x.contiguous()
        # Concatenated along dim 0 (the shape every backend takes), then seen with a rank dim.
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        received = x.numel() * x.element_size() * (size - 1)
        stats.gathered_bytes += received
        stats.per_layer.append(received)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty(grad.shape[1:])
        grad = grad.contiguous().view(grad.shape[0] * grad.shape[1], *grad.shape[2:])
        _REDUCE_SCATTER(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        ctx.stats.scattered_bytes += out.numel() * out.element_size() * (ctx.size - 1)
        return out, None, None, None


class ContextParallel:
    """This rank's part of context parallelism: the batch split, the positions the model is
    called with, and the attention that sees the whole sequence (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, kernel_masks: bool | None = None):
        self.group = group
        self.split = SequenceSplit(rank, size)
        self.stats = CommStats()
        self.positions: torch.Tensor | None = None
        """This micro-batch's true positions, set while a step runs."""
        self.kernel_masks = kernel_masks
        """Whether a chunk's causal mask goes to SDPA as `causal_lower_right` (the kernel applies it)
        or as a tensor built once per shape; None: the former on any device but a CPU."""
        self._masks: dict[tuple[int, int, torch.device, torch.dtype], torch.Tensor] = {}
        self._calls = 0

    # ---- the batch ---------------------------------------------------------------------------

    def shard_batch(self, batch: Batch) -> Batch:
        """This rank's tokens of an (input, target) batch; the positions are kept for the model."""
        if isinstance(batch, dict):
            raise ContractError("strategy.cp splits (input, target) token batches; this data gives dicts "
                                "(their labels are shifted inside the model, across the split)")
        inputs, targets = batch
        if inputs.dim() < 2 or inputs.is_floating_point():
            raise ContractError(f"strategy.cp={self.split.size} splits token sequences; the inputs are "
                                f"{inputs.dtype} of shape {tuple(inputs.shape)} (no sequence dimension)")
        self.positions = self.split.positions(inputs.shape[1], inputs.device)
        sharded_targets = targets.index_select(1, self.positions) if targets.dim() >= 2 else targets
        return inputs.index_select(1, self.positions), sharded_targets

    def position_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """A forward pre-hook (with kwargs) on the model: `position_ids=` this rank's positions."""
        if self.positions is None:
            return None
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        device = first.device if first is not None else self.positions.device
        return args, {**kwargs, "position_ids": self.positions.to(device).unsqueeze(0)}

    def install(self, model: nn.Module) -> None:
        """Call `model` with this rank's positions whenever a context-parallel step runs it."""
        model.register_forward_pre_hook(self.position_hook, with_kwargs=True)

    # ---- attention ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def dispatch(self) -> Iterator[None]:
        """`F.scaled_dot_product_attention` is this rank's context-parallel attention inside."""
        original = F.scaled_dot_product_attention
        if isinstance(original, _Bound):  # already swapped (a nested step)
            yield
            return
        F.scaled_dot_product_attention = _Bound(self, original)  # type: ignore[assignment]
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original

    def attention(self, sdpa: Callable[..., torch.Tensor], *args: object, **kwargs: object) -> torch.Tensor:
        """SDPA over the whole sequence for this rank's queries: K/V all-gathered and put back in
        sequence order; under a causal mask, one call per chunk of queries against the keys up to
        the chunk's end (see the module docstring)."""
        a = dict(zip(SDPA_PARAMS, args, strict=False)) | kwargs
        query, key, value = a["query"], a["key"], a["value"]
        if query.device.type == "meta":  # a pipeline stage's shape inference: no peers to gather from
            return sdpa(*args, **kwargs)
        self._calls += 1
        self.stats.layers += 1
        mask = a.get("attn_mask")
        if mask is not None and mask.dtype != torch.bool:
            raise ContractError("strategy.cp: the model passes SDPA an additive (float) attn_mask, a bias the "
                                "context-parallel attention cannot re-lay over the split sequence; use a causal "
                                "model without attention biases, or cp=1")
        # A mask built by the model is its causal mask over its local tokens (tuple batches carry no
        # padding), wrong for a split sequence: the causal mask of the true positions replaces it.
        causal = bool(a.get("is_causal")) or mask is not None
        dim = 2  # (batch, heads, sequence, head_dim)
        if key.shape == value.shape:
            kv = self._gather(torch.stack([key, value]), dim + 1)
            key, value = kv[0], kv[1]
        else:
            key, value = self._gather(key, dim), self._gather(value, dim)
        extra = {"dropout_p": a.get("dropout_p", 0.0), "scale": a.get("scale"),
                 **({"enable_gqa": True} if a.get("enable_gqa") else {})}
        if not causal:
            return sdpa(query, key, value, **extra)
        c = query.shape[dim] // 2
        outputs = []
        # torch's own SDPA in the module while the chunks run: the causal bias dispatches only a
        # call of that attribute to the kernels, and calls it itself where it builds the mask.
        swapped, F.scaled_dot_product_attention = F.scaled_dot_product_attention, sdpa
        try:
            for half, chunk in enumerate(self.split.chunks()):
                end = (chunk + 1) * c
                outputs.append(sdpa(query.narrow(dim, half * c, c), key.narrow(dim, 0, end),
                                    value.narrow(dim, 0, end), **self._causal(c, end, query), **extra))
        finally:
            F.scaled_dot_product_attention = swapped
        # Joined in the layout the fused kernels return ((batch, sequence, heads, head_dim) in
        # memory), so that a model's transpose back to tokens stays a view, as after one call.
        return torch.cat([o.transpose(1, 2) for o in outputs], dim=1).transpose(1, 2)

    def _gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence of `x` (this rank's tokens along `dim`), in order."""
        gathered = _GatherSequence.apply(x, self.group, self.split.size, self.stats)
        return self.split.unshard(gathered, dim)

    def _causal(self, queries: int, keys: int, like: torch.Tensor) -> dict[str, object]:
        """SDPA's arguments for `queries` queries that are the last of `keys` keys under a causal
        mask: `is_causal` where they are all of them; else the lower-right triangle, as a bias the
        kernel applies or as an additive mask (0 where the key is at or before the query, -inf
        after) in the query's dtype, made once per shape and shared by every layer: SDPA would
        otherwise convert a boolean mask into a new one per call, and keep each for backward."""
        if queries == keys:
            return {"is_causal": True}
        in_kernel = like.device.type != "cpu" if self.kernel_masks is None else self.kernel_masks
        if in_kernel:
            return {"attn_mask": causal_lower_right(queries, keys)}
        key = (queries, keys, like.device, like.dtype)
        if key not in self._masks:
            rows = torch.arange(keys - queries, keys, device=like.device)
            allowed = torch.arange(keys, device=like.device)[None, :] <= rows[:, None]
            mask = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device)
            self._masks[key] = mask.masked_fill_(~allowed, float("-inf"))
        return {"attn_mask": self._masks[key]}

    # ---- the step ----------------------------------------------------------------------------

    def wrap(self, step: Callable[[Batch, float], torch.Tensor]) -> Callable[[Batch, float], torch.Tensor]:
        """A forward_backward over this rank's part of each sequence, attention dispatched to the
        context-parallel one through forward and backward (recomputation included)."""

        def cp_step(batch: Batch, scale: float) -> torch.Tensor:
            batch = self.shard_batch(batch)
            calls = self._calls
            try:
                with self.dispatch():
                    loss = step(batch, scale)
            finally:
                self.positions = None
            if self._calls == calls:
                raise ContractError(f"strategy.cp={self.split.size}: the model never called "
                                    "torch.nn.functional.scaled_dot_product_attention, the only attention context "
                                    "parallelism splits; use cp=1 for it")
            return loss

        return cp_step


class _Bound:
    """The swapped-in SDPA: `ContextParallel.attention` with the original function bound."""

    def __init__(self, owner: ContextParallel, original: Callable[..., torch.Tensor]):
        self.owner, self.original = owner, original

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.owner.attention(self.original, *args, **kwargs)


def takes_position_ids(model: nn.Module) -> bool:
    """Whether the model's forward accepts `position_ids=` (named, or through **kwargs)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "position_ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@dataclass
class AttentionCalls:
    calls: int = 0
    kv_width: int = 0
    """Key width per token as SDPA sees it (heads x head dim): what context parallelism gathers,
    less than the model's width where grouped K/V heads reach SDPA unexpanded."""


@contextlib.contextmanager
def count_attention_calls() -> Iterator[AttentionCalls]:
    """Count the calls of `torch.nn.functional.scaled_dot_product_attention` inside: the same
    attribute context parallelism swaps, so a model counted here is one it can split."""
    original = F.scaled_dot_product_attention
    counted = AttentionCalls()

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        counted.calls += 1
        key = (dict(zip(SDPA_PARAMS, args, strict=False)) | kwargs)["key"]
        counted.kv_width = max(counted.kv_width, key.shape[-3] * key.shape[-1])  # (batch, heads, seq, head dim)
        return original(*args, **kwargs)

    F.scaled_dot_product_attention = counting  # type: ignore[assignment]
    try:
        yield counted
    finally:
        F.scaled_dot_product_attention = original
