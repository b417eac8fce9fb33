"""What only the model can say about itself, read from the built module and the `model` config.

The parallel code (training/parallel/) reads these and names no module of any model:
- **blocks**: the repeated units FSDP shards one by one, activation checkpointing recomputes and
  pipeline stages are cut between. `model.blocks=<dotted path>` names their container; otherwise
  the modules of the model's `_no_split_modules` classes (Hugging Face's FSDP unit), else the
  longest `ModuleList`/`ModuleDict` whose children share one class.
- **tensor-parallel plan**: module-name patterns -> `colwise`/`rowwise`/`colwise_rep`/
  `rowwise_rep`, from `model.tp_plan`, else the model's own `config.base_model_tp_plan` (relative
  to its base model, Hugging Face) or `_tp_plan`. Entries styled `sequence_parallel` (Hugging
  Face's word) name the norms sequence parallelism splits by position; `model.sp_plan` adds such
  entries to a plan that lacks them. Entries styled `replicated_with_grad_allreduce` name a module
  inside a split region that stays whole (Qwen3's per-head q/k norms), its gradients summed.
- **pipeline layout** (torchtitan's contract): blocks in an `nn.ModuleDict` (names stay stable when
  a stage deletes the others), `pp_first`/`pp_last` naming what only the first and last stage keep,
  and a forward that skips whatever is None. Else Hugging Face's: `config.base_model_pp_plan` names
  the base model's parts in forward order (those before the blocks' container only the first stage
  keeps, those after it only the last), the model class's `_pp_plan` its head (the last stage's);
  a stage's missing parts become pass-through placeholders, since Hugging Face's forward calls
  them all, and its forward is adapted (training/contract/hf.py: token ids in on the first stage,
  hidden states as `inputs_embeds` on the others, a tensor out).
- **expert-parallel plan**: module-name patterns in Hugging Face's `base_model_ep_plan` words, from
  `model.ep_plan`, else the model's `config.base_model_ep_plan` (relative to its base model) or
  `_ep_plan`: `ep_dispatch_experts` names an experts module called as `(tokens, top_k_index,
  top_k_weights)` (tokens x d, tokens x k chosen experts with the index E marking a dropped slot,
  tokens x k weights; out: tokens x d, each token's weighted sum; optionally also
  `forward_grouped(tokens grouped by expert, counts)`, which expert parallelism then calls on the
  tokens it received), `grouped_gemm` each of its
  parameters, stacked along the experts in dim 0; `ep_router` is accepted (the router stays whole:
  each rank routes its own tokens). Mixtral, Qwen3-MoE and the other transformers MoE families
  declare it; so does the built-in MoE GPT.
- **head**: the last part the pipeline layout gives the last stage, when it is a linear layer
  (the output projection: `output`, Hugging Face's `lm_head`). Tensor parallelism splits it by
  vocabulary and keeps its logits split into the loss (torchtitan's loss parallelism), unless its
  weight is tied to the embeddings or `model.loss` is the user's own (which gets whole logits).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from common.errors import ContractError
from training.config import (
    EP_EXPERTS,
    EP_ROLES,
    EP_WEIGHTS,
    REPLICATED_STYLE,
    SP_STYLE,
    TP_STYLES,
    ModelConfig,
)
from training.contract.blocks import Block, PipelineLayout, Skipped, _submodule, find_blocks, pipeline_layout

HEAD_ATTRS = ("num_attention_heads", "num_key_value_heads", "n_heads", "num_heads", "n_head")
"""Attributes that hold a head count, on the model's config or on any module: tensor parallelism
must divide each."""


def tp_plan(model: nn.Module, cfg: ModelConfig) -> tuple[dict[str, str], str] | None:
    """The tensor-parallel plan with names from the model's root, `model.sp_plan`'s entries added,
    and where it came from; None when neither the config nor the model has one."""
    found = _own_plan(model, cfg)
    if found is None or not cfg.sp_plan:
        return found
    plan, source = found
    return {**plan, **cfg.sp_plan}, f"{source} + model.sp_plan"


def _own_plan(model: nn.Module, cfg: ModelConfig) -> tuple[dict[str, str], str] | None:
    return _declared(model, cfg.tp_plan, "tp")


def _declared(model: nn.Module, given: dict[str, str] | None, kind: str) -> tuple[dict[str, str], str] | None:
    """The `kind` ("tp", "ep") plan with names from the model's root and where it came from: the
    config's `model.<kind>_plan`, else the model's `config.base_model_<kind>_plan` (relative to its
    base model, Hugging Face's), else its class's `_<kind>_plan`; None when none is declared."""
    if given:
        return dict(given), f"model.{kind}_plan"
    config = getattr(model, "config", None)
    base = getattr(config, f"base_model_{kind}_plan", None)
    if base:
        prefix = getattr(model, "base_model_prefix", "")
        root = f"{prefix}." if prefix and hasattr(model, prefix) else ""
        return {f"{root}{k}": v for k, v in base.items()}, f"{type(config).__name__}.base_model_{kind}_plan"
    own = getattr(model, f"_{kind}_plan", None)
    if own:
        return dict(own), f"{type(model).__name__}._{kind}_plan"
    return None


@dataclass(frozen=True)
class ExpertSite:
    """An experts module the expert-parallel plan names."""

    name: str
    module: nn.Module
    n_experts: int
    weights: tuple[str, ...]
    """Its parameters (their names in it), each stacked along the experts in dim 0."""


def resolve_experts(model: nn.Module, plan: dict[str, str], source: str, whole: bool = True) -> list[ExpertSite]:
    """The experts modules the plan names, checked: every pattern matches (in a `whole` model: a
    pipeline stage holds only some), and every parameter of an experts module is declared
    `grouped_gemm` with the same number of experts along dim 0."""
    names = {name: module for name, module in model.named_modules() if not isinstance(module, Skipped)}
    for pattern, role in plan.items():
        if role not in EP_ROLES:
            raise ContractError(f"{source}[{pattern!r}]={role!r}: supported roles are {', '.join(EP_ROLES)}")
    params = dict(model.named_parameters())
    for pattern in plan if whole else []:
        if not any(_pattern(pattern).match(n) for n in [*names, *params]):
            raise ContractError(f"{source}[{pattern!r}] matches no module or parameter of {type(model).__name__}")
    experts = [p for p, role in plan.items() if role == EP_EXPERTS]
    stacked = [p for p, role in plan.items() if role == EP_WEIGHTS]
    sites = []
    for name, module in names.items():
        if not any(_pattern(p).match(name) for p in experts):
            continue
        own = list(module.named_parameters())
        undeclared = [n for n, _ in own if not any(_pattern(p).match(f"{name}.{n}") for p in stacked)]
        if not own or undeclared:
            raise ContractError(f"{source} names {name} ({type(module).__name__}) {EP_EXPERTS}, but "
                                f"{f'{name}.{undeclared[0]}' if own else 'it has no parameter'} is not declared "
                                f"{EP_WEIGHTS}: expert parallelism splits every parameter of it along the experts")
        counts = {tuple(p.shape)[:1] for _, p in own}
        if len(counts) != 1 or not next(iter(counts)):
            raise ContractError(f"{source}: the {EP_WEIGHTS} parameters of {name} do not share one number of "
                                f"experts in dim 0 ({', '.join(f'{n} {tuple(p.shape)}' for n, p in own)})")
        sites.append(ExpertSite(name, module, next(iter(counts))[0], tuple(n for n, _ in own)))
    return sites


def _pattern(glob: str) -> re.Pattern[str]:
    """A plan key as a regex: `*` matches one dotted name (a layer index)."""
    return re.compile("^" + r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in glob.split(".")) + "$")


def resolve_plan(model: nn.Module, plan: dict[str, str], source: str) -> dict[str, str]:
    """The plan's entries expanded to the module names they match, checked: every style is one we
    apply and every pattern matches a linear layer, or, styled `replicated_with_grad_allreduce`, a
    module with parameters (`sequence_parallel` entries: sp_norms)."""
    # A pipeline stage's placeholders (Skipped) stand for parts it doesn't hold: nothing to split.
    names = {name: module for name, module in model.named_modules() if not isinstance(module, Skipped)}
    # A family's own plan covers every kind of layer the family builds, and a config may build only
    # some (Qwen3-MoE's dense `mlp.gate_proj` where every layer is a mixture of experts): as in
    # transformers, its patterns that match nothing split nothing. A user's plan is checked whole.
    declared_by_user = source.startswith("model.")
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style == SP_STYLE:
            continue
        if style not in TP_STYLES:
            raise ContractError(f"{source}[{pattern!r}]={style!r}: supported styles are {', '.join(TP_STYLES)}; "
                                "give a plan of those in model.tp_plan")
        matched = [n for n in names if _pattern(pattern).match(n)]
        if not matched and declared_by_user:
            raise ContractError(f"{source}[{pattern!r}] matches no module of {type(model).__name__}")
        for name in matched:
            if style == REPLICATED_STYLE:
                if next(names[name].parameters(), None) is None:
                    raise ContractError(f"{source}[{pattern!r}] matches {name}, which has no parameters to "
                                        f"keep whole: {REPLICATED_STYLE} names a module with parameters")
            elif not isinstance(names[name], nn.Linear):
                raise ContractError(f"{source}[{pattern!r}] matches {name}, a {type(names[name]).__name__}; "
                                    "tensor parallelism splits nn.Linear layers")
            resolved[name] = style
    return resolved


def sp_norms(model: nn.Module, plan: dict[str, str], source: str, whole: bool = True) -> list[str]:
    """The module names the plan's `sequence_parallel` patterns match, in the model's order;
    ContractError for a pattern that matches nothing in a `whole` model (a pipeline stage holds
    only some)."""
    patterns = [p for p, style in plan.items() if style == SP_STYLE]
    names = [name for name, module in model.named_modules() if not isinstance(module, Skipped)]
    for pattern in patterns if whole else []:
        if not any(_pattern(pattern).match(n) for n in names):
            raise ContractError(f"{source}[{pattern!r}] matches no module of {type(model).__name__}")
    return [n for n in names if any(_pattern(p).match(n) for p in patterns)]


def tp_divisors(model: nn.Module, resolved: dict[str, str]) -> dict[str, int]:
    """What the tensor-parallel degree must divide: the split widths and every head count."""
    out: dict[str, int] = {}
    for name, style in resolved.items():
        linear = model.get_submodule(name)
        if style == REPLICATED_STYLE:
            continue  # not split
        if style.startswith("colwise"):
            out[f"{name}.out_features"] = linear.out_features
        else:
            out[f"{name}.in_features"] = linear.in_features
    holders = [getattr(model, "config", None), *model.modules()]
    for holder in holders:
        for attr in HEAD_ATTRS:
            value = getattr(holder, attr, None) if holder is not None else None
            if isinstance(value, int) and value > 0:
                out[attr] = value
    return out


@dataclass(frozen=True)
class Pending:
    """A model built on the meta device, to be materialized shard by shard once sharded
    (training/parallel/materialize.py)."""

    names: dict[nn.Module, str]
    """Each module's name in the model as built: its initialisation's seed."""
    init: Callable[[nn.Module], None] | None
    """The model's per-module initialiser (None: torch's reset_parameters)."""
    seed: int
    weights_dir: str | None = None
    """A checkpoint to read the values from (shard by shard), where the model names one."""


@dataclass
class ModelSpec:
    """One built model's declarations, as the parallel code reads them."""

    blocks: list[Block]
    plan: tuple[dict[str, str], str] | None
    """The tensor-parallel plan (patterns from the root) and where it came from; None: no plan."""
    pending: Pending | None = None
    """Set when the model's parameters are still on the meta device, waiting for their shards."""
    split_head: bool = True
    """Whether the loss takes vocabulary-split logits (false for a `model.loss` of the user's own)."""
    ep_plan: tuple[dict[str, str], str] | None = None
    """The expert-parallel plan (patterns from the root) and where it came from; None: no plan."""

    def live_blocks(self) -> list[Block]:
        """The blocks still in the model (a pipeline stage deletes the others, or skips them)."""
        return [b for b in self.blocks
                if b.name in dict(b.parent.named_children()) and not isinstance(b.module, Skipped)]

    def tp_plan(self, model: nn.Module) -> dict[str, str]:
        """The plan resolved to module names; ContractError when the model has none."""
        if self.plan is None:
            raise ContractError(f"{type(model).__name__} has no tensor-parallel plan: give model.tp_plan "
                                "(module-name pattern -> colwise/rowwise), or use ddp, zero1/2/3 or pp")
        return resolve_plan(model, *self.plan)

    def sp_norms(self, model: nn.Module, whole: bool = True) -> list[str]:
        """The norms sequence parallelism splits by position (those this pipeline stage holds where
        not `whole`); ContractError when the plan names none."""
        names = sp_norms(model, *self.plan, whole=whole) if self.plan is not None else []
        if not names:
            raise ContractError(f"{type(model).__name__} declares no sequence-parallel norms: give model.sp_plan "
                                "(norm-name pattern -> sequence_parallel, every norm of the blocks and the final "
                                "one), or set strategy.sequence_parallel=false")
        return names

    def layout(self, model: nn.Module) -> PipelineLayout:
        return pipeline_layout(model, self.blocks)

    def experts(self, model: nn.Module, whole: bool = True) -> list[ExpertSite]:
        """The experts modules the plan names (those this pipeline stage holds where not `whole`);
        none without a plan. ContractError for a plan that does not fit the model."""
        return resolve_experts(model, *self.ep_plan, whole=whole) if self.ep_plan is not None else []

    def head(self, model: nn.Module) -> str | None:
        """The output projection tensor parallelism splits by vocabulary, where this (part of the)
        model holds it; None where it has none, or its loss must see whole logits, or the head's
        weight is tied to the embeddings (the layout refuses those)."""
        if not self.split_head:
            return None
        try:
            last = self.layout(model).last
        except ContractError:
            return None
        return last[-1] if last and isinstance(_submodule(model, last[-1]), nn.Linear) else None

    def keep_first_blocks(self, count: int) -> None:
        """Delete every block after the first `count`, in place: a slice of the model (its
        embeddings, first blocks and head) that the plan can hold when the whole can't."""
        for block in reversed(self.blocks[count:]):
            if isinstance(block.parent, nn.ModuleDict):
                del block.parent[block.name]
            else:
                del block.parent[int(block.name)]
        self.blocks = self.blocks[:count]


def model_spec(model: nn.Module, cfg: ModelConfig) -> ModelSpec:
    """Read `model`'s declarations (and the `model` config's overrides of them)."""
    return ModelSpec(find_blocks(model, cfg.blocks), tp_plan(model, cfg), split_head=cfg.loss is None,
                     ep_plan=_declared(model, cfg.ep_plan, "ep"))
