"""Worker functions that only the Ray launcher tests run (importable by Ray's workers)."""

from __future__ import annotations

from typing import Any


def env_with_node_ids(inputs: Any) -> tuple[Any, list[str]]:
    """The env stage's result, and the Ray node id of every rank (in rank order)."""
    import ray

    from stages.env_check import run
    from training.dist import gather_objects

    return run(inputs), gather_objects(ray.get_runtime_context().get_node_id())


def gpus_of_workers(_inputs: Any) -> list[tuple[list, str | None]]:
    """Every rank's GPU ids as Ray assigned them, and the CUDA_VISIBLE_DEVICES Ray set for it."""
    import os

    import ray

    from training.dist import gather_objects

    return gather_objects(([str(i) for i in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")))
