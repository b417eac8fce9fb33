"""What each worker node will have, decided from the launcher's own resources.

The driver is often not a worker: a Slurm login node and a CPU-only Ray head have no GPUs, and a
`ray://` client is another machine altogether. So the GPUs a node's ranks get come from what the
launcher asks for or reports, never from the driver's devices, except under launcher=local, whose
workers are this machine:

- local: the GPUs this machine shows (read from the NVIDIA driver's files, without torch);
- slurm: `launcher.gpus_per_node`; null on a `cuda` cluster means one per task (procs_per_node),
  or, when procs_per_node is null too, what `sinfo` reports for the partition's nodes;
- ray: a private instance runs on this machine (its GPUs); a joined cluster's GPUs are read from
  the cluster when the launcher connects (None here: only the workers can say).

None means "unknown until the workers report": the checks that need the number then run against
the placement the workers report before any stage (pipelines/validate.py: check_placement).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from pipelines.schema import Config

SINFO_TIMEOUT_S = 30


@dataclass(frozen=True)
class SlurmNodes:
    """The partition's nodes as `sinfo` reports them (the smallest, where they differ)."""

    cpus: int | None
    gpus: int


def visible_gpus() -> int:
    """CUDA devices this process may use, read without importing torch (the driver of a cached
    invocation never does): the NVIDIA driver's devices that CUDA_VISIBLE_DEVICES leaves visible,
    when torch was built with CUDA."""
    from pipelines.placement import node_identity

    return node_identity().usable_gpus


def gpus_in_gres(gres: str) -> int:
    """GPUs in a Slurm GRES string: `gpu:h100:8(S:0-1)` -> 8, `gpu:4,nvme:1` -> 4, `(null)` -> 0."""
    total = 0
    for item in gres.split(","):
        found = re.fullmatch(r"gpu(?::[^:(]+)?:(\d+)(?:\(.*\))?", item.strip())
        if found:
            total += int(found.group(1))
    return total


def parse_sinfo(text: str) -> SlurmNodes | None:
    """`sinfo -h -o "%c %G"` lines (one per kind of node) -> the smallest node; None if empty."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].rstrip("+").isdigit():
            rows.append((int(parts[0].rstrip("+")), gpus_in_gres(parts[1])))
    if not rows:
        return None
    return SlurmNodes(cpus=min(c for c, _ in rows), gpus=min(g for _, g in rows))


def slurm_nodes(partition: str | None) -> SlurmNodes | None:
    """The partition's (or the default partition's) nodes, from `sinfo`; None when it can't say."""
    cmd = ["sinfo", "-h", "-o", "%c %G", *(["-p", partition] if partition else [])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=SINFO_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_sinfo(out.stdout) if out.returncode == 0 else None


def gpus_per_node(cfg: Config, sinfo: SlurmNodes | None = None) -> int | None:
    """GPUs on each worker node, from the launcher's resources; None: only the workers can say.
    `sinfo`: the Slurm partition's nodes (read from `sinfo` when needed and not given)."""
    launcher = cfg.launcher
    if launcher.name == "local":
        return visible_gpus()
    if launcher.name == "slurm":
        if launcher.gpus_per_node is not None:
            return launcher.gpus_per_node
        if cfg.cluster.accelerator != "cuda":
            return 0
        if cfg.procs_per_node is not None:
            return cfg.procs_per_node
        found = sinfo or slurm_nodes(launcher.partition)
        return found.gpus if found is not None else None
    if launcher.name == "ray":
        if launcher.use_gpu is False:
            return 0
        if launcher.address is None:  # a private instance on this machine: Ray sees its GPUs
            return visible_gpus()
        return None
    raise AssertionError(f"unvalidated launcher {launcher.name}")


def cpus_per_task(cpus_per_node: int | None, tasks_per_node: int) -> int | None:
    """Each task's share of a node's cores (at least one); None when the node's cores are unknown."""
    return None if cpus_per_node is None else max(1, cpus_per_node // max(1, tasks_per_node))
