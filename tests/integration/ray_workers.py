"""Worker functions that only the Ray launcher tests run (importable by Ray's workers)."""

from __future__ import annotations

from typing import Any


def env_with_node_ids(inputs: Any) -> tuple[Any, list[str]]:
    """The env stage's result, and the Ray node id of every rank (in rank order)."""
    import ray

    from stages.env_check import run
    from training.dist import gather_objects

    return run(inputs), gather_objects(ray.get_runtime_context().get_node_id())
