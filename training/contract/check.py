"""The user's model and data checked before any rank starts: what they are, or one line saying
what is wrong.

`describe` imports the factories `model._target_` and `data._target_` name, checks their keyword
arguments against their signatures, builds the data set and looks at an item, builds the model
(on the CPU when it is small enough to run a real batch, else on the meta device), runs a batch of
two items through it and its loss, and reads its declarations (blocks, tensor-parallel plan,
pipeline layout). Every problem is a `ConfigError`: the key, what was found, how to fix it. What it
learns (`ContractFacts`) is what the config checks need to hold a strategy against the model.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from common.errors import ConfigError
from training.config import TARGET_KEY, DataConfig, ModelConfig

REAL_FORWARD_MAX_BYTES = 2 * 1024**3
"""Models up to this many bytes of fp32 parameters are checked with a real forward on the CPU
(token ids beyond the vocabulary show only there); larger ones on the meta device (shapes only)."""


@dataclass(frozen=True)
class ContractFacts:
    """What the checks learnt about a model and its data."""

    num_samples: int
    item: str
    """`pair` for (input, target) items, `dict` for dicts of tensors."""
    tokens_per_sample: int
    params: int
    blocks: int
    """Repeated blocks found (the FSDP, checkpointing and pipeline unit); 0: none."""
    blocks_found_by: str
    tp_plan: str | None
    """Where the tensor-parallel plan comes from; None: the model has none."""
    tp_problem: str | None
    """Why that plan can't be applied (an unsupported style, a pattern matching nothing)."""
    tp_sizes: dict[str, int]
    """Widths and head counts the tensor-parallel degree must divide."""
    pipeline_problem: str | None
    """Why the model can't be split into pipeline stages; None when it declares the layout."""
    checked_on: str
    """`cpu` (a real batch ran) or `meta` (shapes only: the model is too large to run here)."""
    sp_problem: str | None = None
    """Why strategy.sequence_parallel can't split the model (no norms declared `sequence_parallel`,
    a pattern matching nothing); None when it can."""
    attention_calls: int = 0
    """Calls of torch.nn.functional.scaled_dot_product_attention in one forward: the attention
    context parallelism can split (0: none it can)."""
    takes_position_ids: bool = False
    """The model's forward accepts `position_ids=` (what context parallelism passes)."""
    experts: list[int] = dataclasses.field(default_factory=list)
    """Experts of each experts module the model's expert plan names (training/contract/spec.py), which
    expert parallelism can split; empty: none."""
    ep_problem: str | None = None
    """Why the model's expert plan can't be applied (an unknown role, a pattern matching nothing, an
    experts module's undeclared parameter); None when it can, or it declares none."""


def _one_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def check_factory(key: str, target: str, kwargs: dict[str, Any]) -> Any:
    """The factory `target` names, with `kwargs` checked against its signature."""
    from training.contract.calls import resolve_target

    try:
        factory = resolve_target(target)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{key}.{TARGET_KEY}", target, f"cannot be imported ({_one_line(err)}); is its package "
                          "installed or on PYTHONPATH?") from None
    if not callable(factory):
        raise ConfigError(f"{key}.{TARGET_KEY}", target, f"is a {type(factory).__name__}, not a function or class")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return factory  # a builtin without a signature: its own error will say
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for name in kwargs:
        if not takes_any and name not in named and not name.startswith("_"):
            raise ConfigError(f"{key}.{name}", kwargs[name], f"{target} takes no argument {name!r}; it takes "
                              f"{', '.join(named) or 'none'}")
    for name, p in params.items():
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in kwargs:
            raise ConfigError(f"{key}.{name}", None, f"{target} needs it: add +{key}.{name}=<value> (or put it in "
                              "your YAML)")
    return factory


