"""How many microbatches' activations a pipeline rank holds at once: what a schedule costs in memory.

A schedule's peak activation memory is its microbatches in flight — forwarded, their activations
saved, not yet fully backwarded — times one microbatch's activations. `InFlight` counts them on a
real run: each chunk's forward is tagged with its microbatch (a chunk forwards its microbatches in
order under every schedule), the tensors autograd saves for backward are held through packing
hooks, and a (chunk, microbatch) is in flight while autograd still holds any tensor it saved — for
the zero-bubble schedules that is until its weight-gradient pass.

Counts are in stage units: a chunk of b blocks counts b / (blocks / pp), so that one microbatch
through one stage of a one-stage-per-rank pipeline is 1 (GPipe's m, 1F1B's pp on stage 0, and
Megatron's interleaved pp·(1 + (pp−1)/(pp·v)) are in these units). Parameters a layer saves
(a linear keeps its weight) are not activations and are not counted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from training.memory import packed


@dataclass(frozen=True)
class InFlightPeak:
    stages: float
    """Peak microbatches in flight, in stage units (see the module docstring)."""
    chunk_microbatches: int
    """Peak (chunk, microbatch) pairs in flight."""
    saved_bytes: int
    """Peak bytes of the tensors autograd held for backward (each storage once)."""
    microbatch_bytes: int
    """Bytes one microbatch saves through all of this rank's chunks (its first microbatch)."""
    chunk_microbatches_each: tuple[int, ...] = ()
    """Per chunk, the most of its microbatches in flight at once: the last stage's chunk tells how
    many microbatches' head and loss activations the schedule holds."""


class _Held:
    """A saved tensor as autograd holds it: released when autograd lets the packed value go."""

    def __init__(self, t: torch.Tensor, release: object):
        self.t, self._release = t, release

    def __del__(self) -> None:
        self._release()


class InFlight:
    """Counts what `chunks` (one rank's, in stage order) hold in flight during the steps it is
    entered for; `weights[i]`: chunk i's blocks over the blocks of one stage at one stage a rank."""

    def __init__(self, chunks: list[nn.Module], weights: list[float]):
        self.chunks, self.weights = chunks, weights
        self._params = {p.untyped_storage()._cdata for c in chunks for p in c.parameters()}
        self._forwards = [0] * len(chunks)
        self._live: dict[tuple[int, int], int] = defaultdict(int)
        self._storages: dict[int, list[int]] = {}
        """storage -> [tensors holding it, its bytes]"""
        self._first_bytes: dict[int, int] = defaultdict(int)
        self._stack: list = []
        self._handles: list = []
        self.peak = InFlightPeak(0.0, 0, 0, 0)
        self._bytes = 0

    def __enter__(self) -> InFlight:
        self._forwards = [0] * len(self.chunks)
        for i, chunk in enumerate(self.chunks):
            self._handles.append(chunk.register_forward_pre_hook(lambda m, a, i=i: self._begin(i)))
            self._handles.append(chunk.register_forward_hook(lambda m, a, o: self._end()))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _begin(self, chunk: int) -> None:
        tag = (chunk, self._forwards[chunk])
        self._forwards[chunk] += 1
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, tag), lambda held: held.t)
        hooks.__enter__()
        self._stack.append(hooks)

    def _end(self) -> None:
        self._stack.pop().__exit__(None, None, None)

    def _pack(self, t: torch.Tensor, tag: tuple[int, int]) -> object:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._params:
            return _Held(packed(t), lambda: None)
        held = self._storages.setdefault(key, [0, storage.nbytes()])
        if held[0] == 0:
            self._bytes += held[1]
            if tag[1] == 0:
                self._first_bytes[tag[0]] += held[1]
        held[0] += 1
        self._live[tag] += 1
        self._record()

        def release() -> None:
            held[0] -= 1
            if held[0] == 0:
                self._bytes -= held[1]
                self._storages.pop(key, None)
            self._live[tag] -= 1
            if self._live[tag] == 0:
                del self._live[tag]

        return _Held(packed(t), release)

    def _record(self) -> None:
        stages = sum(self.weights[chunk] for chunk, _ in self._live)
        each = [sum(1 for chunk, _ in self._live if chunk == i) for i in range(len(self.chunks))]
        before = self.peak.chunk_microbatches_each or (0,) * len(self.chunks)
        self.peak = InFlightPeak(max(self.peak.stages, stages), max(self.peak.chunk_microbatches, len(self._live)),
                                 max(self.peak.saved_bytes, self._bytes), sum(self._first_bytes.values()),
                                 tuple(max(a, b) for a, b in zip(before, each, strict=True)))
