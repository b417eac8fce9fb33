"""Sweeps: the study id a `-m` sweep gives its invocations when `study` is unset (`study_id_for`),
and Hydra's multirun callback that masks the secrets of the sweep's multirun.yaml
(`RedactSweepConfig`).

Reading a study back (its summaries from the sweep dir or MLflow) and the report a sweep ends with
are the application's: reports/studies.py and reports/sweep.py, named in conf/ by `_target_` or a
pipeline's `precheck`; the engine tags and names the runs, it doesn't read studies.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback


def study_id_for(sweep_dir: str | Path) -> str:
    """`outputs/multirun/2026-11-29/11-40-12-123456` -> `2026-11-29_11-40-12-123456`."""
    path = Path(sweep_dir)
    return re.sub(r"[^\w.:/-]", "-", f"{path.parent.name}_{path.name}" if path.parent.name else path.name)


class RedactSweepConfig(Callback):
    """Hydra's sweeper saves `<sweep dir>/multirun.yaml`, overrides included, in clear; mask its
    secrets as soon as the first job starts (the runs' own config.yaml are written masked)."""

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        from common.files import write_atomic
        from pipelines.redact import redact_override, redact_tree

        try:
            path = Path(str(config.hydra.sweep.dir)) / "multirun.yaml"
        except Exception:  # noqa: BLE001 - a single run has no sweep dir to look at
            return
        if not path.is_file():
            return
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        task = data.get("hydra", {}).get("overrides", {}).get("task")
        if task:
            data["hydra"]["overrides"]["task"] = [redact_override(o) for o in task]
        masked = redact_tree(data)  # hydra's own part too: override_dirname repeats the overrides
        write_atomic(path, OmegaConf.to_yaml(OmegaConf.create(masked)))