def describe(model_cfg: ModelConfig, data_cfg: DataConfig, seed: int) -> ContractFacts:
    """Check the model and data contract; its facts, or ConfigError (see the module docstring)."""
    import torch

    from training.parallel.cp import count_attention_calls, takes_position_ids

    check_factory("model", model_cfg.target, model_cfg.kwargs)
    check_factory("data", data_cfg.target, data_cfg.kwargs)
    if model_cfg.loss is not None:
        check_factory("model.loss", model_cfg.loss.target, model_cfg.loss.kwargs)
    dataset = _dataset(data_cfg)
    items = [_item(dataset, i, data_cfg) for i in range(min(2, len(dataset)))]
    model = _model(model_cfg, seed, torch.device("meta"))
    params = sum(p.numel() for p in model.parameters())
    checked_on = "cpu" if params * 4 <= REAL_FORWARD_MAX_BYTES else "meta"
    if checked_on == "cpu":
        model = _model(model_cfg, seed, torch.device("cpu"))
    else:
        # transformers' default grouped GEMM (torch._grouped_mm) takes only bf16 on the meta
        # device: the shapes are checked through the routed loop the rulers count with.
        from training.contract.hf import count_experts_as_routed

        count_experts_as_routed(model)
    batch = _collate(items, data_cfg, torch.device(checked_on))
    _check_vocabulary(model, dataset, model_cfg, data_cfg)
    with count_attention_calls() as attention:
        _check_forward(model, model_cfg, data_cfg, batch)
    facts = _declarations(model, model_cfg, data_cfg, dataset, batch, params, checked_on)
    return dataclasses.replace(facts, attention_calls=attention.calls, takes_position_ids=takes_position_ids(model))


def _dataset(cfg: DataConfig) -> Any:
    from training.data import build_dataset

    try:
        dataset = build_dataset(cfg)
        size = len(dataset)
    except (TypeError, ValueError, OSError, RuntimeError, KeyError, IndexError) as err:
        raise ConfigError("data", cfg.name, f"{cfg.target} raised {_one_line(err)}") from None
    if size < 1:
        raise ConfigError("data", cfg.name, f"{cfg.target} returned an empty data set")
    return dataset


def _item(dataset: Any, i: int, cfg: DataConfig) -> Any:
    import torch

    try:
        item = dataset[i]
    except Exception as err:  # noqa: BLE001 - any failure to read an item is the user's data
        raise ConfigError("data", cfg.name, f"reading item {i} of {cfg.target} raised {_one_line(err)}") from None
    shape = ("a dataset item must be an (input, target) pair of tensors or a dict of tensors "
             "(Hugging Face style: input_ids, labels)")
    if isinstance(item, dict):
        bad = [k for k, v in item.items() if not isinstance(v, torch.Tensor | int | float)]
        if not item or bad:
            raise ConfigError("data", cfg.name, f"item {i} of {cfg.target} is a dict with "
                              f"{'no keys' if not item else f'{bad[0]!r} holding a {type(item[bad[0]]).__name__}'}; {shape}")
        return item
    if not isinstance(item, tuple | list) or len(item) != 2:
        what = f"a {len(item)}-tuple" if isinstance(item, tuple | list) else f"a {type(item).__name__}"
        raise ConfigError("data", cfg.name, f"item {i} of {cfg.target} is {what}; {shape}")
    if not all(isinstance(v, torch.Tensor | int | float) for v in item):
        raise ConfigError("data", cfg.name, f"item {i} of {cfg.target} holds a {type(item[0]).__name__} and a "
                          f"{type(item[1]).__name__}; {shape}")
    return item


def _collate(items: list[Any], cfg: DataConfig, dev: Any) -> Any:
    from torch.utils.data import default_collate

    from training.contract.calls import to_device

    try:
        return to_device(default_collate(items), dev)
    except (TypeError, RuntimeError) as err:
        raise ConfigError("data", cfg.name, f"items of {cfg.target} do not stack into a batch ({_one_line(err)}); "
                          "every item's tensors must have the same shape") from None


