"""A model built from its `_target_`, the loss it trains on, and a batch through it: nothing here
knows a particular model (the built-in GPT and MLP are factories named in their YAML like any
user's, `_target_: training.models.gpt.build`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from training.config import ModelConfig, Target

Batch = tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]
"""One micro-batch as the DataLoader collates it: `(inputs, targets)` or a dict of tensors."""


LossFn = Callable[[Any, torch.Tensor | None], torch.Tensor]
"""`loss(output, target) -> scalar`: what the model's output is trained against."""


def resolve_target(target: str) -> Any:
    """The object a `_target_` names (`package.module.attr`, nested attributes allowed). Raises
    ModuleNotFoundError when no prefix of it imports, and lets an import error from inside the
    user's module (a dependency it lacks) through as it is."""
    parts = target.split(".")
    missing: ModuleNotFoundError | None = None
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
                raise  # the module exists but imports something that doesn't
            missing = missing or err
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            if missing is not None:  # `pkg.nope.build`: the module that is not there is the news
                raise missing from None
            raise
        return obj
    raise missing or ModuleNotFoundError(f"no module in {target!r}")


def instantiate(target: str, kwargs: dict[str, Any]) -> Any:
    """`target(**kwargs)`, with nested `_target_` nodes in the kwargs instantiated by Hydra's rules."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate({"_target_": target, **kwargs}, _convert_="all")
    except InstantiationException as err:
        # Hydra wraps the factory's own error in a paragraph; the factory's error is the news.
        if err.__cause__ is not None:
            raise err.__cause__ from None
        raise


class NotAModule(TypeError):
    """The model factory returned something that is not an `nn.Module`."""


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The model, initialised from `seed` (identically on every rank), on the current default
    device (wrap in `torch.device("meta")` to build without memory)."""
    torch.manual_seed(seed)
    model = instantiate(cfg.target, cfg.kwargs)
    if not isinstance(model, nn.Module):
        raise NotAModule(f"returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: a tensor, a Hugging Face output's `.logits`, or a tuple's first."""
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "logits", None) is not None:
        return output.logits
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the model returned a {type(output).__name__}: a tensor of logits, an object with .logits "
                    "or .loss, or a tuple starting with the logits was expected; set model.loss for anything else")


def cross_entropy(output: Any, target: torch.Tensor | None) -> torch.Tensor:
    """Mean cross-entropy of the logits over every predicted position (tokens) or sample (classes)."""
    if target is None:
        raise TypeError("the batch has no target (labels) and the model returned no .loss")
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def model_loss(cfg: ModelConfig) -> LossFn:
    """loss(output, target): `model.loss._target_` when set; else the output's own `.loss` (Hugging
    Face, given labels) when it has one; else cross-entropy of the logits against the target."""
    custom = _custom_loss(cfg.loss) if cfg.loss is not None else None

    def loss(output: Any, target: torch.Tensor | None) -> torch.Tensor:
        if custom is not None:
            return custom(output, target)
        own = getattr(output, "loss", None)
        if isinstance(own, torch.Tensor):
            return own
        return cross_entropy(output, target)

    return loss


def _custom_loss(spec: Target) -> LossFn:
    made = instantiate(spec.target, spec.kwargs) if spec.kwargs else resolve_target(spec.target)
    if not callable(made):
        raise TypeError(f"model.loss._target_={spec.target} gave a {type(made).__name__}, not a callable")
    return made


def forward(model: nn.Module, batch: Batch) -> tuple[Any, torch.Tensor | None]:
    """The model's output on a batch and the target to hold it against: `model(inputs)` for an
    `(inputs, target)` pair, `model(**batch)` for a dict (whose `labels` are the target)."""
    if isinstance(batch, dict):
        return model(**batch), batch.get("labels")
    inputs, target = batch
    return model(inputs), target


def batch_loss(model: nn.Module, batch: Batch, loss: LossFn) -> torch.Tensor:
    """The model's loss on one batch."""
    output, target = forward(model, batch)
    return loss(output, target)


def batch_size(batch: Batch) -> int:
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return first.shape[0]


def tokens_per_sample(batch: Batch) -> int:
    """Positions trained per sample: an integer (token id) input's length, else 1 (a feature row,
    an image: throughput is then counted in samples)."""
    inputs = batch.get("input_ids") if isinstance(batch, dict) else batch[0]
    if inputs is None or inputs.is_floating_point():
        return 1
    return inputs[0].numel()


def to_device(batch: Batch, dev: torch.device) -> Batch:
    non_blocking = dev.type == "cuda"
    if isinstance(batch, dict):
        return {k: v.to(dev, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return tuple(v.to(dev, non_blocking=non_blocking) for v in batch)
