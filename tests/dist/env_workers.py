"""Worker functions for the env stage's distributed tests (importable by the workers)."""

from __future__ import annotations

import torch.distributed as dist

from stages.env_check import EnvInputs, EnvResult, check_fleet
from training.envinfo import collect_local


def torch_differs_on_rank1(inputs: EnvInputs) -> EnvResult:
    """The real fleet check, with rank 1 claiming another torch version."""
    facts = collect_local()
    if dist.get_rank() == 1:
        facts["torch"] = "0.0.0+planted"
    return check_fleet(facts, inputs.env)
