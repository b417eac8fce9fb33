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
from typing import Any

from torch import nn


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def causal_lm(model_class: str, config_class: str, pretrained: str | None = None, **config: Any) -> nn.Module:
    """`model_class(config_class(**config))`; with `pretrained` (a local directory holding
    config.json and safetensors weights), the architecture of its config (`**config` overriding
    it), its weights named for the materialization to read, each rank its own shard
    (training/parallel/materialize.py): nobody loads the whole checkpoint."""
    model_type, config_type = _class(model_class), _class(config_class)
    # Config classes take any keyword silently; a misspelt field would be a model that ignores it.
    known = set(config_type().to_dict())
    unknown = sorted(set(config) - known)
    if unknown:
        raise TypeError(f"{config_type.__name__} has no field {unknown[0]!r}")
    if pretrained is not None:
        model = model_type(config_type.from_pretrained(pretrained, **config))
        model.weights_dir = str(pretrained)
        return model
    return model_type(config_type(**config))


def stage_forward(model: nn.Module, first: bool) -> None:
    """Make a pipeline stage of a Hugging Face causal LM (the parts it doesn't own replaced by
    pass-through placeholders) take and return the one tensor stages pass on, through the model's
    own forward, as transformers' own pipeline split does: the first stage takes the token ids,
    the others the hidden states as `inputs_embeds` (the embedding is then not called). The base
    model's forward computes the positions, the causal mask and the rotary embedding from what it
    is given, on every stage. Out comes `.logits`: the logits on the last stage, the hidden states
    elsewhere (the head there is a placeholder). No KV cache: training keeps none."""
    own = model.forward
    key = "input_ids" if first else "inputs_embeds"

    def forward(x: Any, **kwargs: Any) -> Any:
        return own(**{key: x}, use_cache=False, **kwargs).logits

    model.forward = forward


ROUTED = "scalestudy_routed"
"""The experts implementation Hugging Face MoE models are counted with on the meta device."""


def routed_experts_forward(self: nn.Module, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """A Hugging Face experts module's forward (transformers' `use_experts_implementation`
    interface) as a loop over the experts, each on its group of routed slots, what grouped GEMM
    kernels compute and save: its FLOPs are the active parameters' (top-k experts a token), its
    saved tensors each slot's inputs. The groups are the router's, or on the meta device (no values)
    the slots spread evenly. transformers' own `grouped_mm` runs `torch._grouped_mm`, which the FLOP
    counter doesn't see and which needs bf16 on the meta device; its `batched_mm` gathers every
    slot's weights, and would be counted as saving them."""
    import torch
    import torch.nn.functional as F

    k = top_k_index.shape[-1]
    experts = top_k_index.reshape(-1)
    order = experts.argsort(stable=True)
    slots = hidden_states[torch.div(order, k, rounding_mode="floor")]
    n = self.num_experts
    if slots.is_meta:
        counts = [len(c) for c in torch.arange(slots.shape[0]).tensor_split(n)]
    else:
        counts = torch.bincount(experts, minlength=n).tolist()
    up = self.gate_up_proj if self.has_gate else self.up_proj
    outputs = []
    for e, chunk in enumerate(slots.split(counts)):
        if not counts[e]:
            continue
        hidden = chunk @ up[e] if self.is_transposed else F.linear(chunk, up[e])
        if self.has_bias:
            hidden = hidden + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[e]
        hidden = self._apply_gate(hidden) if self.has_gate else self.act_fn(hidden)
        hidden = hidden @ self.down_proj[e] if self.is_transposed else F.linear(hidden, self.down_proj[e])
        if self.has_bias:
            hidden = hidden + self.down_proj_bias[e]
        outputs.append(hidden)
    routed = torch.cat(outputs) * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(hidden_states.dtype)
    return torch.zeros_like(hidden_states).index_add(0, torch.div(order, k, rounding_mode="floor"), routed)


def count_experts_as_routed(model: nn.Module) -> None:
    """Have a Hugging Face MoE model's experts run routed_experts_forward (a no-op for any other
    model): what the plan's counting on the meta device uses."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) is None:
        return
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(ROUTED, routed_experts_forward)
    for module in model.modules():
        module_config = getattr(module, "config", None)
        if getattr(module_config, "_experts_implementation", None) is not None:
            module_config._experts_implementation = ROUTED
