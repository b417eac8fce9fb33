"""Which saved activations tensor parallelism splits, read from the model's own TP plan.

Without sequence parallelism (Korthikanti et al. 2022, Table 2), a TP rank keeps whole copies of
what is saved outside the split region: the norms' inputs, the residual stream and the inputs of
the column-split linears; what is saved between a column-split linear's output and the next
row-split linear's input (attention's q, k, v and output, the MLP's hidden activations) is split
over the TP ranks. So one forward + backward, with the plan's modules marking where a split region
opens (`colwise` output) and closes (`rowwise` output), counts both parts per sample at once: on
the meta device, for any model that declares a plan.

With sequence parallelism (training/parallel/sp.py) everything a block saves is split (by heads
inside the regions, by position outside them), and so is what the sequence-parallel norms outside
the blocks save (the final norm); what stays whole is the rest saved outside the blocks (the
embeddings' indices, the head's input, the loss).

Selective checkpointing keeps op outputs (training/parallel/ac.py), counted where the op ran: a
column-split linear's output is split, though produced before the region it opens; a row-split
linear's is whole under TP (its all-reduced sum), though produced inside the region it closes.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from training.memory import SavedActivations, packed
from training.planner.shape import Activations


@dataclass(frozen=True)
class TpSplit:
    saved_bytes: int
    """Everything saved for backward (parameters excluded)."""
    replicated_bytes: int
    """The part saved outside the split regions: whole on every TP rank."""
    outside_blocks_bytes: int = 0
    """The part saved outside the model's blocks (embeddings, final norm, head, loss)."""
    loss_temp_bytes: int = 0
    """What backward makes first, beside all that is saved: the gradients of the loss with respect
    to the model's output and the loss's own intermediate (two fp32 tensors of the output's size,
    e.g. a language model's logits; whole on every TP rank unless the head is split, `head_bytes`)."""
    sequence_replicated_bytes: int = 0
    """The part saved outside the blocks and the sequence-parallel norms: whole on every TP rank
    under sequence parallelism (the rest is split over them)."""
    head_bytes: int = 0
    """The part saved after the model's head (its logits, the loss's softmax), counted in
    `replicated_bytes` and `outside_blocks_bytes`: split over the TP ranks where the trainer splits
    the head by vocabulary (training/parallel/tp.py), as are the loss's temporaries."""
    experts_bytes: int = 0
    """The part saved inside the experts modules (routed tokens, the experts' hidden activations),
    counted in `replicated_bytes` (they are in no TP plan): split over the TP ranks where expert
    parallelism splits a TP group's tokens (training/parallel/ep.py)."""
    moe_bytes: int = 0
    """The part saved inside the mixture-of-experts layers (router, experts, combine: the experts
    modules' parents), `experts_bytes` among them: whole on every TP rank under sequence
    parallelism too, which hands those layers whole tokens (training/parallel/sp.py)."""
    weight_output_bytes: int = 0
    """The outputs of the ops that take a weight beside an activation (a linear's, a norm's):
    what a split-backward pipeline schedule keeps the gradients of from a microbatch's
    input-gradient pass to its weight pass (WeightOutputs)."""
    tail_weight_output_bytes: int = 0
    """Of `weight_output_bytes`, the part after the blocks but the head's logits (the final norm's):
    the last pipeline stage's beside the loss's temporaries."""
    block_backward_bytes: int = 0
    """The most a block's backward allocated beside what it was given and the weight gradients,
    for the whole batch (BackwardTemporaries); not in `per_sample`: part of it is per sample (its
    activations' gradients), part not (a weight-sized scratch), told apart by a second batch size
    (training/planner/anatomy.py)."""


    def per_sample(self, samples: int, sequence_norms: bool = True) -> Activations:
        """These counts per sample, as the cost model takes them: the loss's temporaries counted in
        what is saved and in every part TP leaves whole. A model with no sequence-parallel norms
        (`sequence_norms` False) keeps under sequence parallelism what it keeps under TP alone."""
        temps = self.loss_temp_bytes / samples
        sequence = self.sequence_replicated_bytes if sequence_norms else self.replicated_bytes
        return Activations(saved=self.saved_bytes / samples + temps, tp_replicated=self.replicated_bytes / samples + temps,
                           outside_blocks=self.outside_blocks_bytes / samples, loss_temp=temps,
                           sp_replicated=sequence / samples + temps, head=self.head_bytes / samples,
                           experts=self.experts_bytes / samples, moe=self.moe_bytes / samples,
                           weight_outputs=self.weight_output_bytes / samples,
                           tail_weight_outputs=self.tail_weight_output_bytes / samples)

