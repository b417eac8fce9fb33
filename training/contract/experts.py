"""The experts any model declares (its expert plan: training/contract/spec.py), as the trainer
handles them whatever the family: the routed slots grouped by expert (what the built-in MoE layer
and expert parallelism's dispatch share), and the slots each expert was sent, counted step by step
(what train logs as the load imbalance and the plan reads back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


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


def group_by_expert(top_k_index: torch.Tensor, n_experts: int, tokens: torch.Tensor,
                    capacity_factor: float | None = None) -> Slots:
    """The slots of `top_k_index` (tokens x k; the index `n_experts` marks a dropped slot) grouped by
    expert. On the meta device (no router values) the slots are spread evenly over the experts, and
    an expert keeps at most its capacity of them (`capacity_factor`: the experts module's, None for
    none): balanced routing's drops, so the plan counts the slots the trainer would keep."""
    flat = top_k_index.reshape(-1)
    k = top_k_index.shape[-1]
    if tokens.is_meta:
        share, rest = divmod(flat.numel(), n_experts)
        counts = [share + (i < rest) for i in range(n_experts)]
        if capacity_factor is not None:
            counts = [min(n, capacity(capacity_factor, flat.numel(), n_experts)) for n in counts]
        return Slots(torch.arange(sum(counts), device=flat.device), counts, k)
    kept = torch.nonzero(flat < n_experts).squeeze(-1)
    order = kept[flat[kept].argsort(stable=True)]
    return Slots(order, torch.bincount(flat[kept], minlength=n_experts).tolist(), k)


def capacity_factor_of(experts: nn.Module) -> float | None:
    """The capacity factor an experts module declares (`capacity_factor`, as the built-in
    GroupedExperts does): it is sent at most that many times a balanced expert's slots. None (the
    Hugging Face families, which drop nothing): no bound."""
    factor = getattr(experts, "capacity_factor", None)
    return float(factor) if factor is not None else None


def capacity(capacity_factor: float, slots: int, n_experts: int) -> int:
    """The slots an expert keeps of `slots` routed over `n_experts` at `capacity_factor`
    (GShard's capacity: the factor times a balanced expert's share, rounded up)."""
    return math.ceil(capacity_factor * slots / n_experts)


def load_imbalance(tokens_per_expert: torch.Tensor | list[int], routed: float | None = None) -> float:
    """The most loaded expert's slots over the mean (1.0: balanced): what bounds an expert-parallel
    step, which waits for its busiest expert. `routed`: the slots routed, dropped ones included,
    when some were dropped over capacity: the mean is then a balanced expert's share of them, so a
    capacity factor c bounds the figure by c."""
    load = torch.as_tensor(tokens_per_expert, dtype=torch.float64)
    total = float(load.sum()) if routed is None else routed
    return float(load.max() * len(load) / total) if total > 0 else 1.0


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
    not count again. Slots dropped over capacity (the index n_experts) are counted apart, in a last
    column: the imbalance is taken against the slots routed, not only those kept (load_imbalance)."""

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
        load = torch.bincount(index, minlength=self.n_experts + 1)
        self.load = load if self.load is None else self.load + load

    def take(self) -> torch.Tensor:
        """The slots each expert kept since the last call, then the slots dropped (n_experts + 1
        counts; zeros if no forward ran), and reset."""
        load = self.load if self.load is not None else torch.zeros(self.n_experts + 1, dtype=torch.long,
                                                                   device=self.device)
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
        """Layer name -> per step, the slots each expert kept on this rank, then the slots dropped
        over capacity (LoadCounter.take's columns; `kept_and_routed` reads them); a host sync."""
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


def kept_and_routed(step: list[int]) -> tuple[list[int], int]:
    """One step's counts of a layer (ExpertLoads.counts): the slots each expert kept, and the slots
    routed, dropped ones included."""
    return step[:-1], sum(step)


def dropped_share(counts: dict[str, list[list[int]]]) -> float:
    """Of the slots routed over every step and layer, the share dropped over capacity."""
    routed = dropped = 0
    for steps in counts.values():
        for step in steps:
            kept, total = kept_and_routed(step)
            routed, dropped = routed + total, dropped + total - sum(kept)
    return dropped / routed if routed else 0.0


def step_imbalance(counts: dict[str, list[list[int]]], ranks: int | None = None) -> list[float]:
    """Per step, the layers' mean of busiest-over-mean: each layer's experts wait for its busiest
    one; with `ranks`, each layer's experts split into that many contiguous groups (expert
    parallelism's ranks, training/parallel/ep.py), each group's slots summed: the ranks wait for the
    busiest. The mean is a balanced share of the slots routed (load_imbalance)."""
    if not counts:
        return []
    layers = list(counts.values())
    return [sum(load_imbalance(_by_rank(layer[step], ranks), kept_and_routed(layer[step])[1]) for layer in layers)
            / len(layers) for step in range(len(layers[0]))]


def _by_rank(step: list[int], ranks: int | None) -> list[int]:
    """A layer's kept slots per expert summed over `ranks` contiguous groups of experts (ep's
    placement); None: per expert."""
    load, _ = kept_and_routed(step)
    size = len(load) // ranks if ranks else 1
    return [sum(load[i:i + size]) for i in range(0, len(load), size)]


def _degrees(counts: dict[str, list[list[int]]]) -> list[int]:
    """The expert-parallel degrees > 1 that divide every layer's experts."""
    experts = {len(steps[0]) - 1 for steps in counts.values() if steps}
    return [ep for ep in range(2, min(experts, default=0) + 1) if all(n % ep == 0 for n in experts)]


def rank_imbalance(counts: dict[str, list[list[int]]]) -> dict[str, float]:
    """For each expert-parallel degree > 1 that divides every layer's experts, the steps' mean of
    step_imbalance over that many ranks (keyed by the degree as text, as JSON keeps it): what the
    cost model stretches an expert-parallel step by. Routing does not depend on the layout, so a run
    of any layout measures every degree."""
    out = {}
    for ep in _degrees(counts):
        per_step = step_imbalance(counts, ep)
        if per_step:
            out[str(ep)] = sum(per_step) / len(per_step)
    return out


def rank_held_imbalance(counts: dict[str, list[list[int]]]) -> dict[str, float]:
    """For each degree rank_imbalance gives, the highest over the steps of the busiest rank's slots
    summed over the layers over the mean rank's: what the busiest rank's experts hold for backward
    against a balanced rank's at the worst step, where a run's memory peaks (the memory ruler's: a
    step's layers add up in memory, where in time each layer waits for its own busiest rank). A
    longer run may meet a worse step: the figure grows with the steps measured."""
    out = {}
    layers = list(counts.values())
    for ep in _degrees(counts):
        per_step = [load_imbalance([sum(held) for held in zip(*(_by_rank(layer[step], ep) for layer in layers),
                                                               strict=True)],
                                   sum(kept_and_routed(layer[step])[1] for layer in layers))
                    for step in range(len(layers[0]))]
        if per_step:
            out[str(ep)] = max(per_step)
    return out
