"""`run.py` as the benches run it: one invocation in a directory of their own, timed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cli(cwd: Path, *args: str, env: dict[str, str] | None = None) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"run.py {' '.join(args)} failed: {done.stderr[-2000:]}")
    return time.perf_counter() - start, done
