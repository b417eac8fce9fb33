"""The launcher interface: run one stage's function on a world of ranks, return rank 0's result."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipelines.paths import ROOT

if TYPE_CHECKING:
    from pipelines.placement import Placement


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
    memory_budget_gib: float | None = None
    """Each rank's device-memory budget on CPU (`cluster.device_memory_gib` of a measured cluster):
    a rank over it fails as CUDA's out-of-memory would. None: no budget (training/budget.py)."""
    timeout_s: float | None = None
    """The stage's collective timeout (launcher.stage_timeout_s); None: the launcher's timeout_s."""
    checkpoint_timeout_s: float | None = None
    """The collective timeout while a checkpoint is saved or loaded (launcher.checkpoint_timeout_s)."""
    backend: str | None = None
    """This task's process-group backend; None: the launcher's, resolved for its workers."""


class Launcher(Protocol):
    def placement(self, world: WorldSpec) -> Placement:
        """The launcher and the identity of the nodes `world` runs on, read where it runs (the
        pre-flight re-check every invocation makes before trusting a cached measurement)."""

    def run(self, task: Task, world: WorldSpec) -> Any:
        """Run `task` on every rank of `world`; rank 0's return value, or raise StageFailed."""

    def record(self) -> dict[str, Any]:
        """What summary.json should say of where the stages ran (allocations, job ids, worker
        processes); empty when there is nothing beyond the placement."""

    def close(self) -> None:
        """Release whatever the launcher started (clusters, allocations, daemons)."""


def worker_pythonpath() -> str:
    """PYTHONPATH for workers: this project first, then the driver's own entries made absolute, so
    that a user's package on a relative PYTHONPATH (`PYTHONPATH=. python run.py ...`) imports the
    same wherever and in whatever directory a worker starts."""
    entries = [str(ROOT), *(os.environ.get("PYTHONPATH") or "").split(os.pathsep)]
    absolute = [str(Path(e).resolve()) for e in entries if e]
    return os.pathsep.join(dict.fromkeys(absolute))


def probe_placement(launcher: Launcher, name: str, backend: str, world: WorldSpec, workdir: Path) -> Placement:
    """A placement read on the launcher's own workers: every rank reports its node's identity."""
    from pipelines.placement import Placement, per_node

    # Over gloo whatever the workers have: the probe gathers host objects, and it is what says
    # whether the workers have the GPUs nccl needs.
    probe = Task(stage="placement", fn="pipelines.placement:probe", inputs=None, workdir=workdir, backend="gloo")
    ranks = launcher.run(probe, world)
    return Placement(name, backend, per_node(ranks))
