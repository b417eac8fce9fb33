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
spread evenly over the experts, so FLOPs count the active parameters, top-k experts a token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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

    def __init__(self, n_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, d_model))

    def forward(self, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        slots = group_by_expert(top_k_index, local_part(self.w1).shape[0], tokens)
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


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (split experts, their gradients); a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass(frozen=True)
class Slots:
    """A layer's routed slots (token-major: token i's k slots are i*k ... i*k+k-1) grouped by expert."""

    order: torch.Tensor
    """The kept slots, by expert, in token order within each expert's group (a stable sort: routing
    is deterministic given the weights)."""
    counts: list[int]
    """Kept slots per expert, in expert order."""
    top_k: int

    @property
    def token(self) -> torch.Tensor:
        """The token each grouped slot carries."""
        return torch.div(self.order, self.top_k, rounding_mode="floor")

    def combine(self, routed: torch.Tensor, top_k_weights: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Each token's weighted sum of what its kept slots came back with (`routed`, by expert)."""
        weight = top_k_weights.reshape(-1)[self.order].unsqueeze(-1).to(routed.dtype)
        return torch.zeros_like(tokens).index_add(0, self.token, (routed * weight).to(tokens.dtype))


def group_by_expert(top_k_index: torch.Tensor, n_experts: int, tokens: torch.Tensor) -> Slots:
    """The slots of `top_k_index` (tokens x k; the index `n_experts` marks a dropped slot) grouped by
    expert. On the meta device (no router values) the slots are spread evenly over the experts."""
    flat = top_k_index.reshape(-1)
    k = top_k_index.shape[-1]
    if tokens.is_meta:
        share, rest = divmod(flat.numel(), n_experts)
        return Slots(torch.arange(flat.numel(), device=flat.device), [share + (i < rest) for i in range(n_experts)], k)
    kept = torch.nonzero(flat < n_experts).squeeze(-1)
    order = kept[flat[kept].argsort(stable=True)]
    return Slots(order, torch.bincount(flat[kept], minlength=n_experts).tolist(), k)


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
        self.experts = GroupedExperts(n_experts, d_model, hidden)

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
        capacity = math.ceil(self.capacity_factor * chosen.numel() / self.n_experts)
        flat = chosen.reshape(-1)
        one_hot = F.one_hot(flat, self.n_experts)
        place = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1)  # 1-based place in its expert's queue
        return torch.where(place <= capacity, flat, self.n_experts).reshape(chosen.shape)


def load_imbalance(tokens_per_expert: torch.Tensor | list[int]) -> float:
    """The most loaded expert's slots over the mean (1.0: balanced): what bounds an expert-parallel
    step, which waits for its busiest expert."""
    load = torch.as_tensor(tokens_per_expert, dtype=torch.float64)
    return float(load.max() / load.mean()) if load.sum() > 0 else 1.0


WRAPPERS = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
"""Prefixes DDP, torch.compile and checkpointing add to module names: stripped, so every rank and
layout names a layer as the model does."""


def layer_name(name: str) -> str:
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


class LoadCounter:
    """The routed slots per expert an experts module (one named by the model's expert plan:
    training/contract/spec.py) was sent since the last `take()`, on the device: a forward pre-hook
    reads its `top_k_index`, so every MoE family is counted alike. Each forward counts once
    (micro-batches, pipeline microbatches add up); checkpointing's recomputation in backward does
    not count again; dropped slots (the index n_experts) do not count."""

    def __init__(self, module: nn.Module, n_experts: int):
        self.n_experts = n_experts
        self.load: torch.Tensor | None = None
        self.device = next(module.parameters()).device
        self.handle = module.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        if index.is_meta or torch._C._current_graph_task_id() != -1:  # meta, or recomputed inside backward
            return
        index = index.reshape(-1)
        load = torch.bincount(index[index < self.n_experts], minlength=self.n_experts)
        self.load = load if self.load is None else self.load + load

    def take(self) -> torch.Tensor:
        """The slots per expert since the last call (zeros if no forward ran), and reset."""
        load = self.load if self.load is not None else torch.zeros(self.n_experts, dtype=torch.long, device=self.device)
        self.load = None
        return load


class ExpertLoads:
    """Each experts module's routed slots per expert, step by step, on this rank: collected after
    every optimizer step (a step post-hook, so the loop is untouched) and kept on the device until
    `counts()` reads them once, at the end of the run. `experts`: name -> (module, its experts)."""

    def __init__(self, experts: dict[str, tuple[nn.Module, int]], optimizer: torch.optim.Optimizer, skip: int = 0):
        self.layers = {layer_name(name): LoadCounter(module, n) for name, (module, n) in experts.items()}
        self.steps: list[torch.Tensor] = []
        self.skip = skip
        """Steps whose loads are dropped: a pipeline's first step also runs torch's shape-inference
        forward (on placeholder activations after the first stage), whose routing is not the model's."""
        if self.layers:
            optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, *_: object) -> None:
        loads = torch.stack([c.take() for c in self.layers.values()])
        if self.skip:
            self.skip -= 1
            return
        self.steps.append(loads)

    def counts(self) -> dict[str, list[list[int]]]:
        """Layer name -> per step, the slots each expert took on this rank (a host sync)."""
        if not self.steps:
            return {}
        per_step = torch.stack(self.steps).cpu()  # steps x layers x experts
        return {name: per_step[:, i].tolist() for i, name in enumerate(self.layers)}


def merge_counts(per_rank: list[dict[str, list[list[int]]]]) -> dict[str, list[list[int]]]:
    """The ranks' counts summed by layer (ranks that saw different tokens: pass one rank per group
    of ranks that routed the same tokens, e.g. tensor-parallel rank 0)."""
    merged: dict[str, list[list[int]]] = {}
    for counts in per_rank:
        for name, steps in counts.items():
            if name not in merged:
                merged[name] = [list(s) for s in steps]
            else:
                merged[name] = [[a + b for a, b in zip(x, y, strict=True)] for x, y in zip(merged[name], steps, strict=True)]
    return merged


def step_imbalance(counts: dict[str, list[list[int]]], ranks: int | None = None) -> list[float]:
    """Per step, the layers' mean of busiest-over-mean: each layer's experts wait for its busiest
    one; with `ranks`, each layer's experts split into that many contiguous groups (expert
    parallelism's ranks, training/parallel/ep.py), each group's slots summed: the ranks wait for the
    busiest."""
    if not counts:
        return []
    layers = list(counts.values())

    def grouped(load: list[int]) -> list[int]:
        size = len(load) // ranks if ranks else 1
        return [sum(load[i:i + size]) for i in range(0, len(load), size)]

    return [sum(load_imbalance(grouped(layer[step])) for layer in layers) / len(layers)
            for step in range(len(layers[0]))]


def rank_imbalance(counts: dict[str, list[list[int]]]) -> dict[str, float]:
    """For each expert-parallel degree > 1 that divides every layer's experts, the steps' mean of
    step_imbalance over that many ranks (keyed by the degree as text, as JSON keeps it): what the
    cost model stretches an expert-parallel step by. Routing does not depend on the layout, so a run
    of any layout measures every degree."""
    if not counts:
        return {}
    experts = {len(steps[0]) for steps in counts.values() if steps}
    degrees = [ep for ep in range(2, min(experts, default=0) + 1) if all(n % ep == 0 for n in experts)]
    out = {}
    for ep in degrees:
        per_step = step_imbalance(counts, ep)
        if per_step:
            out[str(ep)] = sum(per_step) / len(per_step)
    return out
