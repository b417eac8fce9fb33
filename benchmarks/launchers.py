"""Bench 6: the cluster launchers against launcher=local, a Ray cluster joined as a user joins one
and Slurm where a cluster answers."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cli import _cli
from benchmarks.rows import Row

LAUNCHER_ARGS = {
    "ray": lambda head: [f"launcher.address={head.address}"],
    # One intra-op thread per rank, as launcher=local gives each of 2 ranks on this 2-core host:
    # scripts/slurm-local.sh's emulated nodes claim 4 CPUs each (so jobs fit side by side), and the
    # default node share would run 4 threads per rank on the 2 cores (measured at 34823f9: 80.5
    # against local's 774 samples/s). The tests pass the same (tests/integration/test_slurm.py).
    "slurm": lambda head: ["launcher.cpus_per_task=1"],
    "local": lambda head: [],
}
"""What each launcher's runs add to the command line."""


def _slurm_up() -> bool:
    import shutil

    if shutil.which("sinfo") is None:
        return False
    probe = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    return probe.returncode == 0 and bool({"idle", "mix", "alloc"} & set(probe.stdout.split()))


class RayHead:
    """A Ray cluster started once (`ray start --head --block`), as a user joining one has it; in its
    own process group, stopped by that group's id at the end."""

    def __init__(self, tmp: Path):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.env = {**os.environ, "HOME": str(tmp / "home"), "RAY_TMPDIR": tempfile.mkdtemp(prefix="ss-bh-")}
        (tmp / "home").mkdir(exist_ok=True)
        ray = Path(sys.executable).with_name("ray")
        self.proc = subprocess.Popen([str(ray), "start", "--head", f"--port={self.port}", f"--num-cpus={os.cpu_count()}",
                                      "--include-dashboard=false", "--block"], env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(15)  # gcs, raylet and the runtime-env agent up

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        """The head's process group, then each process it started, by PID: Ray's workers lead
        process groups of their own, and one (a Train controller, 2026-12-06) outlived its raylet."""
        import signal

        import psutil

        try:
            started = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            started = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        for proc in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(started, timeout=10)
        subprocess.run(["rm", "-rf", self.env["RAY_TMPDIR"]])


def bench_launchers() -> list[Row]:
    """6. A whole `only=[train]` invocation (env, bandwidth, lr_find, plan and train all run: a fresh
    cache each time) on Ray joining a running cluster, and on Slurm where a cluster answers, vs
    local: wall seconds, train samples/s (the train stage alone, longer: `_train_speed`), and the
    Slurm jobs each invocation asked for."""
    launchers = ["ray"] + (["slurm"] if _slurm_up() else [])
    if "slurm" not in launchers:
        print("   (slurm: no cluster answers here; `bash scripts/slurm-local.sh up` to include it)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        head = RayHead(Path(tmp))
        try:
            args = ["experiment=smoke", "train.steps=60", "tracking=none", "only=[train]"]
            for launcher in launchers:
                seconds: dict[str, list[float]] = {launcher: [], "local": []}
                jobs: list[int] = []
                for i in range(2):
                    for name in (launcher, "local"):
                        extra = LAUNCHER_ARGS[name](head)
                        # Its own run dir and cache per pair and round: local's runs against Ray must
                        # not serve local's runs against Slurm.
                        run = f"{launcher}-vs-{name}{i}"
                        wall, _ = _cli(Path(tmp), *args, *extra, f"launcher={name}", f"hydra.run.dir={run}",
                                       f"cache_dir={tmp}/cache-{run}", env=head.env)
                        summary = json.loads((Path(tmp) / f"{run}/summary.json").read_text())
                        served = [stage for stage, s in summary["stages"].items() if s["status"] == "cached"]
                        if served:
                            raise RuntimeError(f"{run}: {served} served from the cache; the row would time nothing")
                        seconds[name].append(wall)
                        if name == "slurm":
                            jobs.append(len({j for s in summary["stages"].values() for j in s.get("jobs", [])}))
                speed = _train_speed(Path(tmp), launcher, args, head)
                goal = {"ray": "<= 1.3", "slurm": "<= 1.2"}[launcher]
                where = "joining a running Ray cluster" if launcher == "ray" else "a 2-node Slurm cluster"
                rows.append(Row(f"launcher {launcher} vs local, whole only=[train] invocation wall time ({where})",
                                statistics.median(seconds[launcher]), statistics.median(seconds["local"]), "s", goal))
                rows.append(Row(f"launcher {launcher} vs local, train samples/s ({TRAIN_SPEED_STEPS} steps, median of {TRAIN_SPEED_REPEATS}, "
                                "alternating)", statistics.median(speed[launcher]),
                                statistics.median(speed["local"]), "samples/s", ">= 0.95"))
                if jobs:
                    rows.append(Row("launcher slurm, Slurm jobs per invocation (vs the goal of one)", max(jobs), 1,
                                    "jobs", "1"))
        finally:
            head.stop()
    return rows


TRAIN_SPEED_STEPS = 400
TRAIN_SPEED_REPEATS = 10
"""Runs a side of the samples/s rows. One run spreads ~3-4 % from the next on this 2-core host (ten
pairs on Ray, 2026-12-06: Ray 1055-1163 samples/s, local 1087-1234; their medians 0.953), so a
median of 5 a side read the ratio with an sd of ~2.4 %, as much as the margin between Ray's ~0.955
and the goal of 0.95 (0.945 in the full bench of 2026-12-05, 0.982 in the one before it); at 10,
~1.7 %. Each pair is printed, so that a row's spread can be read from the bench's log."""


def _train_speed(tmp: Path, launcher: str, args: list[str], head: RayHead) -> dict[str, list[float]]:
    """Train samples/s on `launcher` and on local: the train stage alone re-run (what is upstream
    of it served from the cache the wall-time runs filled) over TRAIN_SPEED_STEPS steps, the two
    taking turns going first. A 60-step stage times ~0.6 s, and two local runs on this host
    differ by up to a quarter at that length: more than the launchers do."""
    speed: dict[str, list[float]] = {launcher: [], "local": []}
    for i in range(TRAIN_SPEED_REPEATS):
        for name in (launcher, "local") if i % 2 == 0 else ("local", launcher):
            extra = LAUNCHER_ARGS[name](head)
            run = f"{launcher}-vs-{name}-speed{i}"
            _cli(tmp, *args, *extra, f"train.steps={TRAIN_SPEED_STEPS}", "force=[train]", f"launcher={name}",
                 f"hydra.run.dir={run}", f"cache_dir={tmp}/cache-{launcher}-vs-{name}0", env=head.env)
            summary = json.loads((tmp / f"{run}/summary.json").read_text())
            speed[name].append(summary["stages"]["train"]["result"]["samples_per_s"])
        print(f"   {launcher} vs local, pair {i}: {speed[launcher][-1]:.0f} vs {speed['local'][-1]:.0f} samples/s",
              flush=True)
    return speed
