"""Run a function on N real gloo ranks through the project's own local launcher."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pipelines.launchers.base import Task, WorldSpec
from pipelines.launchers.local import LocalLauncher
from pipelines.schema import LauncherConfig


def run_world(fn: str, inputs: Any = None, world: int = 2, workdir: Path | None = None,
              timeout_s: float = 60.0, grace_s: float = 5.0, artifacts: Path | None = None, **kwargs: Any) -> Any:
    """Call `fn` ("module:function", importable from the repo root) as `fn(inputs, **kwargs)` on
    `world` ranks with torch.distributed (gloo) initialised; return rank 0's result, or raise
    StageFailed naming the failing rank."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="scalestudy-test-"))
    launcher = LocalLauncher(LauncherConfig(timeout_s=timeout_s, grace_s=grace_s))
    task = Task(stage="test", fn=fn, inputs=inputs, kwargs=kwargs, artifacts=artifacts, workdir=workdir)
    return launcher.run(task, WorldSpec(world, 1))


def asked_statuses(summary: dict) -> dict[str, str]:
    """Each stage's status in a summary.json, leaving out the stages the run did not ask for
    (trials, with plan.trials=0: skipped by design, not by failure)."""
    return {name: s["status"] for name, s in summary["stages"].items()
            if not (s["status"] == "skipped" and (s.get("error") or "").startswith("not asked for"))}