OPENS = ("colwise",)
"""Styles whose output is split: a split region starts after them (not `colwise_rep`/`_gather`,
whose output is gathered whole again)."""
CLOSES = ("rowwise",)
"""Styles whose output is whole again (reduced): the region ends after them."""


def _role(style: str) -> str | None:
    if style in OPENS:
        return "open"
    if style.startswith(CLOSES):
        return "close"
    return None


def measure_tp_split(model: nn.Module, plan: dict[str, str], run: Callable[[], torch.Tensor],
                     blocks: list[nn.Module] | tuple = (), sequence_norms: list[nn.Module] | tuple = (),
                     head: nn.Module | None = None, experts: list[nn.Module] | tuple = ()) -> TpSplit:
    """Run `run` (a forward returning the loss) and its backward, counting saved bytes by where
    they were saved; `plan` is the model's TP plan as full module names -> styles, `blocks` the
    model's blocks (what is saved outside them is told apart too), `sequence_norms` its
    sequence-parallel norms, `head` its output projection (what is saved after it too), `experts`
    its experts modules (what they save too, and what their parents, the MoE layers, save)."""
    inside, opening, closing = [False], [False], [False]
    depth, norm_depth = [0], [0]
    split_keys: set[int] = set()
    block_keys: set[int] = set()
    sequence_keys: set[int] = set()
    saved = _Classifier(model, (inside, opening, closing), split_keys, depth, block_keys, norm_depth, sequence_keys)
    outputs: list[int] = []
    handles = [model.register_forward_hook(lambda m, a, o: outputs.append(_numel(o)))]
    if head is not None:
        handles.append(head.register_forward_hook(lambda m, a, o: saved.after_head.__setitem__(0, True)))
    expert_depth, moe_depth = [0], [0]
    layers = [parent for parent in _parents(model, experts)]
    handles += (_counting(blocks, depth) + _counting(sequence_norms, norm_depth) + _counting(experts, expert_depth)
                + _counting(layers, moe_depth))
    saved.expert_depth, saved.moe_depth = expert_depth, moe_depth
    modules = _by_name(model)
    for name, style in plan.items():
        role = _role(style)
        if role is not None:
            opened = role == "open"
            module = modules[name]
            handles.append(module.register_forward_hook(lambda m, a, o, opened=opened: inside.__setitem__(0, opened)))
            handles += _flagging(module, opening if opened else closing)
    temporaries = BackwardTemporaries(model, blocks)
    weights = WeightOutputs(depth)
    try:
        with saved, weights:
            loss = run()
        with temporaries:
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
        temporaries.remove()
        model.zero_grad(set_to_none=True)
    total = saved.bytes
    whole = sum(n for k, n in saved.sizes.items() if k not in split_keys)
    outside = sum(n for k, n in saved.sizes.items() if k not in block_keys) if blocks else 0
    unsplit = sum(n for k, n in saved.sizes.items() if k not in block_keys | sequence_keys) if blocks else total
    after_head = sum(n for k, n in saved.sizes.items() if k in saved.head_keys)
    in_experts = sum(n for k, n in saved.sizes.items() if k in saved.expert_keys and k not in split_keys)
    in_moe = sum(n for k, n in saved.sizes.items() if k in saved.moe_keys and k not in split_keys)
    return TpSplit(total, whole, outside, 2 * 4 * sum(outputs), unsplit, after_head, in_experts, in_moe,
                   weights.bytes, weights.after_blocks_but_the_head, temporaries.block_peak)


def _parents(model: nn.Module, modules: list[nn.Module] | tuple) -> list[nn.Module]:
    """The modules holding each of `modules` (a mixture of experts' layer holds its experts)."""
    wanted = {id(m) for m in modules}
    return [parent for parent in model.modules() for child in parent.children() if id(child) in wanted]


