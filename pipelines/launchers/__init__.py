"""Launchers decide where a stage runs; the stage decides what it does."""

from __future__ import annotations

from pathlib import Path

from pipelines.launchers.base import Launcher, StageFailed, Task, WorldSpec
from pipelines.schema import LauncherConfig


def make_launcher(cfg: LauncherConfig, run_dir: Path, world: WorldSpec) -> Launcher:
    """The launcher named by `launcher.name`, for an invocation of `world` whose Hydra run dir is
    `run_dir`. One that cannot reach its cluster raises ConfigError here, before anything runs."""
    if cfg.name == "local":
        from pipelines.launchers.local import LocalLauncher

        return LocalLauncher(cfg, ranks_per_host=world.size)
    if cfg.name == "ray":
        from pipelines.launchers.ray import RayLauncher

        return RayLauncher(cfg, run_dir, world)
    if cfg.name == "slurm":
        from pipelines.launchers.slurm import SlurmLauncher, check_partition

        if cfg.partition is not None:  # before any job: a wrong partition is a one-line user error
            check_partition(cfg.partition)
        return SlurmLauncher(cfg, run_dir, world)
    raise AssertionError(f"unvalidated launcher {cfg.name}")


__all__ = ["Launcher", "StageFailed", "Task", "WorldSpec", "make_launcher"]
