"""The Slurm jobs launcher=slurm generates, checked against golden files (as submitit's own tests
do): the sbatch script of a 2x2 stage job with every resource option set, and the pipeline job
of submit_only. No cluster needed. After an intended change, delete the golden file and re-run
to record the new one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipelines.launchers.base import WorldSpec
from pipelines.schema import LauncherConfig

GOLDEN = Path(__file__).parent / "golden"
ROOT = Path(__file__).resolve().parents[2]
CFG = LauncherConfig(
    name="slurm", partition="gpu", account="research", qos="high", constraint="a100", gpus_per_node=4,
    cpus_per_task=8, mem_gb=256, timeout_min=120, setup=["module load cuda/12.4"],
    additional_parameters={"exclusive": True}, max_requeues=5,
)


def check_golden(name: str, text: str, replacements: dict[str, str]) -> None:
    for real, placeholder in replacements.items():
        text = text.replace(real, placeholder)
    path = GOLDEN / name
    if not path.exists():
        path.write_text(text)
        pytest.skip(f"recorded {path}: check it in")
    assert text == path.read_text(), f"{name} changed; if intended, delete {path} and re-run"


def test_stage_job_parameters_match_the_golden_sbatch_script(tmp_path):
    from pipelines.launchers.slurm import SlurmLauncher

    executor = SlurmLauncher(CFG, tmp_path).executor("train", WorldSpec(2, 4))._executor
    assert executor.max_num_timeout == CFG.max_requeues
    script = executor._make_submission_file_text(executor._submitit_command_str, "UID")
    check_golden("slurm_stage.sbatch", script,
                 {sys.executable: "<PYTHON>", str(tmp_path): "<RUN_DIR>", str(ROOT): "<ROOT>"})


def test_short_jobs_get_the_checkpoint_signal_inside_their_time_limit():
    from pipelines.launchers.slurm import job_parameters

    short = job_parameters(LauncherConfig(name="slurm", timeout_min=1), WorldSpec(1, 1), "lr_find")
    assert short["slurm_signal_delay_s"] == 30
    assert "gpus_per_node" not in short and "slurm_partition" not in short and "mem_gb" not in short


def test_pipeline_job_matches_the_golden_script(tmp_path):
    from pipelines.launchers.slurm_batch import batch_script, pipeline_overrides
    from pipelines.schema import Config

    cfg = Config(launcher=CFG)
    overrides = ["launcher=slurm", "nodes=2", "only=[plan]", "launcher.submit_only=true"]
    assert pipeline_overrides(overrides)[-1] == "launcher.submit_only=false"
    script = batch_script(cfg, tmp_path / "run", overrides, tmp_path, "/usr/bin/python3")
    check_golden("slurm_pipeline.sbatch", script, {str(tmp_path): "<TMP>", str(ROOT): "<ROOT>"})


def test_submit_only_refuses_to_write_a_secret_into_the_batch_script(tmp_path, compose_cfg):
    import pytest

    from pipelines.launchers.slurm_batch import submit_pipeline
    from training.config import ConfigError

    cfg = compose_cfg("launcher=slurm", "launcher.submit_only=true")
    with pytest.raises(ConfigError, match=r"https://\*\*\*@host"):
        submit_pipeline(cfg, tmp_path / "run", ["launcher=slurm", "tracking.uri=https://me:pw@host"])
    assert not (tmp_path / "run").exists(), "nothing written"