def _by_name(model: nn.Module) -> dict[str, nn.Module]:
    """The model's modules by their names as the plan gives them: without the prefix activation
    checkpointing's wrappers add (torch's state dicts drop it too)."""
    return {name.replace(_CHECKPOINT_PREFIX, ""): module for name, module in model.named_modules()}


def _counting(modules: list[nn.Module] | tuple, depth: list[int]) -> list:
    """Hooks keeping `depth[0]` the number of `modules` whose forward is running."""
    handles = []
    for module in modules:
        handles.append(module.register_forward_pre_hook(lambda m, a: depth.__setitem__(0, depth[0] + 1)))
        handles.append(module.register_forward_hook(lambda m, a, o: depth.__setitem__(0, depth[0] - 1)))
    return handles


def _flagging(module: nn.Module, flag: list[bool]) -> list:
    """Hooks keeping `flag[0]` true while `module`'s forward runs."""
    return [module.register_forward_pre_hook(lambda m, a: flag.__setitem__(0, True)),
            module.register_forward_hook(lambda m, a, o: flag.__setitem__(0, False))]


def _numel(output: object) -> int:
    """Elements of a forward's output: a tensor, a tuple's first, a Hugging Face output's logits."""
    if isinstance(output, torch.Tensor):
        return output.numel()
    if isinstance(output, tuple | list) and output:
        return _numel(output[0])
    logits = getattr(output, "logits", None)
    return logits.numel() if isinstance(logits, torch.Tensor) else 0


class WeightOutputs(TorchFunctionMode):
    """Bytes of the outputs of the ops that take a trainable parameter beside an activation that
    requires a gradient (a linear, a norm, a weight multiplied in), and of those run after the
    blocks (`depth` counts the blocks running; none has run yet while `after_blocks` is 0 and the
    blocks are before). torch's input-gradient pass (pipelining's stage_backward_input) keeps the
    gradient of each such output until the weight pass: they are where a weight's gradient
    branches off the activations'. An embedding's indices need no gradient: not counted."""

    def __init__(self, depth: list[int]):
        super().__init__()
        self.depth, self.bytes, self.after_blocks, self._blocks_seen, self._last = depth, 0, 0, False, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = tree_leaves((args, kwargs or {}))
        weighted = any(isinstance(a, nn.Parameter) and a.requires_grad for a in leaves)
        if weighted and any(isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter) and a.requires_grad
                            for a in leaves):
            n = sum(t.numel() * t.element_size() for t in tree_leaves(out)
                    if isinstance(t, torch.Tensor) and t.requires_grad)
            self.bytes += n
            inside = self.depth[0] > 0
            self._blocks_seen |= inside
            if self._blocks_seen and not inside:
                self.after_blocks += n
                self._last = n
        return out

    @property
    def after_blocks_but_the_head(self) -> int:
        """`after_blocks` without the last op's (the head's logits): the gradient of the model's
        output is the loss's own temporary, which the memory ruler counts with each of the last
        stage's microbatches in flight (Activations.loss_temp)."""
        return self.after_blocks - self._last


def backward_temporaries(model: nn.Module, blocks: list[nn.Module] | tuple, run: Callable[[], torch.Tensor]) -> int:
    """BackwardTemporaries' count for one forward (`run`, returning the loss) and its backward."""
    temporaries = BackwardTemporaries(model, blocks)
    try:
        loss = run()
        with temporaries:
            loss.backward()
    finally:
        temporaries.remove()
        model.zero_grad(set_to_none=True)
    return temporaries.block_peak


