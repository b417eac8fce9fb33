"""Stage results stored under content keys, written atomically.

key = sha256(stage name, function, the stage's own resolved config, the digests of the upstream
results it receives, the code version, the driver's environment fingerprint, and for a stage that
runs on workers its placement: the launcher and the identity of the nodes it ran on, read there
(pipelines/placement.py)). Upstream *result digests* rather than upstream keys: `force=[lr_find]`
then re-runs downstream stages only when the forced result really changed. The placement keeps a
cache shared by two clusters (or by launcher=local and a cluster) from answering one with the
other's measurements.

Each entry also records where it came from (`origin`: the invocation's run dir and MLflow run,
the placement it was measured on, when), so that a cached stage says who first measured it.

An entry is a directory `<cache_dir>/<stage>/<key>/` with `entry.json` and `artifacts/`. It is
built under a temporary name and renamed into place, so a reader never sees half an entry, and a
driver killed mid-write leaves only a temporary directory that is never read.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.files import write_atomic
from pipelines.configtools import from_dict, to_jsonable
from pipelines.paths import ROOT

PACKAGES = ("common", "pipelines", "reports", "stages", "training")


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
def _installed(top: str) -> str | None:
    names = importlib.metadata.packages_distributions().get(top)
    if not names:
        return None
    return f"{names[0]}=={importlib.metadata.version(names[0])}"


@functools.cache
def package_code(top: str) -> str:
    """What identifies the code of top-level package `top`: its installed distribution and version,
    or, for a user's package on PYTHONPATH, a hash of its Python sources. This project's own
    packages are code_version()'s."""
    spec = importlib.util.find_spec(top)
    if spec is None:
        return "not found"
    # A package's directory, or a single module's file.
    root = Path(next(iter(spec.submodule_search_locations))) if spec.submodule_search_locations else Path(spec.origin or ".")
    if {"site-packages", "dist-packages"} & set(root.parts):
        return _installed(top) or str(root)
    files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
    h = hashlib.sha256()
    for file in files:
        h.update(str(file.relative_to(root.parent)).encode())
        h.update(file.read_bytes())
    return h.hexdigest()[:16]


def targets_code(targets: list[str]) -> dict[str, str]:
    """The code behind each `_target_` outside this project (a user's model or data set, or a
    library such as transformers): a stage whose result depends on it re-runs when it changes."""
    tops = sorted({t.split(".")[0] for t in targets if t} - set(PACKAGES))
    return {top: package_code(top) for top in tops}


@functools.cache
def env_fingerprint() -> dict[str, Any]:
    """The driver's software: what a driver stage's result can depend on. Read from package
    metadata, so that a fully cached invocation never imports torch. Where a worker stage ran is
    its placement's business, not this."""
    from pipelines.placement import torch_cuda_build

    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "torch": torch_version,
        "cuda": torch_cuda_build(),
    }


def stage_key(name: str, fn: str, inputs: Any, upstream: dict[str, str], extra: dict[str, Any] | None = None,
              placement: str | None = None) -> str:
    """The content key; `placement` is the fingerprint of the workers a non-driver stage runs on."""
    return digest(
        {
            "stage": name,
            "fn": fn,
            "config": inputs,
            "upstream": upstream,
            "code": code_version(),
            "env": env_fingerprint(),
            "placement": placement,
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
    origin: dict[str, Any] | None = None
    """Who measured it: the invocation's run dir and MLflow run, its placement, when (None for
    entries written before origins were recorded)."""
    peak_memory_bytes: int | None = None
    """The highest peak device memory of the ranks that produced it (None: not measured)."""


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
        return Entry(key, result, metrics, float(data["seconds"]), path / "artifacts", data.get("origin"),
                     data.get("peak_memory_bytes"))

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

    def commit(self, staging: Path, stage: str, key: str, result: Any, metrics: list, seconds: float,
               origin: dict[str, Any] | None = None, peak_memory_bytes: int | None = None) -> Entry:
        """Write entry.json into `staging`, then rename it into place in one step."""
        payload = {"result": to_jsonable(result), "metrics": metrics, "seconds": seconds, "created": time.time(),
                   "origin": origin, "peak_memory_bytes": peak_memory_bytes}
        write_atomic(staging / "entry.json", json.dumps(payload, default=str).encode())
        final = self.path(stage, key)
        try:
            os.rename(staging, final)
        except OSError:
            # Another invocation committed the same key first: its entry is equally valid.
            shutil.rmtree(staging, ignore_errors=True)
        return Entry(key, result, metrics, seconds, final / "artifacts", origin, peak_memory_bytes)

    def last_placement(self, scope: str) -> dict[str, Any] | None:
        """The placement an earlier invocation recorded for `scope` (launcher and world), if any."""
        try:
            return json.loads((self.root / "placements" / f"{scope}.json").read_text())
        except (OSError, ValueError):
            return None

    def record_placement(self, scope: str, data: dict[str, Any]) -> None:
        path = self.root / "placements" / f"{scope}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(data, indent=1).encode())

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)
