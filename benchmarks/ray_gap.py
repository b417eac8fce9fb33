"""Where launcher=ray's train-speed gap goes (#27): the train stage's samples/s on Ray as shipped, on
Ray with some of the job's own Ray processes paused while both ranks train, and on launcher=local,
the arms taking turns going first, median of each. A diagnostic to run by hand, not a bench row:
no user run pauses Ray's processes.

    python benchmarks/ray_gap.py ROUNDS ARM [ARM ...]

Besides Ray and local as they are, each ARM is a run of names joined by '+': Ray processes to pause
(SIGSTOP, then SIGCONT once either rank goes idle), by actor class, e.g.
`TrainController+SynchronizationActor`, or by a Ray daemon's binary or script, e.g. `raylet`, `log_monitor`;
`load`, an outside process busy 1 ms in every 5 (20 % of a core) beside the train stage; `pin`, each
rank's threads pinned to a core of its own (rank i to core i) once both train; `local`, the arm on
launcher=local (`local+load`, `local+pin`). Each run is a whole `only=[train]`
invocation joining one running Ray head (the bench's RayHead), the stages upstream of train served
from a cache filled once, so that only the train stage runs: TRAIN_SPEED_STEPS steps, as the
bench's samples/s row.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cli import _cli  # noqa: E402
from benchmarks.launchers import LAUNCHER_ARGS, TRAIN_SPEED_STEPS, RayHead  # noqa: E402

LOAD = "import time\nwhile True:\n    t = time.perf_counter()\n    while time.perf_counter() - t < 0.001: pass\n" \
       "    time.sleep(0.004)\n"
"""The outside load: 1 ms busy, 4 ms asleep, 200 wake-ups a second (what a busy neighbour does)."""

BUSY = 150.0
"""The ranks' CPU together, percent of a core, above which both are training (not the stage's
one-device baseline, not start-up)."""


class Pauser(threading.Thread):
    """Pauses the Ray processes whose actor class or script is in `classes` while both ranks are
    busy; with `pin`, pins each rank's threads to a core of its own then."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.classes: tuple[str, ...] = ()
        self.pin = False
        self.pinned: set[int] = set()
        self.paused: list[psutil.Process] = []
        self.pauses = 0
        self.done = False

    def _processes(self) -> tuple[list[psutil.Process], list[psutil.Process]]:
        ranks, chosen = [], []
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = proc.info["cmdline"] or [""]
            if cmdline[0].startswith("ray::RayTrainWorker") or "pipelines.launchers.worker" in cmdline[1:3]:
                ranks.append(proc)
            elif any(cmdline[0].startswith(f"ray::{name}") or cmdline[0].endswith(f"/{name}")
                     or any(a.endswith(f"/{name}.py") for a in cmdline[1:3]) for name in self.classes):
                chosen.append(proc)
        return ranks, chosen

    def run(self) -> None:
        while not self.done:
            if not self.classes and not self.pin:
                time.sleep(0.2)
                continue
            ranks, chosen = self._processes()
            try:
                for rank in ranks:
                    rank.cpu_percent(None)
                time.sleep(0.3)
                busy = len(ranks) == 2 and sum(rank.cpu_percent(None) for rank in ranks) > BUSY
            except psutil.NoSuchProcess:
                continue
            if busy and self.pin:
                self._pin(ranks)
            if busy and not self.paused and self.classes:
                for proc in chosen:
                    try:
                        proc.send_signal(signal.SIGSTOP)
                        self.paused.append(proc)
                    except psutil.NoSuchProcess:
                        pass
                self.pauses += 1
            elif not busy:
                self.resume()

    def _pin(self, ranks: list[psutil.Process]) -> None:
        """Rank i's threads (a thread's affinity is its own: every one of them) to core i."""
        for core, rank in enumerate(sorted(ranks, key=lambda p: p.pid)):
            if rank.pid in self.pinned:
                continue
            for thread in rank.threads():
                try:
                    os.sched_setaffinity(thread.id, {core % os.cpu_count()})
                except OSError:
                    pass
            self.pinned.add(rank.pid)

    def resume(self) -> None:
        for proc in self.paused:
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        self.paused = []


def main(rounds: int, arms: list[str]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ray-gap-"))
    head = RayHead(tmp)
    pauser = Pauser()
    pauser.start()
    args = ["experiment=smoke", "train.steps=60", "tracking=none", "only=[train]"]
    speed: dict[str, list[float]] = {name: [] for name in ["ray", "local", *arms]}
    classes = {arm: tuple(n for n in arm.split("+") if n not in ("ray", "local", "load", "pin")) for arm in speed}
    try:
        for launcher in ("ray", "local"):  # fills each launcher's cache: env, bandwidth, lr_find, plan
            _cli(tmp, *args, *LAUNCHER_ARGS[launcher](head), f"launcher={launcher}", f"hydra.run.dir=fill-{launcher}",
                 f"cache_dir={tmp}/cache-{launcher}", env=head.env)
        names = list(speed)
        for i in range(rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                launcher = "local" if "local" in name.split("+") else "ray"
                pauser.classes = classes[name]
                pauser.pin = "pin" in name.split("+")
                run = f"run{i}-{names.index(name)}"
                load = subprocess.Popen([sys.executable, "-c", LOAD]) if "load" in name.split("+") else None
                try:
                    _cli(tmp, *args, *LAUNCHER_ARGS[launcher](head), f"train.steps={TRAIN_SPEED_STEPS}",
                         "force=[train]", f"launcher={launcher}", f"hydra.run.dir={run}",
                         f"cache_dir={tmp}/cache-{launcher}", env=head.env)
                finally:
                    pauser.classes = ()
                    pauser.pin = False
                    pauser.resume()
                    if load is not None:
                        load.kill()
                        load.wait()
                summary = json.loads((tmp / run / "summary.json").read_text())
                speed[name].append(summary["stages"]["train"]["result"]["samples_per_s"])
            print(f"round {i}: " + ", ".join(f"{n} {v[-1]:.0f}" for n, v in speed.items()), flush=True)
        for name, values in speed.items():
            # Each arm against local under the same outside load and pinning, where that arm was run.
            same = "+".join(["local", *(n for n in name.split("+") if n in ("load", "pin"))])
            base = same if same in speed else "local"
            print(f"{name}: median {statistics.median(values):.0f} samples/s, "
                  f"{statistics.median(values) / statistics.median(speed[base]):.3f} of {base}")
        print(f"pauses: {pauser.pauses}")
    finally:
        pauser.done = True
        pauser.resume()
        head.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
