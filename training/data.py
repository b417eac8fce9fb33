"""Seeded data, nothing downloaded: synthetic tokens, real text from Python itself, and features.

Every rank builds the same pool from the seed; `GlobalBatches` then deals disjoint slices of each
global batch to the ranks, so that the samples of optimizer step s are the same whatever the world
size, only split differently. That is what makes losses comparable across strategies and sizes.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from training.config import DataConfig, ModelConfig


def make_pool(data: DataConfig, model: ModelConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of `data.num_samples` samples, identical on every rank for a seed."""
    gen = torch.Generator().manual_seed(seed + 1)
    if data.kind == "markov":
        seqs = _markov(data.num_samples, model.seq_len + 1, model.vocab_size, data.branching, gen)
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
    if data.kind == "text":
        seqs = _python_text(data.num_samples, model.seq_len + 1)
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
    return _blobs(data.num_samples, data.num_features, data.num_classes, gen)


def _markov(n: int, length: int, vocab: int, branching: int, gen: torch.Generator) -> torch.Tensor:
    """Sequences from a random sparse Markov chain: each token has `branching` likely successors,
    so a model can learn it down to a loss near log(branching)."""
    successors = torch.stack([torch.randperm(vocab, generator=gen)[:branching] for _ in range(vocab)])
    weights = torch.rand(vocab, branching, generator=gen) + 0.1
    seqs = torch.empty(n, length, dtype=torch.long)
    seqs[:, 0] = torch.randint(vocab, (n,), generator=gen)
    for t in range(1, length):
        prev = seqs[:, t - 1]
        choice = torch.multinomial(weights[prev], 1, generator=gen).squeeze(1)
        seqs[:, t] = successors[prev, choice]
    return seqs


def python_text_files() -> list[Path]:
    """The standard library's own top-level sources: real English-and-code text on every machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def _python_text(n: int, length: int) -> torch.Tensor:
    """Byte-level windows (stride length-1) over the concatenated standard library sources."""
    needed = n * (length - 1) + 1
    chunks, size = [], 0
    for path in python_text_files():
        chunks.append(path.read_bytes())
        size += len(chunks[-1])
        if size >= needed:
            break
    blob = b"".join(chunks)
    if len(blob) < needed:
        raise ValueError(f"data=text: the standard library holds {len(blob)} bytes, fewer than the {needed} needed")
    flat = torch.frombuffer(bytearray(blob[:needed]), dtype=torch.uint8).long()
    return flat.unfold(0, length, length - 1)[:n]


def _blobs(n: int, features: int, classes: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian clusters around random centres: a classification task an MLP learns quickly."""
    centres = torch.randn(classes, features, generator=gen) * 2.0
    labels = torch.randint(classes, (n,), generator=gen)
    return centres[labels] + torch.randn(n, features, generator=gen), labels


class GlobalBatches:
    """Which pool rows a rank trains on at each step.

    Global sample position p = step * G + j (G = micro_batch x grad_accum x dp_size) maps to row
    perm_epoch[p mod N] of a per-epoch seeded permutation. Rank r's micro-batch a of a step is
    positions [(a * dp_size + r) * micro_batch, ... + micro_batch), so ranks are disjoint and the
    union over ranks and micro-batches is the global batch, whatever the split.
    """

    def __init__(self, pool_size: int, micro_batch: int, grad_accum: int, dp_rank: int, dp_size: int, seed: int):
        self.n, self.micro, self.accum = pool_size, micro_batch, grad_accum
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp_size

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))}
        return self._perms[epoch]

    def rows(self, step: int, micro: int) -> torch.Tensor:
        """Pool rows of this rank's micro-batch `micro` at optimizer step `step`."""
        start = step * self.global_batch + (micro * self.dp_size + self.dp_rank) * self.micro
        positions = torch.arange(start, start + self.micro)
        epochs = positions // self.n
        out = torch.empty(self.micro, dtype=torch.long)
        for epoch in epochs.unique().tolist():
            mask = epochs == epoch
            out[mask] = self._perm(epoch)[positions[mask] % self.n]
        return out
