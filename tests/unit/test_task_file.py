"""The task file a launcher hands its workers holds the stage's config in clear (a model factory's
token, say): readable by its owner only, and gone once the stage ends (launcher=local and slurm)."""

from __future__ import annotations

import os
import pickle
import stat

from pipelines.launchers.base import Task
from pipelines.launchers.tasks import remove_task, write_task


def test_a_task_file_is_its_owners_alone_whatever_the_umask_and_removed_after(tmp_path):
    task = Task("train", "stages.train:run", {"hf_token": "hf_secret"}, workdir=tmp_path / "train")
    old = os.umask(0)  # the most permissive a user's shell could be
    try:
        path = write_task(task)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert pickle.loads(path.read_bytes()).inputs == {"hf_token": "hf_secret"}
    # A re-launch in the same directory writes it afresh, still private.
    (tmp_path / "train" / "result.pkl").write_bytes(b"stale")
    assert stat.S_IMODE(write_task(task).stat().st_mode) == 0o600
    assert not (tmp_path / "train" / "result.pkl").exists(), "a stale result is not read as this launch's"
    remove_task(task)
    assert not path.exists()
