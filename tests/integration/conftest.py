"""The study sweep that test_study.py and test_mlflow_ui.py share: run once per session, since it
costs a minute or two on 2 cores."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def study(tmp_path_factory):
    """A real 2 strategies x 2 sizes sweep on CPU with MLflow on (sqlite in its own tmp dir).

    `snapshot_uri` is a copy of the store taken as the sweep ended: tests that add runs (compare,
    calibrate) write to `uri`, and the UI tests read the study as a user finds it after the sweep."""
    tmp = tmp_path_factory.mktemp("study")
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", "strategy=ddp,zero3", "nodes=1,2",
                             "experiment=smoke", "hydra.sweep.dir=sweep"],
                            cwd=tmp, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted((tmp / "sweep").rglob("summary.json"))]
    match = re.search(r"^study (\S+): MLflow run (\w+);", result.stdout, re.M)
    assert match, result.stdout[-2000:]
    snapshot = tmp / "after-sweep.db"
    shutil.copyfile(tmp / "outputs" / "mlflow.db", snapshot)
    return {"dir": tmp, "stdout": result.stdout, "summaries": summaries, "id": match[1], "study_run": match[2],
            "uri": f"sqlite:///{tmp}/outputs/mlflow.db", "snapshot_uri": f"sqlite:///{snapshot}"}
