"""`launcher=slurm launcher.submit_only=true`: run the whole pipeline as one Slurm batch job.

For users on a login node who walk away: the invocation writes an sbatch script that re-runs
`run.py` with the same overrides (and `launcher.submit_only=false`) in this invocation's run dir,
submits it, prints the job id and where the summary and MLflow data will be, and returns.

Deadlock: the pipeline job stays alive while its stages run as further Slurm jobs. It therefore
asks for the least a job can hold, one task with one CPU and no GPU, so that on a partition that
shares nodes (cons_tres, the default) the stage jobs still find the rest of every node. On a
partition that allocates whole nodes, the pipeline job would hold a node its stages need.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from pipelines.redact import redact_text
from pipelines.schema import Config
from training.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SCRIPT_NAME = "pipeline.sbatch"


def pipeline_overrides(overrides: list[str]) -> list[str]:
    """The invocation's overrides, with submit_only turned off so the job runs the pipeline."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith("launcher.submit_only=")]
    return [*kept, "launcher.submit_only=false"]


def batch_script(cfg: Config, run_dir: Path, overrides: list[str], cwd: Path, python: str) -> str:
    """The sbatch script of the pipeline job."""
    launcher = cfg.launcher
    # Every stage job may use its full time limit, one after the other.
    minutes = launcher.timeout_min * max(1, len(cfg.pipeline.stages))
    options = [
        "--job-name=scalestudy-pipeline",
        f"--output={run_dir}/pipeline-%j.out",
        "--nodes=1",
        "--ntasks=1",
        "--cpus-per-task=1",
        f"--time={minutes}",
    ]
    for key in ("partition", "account", "qos"):
        if getattr(launcher, key) is not None:
            options.append(f"--{key}={getattr(launcher, key)}")
    command = [python, str(ROOT / "run.py"), *pipeline_overrides(overrides), f"hydra.run.dir={run_dir}"]
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {option}" for option in options),
        "set -e",
        f"cd {shlex.quote(str(cwd))}",
        *launcher.setup,
        f"export PYTHONPATH={ROOT}${{PYTHONPATH:+:$PYTHONPATH}}",
        "exec " + " ".join(shlex.quote(part) for part in command),
    ]
    return "\n".join(lines) + "\n"


def mlflow_location(cfg: Config, cwd: Path) -> str:
    """Where the job's MLflow data will be, as a user would look for it."""
    if cfg.tracking.name == "none":
        return "none (tracking=none)"
    uri = cfg.tracking.uri
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{cwd / uri.removeprefix('sqlite:///')}"
    return uri


def submit_pipeline(cfg: Config, run_dir: Path, overrides: list[str]) -> str:
    """Write and submit the pipeline job; return what to tell the user (job id, paths)."""
    if cfg.launcher.name != "slurm":
        raise ConfigError("launcher.submit_only", True, f"needs launcher=slurm, not launcher={cfg.launcher.name}")
    for arg in overrides:
        if redact_text(arg) != arg:
            raise ConfigError("launcher.submit_only", True, f"the override {redact_text(arg)} carries a secret that "
                              "would sit in clear in the batch script; pass it through the environment instead")
    cwd = Path(os.getcwd())
    run_dir.mkdir(parents=True, exist_ok=True)
    script = run_dir / SCRIPT_NAME
    script.write_text(batch_script(cfg, run_dir, overrides, cwd, sys.executable))
    try:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True)
    except FileNotFoundError as err:
        raise ConfigError("launcher.submit_only", True, "needs sbatch on the PATH (a Slurm login node)") from err
    except subprocess.CalledProcessError as err:
        raise ConfigError("launcher.submit_only", True, f"sbatch rejected {script}: {err.stderr.strip()}") from err
    job_id = done.stdout.strip().split(";")[0]
    return "\n".join([
        f"submitted the pipeline as Slurm job {job_id} ({script})",
        f"log:     {run_dir}/pipeline-{job_id}.out",
        f"summary: {run_dir / 'summary.json'}",
        f"mlflow:  {mlflow_location(cfg, cwd)}",
        f"follow:  squeue -j {job_id}; cancel: scancel {job_id}",
    ])
