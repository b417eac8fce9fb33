"""Tensor parallelism with DTensor, from the model's own plan (Hugging Face's strings).

`colwise` splits a linear by output columns and `rowwise` by input rows: a column split followed
by its row partner needs one all-reduce per pair in forward and one in backward (Megatron). The
plan comes from the model (training/contract/spec.py), resolved to module names.

**Sequence parallelism** (Korthikanti et al. 2022, Megatron's): what TP leaves whole on every rank
between the split regions (the norms, the residual stream, its dropout) is split over the sequence
instead. Each block's input is cut into this rank's positions (a Shard(1) DTensor from there on);
each norm the plan styles `sequence_parallel` runs on those positions and all-gathers its output
once for the column-split linears after it (torch's SequenceParallel with a gathered output, as
NeMo's SequenceParallelAllGatherActivation); each row-split linear reduce-scatters its partial sums
back to positions (RowwiseParallel(output_layouts=Shard(1))) instead of all-reducing them. A pair's
all-reduce becomes an all-gather in and a reduce-scatter out, and the reverse in backward. As in
Megatron, the column-split linears save the norm's shard, not the gathered input, and gather it
again in backward: every activation a block saves is then split over the TP ranks.

**Loss parallelism** (torchtitan's; Megatron's vocabulary-parallel cross-entropy): the model's head
(training/contract/spec.py) is split by vocabulary and its logits stay split, a DTensor sharded on
the last dimension, into the loss, which torch computes on the shards under `loss_parallel()`: a
max, a sum of exponentials and the target's logit all-reduced per position instead of the logits
gathered. The logits, the loss's saved softmax and its gradients are then split over the TP
ranks; the head's input gradient is all-reduced (a column split's partial sums), as any column
split's is. For a 128K vocabulary the logits outweigh everything else a step saves at short
sequences.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from training.config import REPLICATED_STYLE
from training.contract.spec import ModelSpec
from training.memory import packed, storage_id

STYLES = {  # "colwise": SharingColwise
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    # A module between a column and a row split that stays whole (Qwen3's per-head q/k norms see
    # only this rank's heads): its parameters replicated DTensors and its input declared one shard
    # of a tensor (dim 0: any dimension its forward does not reduce over), so each rank's gradient
    # is a partial sum, accumulated as one over micro-batches and summed over the TP ranks once a
    # step (sum_partial_grads; under FSDP by its reduction). Hugging Face's own style all-reduces
    # the accumulated .grad after every backward, which sums an earlier micro-batch's gradient
    # again. The output goes on as the local tensor.
    REPLICATED_STYLE: lambda: SequenceParallel(sequence_dim=0, use_local_output=True),
}

POSITIONS = Shard(1)
"""Where sequence parallelism splits an activation (batch, sequence, hidden): by position."""

SP_STYLES = {
    **STYLES,
    # The partial sums reduce-scattered to positions, kept a DTensor: the residual stream's layout.
    "rowwise": lambda: RowwiseParallel(output_layouts=POSITIONS, use_local_output=False),
}

VOCABULARY = Shard(-1)
"""Where loss parallelism splits the logits (batch, sequence, vocabulary): by vocabulary."""

SPLIT_LOGITS = "_split_logits"
"""The attribute that marks the head's output: logits the model hands on split, not gathered."""

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
    """The model's sequence-parallel layout under `checkpointing` (ContractError: no norms declared):
    the MoE layers are the parents of the experts modules its expert plan names."""
    moe = [model.get_submodule(site.name.rpartition(".")[0]) for site in spec.experts(model, whole=False)]
    return SequenceLayout(spec.sp_norms(model, whole=False), [b.module for b in spec.live_blocks()],
                          checkpointing == "none", moe)


def apply_tp(model: nn.Module, plan: dict[str, str], tp_mesh: DeviceMesh,
             sequence: SequenceLayout | None = None, head: str | None = None) -> bool:
    """Split the modules `plan` names (module name -> style) over `tp_mesh`, with `sequence` the
    rest by position, and the `head` by vocabulary; names the pipeline split removed are skipped.
    True when this part holds the head and its logits now come out split (the loss must then run
    under `loss_parallel`: split_loss)."""
    present = {name for name, _ in model.named_modules()}
    table = SP_STYLES if sequence is not None else STYLES
    last_input = _LastInput()  # shared by the column-split linears, whose inputs may be one tensor
    styles: dict[str, ParallelStyle] = {name: SharingColwise(last_input) if style == "colwise" else table[style]()
                                        for name, style in plan.items() if name in present}
    split_head = head is not None and head in present
    if split_head:
        styles[head] = ColwiseParallel(output_layouts=VOCABULARY, use_local_output=False)
    if sequence is not None:
        inside = {id(m) for block in sequence.blocks for m in block.modules()}
        for name in sequence.norms:
            if name in present:
                in_block = id(model.get_submodule(name)) in inside
                styles[name] = GatheringNorm(in_block, sequence.keep_shards and in_block)
    parallelize_module(model, tp_mesh, styles)
    for name, style in styles.items():  # a split region ends where a row split starts
        if isinstance(style, RowwiseParallel):
            model.get_submodule(name).register_forward_pre_hook(last_input.clear)
    model.register_forward_hook(last_input.clear)
    if split_head:  # after the style's own hook, which makes the DTensor the model hands on
        model.get_submodule(head).register_forward_hook(_mark_split_logits)
    if sequence is not None:
        _split_residual_stream(model, sequence.blocks, tp_mesh)
        for module in sequence.whole:
            _takes_whole_tokens(module, tp_mesh)
        if sequence.keep_shards:
            for name, style in plan.items():
                if style == "colwise" and name in present:
                    _save_shards(model.get_submodule(name))
    return split_head