class BackwardTemporaries(TorchDispatchMode):
    """The most bytes a block's backward holds beyond its start: the storages backward's ops
    allocate while inside the block (its activations' gradients, an op's scratch), less what was
    live when the block's backward began (the gradient it was given) and less the weight gradients
    (counted as states; a parameter's hook names each). A block's allocations and frees are
    replayed once it is done, without the weight gradients. Counted from the tensors, so on the
    meta device too."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module] | tuple):
        """Made before the forward whose backward it counts (a block's backward hooks are set up
        as the block runs forward); entered around that backward."""
        super().__init__()
        self.block_peak = 0
        self._live: dict[int, tuple[weakref.ref, int, int]] = {}
        """id of a live storage -> (a weak reference whose callback records its end, bytes, serial)"""
        self._serial = 0
        self._events: list[tuple[int, int]] | None = None
        """Inside a block's backward: (allocation serial, +bytes allocated or -bytes freed), in order."""
        self._gradients: set[int] = set()
        """Serials of the allocations that are weight gradients."""
        self._handles: list = []
        for block in blocks:
            self._handles.append(block.register_full_backward_pre_hook(lambda m, g: self._begin()))
            self._handles.append(block.register_full_backward_hook(lambda m, gi, go: self._end()))
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._weight_gradient))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> BackwardTemporaries:
        # A garbage collection inside a block's backward would free storages of unrelated cycles
        # there, counted as the block's frees: when one runs depends on everything allocated
        # before (collected earlier test modules moved hf-llama's count by 16 KB). None runs
        # until the backward is counted (a collection here first costs 0.13 s a count with torch and transformers loaded).
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.remove()
        super().__exit__(*exc)
        if self._gc_was_enabled:
            gc.enable()

    def _begin(self) -> None:
        self._events = []

    def _end(self) -> None:
        now = peak = 0
        for serial, delta in self._events or ():
            if serial not in self._gradients:
                now += delta
                peak = max(peak, now)
        self.block_peak = max(self.block_peak, peak)
        self._events = None

    def _weight_gradient(self, grad: torch.Tensor) -> None:
        known = self._live.get(id(grad.untyped_storage()))
        if known is not None:
            self._gradients.add(known[2])

    def _freed(self, key: int) -> None:
        known = self._live.pop(key, None)
        if known is not None and self._events is not None:
            self._events.append((known[2], -known[1]))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            # Only what the op allocated: not a view of an input (a weight's transpose, a saved
            # tensor reshaped), nor an input it wrote in place.
            if isinstance(t, torch.Tensor) and not _aliases_an_input(t, args):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._live:
                    self._serial += 1
                    self._live[key] = (weakref.ref(storage, lambda ref, key=key: self._freed(key)), storage.nbytes(),
                                       self._serial)
                    if self._events is not None:
                        self._events.append((self._serial, storage.nbytes()))
        return out


def _aliases_an_input(t: torch.Tensor, args: Any) -> bool:
    """Whether `t` shares its storage with a tensor among `args` (one level of lists: what aten's
    view and in-place ops take). Below autograd a view doesn't say it is one; its storage does."""
    storage = t.untyped_storage()
    flat = [b for a in args for b in (a if isinstance(a, (tuple, list)) else (a,))]
    return any(isinstance(a, torch.Tensor) and a.untyped_storage() is storage for a in flat)


class _Classifier(SavedActivations):
    """SavedActivations that also notes which storages were first saved inside a split region,
    inside a block, and inside a sequence-parallel norm."""

    def __init__(self, model: nn.Module, region: tuple[list[bool], list[bool], list[bool]], split_keys: set[int],
                 depth: list[int], block_keys: set[int], norm_depth: list[int], sequence_keys: set[int]):
        super().__init__(model)
        (self.inside, self.opening, self.closing), self.split_keys = region, split_keys
        self.depth, self.block_keys, self.norm_depth, self.sequence_keys = depth, block_keys, norm_depth, sequence_keys
        self.after_head, self.head_keys = [False], set()
        self.expert_depth, self.expert_keys = [0], set()
        self.moe_depth, self.moe_keys = [0], set()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._classify(t, self.inside[0])
        return packed(t)

    def _kept(self, t: torch.Tensor) -> None:
        # An op's output kept by selective checkpointing: a column-split linear's is split, a
        # row-split one's is its reduced sum.
        self._classify(t, self.opening[0] or (self.inside[0] and not self.closing[0]))

    def _classify(self, t: torch.Tensor, split: bool) -> None:
        before = set(self._seen)
        super()._pack(t)
        new = set(self._seen) - before
        if split:
            self.split_keys.update(new)
        if self.depth[0] > 0:
            self.block_keys.update(new)
        if self.norm_depth[0] > 0:
            self.sequence_keys.update(new)
        if self.after_head[0]:
            self.head_keys.update(new)
        if self.expert_depth[0] > 0:
            self.expert_keys.update(new)
        if self.moe_depth[0] > 0:
            self.moe_keys.update(new)

    @property
    def sizes(self) -> dict[int, int]:
        return dict(self._seen)
