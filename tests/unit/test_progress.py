"""The driver's progress line: drawn from a real stage's status file on a terminal, and nothing
but the per-stage lines when the output is not one."""

from __future__ import annotations

import io

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


def test_a_terminal_sees_the_stage_status_live_then_a_cleared_line(tmp_path):
    screen = Terminal()
    progress = run_stage(tmp_path, screen)
    assert len(progress.shown) >= 2, progress.shown  # several iterations drawn while it ran
    assert progress.shown[-1] == "iteration 5/5"
    assert "\r\x1b[K  lr_find: iteration 5/5" in screen.getvalue()
    assert screen.getvalue().endswith("\r\x1b[K")


def test_a_log_file_gets_no_progress_line(tmp_path):
    log = io.StringIO()
    progress = run_stage(tmp_path, log)
    assert log.getvalue() == "" and progress.shown == []
