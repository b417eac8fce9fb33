"""A stage's cache key moves with everything its result can depend on: the project's code and the
driver's software, beside its config and upstream results (placements: test_placement.py)."""

from __future__ import annotations

import shutil

import pytest

from pipelines import cache


def key() -> str:
    return cache.stage_key("lr_find", "stages.lr_find:run", {"num_iters": 20}, {"env": "abc"})


@pytest.fixture
def fresh(monkeypatch):
    """code_version and env_fingerprint are memoised per process: clear them around each test."""
    cache.code_version.cache_clear()
    cache.env_fingerprint.cache_clear()
    yield monkeypatch
    cache.code_version.cache_clear()
    cache.env_fingerprint.cache_clear()


def test_a_change_to_any_project_source_changes_every_key(fresh, tmp_path):
    for package in cache.PACKAGES:
        shutil.copytree(cache.ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    fresh.setattr(cache, "ROOT", tmp_path)
    before = key()
    assert key() == before, "the same sources, the same key"
    source = tmp_path / "training" / "planner" / "memory.py"  # a module in a subpackage
    source.write_text(source.read_text() + "\n# one more line\n")
    cache.code_version.cache_clear()
    assert key() != before


def test_another_torch_or_python_on_the_driver_changes_every_key(fresh):
    before = key()
    real = cache.importlib.metadata.version
    fresh.setattr(cache.importlib.metadata, "version", lambda name: "9.9.9" if name == "torch" else real(name))
    cache.env_fingerprint.cache_clear()
    upgraded = key()
    assert upgraded != before
    fresh.setattr(cache.platform, "python_version", lambda: "3.99.0")
    cache.env_fingerprint.cache_clear()
    assert key() not in (before, upgraded)


def test_config_and_upstream_are_in_the_key():
    base = key()
    assert cache.stage_key("lr_find", "stages.lr_find:run", {"num_iters": 21}, {"env": "abc"}) != base
    assert cache.stage_key("lr_find", "stages.lr_find:run", {"num_iters": 20}, {"env": "abd"}) != base


def test_a_users_target_code_is_in_the_key_and_moves_with_their_source(fresh, tmp_path):
    """A model or data set of the user's own (`_target_: mymodels.vit.build`) lives outside this
    project: a stage that builds it keys on a hash of its sources; an installed library on its
    version; this project's own packages are code_version()'s, not listed again."""
    import importlib.metadata
    import sys

    package = tmp_path / "mymodels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "vit.py").write_text("def build():\n    return 1\n")
    fresh.syspath_prepend(str(tmp_path))
    cache.package_code.cache_clear()
    targets = ["mymodels.vit.build", "transformers.AutoModelForCausalLM", "training.models.gpt.build"]
    before = cache.targets_code(targets)
    assert set(before) == {"mymodels", "transformers"}
    assert before["transformers"] == f"transformers=={importlib.metadata.version('transformers')}"
    (package / "vit.py").write_text("def build():\n    return 2  # the user changed their model\n")
    cache.package_code.cache_clear()
    after = cache.targets_code(targets)
    assert after["mymodels"] != before["mymodels"] and after["transformers"] == before["transformers"]
    sys.modules.pop("mymodels", None)
    cache.package_code.cache_clear()
