"""Write a flat binary token file (nanoGPT's and llm.c's train.bin) from text files.

    .venv/bin/python scripts/prepare_tokens.py --out data/train.bin my_texts/ notes.md
    .venv/bin/python scripts/prepare_tokens.py --tokenizer my_tokenizer_dir --out data/train.bin my_texts/

Byte-level by default (vocabulary 256: every file's UTF-8 bytes); with `--tokenizer`, a tokenizer
directory on disk (Hugging Face's `tokenizer.json` and friends, loaded offline with AutoTokenizer),
each document followed by its end-of-text token. Token ids go out as uint16 while the vocabulary
fits (<= 65536), else uint32, file by file, so a corpus larger than memory streams through. Beside
the file, `<out>.json` records the dtype, the vocabulary size and the token count: `data=tokens`
reads the dtype from it. The file is written under a temporary name and renamed: a half-written
corpus is never read.

Then: python run.py data=tokens data.path=data/train.bin
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from common.files import atomic_file, write_atomic  # noqa: E402

UINT16_VOCAB = 2**16


def documents(inputs: list[Path], pattern: str) -> Iterator[Path]:
    """Each input file, and the files under each input directory matching `pattern`, sorted."""
    for path in inputs:
        if path.is_dir():
            yield from sorted(p for p in path.rglob(pattern) if p.is_file())
        elif path.is_file():
            yield path
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")


def byte_encoder() -> tuple[Callable[[str], list[int]], int, str]:
    return (lambda text: list(text.encode("utf-8"))), 256, "bytes"


def tokenizer_encoder(directory: Path) -> tuple[Callable[[str], list[int]], int, str]:
    """A tokenizer saved on disk, loaded without the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    eos = tokenizer.eos_token_id

    def encode(text: str) -> list[int]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return [*ids, eos] if eos is not None else ids

    return encode, len(tokenizer), str(directory)


def write_tokens(out: Path, files: list[Path], encode: Callable[[str], list[int]], vocab: int, dtype: str,
                 source: str) -> dict:
    """Encode `files` into `out`, one document after another; returns what goes into `<out>.json`."""
    if dtype == "auto":
        dtype = "uint16" if vocab <= UINT16_VOCAB else "uint32"
    if dtype == "uint16" and vocab > UINT16_VOCAB:
        raise ValueError(f"--dtype uint16 holds ids below {UINT16_VOCAB}, but the vocabulary has {vocab}")
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with atomic_file(out) as tmp, open(tmp, "wb") as handle:
        for path in files:
            ids = np.asarray(encode(path.read_text(encoding="utf-8", errors="replace")), dtype=dtype)
            ids.tofile(handle)
            count += len(ids)
    meta = {"dtype": dtype, "vocab_size": vocab, "tokens": count, "documents": len(files), "tokenizer": source}
    write_atomic(out.with_name(out.name + ".json"), json.dumps(meta, indent=1))
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="text files, or directories to read files from")
    parser.add_argument("--out", required=True, type=Path, help="the token file to write (e.g. data/train.bin)")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory on disk; byte-level without it")
    parser.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto")
    parser.add_argument("--glob", default="*", help="files to take from input directories (default: all)")
    args = parser.parse_args(argv)
    try:
        files = list(documents(args.inputs, args.glob))
        if not files:
            raise FileNotFoundError(f"no files in {', '.join(map(str, args.inputs))} match {args.glob!r}")
        encode, vocab, source = tokenizer_encoder(args.tokenizer) if args.tokenizer else byte_encoder()
        meta = write_tokens(args.out, files, encode, vocab, args.dtype, source)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.out}: {meta['tokens']} tokens ({meta['dtype']}, vocabulary {meta['vocab_size']}) "
          f"from {meta['documents']} files; use: data=tokens data.path={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
