"""env: validate the fleet before anything is measured on it.

Every rank reads its own facts (training.envinfo), all ranks gather everyone's, and every rank
checks the same list: versions that must be identical (torch, CUDA, cuDNN, NCCL, driver, backend,
GPU model) and the configured requirements (a CUDA device, free device memory). Any problem
raises FleetMismatch on every rank, so the job stops before a collective can hang or a timing be
skewed by one odd node; its message shows who has what.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from training.dist import gather_objects
from training.envinfo import (
    GIB,
    check_devices,
    check_ports,
    check_requirements,
    collect_local,
    find_mismatches,
    mismatch_table,
)
from training.plan_config import EnvConfig


@dataclass(frozen=True)
class EnvInputs:
    env: EnvConfig


@dataclass(frozen=True)
class RankInfo:
    """What one rank runs on, as read on that rank; None where it could not be read."""

    rank: int
    node: int
    """The node index (GROUP_RANK / SLURM_NODEID / NODE_RANK)."""
    node_name: str
    """SLURMD_NODENAME, else `node<node>`: emulated nodes share one hostname."""
    hostname: str
    pid: int
    python: str
    torch: str
    backend: str
    """The process group's backend, or `none` without one."""
    gloo: bool
    cuda: str | None
    cudnn: int | None
    nccl: str | None
    driver: str | None
    has_gpu: bool
    gpu_count: int
    gpu_name: str | None
    """The model of this rank's own device."""
    gpu_names: list[str]
    """Every device visible to this rank."""
    gpu_total_bytes: int | None
    gpu_free_bytes: int | None
    gpu_bus_id: str | None
    """The PCI address of this rank's own device (its UUID where torch has no PCI fields)."""
    ib_ports: list[str] | None
    """InfiniBand ports with state and rate; None where `ibstat` is not installed."""
    cpu_count: int | None
    cpu_affinity: int | None
    """CPUs this process may run on."""
    torch_threads: int
    """torch's intra-op threads on this rank (the launcher gives each rank its share of the cores)."""
    host_mem_total_bytes: int | None
    host_mem_available_bytes: int | None
    nccl_env: dict[str, str]
    """NCCL_*, TORCH_NCCL_*, TORCH_FR_* and CUDA_VISIBLE_DEVICES as this rank runs with them."""
    niceness: int | None = None
    """The scheduling niceness the rank's thread runs at (0 unless something lowered it: Ray
    starts its workers at 15, and the launcher puts them back where it may)."""
    subnormals_flushed: bool | None = None
    """Whether the rank's thread computes subnormal floats as zero: every CPU rank does
    (pipelines/launchers/worker.py flush_subnormals; x86 runs each operation on one slowly)."""


@dataclass(frozen=True)
class EnvResult:
    world_size: int
    nodes: int
    """Distinct nodes seen (node name and hostname)."""
    ranks: list[RankInfo]
    consistent: bool

    def metrics(self) -> list[tuple[str, float, int]]:
        """Fleet-wide numbers at step 0; per-rank quantities are the smallest rank's (the limit)."""
        out = [("env/world_size", float(self.world_size), 0), ("env/nodes", float(self.nodes), 0)]
        out.append(("env/gpus_per_rank", float(min(r.gpu_count for r in self.ranks)), 0))
        for key, attr in (
            ("env/host_memory_gib", "host_mem_total_bytes"),
            ("env/host_memory_available_gib", "host_mem_available_bytes"),
            ("env/gpu_memory_gib", "gpu_total_bytes"),
            ("env/gpu_free_memory_gib", "gpu_free_bytes"),
        ):
            smallest = _smallest(getattr(r, attr) for r in self.ranks)
            if smallest is not None:
                out.append((key, smallest / GIB, 0))
        cpus = _smallest(r.cpu_affinity or r.cpu_count for r in self.ranks)
        if cpus is not None:
            out.append(("env/cpus_per_rank", float(cpus), 0))
        return out

    def headline(self) -> str:
        """E.g. "2 ranks on 2 nodes, torch 2.13.0+cpu, gloo: consistent"."""
        first = self.ranks[0]
        parts = [f"{_count(self.world_size, 'rank')} on {_count(self.nodes, 'node')}", f"torch {first.torch}"]
        if first.gpu_name:
            parts.append(f"{first.gpu_count}x {first.gpu_name} per rank")
        if first.cuda:
            parts.append(f"CUDA {first.cuda}")
        if first.nccl:
            parts.append(f"NCCL {first.nccl}")
        parts.append("no process group" if first.backend == "none" else first.backend)
        return f"{', '.join(parts)}: {'consistent' if self.consistent else 'INCONSISTENT'}"


