"""Activation checkpointing: recompute each block's activations in backward instead of keeping them."""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from training.models.spec import Block


def apply_ac(blocks: list[Block]) -> None:
    """Wrap every block in place so that only its input is saved for backward."""
    for block in blocks:
        block.replace(checkpoint_wrapper(block.module, preserve_rng_state=False))
