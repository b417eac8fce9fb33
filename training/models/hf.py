"""Hugging Face causal language models, built from their config in code (nothing downloaded).

`model=hf-llama` names `causal_lm` with the model and config classes of one family; any causal-LM
family of transformers works the same way. The model keeps its own declarations, which the
parallel code reads like any user model's: `config.base_model_tp_plan` (colwise/rowwise strings
relative to the base model), `_no_split_modules` (the decoder layer: the FSDP and checkpointing
unit) and `config.base_model_pp_plan` (the pipeline layout: training/contract/spec.py). Its forward
returns `.loss` when given labels, and its logits otherwise.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

from torch import nn


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _read_by(model_type: type) -> set[str]:
    """The config fields the model's module reads: `config.<name>` and getattr(config, "<name>"...)."""
    # The module's file read as text: inspect.getsource would scan every loaded module for it.
    source = Path(sys.modules[model_type.__module__].__file__).read_text()
    return set(re.findall(r"\bconfig\.(\w+)", source)) | set(re.findall(r"getattr\(\s*config\s*,\s*[\"'](\w+)", source))


def causal_lm(model_class: str, config_class: str, pretrained: str | None = None, **config: Any) -> nn.Module:
    """`model_class(config_class(**config))`; with `pretrained` (a local directory holding
    config.json and safetensors weights), the architecture of its config (`**config` overriding
    it), its weights named for the materialization to read, each rank its own shard
    (training/parallel/materialize.py): nobody loads the whole checkpoint."""
    model_type, config_type = _class(model_class), _class(config_class)
    # Config classes take any keyword silently; a misspelt field would be a model that ignores it.
    # A field is one the config class declares or one the modeling code reads that it does not
    # (Qwen3-MoE's `head_dim`: getattr(config, "head_dim", hidden // heads)).
    known = set(config_type().to_dict())
    unknown = sorted(set(config) - known - _read_by(model_type))
    if unknown:
        raise TypeError(f"{config_type.__name__} has no field {unknown[0]!r}")
    if pretrained is not None:
        model = model_type(config_type.from_pretrained(pretrained, **config))
        model.weights_dir = str(pretrained)
        return model
    return model_type(config_type(**config))


