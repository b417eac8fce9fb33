"""Facts about this rank's software and hardware, and the checks that every rank agrees.

Every fact is read from the machine; one that cannot be read is None, never a guess. The facts
are a plain dict so that they pickle across ranks and can be altered by a test.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training import dist as tdist
from training.units import GIB

if TYPE_CHECKING:
    pass

MUST_MATCH: tuple[str, ...] = (
    "python",
    "torch",
    "cuda",
    "cudnn",
    "nccl",
    "backend",
    "driver",
    "has_gpu",
    "gpu_name",
)
"""Facts that must be identical on every rank: a difference breaks collectives or skews timings."""

TOOL_TIMEOUT_S = 5.0
"""A hung `nvidia-smi` or `ibstat` must not stall the whole fleet check."""
MAX_TABLE_ROWS = 32
"""Beyond this many ranks the table shows the odd ones out first (a 1024-row table is unreadable)."""


def subnormals_flushed() -> bool:
    """Whether this thread computes float32 subnormals as zero (torch.set_flush_denormal): read off
    an operation on one, since torch has no getter."""
    import torch

    tiny = torch.tensor([1e-39], dtype=torch.float64).to(torch.float32)  # 1e-39: subnormal in float32
    return bool((tiny * 1.0).item() == 0.0)


def collect_local() -> dict[str, Any]:
    """This rank's facts: identity, software versions, GPUs, driver, InfiniBand, CPUs, memory."""
    import torch
    import torch.distributed as dist

    node = tdist.node_rank()
    facts: dict[str, Any] = {
        "rank": tdist.rank(),
        "node": node,
        # Emulated nodes (launcher=local, Slurm's multiple slurmd) share one hostname.
        "node_name": os.environ.get("SLURMD_NODENAME") or f"node{node}",
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": tdist.backend(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "driver": driver_version(),
        "ib_ports": infiniband_ports(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "niceness": os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None,
        "subnormals_flushed": subnormals_flushed(),
        "nccl_env": nccl_env(),
    }
    facts.update(_cuda_facts())
    mem = host_memory()
    facts["host_mem_total_bytes"] = mem.get("MemTotal")
    facts["host_mem_available_bytes"] = mem.get("MemAvailable")
    return facts


def _cuda_facts() -> dict[str, Any]:
    """CUDA toolkit, cuDNN, NCCL and this rank's GPU; None (and no GPU) without CUDA."""
    import torch

    cuda = torch.cuda.is_available()
    facts: dict[str, Any] = {
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": nccl_version() if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "gpu_name": None,
        "gpu_names": [],
        "gpu_total_bytes": None,
        "gpu_free_bytes": None,
        "gpu_bus_id": None,
    }
    facts["has_gpu"] = facts["gpu_count"] > 0
    if facts["has_gpu"]:
        index = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        facts.update(
            gpu_name=torch.cuda.get_device_name(index),
            gpu_names=[torch.cuda.get_device_name(i) for i in range(facts["gpu_count"])],
            gpu_total_bytes=total,
            gpu_free_bytes=free,
            gpu_bus_id=bus_id(torch.cuda.get_device_properties(index)),
        )
    return facts


def bus_id(props: Any) -> str | None:
    """A CUDA device's PCI address as the NVIDIA driver writes it (`0000:1b:00.0`), from its
    properties; its UUID where torch has no PCI fields; None where it has neither."""
    fields = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if all(isinstance(f, int) for f in fields):
        return f"{fields[0]:04x}:{fields[1]:02x}:{fields[2]:02x}.0"
    uuid = getattr(props, "uuid", None)
    return None if uuid is None else str(uuid)


NCCL_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "CUDA_VISIBLE_DEVICES")


