"""launcher=slurm against a real Slurm cluster (`bash scripts/slurm-local.sh up`: two emulated
nodes on this machine): training through Slurm matches local training, the env stage sees two
Slurm nodes, a requeued job resumes, failures and impossible requests fail at once, and
submit_only runs the whole pipeline as a batch job."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pipelines.launchers.base import StageFailed, Task, WorldSpec
from pipelines.launchers.local import LocalLauncher
from pipelines.schema import LauncherConfig
from tests.dist.test_strategies import TOL, train_inputs
from training.config import EnvConfig, StrategyConfig

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_UP = "bash scripts/slurm-local.sh up"


def _cluster_problem() -> str | None:
    """Why the Slurm tests cannot run here, or None when a cluster answers."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on the PATH (no Slurm client installed)"
    probe = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0 or not ({"idle", "mix", "alloc"} & set(probe.stdout.split())):
        return f"no Slurm cluster with usable nodes answers ({probe.stderr.strip() or probe.stdout.strip()})"
    return None


PROBLEM = _cluster_problem()
if PROBLEM is not None:
    print(f"\n!!! SKIPPING the Slurm tests: {PROBLEM}; start one with `{CLUSTER_UP}` !!!", file=sys.stderr)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROBLEM is not None, reason=f"SLURM TESTS SKIPPED: {PROBLEM}; run `{CLUSTER_UP}`"),
]


def slurm(run_dir: Path, **overrides: Any) -> Any:
    from pipelines.launchers.slurm import SlurmLauncher

    return SlurmLauncher(LauncherConfig(name="slurm", poll_s=0.3, timeout_min=5, **overrides), run_dir)


def task(tmp_path: Path, fn: str, inputs: Any = None, stage: str = "test") -> Task:
    return Task(stage=stage, fn=fn, inputs=inputs, workdir=tmp_path / "logs" / stage)


def train_task(tmp_path: Path, name: str, steps: int = 6, ckpt_every: int = 0) -> Task:
    inputs = (train_inputs(StrategyConfig(name="ddp"), steps=steps, ckpt_every=ckpt_every), str(tmp_path / name))
    return task(tmp_path, "tests.dist.workers:train_any", inputs, stage="train")


@pytest.mark.parametrize("nodes,procs", [(2, 1), (2, 2)])
def test_train_through_slurm_matches_local(tmp_path, nodes, procs):
    world = WorldSpec(nodes, procs)
    through_slurm = slurm(tmp_path).run(train_task(tmp_path, "slurm"), world)
    local = LocalLauncher(LauncherConfig()).run(train_task(tmp_path, "local"), world)
    assert through_slurm.world_size == nodes * procs
    assert through_slurm.losses == pytest.approx(local.losses, **TOL)


def test_env_stage_sees_two_slurm_nodes(tmp_path):
    from stages.env_check import EnvInputs

    launcher = slurm(tmp_path)
    result = launcher.run(task(tmp_path, "stages.env_check:run", EnvInputs(EnvConfig()), "env"), WorldSpec(2, 1))
    assert result.nodes == 2 and result.world_size == 2
    assert sorted(r.node_name for r in result.ranks) == ["node1", "node2"]
    # cpus_per_task=1: one intra-op thread per rank, not the node's every core (torch is imported
    # before the job's environment is exported, so the variable alone would not take).
    assert [r.torch_threads for r in result.ranks] == [1, 1]
    assert list(launcher.job_ids) == ["env"] and len(launcher.job_ids["env"]) == 1


def _requeue_when_checkpointed(launcher: Any, ckpt: Path, done: threading.Event) -> None:
    """Preempt the running train job once its first checkpoint exists, as Slurm would."""
    while not (ckpt / "latest.json").exists() and not done.is_set():
        time.sleep(0.1)
    job_id = launcher.job_ids["train"][0]
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    # Slurm holds a requeued job ~2.5 min (credential expiry); let it start at once.
    for _ in range(100):
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
        if "PENDING" in state:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
            return
        time.sleep(0.2)


