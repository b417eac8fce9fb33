"""Where a measurement was made: the launcher and the identity of the workers it ran on.

Bandwidth, step time and throughput are properties of the machines that produced them, so the
cache key of every `world` and `one_device` stage holds the placement it ran on, and every result
says where it was measured. A placement is the launcher's name and backend plus one identity per
node, read on that node from files and package metadata (no torch import, no GPU call, no
subprocess: it costs milliseconds):

- the node's name (Slurm's node name, the emulated node of launcher=local, the host otherwise) and
  hostname;
- the CPU model, core count and memory;
- python, torch and the CUDA version torch was built for;
- the GPUs the node shows (model and bus id from the NVIDIA driver's /proc files), and the
  driver's version;
- InfiniBand ports with their state and rate (/sys/class/infiniband).

launcher=local runs on this machine, so the driver reads it (the re-check is free); Ray and Slurm
read it on the workers of the invocation's allocation (`probe`). A changed fleet (a node swapped,
a driver upgraded, a GPU missing, a port down) changes the placement, which re-runs every stage
measured on it and is reported by `diff`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

NVIDIA_PROC = Path("/proc/driver/nvidia")
INFINIBAND_SYS = Path("/sys/class/infiniband")
HIDDEN = ("-1", "NoDevFiles")
"""CUDA_VISIBLE_DEVICES values that hide every device (Slurm writes NoDevFiles)."""
NAME_FIELDS = ("name", "hostname")
"""The fields that tell nodes apart; without them an identity describes a kind of node."""


@dataclass(frozen=True)
class NodeIdentity:
    """What one node is, as read on it."""

    name: str
    """Slurm's node name, `node<i>` for launcher=local's emulated nodes, else the hostname."""
    hostname: str
    cpu_model: str | None
    cpus: int | None
    memory_gib: int | None
    python: str
    torch: str | None
    cuda: str | None
    """The CUDA version torch was built for (None: a CPU build)."""
    gpus: list[str] = field(default_factory=list)
    """`<model> <bus id>` of every GPU the node has (the driver's list: the node's hardware)."""
    driver: str | None = None
    interconnect: list[str] = field(default_factory=list)
    """InfiniBand ports: `<device>/<port> <state> <rate>`."""
    visible_devices: str | None = None
    """CUDA_VISIBLE_DEVICES of the rank that reported, as given (None: unset, every GPU). Its
    indices are not mapped onto `gpus`: Slurm and container runtimes renumber the devices a task
    may use, so which GPU a rank holds is read by the rank itself (env: each rank's bus id)."""

    @property
    def usable_gpus(self) -> int:
        """GPUs the node's ranks may use: every GPU, or as many as CUDA_VISIBLE_DEVICES names."""
        if not self.cuda:
            return 0
        if self.visible_devices is None:
            return len(self.gpus)
        named = [v for v in self.visible_devices.split(",") if v.strip() and v.strip() not in HIDDEN]
        return min(len(named), len(self.gpus)) if self.gpus else 0

    def describe_gpus(self) -> str:
        """E.g. `8 GPUs, CUDA_VISIBLE_DEVICES=0`, `no NVIDIA driver`, `torch built without CUDA`."""
        if not self.gpus:
            return "no NVIDIA GPU or driver"
        if not self.cuda:
            return f"{len(self.gpus)} GPUs, but torch {self.torch} is built without CUDA"
        shown = "" if self.visible_devices is None else f", CUDA_VISIBLE_DEVICES={self.visible_devices!r}"
        return f"{len(self.gpus)} GPUs{shown}"

    def hardware(self) -> dict[str, Any]:
        """The identity without the node's names: what kind of node it is."""
        data = _as_dict(self)
        for key in NAME_FIELDS:
            data.pop(key)
        return data


@dataclass(frozen=True)
class Placement:
    """The workers of one launch: the launcher, and every node's identity in rank order."""

    launcher: str
    backend: str
    nodes: list[NodeIdentity]

    @property
    def fingerprint(self) -> str:
        """Digest of everything: two placements share it only on the same nodes, as they are."""
        return _digest({"launcher": self.launcher, "backend": self.backend, "nodes": [_as_dict(n) for n in self.nodes]})

    @property
    def hardware_class(self) -> str:
        """Digest of the launcher and the distinct kinds of node, names and counts left out: runs
        of different sizes on the same cluster share it (calibration generalises over sizes)."""
        kinds = sorted({json.dumps(n.hardware(), sort_keys=True) for n in self.nodes})
        return _digest({"launcher": self.launcher, "backend": self.backend, "kinds": kinds})

    @property
    def hosts(self) -> list[str]:
        return [n.name for n in self.nodes]

    def first_node(self) -> Placement:
        """Where a one-device stage runs: the first node alone."""
        return replace(self, nodes=self.nodes[:1])

    def describe(self) -> dict[str, Any]:
        """The short form summaries, MLflow tags and reports carry."""
        return {"launcher": self.launcher, "fingerprint": self.fingerprint[:16], "hosts": self.hosts,
                "hardware": self.hardware_class[:16]}


def placement_tags(placement: Placement) -> dict[str, str]:
    """MLflow tags of an invocation run: where its worker stages ran."""
    short = placement.describe()
    return {"placement.launcher": short["launcher"], "placement.fingerprint": short["fingerprint"],
            "placement.hardware": short["hardware"], "placement.hosts": ",".join(short["hosts"])[:5000]}


def _as_dict(node: NodeIdentity) -> dict[str, Any]:
    return {k: getattr(node, k) for k in NodeIdentity.__dataclass_fields__}


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def node_identity(name: str | None = None) -> NodeIdentity:
    """This machine's identity, as `name` (default: Slurm's node name, else the hostname)."""
    host = socket.gethostname()
    return NodeIdentity(
        name=name or os.environ.get("SLURMD_NODENAME") or host,
        hostname=host,
        cpu_model=_cpu_model(),
        cpus=os.cpu_count(),
        memory_gib=_memory_gib(),
        python=platform.python_version(),
        torch=_package_version("torch"),
        cuda=torch_cuda_build(),
        gpus=_gpus(),
        driver=_driver_version(),
        interconnect=_infiniband_ports(),
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def resolved_backend(backend: str, node: NodeIdentity) -> str:
    """launcher.backend with `auto` resolved once for every rank: nccl where torch has CUDA and the
    node's ranks may use GPUs, else gloo."""
    if backend != "auto":
        return backend
    return "nccl" if node.usable_gpus else "gloo"


def probe(_inputs: object = None) -> list[NodeIdentity]:
    """A worker task: every rank's node identity, in rank order (launchers run it on their workers;
    ranks of one node report the same)."""
    from training.dist import gather_objects, node_rank

    name = os.environ.get("SLURMD_NODENAME") or f"{socket.gethostname()}/node{node_rank()}"
    return gather_objects(node_identity(name))


def per_node(ranks: list[NodeIdentity]) -> list[NodeIdentity]:
    """One identity per node, in the order of their first rank."""
    return list({n.name: n for n in reversed(ranks)}.values())[::-1]


def diff(old: Placement, new: Placement) -> list[str]:
    """What changed between two placements, one short line per difference."""
    changes = [f"{key}: {getattr(old, key)} -> {getattr(new, key)}" for key in ("launcher", "backend")
               if getattr(old, key) != getattr(new, key)]
    before, after = {n.name: n for n in old.nodes}, {n.name: n for n in new.nodes}
    changes += [f"node {name} left" for name in before if name not in after]
    changes += [f"node {name} joined" for name in after if name not in before]
    for name in before.keys() & after.keys():
        a, b = _as_dict(before[name]), _as_dict(after[name])
        changes += [f"node {name} {key}: {a[key]} -> {b[key]}" for key in a if a[key] != b[key]]
    return sorted(changes)


def from_json(data: dict[str, Any]) -> Placement:
    nodes = [NodeIdentity(**n) for n in data["nodes"]]
    return Placement(data["launcher"], data["backend"], nodes)


def to_json(placement: Placement) -> dict[str, Any]:
    return {"launcher": placement.launcher, "backend": placement.backend,
            "nodes": [_as_dict(n) for n in placement.nodes]}


# ---- facts, read from files ----------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _cpu_model() -> str | None:
    text = _read(Path("/proc/cpuinfo")) or ""
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found.group(1).strip() if found else platform.processor() or None


def _memory_gib() -> int | None:
    """Whole GiB: MemTotal moves by a few pages on some hosts (the kernel's own reservations)."""
    text = _read(Path("/proc/meminfo")) or ""
    found = re.search(r"^MemTotal:\s+(\d+) kB", text, re.MULTILINE)
    return round(int(found.group(1)) / 1024**2) if found else None


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_cuda_build() -> str | None:
    """`torch.version.cuda`, read from torch's version.py without importing torch (~1 s)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    text = _read(Path(spec.origin).with_name("version.py")) or ""
    found = re.search(r"^cuda\s*(?::\s*[^=]+)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found else None


def _gpus() -> list[str]:
    """Every GPU of the node, in the driver's (bus) order."""
    gpus = []
    for info in sorted((NVIDIA_PROC / "gpus").glob("*/information")):
        text = _read(info) or ""
        model = re.search(r"^Model:\s*(.+)$", text, re.MULTILINE)
        gpus.append(f"{model.group(1).strip() if model else 'unknown'} {info.parent.name}")
    return gpus


def _driver_version() -> str | None:
    text = _read(NVIDIA_PROC / "version") or ""
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
    return found.group(1) if found else None


def _infiniband_ports() -> list[str]:
    ports = []
    for port in sorted(INFINIBAND_SYS.glob("*/ports/*")):
        state = (_read(port / "state") or "").strip()
        rate = (_read(port / "rate") or "").strip()
        ports.append(f"{port.parent.parent.name}/{port.name} {state} {rate}".strip())
    return ports
