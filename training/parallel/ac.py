"""Activation checkpointing: recompute each block's activations in backward instead of keeping them."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_ac(model: nn.Module) -> nn.Module:
    """Wrap every block of `model.layers` so that only its input is saved for backward."""
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    return model
