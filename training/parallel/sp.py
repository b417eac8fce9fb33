"""Sequence parallelism (Korthikanti et al. 2022, Megatron's), on top of tensor parallelism
(training/parallel/tp.py).

What TP leaves whole on every rank between the split regions (the norms, the residual stream, its
dropout) is split over the sequence instead. Each block's input is cut into this rank's positions (a
Shard(1) DTensor from there on); each norm the plan styles `sequence_parallel` runs on those
positions and all-gathers its output once for the column-split linears after it (torch's
SequenceParallel with a gathered output, as NeMo's SequenceParallelAllGatherActivation); each
row-split linear reduce-scatters its partial sums back to positions (tp.py's SP_STYLES) instead of
all-reducing them. A pair's all-reduce becomes an all-gather in and a reduce-scatter out, and the
reverse in backward. As in Megatron, the column-split linears save the norm's shard, not the
gathered input, and gather it again in backward: every activation a block saves is then split over
the TP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from training.contract.spec import ModelSpec
from training.memory import packed, storage_id

POSITIONS = Shard(1)
"""Where sequence parallelism splits an activation (batch, sequence, hidden): by position."""

GATHERED = "_sp_gathered"
"""The attribute by which a norm's gathered output names the shard it was gathered from."""


@dataclass(frozen=True)
class SequenceLayout:
    """What sequence parallelism needs besides the TP plan."""

    norms: list[str]
    """The plan's `sequence_parallel` modules (the blocks' norms and the final one)."""
    blocks: list[nn.Module] = field(default_factory=list)
    """The model's (live) blocks: each one's input is split by position."""
    keep_shards: bool = True
    """Column-split linears save their input's shard and gather it again in backward (Megatron's);
    false where activation checkpointing recomputes the block, and the gather with it, anyway."""
    whole: list[nn.Module] = field(default_factory=list)
    """Modules of the blocks outside the TP plan that take whole tokens: a mixture of experts'
    layers (router and experts), which get the gathered norm output as TP alone hands it and give
    their output back by position."""


def sequence_layout(model: nn.Module, spec: ModelSpec, checkpointing: str) -> SequenceLayout:
    """The model's sequence-parallel layout under `checkpointing` (ContractError: no norms
    declared): the MoE layers are the parents of the experts modules its expert plan names."""
    moe = [model.get_submodule(site.name.rpartition(".")[0]) for site in spec.experts(model, whole=False)]
    return SequenceLayout(spec.sp_norms(model, whole=False), [b.module for b in spec.live_blocks()],
                          checkpointing == "none", moe)


def norm_styles(model: nn.Module, sequence: SequenceLayout, present: set[str]) -> dict[str, ParallelStyle]:
    """The styles of the plan's `sequence_parallel` norms that `model` holds (names in `present`)."""
    inside = {id(m) for block in sequence.blocks for m in block.modules()}
    styles: dict[str, ParallelStyle] = {}
    for name in sequence.norms:
        if name in present:
            in_block = id(model.get_submodule(name)) in inside
            styles[name] = GatheringNorm(in_block, sequence.keep_shards and in_block)
    return styles


def apply_sp(model: nn.Module, sequence: SequenceLayout, column_split: list[nn.Module], mesh: DeviceMesh) -> None:
    """After TP has split `model` with norm_styles among its styles: the residual stream by
    position, the MoE layers given whole tokens, and the `column_split` linears saving shards."""
    for block in sequence.blocks:
        block.register_forward_pre_hook(lambda m, args: (by_position(args[0], mesh), *args[1:]))
    model.register_forward_hook(_whole_output)
    for module in sequence.whole:
        _takes_whole_tokens(module, mesh)
    if sequence.keep_shards:
        for linear in column_split:
            _save_shards(linear)


