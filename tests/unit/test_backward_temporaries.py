"""What a block's backward holds while it runs, beside the saved activations and the weight
gradients (training/activations.py BackwardTemporaries), against hand counts, on CPU and on the
meta device alike (the plan counts it there)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from training.activations import backward_temporaries

S, H = 32, 64


class Sliced(nn.Module):
    """Four matrices in one parameter, each used through a slice: every slice's gradient is made
    whole-parameter-sized before autograd adds them (select's backward), whatever the batch."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, H, H) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(torch.relu(x @ self.w[e]) for e in range(4))


def _peaks(block: nn.Module, dev: str, batches=(1, 2, 4)) -> list[int]:
    block = block.to(dev)
    model = nn.Sequential(nn.Linear(H, H), block).to(dev)
    return [backward_temporaries(model, [block], lambda b=b: model(torch.randn(b, S, H, device=dev)).sum())
            for b in batches]


@pytest.mark.parametrize("dev", ["cpu", "meta"])
def test_an_mlps_backward_holds_two_hidden_gradients_per_sample(dev):
    """Linear(64, 256), GELU, Linear(256, 64) at 32 positions: the second linear's input gradient
    (32 x 256 fp32, 32 KiB) and GELU's (another 32 KiB) are held together; the weight gradients
    and the gradient the block was given are not counted."""
    mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
    assert _peaks(mlp, dev) == [b * 2 * S * 4 * H * 4 for b in (1, 2, 4)]


@pytest.mark.parametrize("dev", ["cpu", "meta"])
def test_weight_sized_scratch_does_not_grow_with_the_batch(dev):
    """The four slices' whole-sized gradients (64 KiB each), three held at once beside the final
    one (a weight gradient, not counted): 192 KiB at any batch; ReLU's input gradient per sample
    (32 x 64 fp32, 8 KiB)."""
    peaks = _peaks(Sliced(), dev)
    assert peaks == [3 * 4 * H * H * 4 + b * S * H * 4 for b in (1, 2, 4)]
