"""Every bad invocation, as a user types it: a non-zero exit within seconds, one line naming the
key, the value and what is allowed, no traceback, and nothing written (no cache, no summary)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.test_config import BAD

ROOT = Path(__file__).resolve().parents[2]
# Problems found only once the invocation reaches its services (after composition).
LATE = [
    (["tracking.uri=http://127.0.0.1:1"], "tracking.uri='http://127.0.0.1:1': no MLflow server answers"),
    (["launcher=ray", "launcher.address=127.0.0.1:1"], "launcher.address"),
    (["pipeline=compare", "study=s1"], "tracking.uri='sqlite:///outputs/mlflow.db': has no MLflow database"),
]
CASES = [*BAD, *LATE]


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "expected"), CASES, ids=[" ".join(o) for o, _ in CASES])
def test_bad_invocation_fails_fast_in_one_line_and_writes_nothing(tmp_path, overrides, expected):
    assert len(CASES) >= 30
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), *overrides, "hydra.run.dir=run"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "outputs" / "cache").exists() and not (tmp_path / "run" / "summary.json").exists()
    assert time.monotonic() - start < 60
