"""Which saved activations tensor parallelism splits, read from the model's own TP plan.

Without sequence parallelism (Korthikanti et al. 2022, Table 2), a TP rank keeps whole copies of
what is saved outside the split region: the norms' inputs, the residual stream and the inputs of
the column-split linears; what is saved between a column-split linear's output and the next
row-split linear's input (attention's q, k, v and output, the MLP's hidden activations) is split
over the TP ranks. So one forward + backward, with the plan's modules marking where a split region
opens (`colwise` output) and closes (`rowwise` output), counts both parts per sample at once: on
the meta device, for any model that declares a plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from training.memory import SavedActivations


@dataclass(frozen=True)
class TpSplit:
    saved_bytes: int
    """Everything saved for backward (parameters excluded)."""
    replicated_bytes: int
    """The part saved outside the split regions: whole on every TP rank."""


OPENS = ("colwise",)
"""Styles whose output is split: a split region starts after them (not `colwise_rep`/`_gather`,
whose output is gathered whole again)."""
CLOSES = ("rowwise",)
"""Styles whose output is whole again (reduced): the region ends after them."""


def _role(style: str) -> str | None:
    if style in OPENS:
        return "open"
    if style.startswith(CLOSES):
        return "close"
    return None


def measure_tp_split(model: nn.Module, plan: dict[str, str], run: Callable[[], torch.Tensor]) -> TpSplit:
    """Run `run` (a forward returning the loss) and its backward, counting saved bytes by where
    they were saved; `plan` is the model's TP plan as full module names -> styles."""
    inside = [False]
    split_keys: set[int] = set()
    saved = _Classifier(model, inside, split_keys)
    handles = []
    for name, style in plan.items():
        role = _role(style)
        if role is not None:
            opened = role == "open"
            handles.append(model.get_submodule(name).register_forward_hook(
                lambda m, a, o, opened=opened: inside.__setitem__(0, opened)))
    try:
        with saved:
            run().backward()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    total = saved.bytes
    whole = sum(n for k, n in saved.sizes.items() if k not in split_keys)
    return TpSplit(total, whole)


class _Classifier(SavedActivations):
    """SavedActivations that also notes which storages were first saved inside a split region."""

    def __init__(self, model: nn.Module, inside: list[bool], split_keys: set[int]):
        super().__init__(model)
        self.inside, self.split_keys = inside, split_keys

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        before = set(self._seen)
        out = super()._pack(t)
        if self.inside[0]:
            self.split_keys.update(set(self._seen) - before)
        return out

    @property
    def sizes(self) -> dict[int, int]:
        return dict(self._seen)
