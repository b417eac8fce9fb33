"""A pipeline rank's model chunks: one stage's part of the model each, cut by the model's layout.

A chunk is the model with only its stage's blocks and ends (training/contract/spec.py's layout):
the model itself, pruned in place, where a rank holds one stage (gpipe, 1f1b); where it holds
several (interleaved, ZB-V), a *skeleton* per stage: a shallow copy of the modules from the
model's root down to the blocks' container and nothing else — every block, embedding and head is
the model's own module object, not a copy, so building chunks allocates nothing and a meta-device
model stays on the meta device; the root's hooks (context parallelism's) come along. Each chunk keeps the model's module names (`layers.5...`), so its state dict
keys, tensor-parallel plan and materialization seeds are the whole model's.

The chunks of a rank live in one `PipelineChunks`, an nn.Module, so that what reads "the model"
(the optimizer, gradient clipping, byte counts, the parameter digest) sees all of them; the
techniques that wrap a model (TP, FSDP, DDP, bf16) are applied to each chunk (`each`), and the
schedule runs one PipelineStage per chunk. Light on imports: the config check uses it too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from training.contract.blocks import Block, PipelineLayout, Skipped
from training.parallel.schedules import stage_blocks


class PipelineChunks(nn.Module):
    """The model chunks one pipeline rank holds, in the order of `stages` (their stage indices)."""

    def __init__(self, chunks: list[nn.Module], stages: list[int]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.stages = list(stages)

    def forward(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError("a pipeline rank's chunks run through its schedule, one PipelineStage each")


def parts(model: nn.Module) -> list[nn.Module]:
    """A rank's chunks: those of a PipelineChunks, else the model itself."""
    return list(model.chunks) if isinstance(model, PipelineChunks) else [model]


def each(model: nn.Module, fn: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """`fn` applied to every chunk, its result (a wrapper, say) taking the chunk's place."""
    if not isinstance(model, PipelineChunks):
        return fn(model)
    for i, chunk in enumerate(model.chunks):
        model.chunks[i] = fn(chunk)
    return model


def chunk_blocks(chunk: nn.Module, layout: PipelineLayout) -> list[Block]:
    """The blocks a chunk holds, as Blocks of its own container."""
    container = chunk.get_submodule(layout.container)
    return [Block(container, name) for name, m in container.named_children() if not isinstance(m, Skipped)]


def prune(model: nn.Module, layout: PipelineLayout, keep: set[str], first: bool, last: bool) -> nn.Module:
    """Remove, in place, every block of `model` not named in `keep`, and the first stage's parts
    unless `first`, the last stage's unless `last`: deleted and set to None under the project's
    contract, replaced by placeholders where the model's forward calls every part (Hugging Face)."""
    container = model.get_submodule(layout.container)
    for name, block in list(container.named_children()):
        if name in keep:
            continue
        if layout.placeholders:
            setattr(container, name, Skipped(block))
        else:
            del container[name]
    for path in (() if first else layout.first) + (() if last else layout.last):
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        part = getattr(parent, attr)
        setattr(parent, attr, Skipped(part) if layout.placeholders else None)
    return model


def skeleton(model: nn.Module, layout: PipelineLayout) -> nn.Module:
    """A copy of the modules a stage prunes — those on the paths from `model` down to its blocks'
    container (inclusive) and to the parents of its ends; every other module, and every parameter
    and buffer, is `model`'s own object."""
    root = _shallow(model)
    copied = {id(root)}
    for path in (layout.container, *(end.rpartition(".")[0] for end in layout.first + layout.last)):
        parent = root
        for name in path.split(".") if path else []:
            child = getattr(parent, name)
            if id(child) not in copied:
                child = _shallow(child)
                setattr(parent, name, child)
                copied.add(id(child))
            parent = child
    return root


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of `module` whose own containers (its children, parameters, buffers, hooks) are new
    dicts, sets and lists holding the same objects: changing the copy's children leaves `module`'s
    alone, and nothing it refers to (a hook's owner, a process group, a config) is copied."""
    clone = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, dict | set | list):
            vars(clone)[key] = copy.copy(value)
    return clone


def split(model: nn.Module, layout: PipelineLayout, stages: list[int], total: int) -> list[nn.Module]:
    """`model` cut into `total` stages by block count, the chunks of `stages` returned in order. One
    stage: `model` pruned in place. Several: a skeleton each, then `model` emptied, so that the
    blocks no chunk of this rank holds are freed with it."""
    names = [name for name, _ in model.get_submodule(layout.container).named_children()]
    if total > len(names):
        raise ValueError(f"{total} pipeline stages but the model has only {len(names)} blocks")
    if len(stages) == 1:
        return [_cut(model, layout, names, stages[0], total)]
    chunks = [_cut(skeleton(model, layout), layout, names, stage, total) for stage in stages]
    prune(model, layout, set(), False, False)
    return chunks


def _cut(root: nn.Module, layout: PipelineLayout, names: list[str], stage: int, total: int) -> nn.Module:
    """`root` pruned to stage `stage` of `total`, its forward adapted where the layout says."""
    chunk = prune(root, layout, set(stage_blocks(names, stage, total)), stage == 0, stage == total - 1)
    if layout.stage_forward is not None:
        layout.stage_forward(chunk, stage == 0)
    return chunk


def composition_problem(model: nn.Module, layout: PipelineLayout, inputs: torch.Tensor) -> str | None:
    """Why `model`, cut into two stages by its layout, computes something else than its own
    forward on `inputs` — a forward that changes what it is given outside the parts the layout
    names (Gemma-2 soft-caps its logits in the head's forward: on every stage, once cut); None when
    the stages compose to the whole. `model` is left as it was (the stages are skeletons)."""
    from training.contract.calls import logits_of

    names = [name for name, _ in model.get_submodule(layout.container).named_children()]
    if len(names) < 2:
        return None
    training = model.training
    model.eval()  # dropout off: the same computation twice
    try:
        with torch.no_grad():
            whole = logits_of(model(inputs))
            staged = inputs
            for stage in (0, 1):
                staged = _cut(skeleton(model, layout), layout, names, stage, 2)(staged)
    finally:
        model.train(training)
    if staged.shape == whole.shape and torch.allclose(staged.float(), whole.float(), rtol=1e-4, atol=1e-5):
        return None
    gap = (staged.float() - whole.float()).abs().max().item() if staged.shape == whole.shape else float("nan")
    return (f"{type(model).__name__} cut into pipeline stages by its {layout.source} computes other outputs than "
            f"its forward (largest difference {gap:.2g}): its forward changes what a stage is given outside the "
            "parts the layout names; use ddp, zero1/2/3 or tp")
