"""scalestudy: measure, plan and run the scaling of a training job, and keep the evidence.

    python run.py                              # the full DAG with the defaults (2 CPU workers)
    python run.py strategy=ddp nodes=4         # the product card's form
    python run.py -m nodes=1,2                 # a sweep
    python run.py only=[plan] force=[lr_find]  # part of the DAG
    python run.py -m strategy=ddp,zero3 nodes=1,2  # a study: report in <sweep dir>/study/
    python run.py pipeline=compare study=<id>  # rebuild a study's report from MLflow

Every invocation writes summary.json in its Hydra run dir and prints its path.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from common.errors import ConfigError
from pipelines.cli import UserError, load, precheck, write_run_config
from pipelines.schema import SlurmLauncherConfig, register

register()
EXIT_CODES: list[int] = []


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def app(dcfg: DictConfig) -> None:
    from hydra.types import RunMode

    from pipelines.outcome import summary_table
    from pipelines.runner import run_pipeline
    from pipelines.study import study_id_for

    try:
        cfg = load(OmegaConf.to_container(dcfg, resolve=True))
        if cfg.dry_run:
            from training.planner.dryrun import format_layout, plan_layout

            world = cfg.nodes * cfg.procs_per_node
            print(format_layout(plan_layout(cfg.model, cfg.strategy, world), cfg.strategy, world))
            EXIT_CODES.append(0)
            return
        hydra_cfg = HydraConfig.get()
        output_dir = Path(hydra_cfg.runtime.output_dir)
        overrides = list(hydra_cfg.overrides.task)
        if cfg.study is None and hydra_cfg.mode == RunMode.MULTIRUN:
            # A sweep is a study: its jobs share the id of their sweep dir.
            cfg = dataclasses.replace(cfg, study=study_id_for(Path(hydra_cfg.sweep.dir).resolve()))
            overrides.append(f"study={cfg.study}")  # a batch job (submit_only) reruns these
        write_run_config(output_dir, cfg, overrides)
        if isinstance(cfg.launcher, SlurmLauncherConfig) and cfg.launcher.submit_only:
            from pipelines.launchers.slurm_batch import submit_pipeline

            print(submit_pipeline(cfg, output_dir, overrides))
            EXIT_CODES.append(0)
            return
        if isinstance(cfg.launcher, SlurmLauncherConfig) and cfg.launcher.dry_run:
            from pipelines.launchers.slurm_commands import DRY_RUN_FILE, render_dry_run

            print(render_dry_run(cfg, output_dir), end="")
            print(f"launcher.dry_run: nothing submitted; the script is {output_dir / 'slurm' / DRY_RUN_FILE}")
            EXIT_CODES.append(0)
            return
        summary = run_pipeline(cfg, output_dir)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        EXIT_CODES.append(2)
        return
    for name, outcome in summary.stages.items():
        if cfg.pipeline.stages[name].echo and outcome.result is not None:
            print(outcome.result.text)
    print(summary_table(summary))
    print(f"summary: {summary.path}")
    EXIT_CODES.append(0 if summary.ok else 1)


def main() -> None:
    try:
        precheck(sys.argv[1:])
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    try:
        app()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(max(EXIT_CODES, default=0))


if __name__ == "__main__":
    main()
