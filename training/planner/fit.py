"""Does the model fit a rank's memory, and on what is the smallest layout that holds it?

The memory ruler (training/planner/memory.py) asked before anything runs, from the model counted on the
meta device (training/planner/anatomy.py: its shape and the bytes it saves per sample, in the run's
precision): the config check refuses a layout that cannot fit a rank's budget, and the stages the
card places on one device run, for a model larger than one device, on the smallest world that
holds it sharded (zero3 over 2, 4, ... ranks), as the first ruler says to.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.config import DataConfig, ModelConfig, StrategyConfig
from training.parallel.dims import resolve_dims
from training.planner.memory import Memory, memory_breakdown
from training.planner.shape import Activations, Shape
from training.planner.workload import strategy_workload
from training.units import GIB

SHARDED = "zero3"
"""How a model larger than one device is held by the smallest layout: FSDP full shard."""


@dataclass(frozen=True)
class Counted:
    shape: Shape
    activations: Activations


_COUNTED: dict[str, Counted] = {}


def counted(model: ModelConfig, data: DataConfig, seed: int, precision: str, checkpointing: str) -> Counted:
    """The model's shape and saved bytes per sample, counted on the meta device on the data's
    first sample (nothing allocated); once per process for the same settings."""
    key = repr((model, data, seed, precision, checkpointing))
    if key not in _COUNTED:
        import torch

        from training.contract.calls import to_device
        from training.data import build_dataset, first_samples
        from training.planner.anatomy import build_on_meta, measure_variant, shape_of

        model_nn, spec = build_on_meta(model, seed)
        shape = shape_of(model_nn, spec, hidden=1, positions=1)
        sample = to_device(first_samples(build_dataset(data), 1), torch.device("meta"))
        cost = measure_variant(model, seed, sample, precision, checkpointing)
        _COUNTED[key] = Counted(shape, cost.activations)
    return _COUNTED[key]


def slice_counted(model: ModelConfig, data: DataConfig, seed: int, precision: str, checkpointing: str,
                  blocks: int) -> Counted:
    """`counted` for the model's first `blocks` blocks (with its embeddings and head)."""
    import torch

    from training.activations import measure_tp_split
    from training.contract.calls import batch_loss, model_loss, to_device
    from training.data import build_dataset, first_samples
    from training.planner.anatomy import build_on_meta, shape_of
    from training.planner.counting import fused_attention_on_meta

    net, spec = build_on_meta(model, seed, precision, checkpointing)
    spec.keep_first_blocks(blocks)
    sample = to_device(first_samples(build_dataset(data), 1), torch.device("meta"))
    with fused_attention_on_meta():
        split = measure_tp_split(net, {}, lambda: batch_loss(net, sample, model_loss(model)),
                                 [b.module for b in spec.blocks])
    return Counted(shape_of(net, spec, hidden=1, positions=1), split.per_sample(1, sequence_norms=False))


def blocks_that_fit(model: ModelConfig, data: DataConfig, seed: int, strategy: StrategyConfig, micro_batch: int,
                    budget_bytes: float) -> int | None:
    """How many of the model's blocks one device holds for a step of `micro_batch` in `strategy`'s
    one-device form: None when the whole model fits, else the most that do (0: not even one)."""
    one = StrategyConfig(name="ddp", precision=strategy.precision,
                         activation_checkpointing=strategy.activation_checkpointing)
    whole = counted(model, data, seed, strategy.precision, strategy.activation_checkpointing)
    if rank_memory(whole, one, "ddp", 1, micro_batch).total <= budget_bytes:
        return None
    for blocks in range(whole.shape.layers - 1, 0, -1):
        part = slice_counted(model, data, seed, strategy.precision, strategy.activation_checkpointing, blocks)
        if rank_memory(part, one, "ddp", 1, micro_batch).total <= budget_bytes:
            return blocks
    return 0


def rank_memory(c: Counted, strategy: StrategyConfig, flavour: str, world: int, micro_batch: int,
                expert_held_imbalance: tuple[tuple[int, float], ...] = ()) -> Memory:
    """One rank's memory at the peak of a step of `strategy` (trained as `flavour`) on `world`
    (`expert_held_imbalance`: the routing a run measured, Workload's field)."""
    d = resolve_dims(strategy, world)
    w = strategy_workload(c.shape, c.activations, strategy, micro_batch, grad_accum=1, tokens_per_sample=1, clip=False,
                          expert_held_imbalance=expert_held_imbalance)
    return memory_breakdown(w, flavour, d)


@dataclass(frozen=True)
class Fit:
    ranks: int
    """1: one device; more: zero3 over that many ranks."""
    memory: Memory
    """Its memory per rank, predicted."""

    def describe(self, budget_bytes: float) -> str:
        where = "one device" if self.ranks == 1 else f"{SHARDED} over {self.ranks} ranks"
        return f"{where}: {self.memory.total / GIB:.2f} GiB per rank of {budget_bytes / GIB:.2f} GiB"


def smallest_world(c: Counted, strategy: StrategyConfig, samples: int, budget_bytes: float, max_ranks: int) -> Fit | None:
    """The fewest ranks that hold a step of `samples` samples within `budget_bytes` each: one device
    as `strategy` trains there (its one-device form: plain data parallelism of one), else zero3
    over 2, 4, ... ranks that divide `max_ranks` and the samples. None: not even `max_ranks` do."""
    one = StrategyConfig(name="ddp", precision=strategy.precision,
                         activation_checkpointing=strategy.activation_checkpointing)
    memory = rank_memory(c, one, "ddp", 1, samples)
    if memory.total <= budget_bytes:
        return Fit(1, memory)
    ranks = 2
    while ranks <= max_ranks:
        if max_ranks % ranks == 0 and samples % ranks == 0:
            sharded = StrategyConfig(name=SHARDED, precision=strategy.precision,
                                     activation_checkpointing=strategy.activation_checkpointing)
            memory = rank_memory(c, sharded, SHARDED, ranks, samples // ranks)
            if memory.total <= budget_bytes:
                return Fit(ranks, memory)
        ranks *= 2
    return None
