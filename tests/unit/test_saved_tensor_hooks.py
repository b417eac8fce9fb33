"""The project's saved-tensor hooks observe what autograd saves; they must not change how long it
lives. A hook that stores the tensor it is given ties an op's saved output to the op's own node,
a cycle only a backward through the node breaks: a graph that is never backwarded (torch's
pipeline schedule infers the first stage's shapes with such a forward) then lives for the run."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from training.memory import SavedActivations
from training.parallel.inflight import InFlight


class Attention(nn.Module):
    """SDPA saves its own output for backward: the case that made the cycle."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _dies_without_backward(model: nn.Module, observe) -> bool:
    """Whether a forward's graph is freed once its output is dropped, never backwarded, while
    `observe` (a context manager) counts what it saves."""
    x = torch.randn(2, 8, 16)
    with observe:
        out = model(x)
    held = weakref.ref(out)
    del out
    gc.collect()
    return held() is None


def test_counting_saved_activations_keeps_nothing_alive():
    model = Attention()
    saved = SavedActivations(model)
    assert _dies_without_backward(model, saved)
    assert saved.bytes > 0, "it still counted what was saved"


def test_counting_in_flight_microbatches_keeps_nothing_alive():
    model = Attention()
    probe = InFlight([model], [1.0])
    with probe:
        assert _dies_without_backward(model, _Null())
    assert probe.peak.saved_bytes > 0


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None
