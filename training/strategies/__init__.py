"""The parallelism strategies, one module each, each one `Strategy` declaration (base.py) that the
config check, `parallelize`, the dry run, the overhead probe, the cost model and the advisor read.
To add one: a module here that registers its declaration (every module of this package is
imported, and the registry is ordered by the declarations' `listed`), and conf/strategy/<name>.yaml
(docs/extending.md)."""

import importlib
import pkgutil

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

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["REGISTRY", "Strategy", "any_layout", "flavour_of", "flavours", "from_plan", "get", "names",
           "pure", "register"]
