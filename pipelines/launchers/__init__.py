"""Launchers decide where a stage runs; the stage decides what it does."""

from __future__ import annotations

from pipelines.launchers.base import Launcher, StageFailed, Task, WorldSpec
from pipelines.schema import LauncherConfig


def make_launcher(cfg: LauncherConfig) -> Launcher:
    """The launcher named by `launcher.name`."""
    if cfg.name == "local":
        from pipelines.launchers.local import LocalLauncher

        return LocalLauncher(cfg)
    raise AssertionError(f"unvalidated launcher {cfg.name}")


__all__ = ["Launcher", "StageFailed", "Task", "WorldSpec", "make_launcher"]
