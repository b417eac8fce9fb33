"""The launcher interface: run one stage's function on a world of ranks, return rank 0's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class StageFailed(RuntimeError):
    """A stage's function raised, or a rank died; the message says which rank and why."""


@dataclass(frozen=True)
class WorldSpec:
    nodes: int
    procs_per_node: int
    distributed: bool = True
    """Initialise torch.distributed in the workers (world stages); one_device stages skip it."""

    @property
    def size(self) -> int:
        return self.nodes * self.procs_per_node


@dataclass(frozen=True)
class Task:
    """Everything a worker needs, picklable: which function, its config and upstream results."""

    stage: str
    fn: str
    inputs: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    artifacts: Path | None = None
    """Directory the stage writes artifacts into (rank 0 only), or None if it takes none."""
    workdir: Path = Path(".")
    """Directory for this launch's logs, task file and result."""


class Launcher(Protocol):
    def run(self, task: Task, world: WorldSpec) -> Any:
        """Run `task` on every rank of `world`; rank 0's return value, or raise StageFailed."""

    def close(self) -> None:
        """Release whatever the launcher started (clusters, daemons)."""
