"""A changed fleet re-runs what was measured on the old one, and the summary says what changed.

The workers of launcher=local are this machine; a test launcher presents the same machine with
one more GPU (as a node whose GPU came back, or a new driver, would look) and the real pipeline
runs against it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipelines.launchers.local import LocalLauncher
from pipelines.placement import NodeIdentity
from pipelines.runner import Runner
from pipelines.tracking import NullTracker
from tests.helpers import asked_statuses

pytestmark = pytest.mark.slow


class GpuAddedLauncher(LocalLauncher):
    """launcher=local, but its machine shows one more GPU than this one has."""

    def identity(self) -> NodeIdentity:
        me = super().identity()
        return dataclasses.replace(me, gpus=[*me.gpus, "NVIDIA H100 80GB HBM3 0000:1b:00.0"], driver="550.54.15")


def run(cfg, tmp_path, name: str, launcher_type=LocalLauncher):
    run_dir = tmp_path / name
    run_dir.mkdir()
    launcher = launcher_type(cfg.launcher, ranks_per_host=cfg.nodes * cfg.procs_per_node)
    summary = Runner(cfg, run_dir, NullTracker(), launcher, echo=lambda *_: None).run()
    data = json.loads(summary.path.read_text())
    return asked_statuses(data), data


def test_a_changed_fleet_reruns_every_measurement_and_names_the_change(compose_cfg, tmp_path):
    cfg = dataclasses.replace(compose_cfg("experiment=smoke", "tracking=none"), cache_dir=str(tmp_path / "cache"))
    statuses, first = run(cfg, tmp_path, "first")
    assert set(statuses.values()) == {"ran"}
    assert first["placement"]["changed"] == []

    statuses, changed = run(cfg, tmp_path, "changed", GpuAddedLauncher)
    # env, the measurements and everything computed from them: nothing is served from the old fleet.
    assert statuses == dict.fromkeys(["env", "bandwidth", "lr_find", "plan", "train", "report"], "ran")
    assert changed["placement"]["fingerprint"] != first["placement"]["fingerprint"]
    host = first["placement"]["nodes"][0]["name"]
    assert f"node {host} driver: None -> 550.54.15" in changed["placement"]["changed"]
    assert any(line.startswith(f"node {host} gpus: [] -> ['NVIDIA H100") for line in changed["placement"]["changed"])
    for name in ("env", "bandwidth", "lr_find", "plan", "train"):
        assert changed["stages"][name]["placement"]["fingerprint"] == changed["placement"]["fingerprint"][:16] or \
            changed["stages"][name]["placement"]["hosts"] == [host]

    # Back on the original fleet: its measurements are still there, and say who made them.
    statuses, back = run(cfg, tmp_path, "back")
    assert set(statuses.values()) == {"cached"}
    assert back["placement"]["changed"], "returning to the old fleet is a change too"
    for name in ("env", "bandwidth", "train"):
        measured = back["stages"][name]["measured_by"]
        assert measured["run_dir"] == str(tmp_path / "first")
        assert measured["placement"]["fingerprint"] == first["placement"]["fingerprint"]