def nccl_env() -> dict[str, str]:
    """The NCCL and torch-NCCL settings this rank runs with (NCCL_IB_HCA, NCCL_SOCKET_IFNAME,
    TORCH_NCCL_ASYNC_ERROR_HANDLING, ...): a study's bandwidth is a fact of them, so they are kept."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(NCCL_ENV_PREFIXES)}


def nccl_version() -> str | None:
    """NCCL's version as "2.x.y", or None when torch was built without it."""
    import torch

    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    # Recent torch returns (major, minor, patch); very old builds returned one integer code.
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def driver_version() -> str | None:
    """The NVIDIA driver version, from NVML if pynvml is installed, else from nvidia-smi."""
    try:
        import pynvml
    except ImportError:
        out = _run_tool("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        # One line per GPU, all the same on one host.
        return out.splitlines()[0].strip() if out and out.strip() else None
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def infiniband_ports() -> list[str] | None:
    """InfiniBand ports as "mlx5_0/1 Active 200 Gb/s InfiniBand", or None without `ibstat`."""
    out = _run_tool("ibstat")
    return None if out is None else parse_ibstat(out)


def parse_ibstat(text: str) -> list[str]:
    """One line per port from `ibstat` output: CA/port, state, rate and link layer."""
    ports: list[dict[str, str]] = []
    ca = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("CA '"):
            ca = line[4:].rstrip("'")
        elif line.startswith("Port ") and line.endswith(":"):
            ports.append({"id": f"{ca}/{line[5:-1]}"})
        elif ports and ":" in line:
            key, _, value = line.partition(":")
            ports[-1][key.strip()] = value.strip()
    return [
        " ".join(
            filter(
                None, [p["id"], p.get("State"), p.get("Rate") and f"{p['Rate']} Gb/s", p.get("Link layer")]
            )
        )
        for p in ports
    ]


def _run_tool(*args: str) -> str | None:
    """stdout of a command-line tool, or None when it is absent, fails or hangs."""
    if shutil.which(args[0]) is None:
        return None
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def host_memory(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """/proc/meminfo in bytes (`MemTotal`, `MemAvailable`, ...); empty where there is none."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def find_mismatches(ranks: Sequence[dict[str, Any]]) -> list[str]:
    """The MUST_MATCH fields whose values are not the same on every rank, in MUST_MATCH order."""
    return [f for f in MUST_MATCH if any(r.get(f) != ranks[0].get(f) for r in ranks[1:])]


def check_requirements(ranks: Sequence[dict[str, Any]], require_cuda: bool, min_free_gib: float) -> list[str]:
    """What the ranks lack against the requirements, one sentence per rank and problem."""
    problems = []
    for r in ranks:
        if not r.get("has_gpu"):
            if require_cuda or min_free_gib > 0:
                problems.append(f"rank {r['rank']} has no CUDA device")
            continue
        free = r.get("gpu_free_bytes")
        if min_free_gib > 0 and (free is None or free / GIB < min_free_gib):
            shown = "unknown" if free is None else f"{free / GIB:.1f} GiB"
            problems.append(f"rank {r['rank']} GPU has {shown} free < {min_free_gib:g} GiB")
    return problems


def check_devices(ranks: Sequence[dict[str, Any]]) -> list[str]:
    """Each rank's device against its backend and its node's other ranks: nccl on a rank without a
    GPU, and two ranks of one node on one GPU (a launcher's binding that gave every task device 0)."""
    problems = [f"rank {r['rank']} has no CUDA device but the backend is nccl" for r in ranks
                if r.get("backend") == "nccl" and not r.get("has_gpu")]
    holders: dict[tuple[Any, Any, str], list[int]] = {}
    for r in ranks:
        if r.get("gpu_bus_id"):
            holders.setdefault((r.get("node_name"), r.get("hostname"), r["gpu_bus_id"]), []).append(r["rank"])
    problems += [f"ranks {', '.join(map(str, shared))} on {node} share GPU {bus}"
                 for (node, _, bus), shared in holders.items() if len(shared) > 1]
    return problems


def check_ports(ranks: Sequence[dict[str, Any]]) -> list[str]:
    """InfiniBand ports that are not Active (Down, Initializing, Armed, Polling): a node whose port
    is down runs its inter-node traffic over whatever is left, and its bandwidth misleads."""
    problems, seen = [], set()
    for r in ranks:
        for port in r.get("ib_ports") or []:
            state = port.split()[1] if len(port.split()) > 1 else "unknown"
            where = (r.get("node_name"), r.get("hostname"), port)
            if state != "Active" and where not in seen:
                seen.add(where)
                problems.append(f"{r.get('node_name')} InfiniBand port {port.split()[0]} is {state}")
    return problems


def mismatch_table(ranks: Sequence[dict[str, Any]], fields: Sequence[str]) -> str:
    """A fixed-width table, one row per rank: `rank | node | host | <field> ...`.

    With more than MAX_TABLE_ROWS ranks the first row is a rank with the most common values,
    the others are ranks that differ from it, and a last line counts the ranks left out.
    """
    rows = _rows_to_show(ranks, fields)
    header = ["rank", "node", "host", *fields]
    cells = [[_cell(r.get(k), k) for k in ("rank", "node_name", "hostname", *fields)] for r in rows]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    lines = [line(header), "-+-".join("-" * w for w in widths), *(line(row) for row in cells)]
    if len(rows) < len(ranks):
        lines.append(f"({len(ranks) - len(rows)} more ranks not shown)")
    return "\n".join(lines)


def _rows_to_show(ranks: Sequence[dict[str, Any]], fields: Sequence[str]) -> list[dict[str, Any]]:
    if len(ranks) <= MAX_TABLE_ROWS:
        return list(ranks)

    def values(r: dict[str, Any]) -> str:
        return repr([r.get(f) for f in fields])

    common = Counter(values(r) for r in ranks).most_common(1)[0][0]
    first = next(r for r in ranks if values(r) == common)
    return [first, *(r for r in ranks if values(r) != common)][:MAX_TABLE_ROWS]


def _cell(value: Any, field: str) -> str:
    if value is None:
        return "-"
    if field.endswith("_bytes") and isinstance(value, int):
        return f"{value / GIB:.1f} GiB"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "-"
    return str(value)
