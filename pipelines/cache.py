"""Stage results stored under content keys, written atomically.

key = sha256(stage name, function, the stage's own resolved config, the digests of the upstream
results it receives, the code version, the environment fingerprint). Upstream *result digests*
rather than upstream keys: `force=[lr_find]` then re-runs downstream stages only when the forced
result really changed.

An entry is a directory `<cache_dir>/<stage>/<key>/` with `entry.json` and `artifacts/`. It is
built under a temporary name and renamed into place, so a reader never sees half an entry, and a
driver killed mid-write leaves only a temporary directory that is never read.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.configtools import from_dict, to_jsonable

PACKAGES = ("pipelines", "stages", "training")
ROOT = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def digest(data: Any) -> str:
    blob = json.dumps(to_jsonable(data), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@functools.cache
def code_version() -> str:
    """Hash of the project's Python sources: any code change invalidates the cache."""
    h = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def env_fingerprint() -> dict[str, Any]:
    """The parts of the environment that change what a stage measures."""
    import torch

    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def stage_key(name: str, fn: str, inputs: Any, upstream: dict[str, str], extra: dict[str, Any] | None = None) -> str:
    return digest(
        {
            "stage": name,
            "fn": fn,
            "config": inputs,
            "upstream": upstream,
            "code": code_version(),
            "env": env_fingerprint(),
            "extra": extra or {},
        }
    )[:24]


@dataclass(frozen=True)
class Entry:
    key: str
    result: Any
    metrics: list[tuple[str, float, int]]
    seconds: float
    artifacts: Path


class Cache:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def load(self, stage: str, key: str, result_type: type) -> Entry | None:
        """The stored entry, or None when absent or unreadable (then the stage re-runs)."""
        path = self.path(stage, key)
        try:
            data = json.loads((path / "entry.json").read_text())
            result = from_dict(result_type, data["result"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        metrics = [(k, float(v), int(s)) for k, v, s in data["metrics"]]
        return Entry(key, result, metrics, float(data["seconds"]), path / "artifacts")

    def checkpoints(self, stage: str, key: str) -> Path:
        """Where a run of this key keeps its checkpoints: the same path when it re-runs after a
        crash, so it resumes; removed once its result is committed."""
        return self.root / stage / f".ckpt-{key}"

    def sweep_stale(self) -> None:
        """Remove staging directories left by drivers that died mid-write (their pid is gone)."""
        for path in self.root.glob("*/.tmp-*"):
            pid = path.name.split("-")[1]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)

    def staging(self, stage: str) -> Path:
        """A fresh private directory to build an entry in (artifacts go in `artifacts/`)."""
        path = self.root / stage / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        (path / "artifacts").mkdir(parents=True)
        return path

    def commit(self, staging: Path, stage: str, key: str, result: Any, metrics: list, seconds: float) -> Entry:
        """Write entry.json into `staging`, then rename it into place in one step."""
        payload = {"result": to_jsonable(result), "metrics": metrics, "seconds": seconds, "created": time.time()}
        tmp = staging / "entry.json.tmp"
        tmp.write_text(json.dumps(payload, default=str))
        os.replace(tmp, staging / "entry.json")
        final = self.path(stage, key)
        try:
            os.rename(staging, final)
        except OSError:
            # Another invocation committed the same key first: its entry is equally valid.
            shutil.rmtree(staging, ignore_errors=True)
        return Entry(key, result, metrics, seconds, final / "artifacts")

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)
