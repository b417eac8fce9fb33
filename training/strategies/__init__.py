"""The parallelism strategies, one module each, each one `Strategy` declaration (base.py) that the
config check, `parallelize`, the dry run, the overhead probe, the cost model and the advisor read.
To add one: a module here that registers its declaration, its name in BUILTIN, and
conf/strategy/<name>.yaml (docs/extending.md)."""

import importlib

from training.strategies.base import (
    REGISTRY,
    Strategy,
    any_layout,
    flavour_of,
    flavours,
    from_plan,
    get,
    names,
    pure,
    register,
)

BUILTIN = ("ddp", "zero1", "zero2", "zero3", "tp", "pp", "hybrid", "auto")
"""The built-in strategies' modules, in the order of the plan's tables and curves."""
for _module in BUILTIN:
    importlib.import_module(f"training.strategies.{_module}")

__all__ = ["BUILTIN", "REGISTRY", "Strategy", "any_layout", "flavour_of", "flavours", "from_plan", "get", "names",
           "pure", "register"]