def _model(cfg: ModelConfig, seed: int, dev: Any) -> Any:
    from training.contract.calls import NotAModule, build_model

    try:
        with dev:
            return build_model(cfg, seed)
    except NotAModule as err:
        raise ConfigError(f"model.{TARGET_KEY}", cfg.target, str(err)) from None
    except Exception as err:  # noqa: BLE001 - the user's factory failed: say how, in one line
        raise ConfigError("model", cfg.name, f"{cfg.target} raised {_one_line(err)}") from None


def _check_vocabulary(model: Any, dataset: Any, model_cfg: ModelConfig, data_cfg: DataConfig) -> None:
    """A data set that says its vocabulary (a token file's .json) against the model's input
    embedding: two samples may not show an id beyond it, a long run would."""
    from torch import nn

    vocab = getattr(dataset, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if isinstance(embedding, nn.Embedding) and embedding.num_embeddings < vocab:
        raise ConfigError("data", data_cfg.name, f"holds token ids up to {vocab - 1} (vocabulary {vocab}), but "
                          f"model={model_cfg.name} embeds only {embedding.num_embeddings}: raise the model's vocabulary")


def _check_forward(model: Any, model_cfg: ModelConfig, data_cfg: DataConfig, batch: Any) -> None:
    import torch

    from training.contract.calls import batch_loss, model_loss

    try:
        loss = batch_loss(model, batch, model_loss(model_cfg))
    except Exception as err:  # noqa: BLE001 - whatever the forward raised is the mismatch to report
        raise ConfigError("data", data_cfg.name, f"a batch of {data_cfg.name} does not fit model={model_cfg.name} "
                          f"({_one_line(err)})") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError("model.loss", model_cfg.name, f"the loss must be a scalar tensor; got "
                          f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")


def _declarations(model: Any, model_cfg: ModelConfig, data_cfg: DataConfig, dataset: Any, batch: Any,
                  params: int, checked_on: str) -> ContractFacts:
    from common.errors import ContractError
    from training.contract.blocks import find_blocks
    from training.contract.calls import tokens_per_sample
    from training.contract.spec import model_spec, tp_divisors
    from training.parallel.chunks import composition_problem

    try:
        find_blocks(model, model_cfg.blocks)
    except ContractError as err:
        raise ConfigError("model.blocks", model_cfg.blocks, str(err).split(": ", 1)[-1]) from None
    spec = model_spec(model, model_cfg)
    found_by = ("model.blocks" if model_cfg.blocks else
                "_no_split_modules" if getattr(model, "_no_split_modules", None) and spec.blocks else
                "the longest list of same-class modules")
    tp_problem, sizes = None, {}
    if spec.plan is not None:
        try:
            resolved = spec.tp_plan(model)
            sizes = tp_divisors(model, resolved)
        except ContractError as err:
            tp_problem = str(err)
    try:
        layout = spec.layout(model)
        # A real batch through the stages the layout cuts (only the CPU check runs one).
        runs = checked_on == "cpu" and not isinstance(batch, dict)
        pipeline_problem = composition_problem(model, layout, batch[0]) if runs else None
    except ContractError as err:
        pipeline_problem = str(err)
    try:
        spec.sp_norms(model)
        sp_problem = None
    except ContractError as err:
        sp_problem = str(err)
    try:
        experts, ep_problem = [site.n_experts for site in spec.experts(model)], None
    except ContractError as err:
        experts, ep_problem = [], str(err)
    return ContractFacts(
        experts=experts,
        ep_problem=ep_problem,
        num_samples=len(dataset),
        item="dict" if isinstance(batch, dict) else "pair",
        tokens_per_sample=tokens_per_sample(batch),
        params=params,
        blocks=len(spec.blocks),
        blocks_found_by=found_by,
        tp_plan=spec.plan[1] if spec.plan is not None else None,
        tp_problem=tp_problem,
        tp_sizes=sizes,
        pipeline_problem=pipeline_problem,
        sp_problem=sp_problem,
        checked_on=checked_on,
    )
