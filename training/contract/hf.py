"""How a Hugging Face model meets the contract beyond what it declares: a pipeline stage's forward
through the model's own (the first stage takes token ids, the others hidden states), and its experts
run routed, as the plan counts them on the meta device (registered in transformers' experts
interface).
"""

from __future__ import annotations

from typing import Any

from torch import nn


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