def by_position(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """`x` split by position: a DTensor redistributed to it, a plain (whole) tensor cut locally
    (no communication; its gradient is all-gathered)."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return x if x.placements == (POSITIONS,) else x.redistribute(placements=[POSITIONS])


def _whole_output(m: nn.Module, args: tuple, out: Any) -> Any:
    """The forward hook by which the model (or stage) hands the residual stream on whole (a view:
    under a split-backward schedule pp.py hands a stage's view on as a copy); the head's logits,
    split by vocabulary (tp.py's loss parallelism), go on as they are."""
    if not (isinstance(out, DTensor) and out.placements == (POSITIONS,)):
        return out
    return out.full_tensor()


def _takes_whole_tokens(module: nn.Module, mesh: DeviceMesh) -> None:
    """A module of a sequence-parallel block outside the TP plan (a mixture of experts' layer): it
    takes the block's gathered norm output as a plain whole tensor, as under TP alone (every TP
    rank routes every token; under expert parallelism each then sends its part to the experts,
    training/parallel/ep.py), and hands its output on by position for the residual stream: a
    local cut, whose gradient is all-gathered in backward."""

    def whole(m: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if isinstance(x, DTensor):  # its gradient comes back whole and alike on every TP rank
            x = x.redistribute(placements=[Replicate()]).to_local()
        return (x, *args[1:])

    def by_positions(m: nn.Module, args: tuple, out: Any) -> Any:
        if isinstance(out, tuple):
            return (by_position(out[0], mesh), *out[1:])
        return by_position(out, mesh)

    module.register_forward_pre_hook(whole)
    module.register_forward_hook(by_positions)


class GatheringNorm(SequenceParallel):
    """torch's SequenceParallel (parameters replicated, computed on this rank's positions), its
    output all-gathered. Inside a block a Replicate DTensor, which the column-split linears take as
    it is: their input gradients are partial sums, reduce-scattered back to positions. Outside (the
    final norm, before an unsplit head) a plain whole tensor, whose gradient is whole already."""

    def __init__(self, in_block: bool, keep_shards: bool):
        super().__init__(sequence_dim=POSITIONS.dim)
        self.in_block, self.keep_shards = in_block, keep_shards

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_module_fn, self._split_input, self._gather)

    @staticmethod
    def _split_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return (by_position(inputs[0], mesh), *inputs[1:])

    def _gather(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        full = output.redistribute(placements=[Replicate()])
        if not self.in_block:
            return full.to_local()
        if self.keep_shards and torch.is_grad_enabled():
            gathered = _Gathered.of(full, output)
            if gathered is not None:
                setattr(full, GATHERED, gathered)
        return full


def _local(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # the local view only: no autograd node
        return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _View:
    """How a saved tensor viewed the gathered input: rebuilt on the input gathered again."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """Elements from the start of the gathered input."""
    dtensor: tuple[Any, ...] | None
    """(mesh, placements, shape, stride) when the saved tensor was a DTensor."""

    def rebuild(self, full: torch.Tensor) -> torch.Tensor:
        local = full.as_strided(self.size, self.stride, full.storage_offset() + self.offset)
        if self.dtensor is None:
            return local
        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class _Gathered:
    """A norm's gathered output, remembered by its storage, with the shard it was gathered from:
    what the column-split linears after it save instead, gathered again (once for all of them)
    when backward first needs it."""

    def __init__(self, full: torch.Tensor, shard: DTensor):
        self.key, self.offset = storage_id(full), full.storage_offset()
        self.shard = _local(shard)
        self.mesh, self.shape, self.stride = shard.device_mesh, shard.shape, shard.stride()
        self.users = 0
        self._full: torch.Tensor | None = None

    @classmethod
    def of(cls, full: DTensor, shard: DTensor) -> _Gathered | None:
        local = _local(full)
        return cls(local, shard) if local.is_contiguous() else None

    def view_of(self, t: torch.Tensor) -> _View | None:
        local = _local(t)
        if storage_id(local) != self.key:
            return None
        meta = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        return _View(tuple(local.shape), local.stride(), local.storage_offset() - self.offset, meta)

    def gather_again(self, shard: torch.Tensor) -> torch.Tensor:
        if self._full is None:
            with torch.no_grad():
                spread = DTensor.from_local(shard, self.mesh, [POSITIONS], run_check=False, shape=self.shape,
                                            stride=self.stride)
                self._full = spread.redistribute(placements=[Replicate()]).to_local()
        full = self._full
        self.users -= 1
        if self.users <= 0:
            self._full = None  # every linear that saved it has had it: free it now, not with the graph
        return full


def _same(t: Any) -> Any:
    return t


class _SavingShards:
    """Saved-tensor hooks over one column-split linear's forward: what it saves of its gathered
    input is saved as the shard instead. Hooks already active (a probe counting saved bytes,
    training/memory.py) see what is really kept: the shard."""

    def __init__(self, gathered: _Gathered):
        self.gathered = gathered
        # Only the innermost saved-tensor hooks run: call the outer ones ourselves.
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.outer_pack, self.outer_unpack = outer if outer is not None else (packed, _same)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> tuple[_View | None, Any]:
        view = self.gathered.view_of(t)
        if view is None:
            return None, self.outer_pack(t)
        self.gathered.users += 1
        return view, self.outer_pack(self.gathered.shard)

    def unpack(self, packed: tuple[_View | None, Any]) -> torch.Tensor:
        view, inner = packed
        value = self.outer_unpack(inner)
        return value if view is None else view.rebuild(self.gathered.gather_again(value))


def _save_shards(linear: nn.Module) -> None:
    """Make a column-split linear save its gathered input as the shard (see _SavingShards)."""
    forward = linear.forward

    def saving_shards(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        gathered = getattr(x, GATHERED, None)
        if gathered is None or not torch.is_grad_enabled():
            return forward(x, *args, **kwargs)
        with _SavingShards(gathered).hooks():
            return forward(x, *args, **kwargs)

    linear.forward = saving_shards