def test_requeued_job_resumes_and_ends_as_uninterrupted(tmp_path):
    launcher = slurm(tmp_path)
    requeued_task = train_task(tmp_path, "requeued", steps=40, ckpt_every=4)
    done = threading.Event()
    preempt = threading.Thread(target=_requeue_when_checkpointed,
                               args=(launcher, tmp_path / "requeued", done), daemon=True)
    preempt.start()
    try:
        resumed = launcher.run(requeued_task, WorldSpec(2, 1))
    finally:
        done.set()
    clean = LocalLauncher(LauncherConfig()).run(train_task(tmp_path, "clean", steps=40, ckpt_every=4),
                                                WorldSpec(2, 1))
    assert resumed.resumed_from > 0
    assert resumed.losses == pytest.approx(clean.losses, **TOL)


def test_crashing_job_fails_the_stage_with_its_stderr_tail(tmp_path):
    launcher = slurm(tmp_path)
    with pytest.raises(StageFailed) as failed:
        launcher.run(task(tmp_path, "tests.dist.workers:raise_on_rank1"), WorldSpec(2, 1))
    message = str(failed.value)
    assert f"Slurm job {launcher.job_ids['test'][0]} ended FAILED" in message
    assert "task 1 stderr" in message and "ValueError: planted failure on rank 1" in message


def test_impossible_request_fails_at_once(tmp_path):
    start = time.monotonic()
    with pytest.raises(StageFailed, match="PartitionNodeLimit"):
        slurm(tmp_path).run(task(tmp_path, "tests.dist.workers:ranks_sum"), WorldSpec(3, 1))
    assert time.monotonic() - start < 20


def test_an_unknown_partition_is_one_line_before_any_job(tmp_path):
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), "launcher=slurm", "launcher.partition=nosuchpartition",
                             "hydra.run.dir=run"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == ("error: launcher.partition='nosuchpartition': no such partition; "
                                     "this cluster has: debug")
    assert not (tmp_path / "run" / "slurm").exists(), "no job was submitted"
    assert time.monotonic() - start < 60


def _wait_for_job(job_id: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
                                capture_output=True, text=True).stdout.split()
        if states and states[0] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
            return states[0]
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"pipeline job {job_id} still running after {timeout_s:g} s")


def test_submit_only_runs_the_pipeline_as_a_batch_job(tmp_path):
    run_dir = tmp_path / "run"
    args = ["experiment=smoke", "tracking=none", "launcher=slurm", "launcher.submit_only=true",
            "launcher.poll_s=0.3", f"hydra.run.dir={run_dir}"]
    start = time.monotonic()
    submitted = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=tmp_path,
                               capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = submitted.stdout.split("Slurm job ")[1].split()[0]
    assert f"summary: {run_dir / 'summary.json'}" in submitted.stdout
    assert time.monotonic() - start < 60
    state = _wait_for_job(job_id, timeout_s=240)
    log = (run_dir / f"pipeline-{job_id}.out").read_text()
    assert state == "COMPLETED", log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {s["status"] for s in summary["stages"].values()} == {"ran"}, log
    assert summary["stages"]["env"]["result"]["nodes"] == 2


def test_a_hung_rank_fails_within_the_collective_timeout_and_the_job_ends(tmp_path):
    launcher = slurm(tmp_path, timeout_s=5)
    start = time.monotonic()
    with pytest.raises(StageFailed, match="ended FAILED"):
        launcher.run(task(tmp_path, "tests.dist.workers:hang_rank1"), WorldSpec(2, 1))
    assert time.monotonic() - start < 90, "rank 0's collective timeout ends the job, not the time limit"
    job = launcher.job_ids["test"][0]
    queued = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True)
    assert queued.stdout.strip() == "", "the job, and every task of it, is gone"


def test_a_killed_rank_fails_the_job_at_once(tmp_path):
    launcher = slurm(tmp_path, timeout_s=30)
    start = time.monotonic()
    with pytest.raises(StageFailed, match="ended FAILED"):
        launcher.run(task(tmp_path, "tests.dist.workers:kill_rank1"), WorldSpec(2, 1))
    assert time.monotonic() - start < 60
