"""Model construction from the `model` and `data` config groups, and the loss they train on."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from training.config import DataConfig, ModelConfig
from training.models.gpt import GPT
from training.models.mlp import MLP


def build_model(model: ModelConfig, data: DataConfig, seed: int) -> nn.Module:
    """The model, initialised from `seed` (identically on every rank)."""
    torch.manual_seed(seed)
    if model.kind == "gpt":
        return GPT(model.vocab_size, model.seq_len, model.d_model, model.n_layers, model.n_heads, model.ffn_mult)
    return MLP(data.num_features, model.d_model, model.n_layers, data.num_classes)


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every predicted position (tokens) or sample (classes)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def loss_fn(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The model's loss on one batch."""
    return logits_loss(model(inputs), targets)


def tokens_per_sample(model: ModelConfig) -> int:
    """Positions trained per sample: the sequence length for the GPT, 1 for the MLP."""
    return model.seq_len if model.kind == "gpt" else 1
