"""Shared fixtures: compose the real configs once, shrink them, build frozen Configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("PYTHONPATH", str(ROOT))

CLUSTER_FILES = {"test_ray.py", "test_slurm.py", "test_launchers_e2e.py", "test_own_model.py"}
"""The files whose tests start Ray instances or submit to the local Slurm cluster."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadfile`): on 2 cores
    one pytest process's tests use ~1.3 of them on average (a launch's ranks start, import torch,
    wait on each other and on Slurm), so two keep both busy. As loadfile does, each file goes to
    one worker (its module fixtures, some of them whole runs, are built once); and the files that
    use Ray or the Slurm cluster count as one file: the local cluster has two nodes, so two
    allocations at once would queue behind each other inside tests that time their failures.
    (xdist's own `loadgroup` marks do not group under pytest 9.2, whose node ids no longer read
    the `_nodeid` that xdist 3.8 rewrites.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "cluster" if Path(path).name in CLUSTER_FILES else path

    return ByFile(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test (its fixtures' setup and teardown too) holds the workers' host lock shared, so a
    timed run inside `host_to_itself` has the cores to itself (tests/helpers.py)."""
    from tests.helpers import sharing_the_host

    with sharing_the_host():
        return (yield)


@pytest.fixture(scope="session", autouse=True)
def _background_mlflow_records(tmp_path_factory):
    """A fully cached invocation leaves a background replay that logs it to MLflow and deletes its
    queue file (pipelines/deferred.py); the session waits for the replays still working, so none
    outlives the tests. A queue file no replayer holds and none has just written is an orphan, as
    the product leaves one for a later drain (test_deferred_tracking leaves some on purpose): not
    waited for."""
    yield
    import time

    base = tmp_path_factory.getbasetemp()
    deadline = time.monotonic() + 120
    while any(_being_replayed(p) for p in base.rglob("mlflow-pending/*.pkl")) and time.monotonic() < deadline:
        time.sleep(0.5)


def _being_replayed(path: Path, starting_s: float = 10.0) -> bool:
    """A replayer holds the file's lock, or the file is young enough that its replayer is starting."""
    import fcntl
    import time

    try:
        if time.time() - path.stat().st_mtime < starting_s:
            return True
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@pytest.fixture(scope="session")
def compose_cfg():
    """compose(overrides) -> frozen, resolved Config, from the real conf/ tree (no GPUs)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipelines.configtools import from_dict
    from pipelines.schema import Config, register
    from pipelines.validate import resolve

    register()

    def _compose(*overrides: str, gpus: int = 0) -> Config:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            dcfg = compose(config_name="config", overrides=list(overrides))
        return resolve(from_dict(Config, OmegaConf.to_container(dcfg, resolve=True)), gpus_per_node=gpus)

    return _compose
