"""What a strategy is: one declaration that every part of the project reads.

The config check (its name and preset degrees), `parallelize` (which wrappers it applies), the dry
run and the cost model (what it shards, whether FSDP regathers parameters for backward, what it
communicates), the overhead probe (whether it can be measured on one rank) and the advisor (the
data-parallel flavours it searches, the scaling curves it draws) all look a strategy up here
instead of testing its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.config import StrategyConfig
    from training.parallel.dims import ParallelDims

DEGREE_NAMES = ("dp_replicate", "dp_shard", "tp", "pp", "cp")
SHARDABLE = ("optimizer", "gradients", "parameters")
"""What data parallelism can shard across its ranks (ZeRO's stages 1, 2 and 3)."""


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str
    """One line for the docs and `python run.py --help`-style listings."""
    degrees: Mapping[str, int]
    """Preset dp_replicate, dp_shard, tp, pp and cp; -1 takes the ranks left over. A declaration
    that names only the first four (written before context parallelism) gets cp=1."""
    wrapper: str | None
    """The data-parallel wrapper it applies of its own: `ddp` (DDP over dp_replicate), `fsdp`
    (FSDP2 over dp_shard, HSDP with dp_replicate too) or None (the degrees decide: FSDP when
    sharding or when replicating a tensor-parallel model, DDP when replicating)."""
    shards: frozenset[str] = field(default_factory=frozenset)
    """What it shards across its data-parallel ranks, among SHARDABLE."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward and gather them again for backward (ZeRO-3),
    or keep them (ZeRO-2). Communication: a second all-gather per unit in backward."""
    simplicity: int | None = None
    """A data-parallel flavour the advisor searches (ties go to the smaller number); None for a
    layout strategy (tp, pp, hybrid), whose flavour follows from its degrees."""
    pure: bool = True
    """Drawn as a scaling curve by the plan (one degree grows with the devices)."""
    not_alone: str | None = None
    """Why its wrapper cannot be measured on a one-rank group (the overhead probe), or None."""
    one_device: str = "ddp"
    """The strategy its 1-device baseline trains as."""
    from_plan: bool = False
    """A placeholder for the plan's recommendation (auto): the train stage trains the plan's whole
    layout and knobs instead, and nothing of its own is checked, measured or searched."""
    any_layout: bool = False
    """It trains whatever degrees it is given (hybrid): the advisor names a layout that no pure
    strategy presets after it, with the degrees as overrides."""
    listed: int = 100
    """Its place in the registry, and so in the plan's tables and curves and every listing (the
    data-parallel flavours first, simplest first; a strategy that says nothing comes last)."""

    def __post_init__(self) -> None:
        unknown = set(self.shards) - set(SHARDABLE)
        if unknown:
            raise ValueError(f"strategy {self.name}: cannot shard {sorted(unknown)}; shardable: {SHARDABLE}")
        if sorted(self.degrees) == sorted(DEGREE_NAMES[:4]):
            object.__setattr__(self, "degrees", {**self.degrees, "cp": 1})  # frozen: set once, here
        if sorted(self.degrees) != sorted(DEGREE_NAMES):
            raise ValueError(f"strategy {self.name}: degrees must name dp_replicate, dp_shard, tp, pp (and cp)")

    @property
    def shards_optimizer_only(self) -> bool:
        """ZeRO-1: DDP's all-reduced gradients, a sharded optimizer (ZeroRedundancyOptimizer)."""
        return self.shards == frozenset({"optimizer"})

    @property
    def is_flavour(self) -> bool:
        return self.simplicity is not None

    def degrees_on(self, devices: int) -> dict[str, int]:
        """Its preset degrees with the leftover degree given `devices`."""
        return {k: devices if v == -1 else v for k, v in self.degrees.items()}


REGISTRY: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Add `strategy` (a module's one declaration); its YAML in conf/strategy/ makes it selectable."""
    REGISTRY[strategy.name] = strategy
    ordered = sorted(REGISTRY.values(), key=lambda s: (s.listed, s.name))
    REGISTRY.clear()
    REGISTRY.update((s.name, s) for s in ordered)
    return strategy


def get(name: str) -> Strategy:
    return REGISTRY[name]


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def from_plan(name: str) -> bool:
    """Whether strategy `name` stands for the plan's recommendation (Strategy.from_plan)."""
    return get(name).from_plan


def any_layout() -> Strategy:
    """The strategy that trains any degrees it is given (Strategy.any_layout): there is one."""
    (strategy,) = (s for s in REGISTRY.values() if s.any_layout)
    return strategy


def flavours() -> list[Strategy]:
    """The data-parallel flavours, simplest first."""
    return sorted((s for s in REGISTRY.values() if s.is_flavour), key=lambda s: s.simplicity)


def pure() -> list[str]:
    """The strategies drawn as the plan's scaling curves and explained one by one, in the registry's
    order (the order of the plan's tables)."""
    return [s.name for s in REGISTRY.values() if s.pure]


def flavour_of(strategy: StrategyConfig, d: ParallelDims) -> str:
    """The data-parallel flavour a configured strategy trains with (what the cost model charges):
    its own when it is one; else by its degrees, FSDP's (resharding or not) when it shards (over
    dp_shard x cp: ParallelDims.gradient_ranks), the simplest when it does not."""
    declared = get(strategy.name)
    if declared.is_flavour:
        return strategy.name
    if d.gradient_ranks(declared.wrapper)[1] > 1:
        return next(f.name for f in flavours()
                    if f.wrapper == "fsdp" and f.reshard_after_forward == strategy.reshard)
    return flavours()[0].name
