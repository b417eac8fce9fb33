"""AdamW over fp32 master weights, optionally sharded over the data-parallel ranks.

One meaning of `precision=bf16` for every strategy: the module computes with bf16 parameters and
the optimizer keeps the fp32 truth. FSDP2 does this itself (MixedPrecisionPolicy over sharded fp32
parameters); for the replicated layouts (ddp, zero1, tp, pp) this optimizer does it, as
Megatron-Core's distributed optimizer does:

- the model holds bf16 parameters and gradients (2 + 2 bytes per parameter);
- the optimizer holds the fp32 master copy and Adam's two fp32 moments (4 + 8 bytes), for every
  parameter, or under zero1 only for this rank's partition of them (12 / N bytes): the ZeRO
  paper's P_os (split experts: N their replicas);
- a step casts the gradients of one chunk at a time to fp32 (never a whole fp32 gradient copy),
  updates the masters, writes them back to the bf16 parameters, and under zero1 each rank then
  broadcasts the partition it updated to the others.

In fp32 the masters are the parameters themselves (nothing is copied); the optimizer is then
plain AdamW, sharded under zero1, still stepping a chunk at a time: torch's foreach AdamW makes a
temporary the size of everything it steps at once (the moments' square root), which for a model
sized to its device is the difference between fitting and not. Adam's state is created when the optimizer is, not at its first
step, so that what a rank holds is there to count (the dry run counts it on the meta device).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from training.planner.memory import STEP_CHUNK_BYTES as CHUNK_BYTES


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _flat(t: torch.Tensor) -> torch.Tensor:
    local = _local(t).detach()
    assert local.is_contiguous(), "parameters are contiguous"
    return local.view(-1)


@dataclass
class Piece:
    """A run of one parameter's elements that one rank updates: all of it, or under zero1 the
    part of it that falls in that rank's even share of the model's flattened parameters."""

    param: nn.Parameter
    start: int
    stop: int


def partition(params: list[nn.Parameter], ranks: int) -> list[list[Piece]]:
    """Each rank's pieces: the parameters' local elements laid end to end and cut into `ranks`
    equal ranges, as Megatron's distributed optimizer cuts its flat buffer (a whole-parameter
    partition leaves the rank that gets the embedding with several times its share)."""
    sizes = [_local(p).numel() for p in params]
    total = sum(sizes)
    bounds = [total * r // ranks for r in range(ranks + 1)]
    out: list[list[Piece]] = [[] for _ in range(ranks)]
    offset = 0
    for p, size in zip(params, sizes, strict=True):
        for r in range(ranks):
            lo, hi = max(bounds[r], offset), min(bounds[r + 1], offset + size)
            if lo < hi:
                out[r].append(Piece(p, lo - offset, hi - offset))
        offset += size
    return out


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
    a parameter not in it is its own master. With `shard_over` (zero1), each group of ranks shares
    out its parameters: each rank updates an even share of their elements (`partition`) and
    broadcasts it over that group after the step; a master is then a slice, of the fp32 parameter
    itself in fp32 (nothing copied). Under expert parallelism, as Megatron-Core's distributed
    optimizer, the dense parameters go to the data-parallel ranks and the split experts to their
    replicas, the ranks that hold the same experts."""

    def __init__(self, params: list[nn.Parameter], masters: dict[nn.Parameter, torch.Tensor], lr: float,
                 weight_decay: float, shard_over: list[tuple[list[nn.Parameter], dist.ProcessGroup]] | None = None):
        self.model_params = params
        self.sets: list[tuple[dist.ProcessGroup | None, list[list[Piece]]]]
        if shard_over is None:
            self.sets = [(None, [[Piece(p, 0, _local(p).numel()) for p in params]])]
            self.pairs = [(piece, masters.get(piece.param, piece.param)) for piece in self.sets[0][1][0]]
        else:
            assert sum(len(ps) for ps, _ in shard_over) == len(params), "every parameter in one group"
            self.sets = [(group, partition(ps, dist.get_world_size(group))) for ps, group in shard_over]
            self.pairs = [(piece, self._slice(piece, masters))
                          for group, shares in self.sets for piece in shares[dist.get_rank(group)]]
        super().__init__([m for _, m in self.pairs], lr=lr, weight_decay=weight_decay)
        init_state(self)

    @staticmethod
    def _slice(piece: Piece, masters: dict[nn.Parameter, torch.Tensor]) -> torch.Tensor:
        source = masters.get(piece.param)
        if source is None:  # fp32: a view of the parameter, updated in place
            return _flat(piece.param)[piece.start:piece.stop]
        return _flat(source)[piece.start:piece.stop].clone()

    @property
    def partitioned(self) -> bool:
        return self.sets[0][0] is not None

    @property
    def has_masters(self) -> bool:
        """Whether it keeps copies of the model's parameters (bf16 training without FSDP)."""
        return any(not _shares_storage(piece.param, m) for piece, m in self.pairs)

    def _grad(self, piece: Piece) -> torch.Tensor:
        grad = piece.param.grad
        if not self.partitioned:
            return grad
        return _flat(grad)[piece.start:piece.stop]

    def _chunks(self) -> Iterator[list[tuple[Piece, torch.Tensor]]]:
        chunk: list[tuple[Piece, torch.Tensor]] = []
        size = 0
        for piece, m in self.pairs:
            if piece.param.grad is None:
                continue
            chunk.append((piece, m))
            size += 4 * (piece.stop - piece.start)
            if size >= CHUNK_BYTES:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        assert closure is None, "MasterAdamW takes no closure"
        group = self.param_groups[0]
        everything = group["params"]
        try:
            for chunk in self._chunks():
                for piece, m in chunk:
                    if m is not piece.param:
                        m.grad = self._grad(piece).to(m.dtype)
                # AdamW steps every parameter of its groups that has a gradient: a master that is
                # the parameter itself has one all along, so the group holds this chunk alone.
                group["params"] = [m for _, m in chunk]
                super().step()
                for piece, m in chunk:
                    if m is not piece.param:
                        m.grad = None
                        self._write_back(piece, m)
        finally:
            group["params"] = everything
        if self.partitioned:
            self._broadcast_shares()

    def _write_back(self, piece: Piece, master: torch.Tensor) -> None:
        if _shares_storage(piece.param, master):
            return
        if not self.partitioned:
            piece.param.copy_(master)
        else:
            _flat(piece.param)[piece.start:piece.stop].copy_(master)

    def _broadcast_shares(self) -> None:
        """Each rank's updated share to the others of its group: one broadcast per rank, of its
        pieces flattened in the model's dtype, so the transient is one share."""
        for group, shares in self.sets:
            if dist.get_world_size(group) == 1:
                continue
            for owner, pieces in enumerate(shares):
                if not pieces:
                    continue
                views = [_flat(piece.param)[piece.start:piece.stop] for piece in pieces]
                flat = torch.cat(views)
                dist.broadcast(flat, src=dist.get_global_rank(group, owner), group=group)
                offset = 0
                for view in views:
                    view.copy_(flat[offset:offset + view.numel()])
                    offset += view.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

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
            for piece, m in self.pairs:
                self._write_back(piece, m)
            if self.partitioned:
                self._broadcast_shares()


def _shares_storage(param: torch.Tensor, master: torch.Tensor) -> bool:
    return _local(param).untyped_storage()._cdata == _local(master).untyped_storage()._cdata