class FleetMismatch(RuntimeError):
    """Ranks disagree on something that must be identical, or lack what the config requires."""


def run(cfg: EnvInputs) -> EnvResult:
    """Check this rank's world (or this process alone, without a process group)."""
    return check_fleet(collect_local(), cfg.env)


def check_fleet(facts: dict[str, Any], cfg: EnvConfig) -> EnvResult:
    """Gather every rank's `facts` and check them; the same result, or the same error, on every rank."""
    ranks = gather_objects(facts)
    mismatches = find_mismatches(ranks)
    problems = check_requirements(ranks, cfg.require_cuda, cfg.min_free_device_memory_gib) + check_devices(ranks)
    if cfg.require_active_ib:
        problems += check_ports(ranks)
    if mismatches or problems:
        raise FleetMismatch(_explain(ranks, mismatches, problems, cfg))
    infos = [RankInfo(**r) for r in ranks]
    # launcher=local emulates nodes on one host, and real hosts may share a node index (Ray):
    # only the pair tells nodes apart in both cases.
    nodes = len({(r.node_name, r.hostname) for r in infos})
    return EnvResult(world_size=len(infos), nodes=nodes, ranks=infos, consistent=True)


def _explain(ranks: list[dict[str, Any]], mismatches: list[str], problems: list[str], cfg: EnvConfig) -> str:
    """A first line saying what is wrong, the table of who has what, and a last line with the fix.

    The fix line also names the problem: launchers that report one line report the last one.
    """
    what = ([f"ranks disagree on {', '.join(mismatches)}"] if mismatches else []) + _summarise(problems)
    fields = list(mismatches)
    fixes = []
    if mismatches:
        fixes.append(
            f"give every rank the same {', '.join(mismatches)} (one container image or venv on all nodes)"
        )
    if problems:
        fields += [f for f in ("backend", "gpu_count", "gpu_name", "gpu_bus_id", "gpu_free_bytes", "ib_ports")
                   if f not in fields]
        if any("InfiniBand" in p for p in problems):
            fixes.append("bring the InfiniBand ports up (ibstat), or set env.require_active_ib=false")
        if any(" share GPU " in p for p in problems):
            fixes.append("give each rank of a node its own GPU (procs_per_node <= GPUs per node; check the "
                         "launcher's --gpu-bind)")
        if any("CUDA device" in p or "GPU has" in p for p in problems):
            need = "a CUDA device"
            if cfg.min_free_device_memory_gib > 0:
                need += f" with >= {cfg.min_free_device_memory_gib:g} GiB free"
            fixes.append(f"give every rank {need}, or relax env.require_cuda / env.min_free_device_memory_gib "
                         "(with launcher.backend=gloo)")
    return "\n".join(
        [f"env: {'; '.join(what)}", mismatch_table(ranks, fields), f"env: to fix, {'; '.join(fixes)}."]
    )


def _summarise(problems: list[str], shown: int = 3) -> list[str]:
    """The first few problems and a count of the rest, to keep the first line one line."""
    rest = len(problems) - shown
    return problems[:shown] + ([f"and {rest} more"] if rest > 0 else [])


def _smallest(values: Iterable[int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(min(known)) if known else None


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
