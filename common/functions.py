"""A function named in the config as `module:function`, imported when first asked (a stage's `fn`
and `fits`, a pipeline's `precheck`): the engine names no stage in its code."""

from __future__ import annotations

import importlib
from typing import Any


def import_function(spec: str) -> Any:
    """The attribute `function` of module `module`. Raises ImportError or AttributeError."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
