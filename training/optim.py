"""AdamW over fp32 master weights, optionally sharded over the data-parallel ranks.

One meaning of `precision=bf16` for every strategy: the module computes with bf16 parameters and
the optimizer keeps the fp32 truth. FSDP2 does this itself (MixedPrecisionPolicy over sharded fp32
parameters); for the replicated layouts (ddp, zero1, tp, pp) this optimizer does it, as
Megatron-Core's distributed optimizer does:

- the model holds bf16 parameters and gradients (2 + 2 bytes per parameter);
- the optimizer holds the fp32 master copy and Adam's two fp32 moments (4 + 8 bytes), for every
  parameter, or under zero1 only for this rank's partition of them (12 / N bytes): the ZeRO
  paper's P_os;
- a step casts the gradients of one chunk at a time to fp32 (never a whole fp32 gradient copy),
  updates the masters, writes them back to the bf16 parameters, and under zero1 each rank then
  broadcasts the partition it updated to the others.

In fp32 the masters are the parameters themselves (nothing is copied); the optimizer is then
plain AdamW, sharded under zero1. Adam's state is created when the optimizer is, not at its first
step, so that what a rank holds is there to count (the dry run counts it on the meta device).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

CHUNK_BYTES = 64 * 1024**2
"""fp32 gradient bytes cast at once during a step: the step's only transient beyond the states."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def partition(params: list[nn.Parameter], ranks: int) -> list[int]:
    """The rank that updates each parameter: largest first, each to the least-loaded rank
    (ZeroRedundancyOptimizer's rule), so that every rank computes the same partition."""
    load = [0] * ranks
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -_local(params[i]).numel()):
        r = min(range(ranks), key=lambda r: load[r])
        owner[i] = r
        load[r] += _local(params[i]).numel()
    return owner


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's step count and two moments for every parameter now (AdamW itself creates
    them at the first step; it uses state that already exists)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


class MasterAdamW(torch.optim.AdamW):
    """AdamW whose parameters are the fp32 masters of this rank's share of the model.

    `masters` maps a model parameter to its fp32 master (the fp32 parameter it was cast from);
    a parameter not in it is its own master. With `group`, each rank updates the partition
    `partition` assigns it and broadcasts it after the step (zero1)."""

    def __init__(self, params: list[nn.Parameter], masters: dict[nn.Parameter, torch.Tensor], lr: float,
                 weight_decay: float, group: dist.ProcessGroup | None = None):
        self.model_params = params
        self.group = group
        ranks = dist.get_world_size(group) if group is not None else 1
        self.owners = partition(params, ranks) if group is not None else [0] * len(params)
        me = dist.get_rank(group) if group is not None else 0
        self.pairs = [(p, masters.get(p, p)) for p, owner in zip(params, self.owners, strict=True) if owner == me]
        super().__init__([m for _, m in self.pairs], lr=lr, weight_decay=weight_decay)
        init_state(self)

    @property
    def partitioned(self) -> bool:
        return self.group is not None

    def _chunks(self) -> Iterator[list[tuple[nn.Parameter, torch.Tensor]]]:
        chunk: list[tuple[nn.Parameter, torch.Tensor]] = []
        size = 0
        for p, m in self.pairs:
            if p.grad is None:
                continue
            chunk.append((p, m))
            size += 4 * _local(m).numel()
            if size >= CHUNK_BYTES:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        assert closure is None, "MasterAdamW takes no closure"
        for chunk in self._chunks():
            copied = [(p, m) for p, m in chunk if m is not p]
            for p, m in copied:
                m.grad = p.grad.to(m.dtype)
            super().step()
            for p, m in copied:
                m.grad = None
                p.copy_(m)
        if self.group is not None:
            self._broadcast_partitions()

    def _broadcast_partitions(self) -> None:
        """Each rank's updated partition to the others: one broadcast per owner, of its
        parameters flattened (in the model's dtype), so the transient is one partition."""
        ranks = dist.get_world_size(self.group)
        for owner in range(ranks):
            mine = [_local(p) for p, o in zip(self.model_params, self.owners, strict=True) if o == owner]
            if not mine:
                continue
            flat = torch.cat([t.detach().reshape(-1) for t in mine])
            dist.broadcast(flat, src=dist.get_global_rank(self.group, owner), group=self.group)
            offset = 0
            for t in mine:
                t.detach().copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @property
    def has_masters(self) -> bool:
        """Whether it keeps copies of the model's parameters (bf16 training without FSDP)."""
        return any(m is not p for p, m in self.pairs)

    def state_dict(self) -> dict:
        """AdamW's state, and the masters' values (a checkpoint must keep the fp32 truth)."""
        return {**super().state_dict(), "masters": [m for _, m in self.pairs]}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("masters", None)
        super().load_state_dict(state_dict)
        if masters is not None:
            with torch.no_grad():
                for (_, m), saved in zip(self.pairs, masters, strict=True):
                    m.copy_(saved)

    def copy_to_model(self) -> None:
        """Write the masters into the model's parameters (after loading a checkpoint)."""
        with torch.no_grad():
            for p, m in self.pairs:
                if m is not p:
                    p.copy_(m)
        if self.group is not None:
            self._broadcast_partitions()
