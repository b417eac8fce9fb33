"""Data: the user's `Dataset` from its `_target_`, the built-in ones, and the order it is read in.

A data set is any map-style `torch.utils.data.Dataset` whose items are `(input, target)` tuples or
dicts (Hugging Face style: `input_ids`, `labels`), built by the factory `data._target_` names. The
built-in ones are factories like any user's: seeded synthetic tokens (`markov`), real text from
Python's own sources (`python_text`), feature clusters (`blobs`) and a flat binary token file on
disk (`tokens`, nanoGPT's and llm.c's train.bin, read through numpy.memmap).

Order: `GlobalBatches` deals disjoint slices of each global batch to the data-parallel ranks, so
that the samples of optimizer step s are the same whatever the world size and strategy, only split
differently. That is what makes losses comparable across strategies and sizes. `loader` reads them
through a `DataLoader` (workers, pinned memory on CUDA) with that order as its batch sampler.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from training.config import DataConfig

MARKOV_CHUNK = 256
"""Markov sequences are generated in seeded chunks of this many, on first use: a what-if plan
reads two samples of a pool it never fills."""
MARKOV_DRAWS = 4096
"""Uniform draws made at once per row while walking the chain (bounds the walk's memory)."""
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def build_dataset(cfg: DataConfig) -> Dataset:
    """The data set `data._target_` builds."""
    from training.contract.calls import instantiate

    dataset = instantiate(cfg.target, cfg.kwargs)
    if not isinstance(dataset, Dataset) and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(f"{cfg.target} returned a {type(dataset).__name__}, not a map-style torch Dataset "
                        "(__getitem__ and __len__)")
    return dataset


# ---- built-in data sets ----------------------------------------------------------------------


class Pairs(Dataset):
    """(input, target) rows of two tensors held in memory."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        assert len(inputs) == len(targets), "one target per input"
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i]


class MarkovTokens(Dataset):
    """Sequences from a random sparse Markov chain: each token has `branching` likely successors,
    so a model can learn it down to a loss near log(branching). Item i is (tokens[:-1], tokens[1:])."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, branching: int, seed: int):
        if branching > vocab_size:
            raise ValueError(f"branching={branching} must be <= vocab_size={vocab_size}")
        self.n, self.length, self.vocab, self.seed = num_samples, seq_len + 1, vocab_size, seed
        gen = torch.Generator().manual_seed(seed + 1)
        # `branching` distinct successors per token: the smallest of random keys per row (a
        # per-row randperm would cost vocab^2 at a 32 k vocabulary).
        keys = torch.rand(vocab_size, vocab_size, generator=gen) if vocab_size <= 4096 else None
        self.successors = (keys.topk(branching, dim=1).indices if keys is not None else
                           _distinct_rows(vocab_size, branching, gen))
        self.weights = torch.rand(vocab_size, branching, generator=gen) + 0.1
        self.chunks: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.n

    def _chunk(self, c: int) -> torch.Tensor:
        if c not in self.chunks:
            gen = torch.Generator().manual_seed((self.seed + 1) * 1_000_003 + c)
            rows = min(MARKOV_CHUNK, self.n - c * MARKOV_CHUNK)
            first = torch.randint(self.vocab, (rows,), generator=gen)
            self.chunks[c] = torch.from_numpy(self._walk(first.numpy(), gen))
        return self.chunks[c]

    def _walk(self, first: np.ndarray, gen: torch.Generator) -> np.ndarray:
        """The chain from `first`, one step per column, by inverse-CDF sampling of a uniform draw
        per step. The walk is sequential in time, so it runs in numpy: a step costs a few
        microseconds where torch's per-call overhead made a 128K-token sample take ~15 s."""
        cdf = (self.weights.cumsum(1) / self.weights.sum(1, keepdim=True))[:, :-1].numpy()
        successors = self.successors.numpy().reshape(-1)
        branching = self.successors.shape[1]
        seqs = np.empty((len(first), self.length), dtype=np.int64)
        seqs[:, 0] = first
        for start in range(1, self.length, MARKOV_DRAWS):
            draws = torch.rand(len(first), min(MARKOV_DRAWS, self.length - start), generator=gen).numpy()
            for j in range(draws.shape[1]):
                prev = seqs[:, start + j - 1]
                choice = (draws[:, j, None] > cdf[prev]).sum(1)
                seqs[:, start + j] = successors[prev * branching + choice]
        return seqs

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        row = self._chunk(i // MARKOV_CHUNK)[i % MARKOV_CHUNK]
        return row[:-1], row[1:]


def _distinct_rows(vocab: int, branching: int, gen: torch.Generator) -> torch.Tensor:
    """`branching` distinct random ids per row for a large vocabulary: offsets from a random start,
    with random distinct steps, wrap around the vocabulary."""
    start = torch.randint(vocab, (vocab, 1), generator=gen)
    steps = torch.randperm(vocab - 1, generator=gen)[:branching] + 1
    return (start + steps.cumsum(0).unsqueeze(0)) % vocab


def markov(num_samples: int, seq_len: int, vocab_size: int, branching: int = 4, seed: int = 0) -> MarkovTokens:
    """`data=markov`: seeded synthetic tokens, identical on every rank."""
    return MarkovTokens(num_samples, seq_len, vocab_size, branching, seed)


def python_text_files() -> list[Path]:
    """The standard library's own top-level sources: real English-and-code text on every machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def python_text(num_samples: int, seq_len: int) -> Pairs:
    """`data=text`: byte-level windows (stride seq_len) over the concatenated standard library."""
    needed = num_samples * seq_len + 1
    chunks, size = [], 0
    for path in python_text_files():
        chunks.append(path.read_bytes())
        size += len(chunks[-1])
        if size >= needed:
            break
    blob = b"".join(chunks)
    if len(blob) < needed:
        raise ValueError(f"the standard library holds {len(blob)} bytes, fewer than the {needed} needed")
    flat = torch.frombuffer(bytearray(blob[:needed]), dtype=torch.uint8).long()
    seqs = flat.unfold(0, seq_len + 1, seq_len)[:num_samples]
    return Pairs(seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous())


def blobs(num_samples: int, num_features: int, num_classes: int, seed: int = 0) -> Pairs:
    """`data=blobs`: Gaussian clusters around random centres, a classification task an MLP learns."""
    gen = torch.Generator().manual_seed(seed + 1)
    centres = torch.randn(num_classes, num_features, generator=gen) * 2.0
    labels = torch.randint(num_classes, (num_samples,), generator=gen)
    return Pairs(centres[labels] + torch.randn(num_samples, num_features, generator=gen), labels)


class TokenFile(Dataset):
    """A flat binary array of token ids on disk, memory-mapped: item i is the window
    [i·seq_len, (i+1)·seq_len] split into (input, next-token target). Only the pages a batch
    touches are read; the file is never loaded whole."""

    def __init__(self, path: str | Path, seq_len: int, dtype: str = "auto"):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no token file at {self.path}")
        meta = token_meta(self.path)
        name = meta.get("dtype", "uint16") if dtype == "auto" else dtype
        if name not in TOKEN_DTYPES:
            raise ValueError(f"dtype={name!r}: must be one of {', '.join(TOKEN_DTYPES)} or auto")
        self.tokens = np.memmap(self.path, dtype=TOKEN_DTYPES[name], mode="r")
        self.seq_len = seq_len
        self.vocab_size: int | None = meta.get("vocab_size")
        if len(self.tokens) < seq_len + 1:
            raise ValueError(f"{self.path} holds {len(self.tokens)} tokens, fewer than one sample of {seq_len + 1}")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        window = torch.from_numpy(self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


def tokens(path: str, seq_len: int, dtype: str = "auto") -> TokenFile:
    """`data=tokens data.path=<train.bin>`."""
    return TokenFile(path, seq_len, dtype)


def token_meta(path: Path) -> dict[str, Any]:
    """The JSON `scripts/prepare_tokens.py` writes beside a token file (dtype, vocab_size), or {}."""
    meta = path.with_name(path.name + ".json")
    return json.loads(meta.read_text()) if meta.is_file() else {}


# ---- order -----------------------------------------------------------------------------------


class GlobalBatches:
    """Which samples a rank trains on at each step.

    Global sample position p = step * G + j (G = micro_batch x grad_accum x dp_size) maps to index
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
        """Sample indices of this rank's micro-batch `micro` at optimizer step `step`."""
        start = step * self.global_batch + (micro * self.dp_size + self.dp_rank) * self.micro
        positions = torch.arange(start, start + self.micro)
        epochs = positions // self.n
        out = torch.empty(self.micro, dtype=torch.long)
        for epoch in epochs.unique().tolist():
            mask = epochs == epoch
            out[mask] = self._perm(epoch)[positions[mask] % self.n]
        return out


class StepSampler(Sampler[list[int]]):
    """GlobalBatches as a DataLoader batch sampler: this rank's micro-batches of steps
    [first, steps), in order (accumulation micro-batches of a step are consecutive)."""

    def __init__(self, batches: GlobalBatches, first: int, steps: int):
        self.batches, self.first, self.steps = batches, first, steps

    def __len__(self) -> int:
        return (self.steps - self.first) * self.batches.accum

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.first, self.steps):
            for micro in range(self.batches.accum):
                yield self.batches.rows(step, micro).tolist()


def loader(dataset: Dataset, batches: GlobalBatches, first: int, steps: int, num_workers: int,
           dev: torch.device) -> DataLoader:
    """This rank's micro-batches of steps [first, steps) through a DataLoader: `num_workers`
    processes prefetching, pinned host memory when the device is a GPU."""
    return DataLoader(dataset, batch_sampler=StepSampler(batches, first, steps), num_workers=num_workers,
                      pin_memory=dev.type == "cuda", persistent_workers=False)


def first_samples(dataset: Dataset, count: int) -> Any:
    """The first `count` items collated into one batch (what plan and the checks measure on)."""
    from torch.utils.data import default_collate

    return default_collate([dataset[i] for i in range(count)])
