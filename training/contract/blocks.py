"""A model's repeated blocks and its pipeline layout: the blocks found (a declared path, the classes
Hugging Face names, else the longest list of alike modules) or declared, a skipped block's stand-in,
and the layout a pipeline stage is cut by (Hugging Face's base_model_pp_plan or the model's own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from common.errors import ContractError


@dataclass(frozen=True)
class Block:
    parent: nn.Module
    name: str
    """The attribute of `parent` that holds the block (a ModuleList/ModuleDict key)."""

    @property
    def module(self) -> nn.Module:
        return getattr(self.parent, self.name)

    def replace(self, module: nn.Module) -> None:
        setattr(self.parent, self.name, module)


class Skipped(nn.Module):
    """What a pipeline stage holds in place of a part it doesn't own, where the model's forward calls
    every part (Hugging Face's): passes its first input through (transformers' PipelineIdentityLayer).
    Keeps the plain attributes of the part it stands for (a layer's `attention_type`, which some
    forwards read to pick a mask)."""

    def __init__(self, stands_for: nn.Module | None = None):
        super().__init__()
        for key, value in vars(stands_for or nn.Module()).items():
            if not key.startswith("_") and isinstance(value, str | int | float | bool):
                setattr(self, key, value)

    def forward(self, *args: object, **kwargs: object) -> object:
        return args[0] if args else next(iter(kwargs.values()))


@dataclass(frozen=True)
class PipelineLayout:
    container: str
    """Dotted path of the blocks' container (an nn.ModuleDict, or a ModuleList under placeholders)."""
    first: tuple[str, ...]
    """Dotted paths of what only the first stage keeps (embeddings)."""
    last: tuple[str, ...]
    """Dotted paths of what only the last stage keeps (final norm, head)."""
    source: str = "pp_first/pp_last"
    placeholders: bool = False
    """A stage's missing blocks and ends become `Skipped` (the forward calls them all), instead of
    being deleted (blocks) and set to None (ends)."""
    stage_forward: Callable[[nn.Module, bool], None] | None = None
    """Adapts a stage module's forward (given whether it is the first stage) to take and return the
    one tensor stages pass on; None: the model's own forward does."""

    def parts(self, model: nn.Module, paths: tuple[str, ...]) -> list[nn.Module]:
        """The modules at `paths` that `model` still holds (a stage removed the others)."""
        found = [_submodule(model, path) for path in paths]
        return [m for m in found if m is not None and not isinstance(m, Skipped)]


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:  # a stage set it to None
        return None


def find_blocks(model: nn.Module, path: str | None = None) -> list[Block]:
    """The model's repeated blocks, in forward order (see the module docstring for the rules)."""
    if path:
        try:
            container = model.get_submodule(path)
        except AttributeError:
            raise ContractError(f"model.blocks={path!r}: the model has no submodule there") from None
        if not isinstance(container, nn.ModuleList | nn.ModuleDict | nn.Sequential):
            raise ContractError(f"model.blocks={path!r} is a {type(container).__name__}; it must name an "
                                "nn.ModuleList, nn.ModuleDict or nn.Sequential of the repeated blocks")
        return [Block(container, name) for name, _ in container.named_children()]
    classes = set(getattr(model, "_no_split_modules", None) or [])
    if classes:
        found = _blocks_of_classes(model, classes)
        if found:
            return found
    return _longest_uniform_list(model)


def _blocks_of_classes(model: nn.Module, classes: set[str]) -> list[Block]:
    """Outermost modules whose class is named in `classes`, with their parents."""
    blocks: list[Block] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ in classes and name and not any(name.startswith(t + ".") for t in taken):
            parent_name, _, attr = name.rpartition(".")
            blocks.append(Block(model.get_submodule(parent_name) if parent_name else model, attr))
            taken.append(name)
    return blocks


def _longest_uniform_list(model: nn.Module) -> list[Block]:
    best: nn.Module | None = None
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList | nn.ModuleDict):
            children = list(module.children())
            if len(children) >= 1 and len({type(c) for c in children}) == 1:
                if best is None or len(children) > len(list(best.children())):
                    best = module
    if best is None:
        return []
    return [Block(best, name) for name, _ in best.named_children()]


def blocks_path(model: nn.Module, blocks: list[Block]) -> str | None:
    """The dotted path of the blocks' container, when they share one."""
    parents = {id(b.parent) for b in blocks}
    if len(parents) != 1:
        return None
    return next((name for name, m in model.named_modules() if m is blocks[0].parent), None)


def pipeline_layout(model: nn.Module, blocks: list[Block]) -> PipelineLayout:
    """The model's pipeline layout, or ContractError saying what to declare."""
    first, last = getattr(model, "pp_first", None), getattr(model, "pp_last", None)
    parents = {id(b.parent) for b in blocks}
    container = blocks[0].parent if blocks else None
    path = blocks_path(model, blocks) if blocks else None
    if first is not None and last is not None and len(parents) == 1 and isinstance(container, nn.ModuleDict):
        layout = PipelineLayout(path or "", tuple(first), tuple(last))
    else:
        layout = _hf_layout(model, path)
    if layout is None:
        raise ContractError(
            f"{type(model).__name__} declares no pipeline layout: keep its blocks in an nn.ModuleDict, set "
            "pp_first and pp_last (the attributes only the first and the last stage keep, e.g. embeddings and "
            "head) on the class, and let forward skip whatever is None; or use ddp, zero1/2/3 or tp")
    _check_untied(model, layout)
    return layout


def _hf_layout(model: nn.Module, container: str | None) -> PipelineLayout | None:
    """The layout Hugging Face's `config.base_model_pp_plan` declares (its parts in forward order,
    relative to the base model) with the class's `_pp_plan` (the head); None without a plan that
    names the blocks' container."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None)
    if not plan or container is None:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    paths = [f"{base}{name}" for name in plan]
    if container not in paths:
        return None
    at = paths.index(container)
    head = tuple(getattr(type(model), "_pp_plan", None) or {})
    first, last = tuple(paths[:at]), (*paths[at + 1:], *head)
    missing = [p for p in (*first, *last) if _submodule(model, p) is None]
    if missing:
        raise ContractError(f"{type(config).__name__}.base_model_pp_plan names {missing[0]!r}, which "
                            f"{type(model).__name__} does not have")
    from training.contract.hf import stage_forward

    return PipelineLayout(container, first, last, f"{type(config).__name__}.base_model_pp_plan",
                          placeholders=True, stage_forward=stage_forward)


def _check_untied(model: nn.Module, layout: PipelineLayout) -> None:
    """A parameter the first and the last stage share (tied embeddings) would be two parameters,
    each trained by its own stage: refuse the layout."""
    first = {id(p): path for path in layout.first for m in layout.parts(model, (path,)) for p in m.parameters()}
    for path in layout.last:
        for name, p in (m for module in layout.parts(model, (path,)) for m in module.named_parameters()):
            if id(p) in first:
                raise ContractError(f"{type(model).__name__} ties {path}.{name} to a parameter of "
                                    f"{first[id(p)]}: the first and last pipeline stages would each train "
                                    "their own copy; untie them (tie_word_embeddings=false) or use ddp, "
                                    "zero1/2/3 or tp")
