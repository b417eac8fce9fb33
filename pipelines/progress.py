"""The driver's live progress line for the running stage.

Rank 0 of a stage writes its latest status (`stages.common.progress`: bandwidth sizes done, LR-finder
iterations, training steps with loss and samples/s) to one small file in the stage's work dir; the
driver polls it and, on a terminal, redraws one line in place. When the output is not a terminal
(CI, a log file, a batch job) it draws nothing: the runner's one line per stage start and end is the
record, and the full status history stays in the rank logs.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import TextIO

PROGRESS_ENV = "SCALESTUDY_PROGRESS"
"""Where rank 0 of a stage writes its status; set by the worker from the task's work dir."""


def progress_file(workdir: Path) -> Path:
    return workdir / "progress"


class StageProgress:
    """While the block runs, redraw `  <stage>: <status>` on `stream` whenever the status file
    changes, if `stream` is a terminal; clear the line at the end."""

    def __init__(self, stage: str, path: Path, stream: TextIO | None = None, interval_s: float = 0.5):
        self.stage, self.path, self.interval_s = stage, path, interval_s
        self.stream = stream if stream is not None else sys.stdout
        self.shown: list[str] = []
        """Every status drawn, in order (what a terminal saw)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StageProgress:
        self.path.unlink(missing_ok=True)  # a previous attempt's status is not this one's
        if self.stream.isatty():
            self._thread = threading.Thread(target=self._run, name=f"progress-{self.stage}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._draw()  # the last status, so a short stage shows it too
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._draw()

    def _draw(self) -> None:
        try:
            status = self.path.read_text().strip()
        except OSError:
            return
        if status and (not self.shown or status != self.shown[-1]):
            self.shown.append(status)
            self.stream.write(f"\r\x1b[K  {self.stage}: {status}")
            self.stream.flush()