class _LastInput:
    """The whole input the last column-split linear took, and the DTensor made of it, held until
    the split region ends (a row split starts, or the forward returns): under checkpointing nothing
    else keeps it, and a weak reference let q, k and v each all-reduce their own input gradient."""

    def __init__(self):
        self.source: weakref.ref | None = None
        self.shared: DTensor | None = None

    def of(self, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        if self.shared is None or self.source is None or self.source() is not x:
            self.shared = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            self.source = weakref.ref(x)
        return self.shared

    def clear(self, *_: Any) -> None:
        self.source = self.shared = None


class SharingColwise(ColwiseParallel):
    """torch's ColwiseParallel, except that column-split linears called one after another on the
    same whole input (attention's q, k and v; a gated MLP's gate and up projections) share one
    DTensor of it. Their input gradients, partial sums, are then added on each rank and all-reduced
    once in backward, as Megatron's fused QKV does, instead of once per linear (measured: 12
    all-reduces a step for a 2-layer GPT with its separate q, k and v, 8 with this:
    tests/unit/test_loss_parallel.py). Inputs that are DTensors already (sequence parallelism's
    gathered norm output) are shared as they are."""

    def __init__(self, last: _LastInput):
        super().__init__()
        self.last = last

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition_linear_fn, self._shared_input,
                                 lambda m, out, mesh: self._prepare_output_fn(self.output_layouts,
                                                                              self.use_local_output, m, out, mesh))

    def _shared_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> DTensor:
        x = inputs[0]
        return x if isinstance(x, DTensor) else self.last.of(x, mesh)


def _mark_split_logits(module: nn.Module, args: tuple, out: DTensor) -> None:
    setattr(out, SPLIT_LOGITS, True)


def split_loss(loss: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    """`loss` on vocabulary-split logits (run it, and its backward, under `loss_parallel()`):
    torch's cross-entropy on the shards gives every rank the same loss, a replicated DTensor,
    handed on as a plain tensor."""
    def whole(output: Any, target: Any) -> torch.Tensor:
        value = loss(output, target)
        return value.full_tensor() if isinstance(value, DTensor) else value

    return whole


def by_position(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """`x` split by position: a DTensor redistributed to it, a plain (whole) tensor cut locally
    (no communication; its gradient is all-gathered)."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return x if x.placements == (POSITIONS,) else x.redistribute(placements=[POSITIONS])


def _split_residual_stream(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh) -> None:
    """Blocks take the residual stream by position; the model (or stage) hands its output on whole, a
    copy: split-backward schedules detach a stage's output in place, refused on full_tensor()'s view."""
    for block in blocks:
        block.register_forward_pre_hook(lambda m, args: (by_position(args[0], mesh), *args[1:]))
    model.register_forward_hook(lambda m, args, out: out.full_tensor().clone() if _positional(out) else out)


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


def _positional(out: Any) -> bool:
    """Whether the model's output is the residual stream still split by position (a pipeline
    stage's), not the head's logits split by vocabulary."""
    return isinstance(out, DTensor) and not getattr(out, SPLIT_LOGITS, False)


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


def sum_partial_grads(params: list[nn.Parameter], tp_mesh: DeviceMesh) -> Callable[[], None]:
    """After the step's last backward, where no FSDP reduces them: the gradients of parameters TP
    keeps whole beside split activations (the sequence-parallel norms, the `replicated_with_grad_allreduce`
    modules) are partial sums over the TP ranks, and DTensor sums them lazily, in every operation
    that reads them: the clip's norm and each of AdamW's reads, four all-reduces per parameter per
    step (measured on a fake process group: 37 for Qwen3-MoE's 9 such parameters). Summed here,
    all of them in one all-reduce per dtype, they are whole before anything reads them."""
    params = [p for p in params if isinstance(p, DTensor) and p.device_mesh == tp_mesh]

    def sum_them() -> None:
        partial = [p for p in params if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)]
        for dtype in {p.grad.dtype for p in partial}:
            group = [p for p in partial if p.grad.dtype == dtype]
            flat = torch.cat([p.grad.to_local().reshape(-1) for p in group])
            torch.distributed.all_reduce(flat, group=tp_mesh.get_group())
            for p, part in zip(group, flat.split([p.grad.to_local().numel() for p in group]), strict=True):
                p.grad = DTensor.from_local(part.view_as(p.grad.to_local()), tp_mesh, [Replicate()], run_check=False)

    return sum_them
