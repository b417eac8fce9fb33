"""Where a measurement was made: placements, their fingerprints, and the keys that hold them."""

from __future__ import annotations

import dataclasses

from pipelines.cache import env_fingerprint, stage_key
from pipelines.placement import NodeIdentity, Placement, diff, from_json, node_identity, to_json


def node(name: str, gpus: list[str] | None = None, driver: str | None = "550.54") -> NodeIdentity:
    return NodeIdentity(name=name, hostname=name, cpu_model="Xeon", cpus=64, memory_gib=1024, python="3.11.7",
                        torch="2.13.0", cuda="12.8", gpus=gpus if gpus is not None else ["NVIDIA H100 0000:1b:00.0"],
                        driver=driver, interconnect=["mlx5_0/1 4: ACTIVE 400 Gb/sec (4X NDR)"])


def cluster(*names: str, launcher: str = "slurm") -> Placement:
    return Placement(launcher, "nccl", [node(n) for n in names])


def key(placement: Placement | None) -> str:
    return stage_key("bandwidth", "stages.bandwidth:run", {"iters": 20}, {}, {"world": [2, 1]},
                     placement.fingerprint if placement is not None else None)


def test_the_same_config_on_two_placements_never_shares_a_key():
    # The driver's own fingerprint is the same in both: only the workers tell them apart.
    keys = {key(cluster("gpu1", "gpu2")), key(cluster("gpu3", "gpu4")), key(cluster("gpu1", "gpu2", launcher="ray")),
            key(Placement("slurm", "gloo", [node("gpu1"), node("gpu2")])), key(None)}
    assert len(keys) == 5


def test_a_changed_device_inventory_or_driver_changes_the_fingerprint():
    base = cluster("gpu1", "gpu2")
    one_gpu_missing = Placement("slurm", "nccl", [node("gpu1"), node("gpu2", gpus=[])])
    upgraded = Placement("slurm", "nccl", [node("gpu1"), node("gpu2", driver="560.1")])
    assert len({base.fingerprint, one_gpu_missing.fingerprint, upgraded.fingerprint}) == 3
    assert key(base) == key(cluster("gpu1", "gpu2")), "an unchanged fleet keeps its keys"


def test_the_hardware_class_ignores_node_names_and_counts_but_not_hardware():
    assert cluster("gpu1", "gpu2").hardware_class == cluster("gpu7").hardware_class
    assert cluster("gpu1").hardware_class != Placement("slurm", "nccl", [node("gpu1", gpus=[])]).hardware_class
    assert cluster("gpu1").hardware_class != cluster("gpu1", launcher="ray").hardware_class


def test_diff_names_what_changed():
    old = cluster("gpu1", "gpu2")
    new = Placement("slurm", "nccl", [node("gpu1", driver="560.1"), node("gpu3")])
    assert diff(old, new) == ["node gpu1 driver: 550.54 -> 560.1", "node gpu2 left", "node gpu3 joined"]
    assert diff(old, old) == []


def test_a_placement_round_trips_through_json():
    placement = cluster("gpu1", "gpu2")
    assert from_json(to_json(placement)) == placement
    assert from_json(to_json(placement)).fingerprint == placement.fingerprint


def test_this_machine_is_read_without_torch_and_the_driver_fingerprint_too():
    import subprocess
    import sys

    code = ("import sys; from pipelines.placement import node_identity; from pipelines.cache import env_fingerprint;"
            "n = node_identity(); env_fingerprint(); print(n.cpus, n.torch, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[2] == "False", "reading the placement must not import torch"
    import torch

    assert out[1] == torch.__version__ and env_fingerprint()["torch"] == torch.__version__
    assert env_fingerprint()["cuda"] == torch.version.cuda
    me = node_identity("x")
    assert me.name == "x" and me.cpus and me.python


def test_one_device_stages_are_keyed_on_the_first_node_only():
    two = cluster("gpu1", "gpu2")
    assert two.first_node() == dataclasses.replace(two, nodes=two.nodes[:1])
    assert two.first_node().fingerprint == cluster("gpu1").fingerprint
