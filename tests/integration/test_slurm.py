"""launcher=slurm against a real Slurm cluster (`bash scripts/slurm-local.sh up`: two emulated
nodes on this machine): training through Slurm matches local training, the env stage sees two
Slurm nodes, a requeued job resumes, failures and impossible requests fail at once, and
submit_only runs the whole pipeline as a batch job."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pipelines.launchers.base import StageFailed, Task, WorldSpec
from pipelines.launchers.local import LocalLauncher
from pipelines.schema import LauncherConfig, SlurmLauncherConfig
from tests.dist.test_strategies import TOL, train_inputs
from tests.helpers import ON_CI, SLURM_UP, asked_statuses, need_slurm, slurm_problem
from training.config import StrategyConfig
from training.plan_config import EnvConfig

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = slurm_problem()
if PROBLEM is not None:
    print(f"\n!!! {'FAILING' if ON_CI else 'SKIPPING'} the Slurm tests: {PROBLEM}; start one with `{SLURM_UP}` !!!",
          file=sys.stderr)
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _slurm_cluster() -> None:
    need_slurm()


@pytest.fixture
def slurm(tmp_path):
    """A SlurmLauncher factory; every launcher it made releases its allocation at the end."""
    from pipelines.launchers.slurm import SlurmLauncher

    made = []

    def make(run_dir: Path, **overrides: Any) -> Any:
        # cpus_per_task=1: the emulated nodes claim 4 CPUs on a 2-core host, so their share (the
        # default) would oversubscribe it; test_cpus_per_task_is_the_node_share holds the default.
        overrides = {"cpus_per_task": 1, **overrides}
        made.append(SlurmLauncher(SlurmLauncherConfig(poll_s=0.3, timeout_min=5, **overrides), run_dir))
        return made[-1]

    yield make
    for launcher in made:
        launcher.close()


def steps_of(job_id: str) -> list[tuple[str, str, str]]:
    """(step id, name, node list) of every job step of an allocation, from Slurm's accounting."""
    for _ in range(50):  # accounting records a step a moment after it ends
        out = subprocess.run(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,JobName,NodeList"],
                             capture_output=True, text=True).stdout
        rows = [tuple(line.split("|")) for line in out.splitlines() if line.strip()]
        steps = [r for r in rows if re.fullmatch(rf"{job_id}\.\d+", r[0])]
        if steps:
            return steps
        time.sleep(0.2)
    return []


def task(tmp_path: Path, fn: str, inputs: Any = None, stage: str = "test") -> Task:
    return Task(stage=stage, fn=fn, inputs=inputs, workdir=tmp_path / "logs" / stage)


def train_task(tmp_path: Path, name: str, steps: int = 6, ckpt_every: int = 0) -> Task:
    inputs = (train_inputs(StrategyConfig(name="ddp"), steps=steps, ckpt_every=ckpt_every), str(tmp_path / name))
    return task(tmp_path, "tests.dist.workers:train_any", inputs, stage="train")


@pytest.mark.parametrize("nodes,procs", [(2, 1), (2, 2)])
def test_train_through_slurm_matches_local(tmp_path, slurm, nodes, procs):
    world = WorldSpec(nodes, procs)
    through_slurm = slurm(tmp_path).run(train_task(tmp_path, "slurm"), world)
    local = LocalLauncher(LauncherConfig()).run(train_task(tmp_path, "local"), world)
    assert through_slurm.world_size == nodes * procs
    assert through_slurm.losses == pytest.approx(local.losses, **TOL)


def test_every_stage_is_a_step_of_one_allocation_on_the_same_nodes(tmp_path, slurm):
    """env, a one-device stage and a second world stage: one allocation, asked for once, each stage a
    job step on its nodes (Slurm's own accounting says so), the one-device stage on its first node."""
    from stages.env_check import EnvInputs

    launcher = slurm(tmp_path)
    env = launcher.run(task(tmp_path, "stages.env_check:run", EnvInputs(EnvConfig()), "env"), WorldSpec(2, 1))
    assert env.nodes == 2 and env.world_size == 2
    assert sorted(r.node_name for r in env.ranks) == ["node1", "node2"]
    # cpus_per_task=1: one intra-op thread per rank, not the node's every core.
    assert [r.torch_threads for r in env.ranks] == [1, 1]
    assert [r.subnormals_flushed for r in env.ranks] == [True, True]
    one = launcher.run(task(tmp_path, "stages.env_check:run", EnvInputs(EnvConfig()), "one"), WorldSpec(1, 1, False))
    again = launcher.run(task(tmp_path, "stages.env_check:run", EnvInputs(EnvConfig()), "again"), WorldSpec(2, 1))
    assert [r.node_name for r in one.ranks] == ["node1"]
    assert [r.node_name for r in again.ranks] == [r.node_name for r in env.ranks]
    (job,) = {i for ids in launcher.job_ids.values() for i in ids}
    assert launcher.record()["allocations"] == [{"job_id": job, "nodes": ["node1", "node2"], "world": [2, 1],
                                                 "log": launcher.record()["allocations"][0]["log"]}]
    steps = steps_of(job)
    assert [name for _, name, _ in steps] == ["scalestudy-env", "scalestudy-one", "scalestudy-again"]
    assert [nodes for _, _, nodes in steps] == ["node[1-2]", "node1", "node[1-2]"]


