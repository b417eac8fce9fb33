"""A checkpoint read tensor by tensor, shard by shard: safetensors files (Hugging Face's format,
`model.safetensors` or several listed in `model.safetensors.index.json`), from which a rank reads
only the slice of each tensor its shard holds (safetensors maps the file; a slice reads its bytes)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class Weights:
    """The tensors of the checkpoint in `directory`, by their names in the model's state dict."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.exists():
            self.files = {k: self.directory / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (self.directory / SINGLE).exists():
            from safetensors import safe_open

            with safe_open(self.directory / SINGLE, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), self.directory / SINGLE)
        else:
            raise FileNotFoundError(f"{self.directory} holds neither {SINGLE} nor {INDEX}")

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The block of tensor `name` of `shape` starting at `offsets` (the whole: zeros, its shape)."""
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            view = f.get_slice(name)
            index = tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))
            return view[index] if index else view[:]
