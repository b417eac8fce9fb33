"""The driver's progress line: drawn from a real stage's status file on a terminal, and nothing
but the per-stage lines when the output is not one."""

from __future__ import annotations

import io
import time

from pipelines.launchers.base import Task, WorldSpec
from pipelines.launchers.local import LocalLauncher
from pipelines.progress import StageProgress, progress_file
from pipelines.schema import LauncherConfig


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_stage(tmp_path, stream) -> StageProgress:
    task = Task(stage="lr_find", fn="tests.unit.toy_stages:reports_progress", inputs=None, kwargs={},
                artifacts=None, workdir=tmp_path)
    launcher = LocalLauncher(LauncherConfig(timeout_s=60))
    with StageProgress("lr_find", progress_file(tmp_path), stream, interval_s=0.05) as progress:
        assert launcher.run(task, WorldSpec(1, 1, distributed=False)) == "done"
    return progress


def test_a_terminal_sees_a_real_stages_status_then_a_cleared_line(tmp_path):
    screen = Terminal()
    progress = run_stage(tmp_path, screen)
    # However the host schedules the drawing thread: what is shown is what the stage reported, in
    # its order, ending with its last status (drawn once more as the stage ends).
    reported = [f"iteration {i}/5" for i in range(1, 6)]
    assert progress.shown and progress.shown[-1] == "iteration 5/5"
    assert progress.shown == [r for r in reported if r in progress.shown]
    assert "\r\x1b[K  lr_find: iteration 5/5" in screen.getvalue()
    assert screen.getvalue().endswith("\r\x1b[K")


def test_each_new_status_is_drawn_while_the_stage_runs(tmp_path):
    """Statuses written while the progress is open are drawn before it closes (waited for with a
    deadline, not timed)."""
    screen, path = Terminal(), progress_file(tmp_path)
    with StageProgress("train", path, screen, interval_s=0.01) as progress:
        for status in ("step 1/3", "step 2/3"):
            path.write_text(status)
            deadline = time.monotonic() + 30
            while status not in progress.shown and time.monotonic() < deadline:
                time.sleep(0.01)
            assert progress.shown[-1] == status
    assert progress.shown == ["step 1/3", "step 2/3"]
    assert screen.getvalue() == "\r\x1b[K  train: step 1/3\r\x1b[K  train: step 2/3\r\x1b[K"


def test_a_log_file_gets_no_progress_line(tmp_path):
    log = io.StringIO()
    progress = run_stage(tmp_path, log)
    assert log.getvalue() == "" and progress.shown == []