def _requeue_when_checkpointed(launcher: Any, ckpt: Path, done: threading.Event) -> None:
    """Preempt the allocation once the train step's first checkpoint exists, as Slurm would: the
    signal to the batch script (which requeues the allocation) and to the step's tasks (which die)."""
    while not (ckpt / "latest.json").exists() and not done.is_set():
        time.sleep(0.1)
    job_id = launcher.job_ids["train"][0]
    subprocess.run(["scancel", "--signal=USR2", "--full", job_id], check=True)
    # Slurm holds a requeued job ~2.5 min (credential expiry); let it start soon. Not at once: a
    # node still finishing the kill refuses to launch it again ("Job credential revoked").
    for _ in range(100):
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
        if "PENDING" in state:
            time.sleep(2)
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
            return
        time.sleep(0.2)


def test_a_requeued_allocation_resumes_the_stage_and_ends_as_uninterrupted(tmp_path, slurm):
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
    assert len(launcher.job_ids["train"]) == 1, "the same allocation, back from the queue"
    restarts = subprocess.run(["scontrol", "show", "job", "-o", launcher.job_ids["train"][0]], capture_output=True,
                              text=True).stdout
    assert "Restarts=1" in restarts


def test_a_raising_rank_fails_the_stage_naming_it_and_the_allocation_serves_the_next(tmp_path, slurm):
    launcher = slurm(tmp_path)
    with pytest.raises(StageFailed, match=r"rank 1 failed: ValueError: planted failure on rank 1") as failed:
        launcher.run(task(tmp_path, "tests.dist.workers:raise_on_rank1"), WorldSpec(2, 1))
    assert f"Slurm allocation {launcher.job_ids['test'][0]}" in str(failed.value)
    assert "Traceback" in (tmp_path / "logs" / "test" / "rank1.log").read_text()
    assert launcher.run(task(tmp_path, "tests.dist.workers:ranks_sum", stage="next"), WorldSpec(2, 1))["sum"] == 3.0
    assert launcher.job_ids["next"] == launcher.job_ids["test"]


def test_impossible_request_fails_at_once(tmp_path, slurm):
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


def test_submit_only_runs_the_pipeline_in_one_allocation_with_its_driver(tmp_path):
    run_dir = tmp_path / "run"
    args = ["experiment=smoke", "tracking=none", "launcher=slurm", "launcher.submit_only=true", "launcher.cpus_per_task=1",
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
    assert set(asked_statuses(summary).values()) == {"ran"}, log
    assert summary["stages"]["env"]["result"]["nodes"] == 2
    # One job in the queue: the stages ran as steps of the very allocation the driver ran in.
    assert [a["job_id"] for a in summary["launcher"]["allocations"]] == [job_id]
    for name in ("env", "bandwidth", "lr_find", "plan", "train"):
        assert summary["stages"][name]["jobs"] == [job_id], name
    assert {name for _, name, _ in steps_of(job_id)} >= {"scalestudy-env", "scalestudy-train"}


def test_a_hung_rank_fails_within_the_collective_timeout_and_its_step_ends(tmp_path, slurm):
    launcher = slurm(tmp_path, timeout_s=5)
    launcher.run(task(tmp_path, "tests.dist.workers:ranks_sum", stage="warm"), WorldSpec(2, 1))
    start = time.monotonic()
    with pytest.raises(StageFailed, match=r"rank 0 failed.*killed: ranks \[1\]"):
        launcher.run(task(tmp_path, "tests.dist.workers:hang_rank1"), WorldSpec(2, 1))
    assert time.monotonic() - start < 60, "rank 0's collective timeout ends the step, not the time limit"
    job = launcher.job_ids["test"][0]
    running = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], capture_output=True, text=True).stdout
    assert [s for s in running.split() if not s.endswith((".batch", ".extern"))] == [], "no step of it is left"


def test_a_killed_rank_fails_the_stage_at_once(tmp_path, slurm):
    launcher = slurm(tmp_path, timeout_s=30)
    launcher.run(task(tmp_path, "tests.dist.workers:ranks_sum", stage="warm"), WorldSpec(2, 1))
    start = time.monotonic()
    with pytest.raises(StageFailed, match="rank 1 was killed by SIGKILL"):
        launcher.run(task(tmp_path, "tests.dist.workers:kill_rank1"), WorldSpec(2, 1))
    assert time.monotonic() - start < 30


def test_cpus_per_task_is_the_node_share_by_default(tmp_path):
    """launcher.cpus_per_task=null: each task gets its node's cores divided by the tasks per node
    (not one core per GPU rank), read from the partition as sinfo reports it."""
    from pipelines.launchers.slurm import SlurmLauncher
    from pipelines.launchers.slurm_commands import sbatch_options

    out = subprocess.run(["scontrol", "show", "node", "node1", "-o"], capture_output=True, text=True, check=True).stdout
    cores = int(re.search(r"CPUTot=(\d+)", out).group(1))
    launcher = SlurmLauncher(SlurmLauncherConfig(), tmp_path, WorldSpec(2, 2))
    assert launcher.cpus == cores // 2
    assert f"#SBATCH --cpus-per-task={cores // 2}" in sbatch_options(launcher.cfg, WorldSpec(2, 2), "x", tmp_path,
                                                                      launcher.cpus)
