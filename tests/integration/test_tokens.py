"""Token files: scripts/prepare_tokens.py writes nanoGPT's train.bin, `data=tokens` reads it through
numpy.memmap without loading it whole, and the whole DAG trains on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import asked_statuses

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "prepare_tokens.py"


def corpus(tmp_path: Path) -> Path:
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    (texts / "b.md").write_text("# notes\nscaling laws, learning rates and the like.\n" * 300)
    return texts


def prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_byte_level_tokens_are_the_files_bytes(tmp_path):
    texts = corpus(tmp_path)
    out = tmp_path / "data" / "train.bin"
    done = prepare("--out", str(out), str(texts))
    assert done.returncode == 0, done.stderr
    meta = json.loads(out.with_name("train.bin.json").read_text())
    expected = (texts / "a.txt").read_bytes() + (texts / "b.md").read_bytes()
    assert meta == {"dtype": "uint16", "vocab_size": 256, "tokens": len(expected), "documents": 2, "tokenizer": "bytes"}
    assert np.fromfile(out, dtype=np.uint16).tolist() == list(expected)
    assert not list(out.parent.glob("*.tmp*")), "written under a temporary name, then renamed"


def test_a_tokenizer_directory_on_disk(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = corpus(tmp_path)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train([str(p) for p in texts.iterdir()], trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<eot>"]))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eot>", unk_token="<unk>").save_pretrained(tmp_path / "tok")
    out = tmp_path / "train.bin"
    done = prepare("--tokenizer", str(tmp_path / "tok"), "--out", str(out), str(texts / "a.txt"))
    assert done.returncode == 0, done.stderr
    meta = json.loads(out.with_name("train.bin.json").read_text())
    ids = np.fromfile(out, dtype=np.uint16)
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok")
    assert meta["vocab_size"] == len(tok) and meta["tokens"] == len(ids) and ids.max() < len(tok)
    assert ids[-1] == tok.eos_token_id, "each document ends with the end-of-text token"
    assert tok.decode(ids[:40].tolist()).replace(" ", "").startswith("thequickbrownfoxjumpsoverthelazydog.")


def test_a_missing_input_is_one_line_and_exit_2(tmp_path):
    done = prepare("--out", str(tmp_path / "x.bin"), str(tmp_path / "nowhere"))
    assert done.returncode == 2 and done.stderr.strip() == f"error: {tmp_path / 'nowhere'}: no such file or directory"


READ_WITHOUT_LOADING = """
import resource, sys
sys.path.insert(0, {root!r})
from training.data import tokens
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
data = tokens({path!r}, seq_len=256)
total = 0
for i in range(0, len(data), len(data) // 64):
    x, y = data[i]
    total += int(x.sum())
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(len(data), (after - before) * 1024)
"""


def test_the_token_file_is_read_without_loading_it_whole(tmp_path):
    """A 2 GiB token file (sparse: it costs no disk), read at 64 places: the process grows by a few
    pages per sample, not by the file."""
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(2 * 1024**3)
    code = READ_WITHOUT_LOADING.format(root=str(ROOT), path=str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    samples, grown = map(int, out.split())
    assert samples == (1024**3 - 1) // 256
    assert grown < 64 * 1024**2, f"reading 64 samples grew the process by {grown / 1024**2:.0f} MiB"


@pytest.mark.slow
def test_the_whole_dag_trains_on_a_token_file(tmp_path):
    out = tmp_path / "train.bin"
    assert prepare("--out", str(out), str(corpus(tmp_path))).returncode == 0
    args = ["data=tokens", f"data.path={out}", "data.seq_len=32", "train.steps=12", "train.micro_batch=4",
            "lr_find.num_iters=20", "bandwidth.max_bytes=65536", "tracking=none", "hydra.run.dir=run"]
    done = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert set(asked_statuses(summary).values()) == {"ran"}
    train = summary["stages"]["train"]["result"]
    assert train["tokens_per_s"] == pytest.approx(32 * train["samples_per_s"])
    assert train["final_loss"] < train["losses"][0]
    # A model whose vocabulary is smaller than the file's is stopped before anything runs.
    small = subprocess.run([sys.executable, str(ROOT / "run.py"), *args[:-1], "model.vocab_size=128", "hydra.run.dir=r2"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert small.returncode == 2
    assert "holds token ids up to 255 (vocabulary 256), but model=gpt-tiny embeds only 128" in small.stderr
