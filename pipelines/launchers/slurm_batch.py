"""`launcher=slurm launcher.submit_only=true`: the invocation's one allocation, with the driver in it.

For users on a login node who walk away: the invocation writes an sbatch script that asks for the
allocation its stages need (`nodes` x `procs_per_node` tasks with the launcher's resources, as an
interactive invocation would) and runs `run.py` with the same overrides (and
`launcher.submit_only=false`) as its batch script, in this invocation's run dir; then it submits
it, prints the job id and where the summary and MLflow data will be, and returns. The driver finds
its allocation in SCALESTUDY_SLURM_ALLOCATION and runs every stage as a job step of it: one job in
the queue, no driver job holding a CPU while others wait. Preempted or at its time limit, the job
requeues itself and the driver starts again: cached stages are skipped, train resumes from its
checkpoint.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from common.errors import ConfigError
from pipelines.launchers.base import WorldSpec, worker_pythonpath
from pipelines.launchers.slurm import ALLOCATION_ENV
from pipelines.launchers.slurm_commands import node_share, requeue_trap, sbatch_options
from pipelines.paths import ROOT
from pipelines.redact import redact_text
from pipelines.schema import Config

SCRIPT_NAME = "pipeline.sbatch"


def pipeline_overrides(overrides: list[str]) -> list[str]:
    """The invocation's overrides, with submit_only turned off so the job runs the pipeline."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith("launcher.submit_only=")]
    return [*kept, "launcher.submit_only=false"]


def batch_script(cfg: Config, run_dir: Path, overrides: list[str], cwd: Path, python: str) -> str:
    """The sbatch script of the pipeline's allocation, its driver as the batch script."""
    world = WorldSpec(cfg.nodes, cfg.procs_per_node)
    command = [python, str(ROOT / "run.py"), *pipeline_overrides(overrides), f"hydra.run.dir={run_dir}"]
    lines = [
        "#!/bin/bash",
        *sbatch_options(cfg.launcher, world, "scalestudy-pipeline", run_dir / "pipeline-%j.out",
                        node_share(cfg.launcher, world.procs_per_node)),
        *requeue_trap(cfg.launcher.max_requeues),
        f"cd {shlex.quote(str(cwd))}",
        *cfg.launcher.setup,
        f"export PYTHONPATH={shlex.quote(worker_pythonpath())}",
        f'export {ALLOCATION_ENV}="$SLURM_JOB_ID"',
        "# In the background, so that the trap runs the moment USR2 comes.",
        " ".join(shlex.quote(part) for part in command) + " &",
        "wait $!",
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
