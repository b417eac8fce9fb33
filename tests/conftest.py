"""Shared fixtures: compose the real configs once, shrink them, build frozen Configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("PYTHONPATH", str(ROOT))


@pytest.fixture(scope="session", autouse=True)
def _background_mlflow_records(tmp_path_factory):
    """A fully cached invocation leaves a background replay that logs it to MLflow and deletes its
    queue file (pipelines/deferred.py); the session waits for them, so none outlives the tests."""
    yield
    import time

    base = tmp_path_factory.getbasetemp()
    deadline = time.monotonic() + 120
    while any(base.rglob("mlflow-pending/*.pkl")) and time.monotonic() < deadline:
        time.sleep(0.5)


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
