"""A mixture-of-experts feed-forward layer (top-k routing, a load-balancing loss, an optional
capacity factor): what the built-in GPT uses in place of its feed-forward when `n_experts` > 0.

Routing, as Mixtral and Qwen3-MoE route: a linear router scores every expert per token, the
top-k experts by softmax probability take the token, weighted by those probabilities
renormalised over the k. The tokens are then grouped by expert (a stable sort: ties keep token
order, so routing is deterministic given the weights) and each expert runs on its group,
Megatron-Core's and torchtitan's grouped layout: the experts' weights are stacked in two
parameters, `w1` (E x d x h) and `w2` (E x h x d), the shape expert parallelism shards along E.

Load balancing: Switch Transformer's auxiliary loss, E x sum_e f_e x P_e (f_e the share of the
routed slots expert e takes, P_e its mean router probability), 1 when balanced. It joins the
gradient without changing the logged loss (DeepSeek's `AddAuxiliaryLoss`): the layer's output
carries it, scaled by `aux_loss_coef`, into backward.

Capacity factor: null keeps every token (no dropping). A number c caps each expert at
ceil(c x tokens x k / E) slots; the slots over it, latest tokens first, are dropped (the token
keeps its other experts and the residual), as GShard and Switch do.

On the meta device (the plan's counting) there are no router values: the slots are taken as
spread evenly over the experts, so FLOPs count the active parameters, top-k experts a token, and
with a capacity factor below 1 each expert keeps its capacity of them (balanced routing's drops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from training.contract.experts import capacity, group_by_expert, local_part


class AddAuxiliaryLoss(torch.autograd.Function):
    """Returns `x` unchanged; backward also sends a gradient of 1 into `aux` (already scaled), so the
    auxiliary loss is minimised with the model's loss without entering the loss the trainer logs."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype, ctx.aux_device = aux.dtype, aux.device
        return x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=ctx.aux_device)


class GroupedExperts(nn.Module):
    """E feed-forward experts (d -> h -> d, GELU) as two stacked weights, called as Hugging Face's
    MoE experts are: `(tokens, top_k_index, top_k_weights)`, each token's k chosen experts (the
    index E marks a slot dropped over capacity, as transformers marks masked ones) and their
    weights; out comes each token's weighted sum. Grouping the slots by expert is theirs to do, so
    expert parallelism (training/parallel/ep.py) can send each group to its expert's rank instead."""

    def __init__(self, n_experts: int, d_model: int, hidden: int, capacity_factor: float | None = None):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.capacity_factor = capacity_factor
        """The router's (MoE's): the contract's way for an experts module to say it is sent at most
        that many slots an expert (group_by_expert on meta, the plan's imbalance bound)."""

    def forward(self, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        slots = group_by_expert(top_k_index, local_part(self.w1).shape[0], tokens, self.capacity_factor)
        routed = self.forward_grouped(tokens[slots.token], slots.counts)
        return slots.combine(routed, top_k_weights, tokens)

    def forward_grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`x`: tokens grouped by expert, `counts[e]` of them for expert e, in order; out, each
        token's expert output, unweighted (what expert parallelism calls on the received tokens)."""
        w1, w2 = local_part(self.w1), local_part(self.w2)  # expert parallelism's shard, as a plain tensor
        # Empty groups too: the output then always depends on `x` and on every expert, so a rank
        # whose experts got no token still runs the all-to-all's backward its peers wait in.
        # One GELU over every group (elementwise, so the same numbers): one call, not E, which on the
        # meta device - where the plan counts a 256-expert layer - is most of the forward's time.
        hidden = F.gelu(torch.cat([chunk @ w1[e] for e, chunk in enumerate(x.split(counts))]))
        return torch.cat([chunk @ w2[e] for e, chunk in enumerate(hidden.split(counts))])


class MoE(nn.Module):
    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int, capacity_factor: float | None = None,
                 aux_loss_coef: float = 0.01):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0, or null (no token dropping)")
        self.top_k, self.capacity_factor, self.aux_loss_coef = top_k, capacity_factor, aux_loss_coef
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, d_model, hidden, capacity_factor)

    @property
    def n_experts(self) -> int:
        return self.router.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        y = self.experts(tokens, self._drop_over_capacity(chosen), weights).reshape(shape)
        if self.training and self.aux_loss_coef and not x.is_meta:
            y = AddAuxiliaryLoss.apply(y, self.aux_loss_coef * self.balance_loss(probs, chosen))
        return y

    def balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Switch Transformer's E x sum_e f_e x P_e over this forward's tokens (1 when balanced)."""
        e = self.n_experts
        share = torch.bincount(chosen.reshape(-1), minlength=e).to(probs.dtype) / chosen.numel()
        return e * (share * probs.mean(dim=0)).sum()

    def _drop_over_capacity(self, chosen: torch.Tensor) -> torch.Tensor:
        """`chosen` with each slot over its expert's capacity (its latest tokens) marked dropped
        (the index n_experts)."""
        if self.capacity_factor is None or chosen.is_meta:
            return chosen
        kept = capacity(self.capacity_factor, chosen.numel(), self.n_experts)
        flat = chosen.reshape(-1)
        one_hot = F.one_hot(flat, self.n_experts)
        place = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1)  # 1-based place in its expert's queue
        return torch.where(place <= kept, flat, self.n_experts).reshape(chosen.shape)


