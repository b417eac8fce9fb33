"""A plain MLP classifier: the second model family, for feature data."""

from __future__ import annotations

import torch
from torch import nn


def build(in_features: int, num_classes: int, hidden: int = 256, depth: int = 3) -> MLP:
    """The factory `model=mlp` names; its input and output sizes come from the data's."""
    return MLP(in_features, hidden, depth, num_classes)


class MLP(nn.Module):
    pp_first: tuple[str, ...] = ()
    pp_last = ("output",)
    init_module = None
    """torch's own reset_parameters initialises it: it can be built on the meta device."""

    def __init__(self, in_features: int, hidden: int, depth: int, num_classes: int):
        super().__init__()
        dims = [in_features, *([hidden] * depth)]
        self.layers = nn.ModuleDict(
            {str(i): nn.Sequential(nn.Linear(a, b), nn.ReLU()) for i, (a, b) in enumerate(zip(dims, dims[1:], strict=False))}
        )
        self.output: nn.Linear | None = nn.Linear(dims[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return self.output(x) if self.output is not None else x
