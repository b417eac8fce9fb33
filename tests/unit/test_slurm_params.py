"""The Slurm scripts launcher=slurm generates, checked against golden files (as submitit's own tests
do): the allocation of a 2x4 invocation with every resource option set, and the pipeline job of
submit_only. No cluster and no Slurm binary needed. After an intended change, regenerate them with
`SCALESTUDY_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_slurm_params.py` and review
the diff."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipelines.launchers.base import WorldSpec
from pipelines.schema import SlurmLauncherConfig

GOLDEN = Path(__file__).parent / "golden"
ROOT = Path(__file__).resolve().parents[2]
UPDATE = "SCALESTUDY_UPDATE_GOLDEN"
CFG = SlurmLauncherConfig(
    partition="gpu", account="research", qos="high", constraint="a100", gpus_per_node=4, cpus_per_task=8, mem_gb=256,
    timeout_min=120, setup=["module load cuda/12.4"], additional_parameters={"exclusive": ""}, max_requeues=5,
)


def check_golden(name: str, text: str, replacements: dict[str, str]) -> None:
    for real, placeholder in replacements.items():
        text = text.replace(real, placeholder)
    path = GOLDEN / name
    if os.environ.get(UPDATE) == "1":
        path.write_text(text)
    assert path.exists(), f"{path} is missing: regenerate it with {UPDATE}=1 .venv/bin/python -m pytest {__file__}"
    assert text == path.read_text(), f"{name} changed; if intended: {UPDATE}=1 .venv/bin/python -m pytest {__file__}"


def test_the_allocation_script_matches_the_golden_file(tmp_path, monkeypatch):
    from pipelines.launchers.slurm_commands import allocation_script

    script = allocation_script(CFG, WorldSpec(2, 4), tmp_path / "alloc")
    check_golden("slurm_allocation.sbatch", script, {str(tmp_path): "<RUN_DIR>"})


def test_short_allocations_get_the_requeue_signal_inside_their_time_limit(tmp_path):
    from pipelines.launchers.slurm_commands import sbatch_options

    short = sbatch_options(SlurmLauncherConfig(timeout_min=1), WorldSpec(1, 1), "x", tmp_path / "log")
    assert "#SBATCH --signal=B:USR2@30" in short
    assert not any(o.startswith(("#SBATCH --gpus", "#SBATCH --partition", "#SBATCH --mem")) for o in short)


def test_pipeline_job_is_the_allocation_with_the_driver_inside(tmp_path, monkeypatch):
    from pipelines.launchers.slurm_batch import batch_script, pipeline_overrides
    from pipelines.schema import Config

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    cfg = Config(launcher=CFG, nodes=2, procs_per_node=4)
    overrides = ["launcher=slurm", "nodes=2", "only=[plan]", "launcher.submit_only=true"]
    assert pipeline_overrides(overrides)[-1] == "launcher.submit_only=false"
    script = batch_script(cfg, tmp_path / "run", overrides, tmp_path, "/usr/bin/python3")
    check_golden("slurm_pipeline.sbatch", script, {str(tmp_path): "<TMP>", str(ROOT): "<ROOT>"})


def test_srun_reports_name_the_ranks_and_how_they_ended():
    from pipelines.launchers.slurm_commands import ended_tasks

    stderr = ("srun: error: node1: task 0: Exited with exit code 1\nsrun: Terminating StepId=5.3\n"
              "srun: error: node2: tasks 1-2,4: Killed\nsrun: error: node2: task 3: Segmentation fault (core dumped)\n")
    assert ended_tasks(stderr) == {0: "exited with code 1", 1: "was killed by SIGKILL", 2: "was killed by SIGKILL",
                                   4: "was killed by SIGKILL", 3: "was killed by SIGSEGV"}
    assert list(ended_tasks(stderr))[0] == 0, "in the order srun reports them: the first is the root cause"


def test_submit_only_refuses_to_write_a_secret_into_the_batch_script(tmp_path, compose_cfg):
    from common.errors import ConfigError
    from pipelines.launchers.slurm_batch import submit_pipeline

    cfg = compose_cfg("launcher=slurm", "launcher.submit_only=true")
    with pytest.raises(ConfigError, match=r"https://\*\*\*@host"):
        submit_pipeline(cfg, tmp_path / "run", ["launcher=slurm", "tracking.uri=https://me:pw@host"])
    assert not (tmp_path / "run").exists(), "nothing written"


def test_the_allocation_holds_while_the_heartbeat_is_fresh_and_frees_itself_when_it_goes_stale(tmp_path):
    """The batch script itself, run by bash as slurmd would run it (its #SBATCH lines are comments):
    it holds while the driver touches the heartbeat, ends when released, and ends on its own when the
    heartbeat is older than HEARTBEAT_STALE_S (a driver killed with SIGKILL frees its nodes)."""
    import subprocess
    import time

    from pipelines.launchers.slurm_commands import HEARTBEAT_STALE_S, allocation_script

    folder = tmp_path / "alloc"
    folder.mkdir()
    script = tmp_path / "allocation.sh"
    script.write_text(allocation_script(SlurmLauncherConfig(), WorldSpec(1, 1), folder))
    heartbeat = folder / "heartbeat"
    heartbeat.touch()
    held = subprocess.Popen(["bash", str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            held.wait(timeout=3)  # a fresh heartbeat: still held
        (folder / "release").touch()
        assert held.wait(timeout=10) == 0, "released by the driver"
    finally:
        held.kill()
    (folder / "release").unlink()
    stale = time.time() - HEARTBEAT_STALE_S - 5
    os.utime(heartbeat, (stale, stale))  # the driver stopped touching it (killed)
    assert subprocess.run(["bash", str(script)], capture_output=True, timeout=10).returncode == 0
