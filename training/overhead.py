"""What a strategy's wrapper adds to every step, measured on one rank.

The plan's compute ruler times the bare model. Each parallelism wrapper adds work to every step
that does not shrink with more devices: DDP's reducer (autograd hooks, copies into and out of the
gradient buckets), FSDP2's pre- and post-hooks, its all-gather copy-in and copy-out and an
optimizer stepping DTensors, ZeroRedundancyOptimizer's partition bookkeeping, DTensor dispatch
for tensor parallelism. On a process group of one rank every collective is a local no-op, so the
wrapped step minus the bare one is that overhead: measured here, not assumed. On the 2-core CPU
host this was written on, gpt-tiny's 11.7 ms step grows by about 1 ms under DDP and 10.5 ms under
FSDP2's zero3, more than the α–β model's communication for the latter.

FSDP2 is timed on a fake group of two instead: on one rank it skips the all-gather's copy-in and
copy-out and the reduce-scatter's (torch's world-size-1 shortcut), work it does at any larger size.
On that host gpt-tiny's zero3 step took 12.1 ms on one rank, 13.5 ms as rank 0 of two, and its
step at world 2 spent 15.5-16 ms outside its collectives (1.12x contention on 13.5: 15.1).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from common.errors import ContractError
from training import strategies as registry
from training.config import ModelConfig, StrategyConfig
from training.contract.calls import Batch, LossFn
from training.dist import synchronize
from training.planner.hardware import EXPERT_DISPATCH

if TYPE_CHECKING:
    from training.parallel.compose import Parallel


@dataclass(frozen=True)
class Overheads:
    seconds: dict[str, float]
    """Per strategy: wrapped minus bare micro-batch step, median over interleaved rounds (>= 0)."""
    bare_step_s: float
    """The bare step these were measured against."""
    not_measured: dict[str, str]
    """Strategy -> why its overhead could not be measured here."""


@contextlib.contextmanager
def one_rank_group(dev: torch.device) -> Iterator[bool]:
    """A process group of this process alone (an in-memory store) for the duration, unless
    torch.distributed is already up. Yields False when it is up with other ranks in it: a
    one-rank mesh can't be made there without them."""
    if dist.is_initialized():
        yield dist.get_world_size() == 1
        return
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield True
    finally:
        dist.destroy_process_group()


SHARDED_WORLD = 2
"""The fake group FSDP2's wrappers are timed on: the smallest that runs its copies."""


@contextlib.contextmanager
def fake_group(world: int) -> Iterator[None]:
    """A fake process group of `world` ranks, this process its rank 0 and every collective a no-op
    that leaves its output as it was, for the duration (torch.distributed must not be up)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield True
    finally:
        dist.destroy_process_group()


def measure_overheads(
    model: nn.Module,
    model_cfg: ModelConfig,
    loss: LossFn,
    batch: Batch,
    strategies: list[str],
    dev: torch.device,
    grad_clip: float | None,
    base: StrategyConfig,
    rounds: int = 3,
    steps: int = 3,
) -> Overheads:
    """Time `model` bare and wrapped by each strategy (a copy of it, wrapped by the real
    `parallelize` on a one-rank group; FSDP2's on a fake group of SHARDED_WORLD), alternating in
    `rounds` so a drifting host moves both alike. Both run the training step (training/step.py)
    on `batch`, in `base`'s precision. `model` comes prepared as the plan measures it (activation
    checkpointing already applied), so neither the bare step nor the wrappers apply it again."""
    from training.contract.spec import model_spec
    from training.parallel.compose import trainable
    from training.step import optimizer_step

    def stepper(parallel: Parallel, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            optimizer_step(parallel, optimizer, [batch], 1, grad_clip, dev)
            synchronize(dev)
        return step

    def median_step(step: Callable[[], None]) -> float:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    declared = {s: registry.get(s) for s in strategies}
    wanted = [s for s, d in declared.items() if d.not_alone is None]
    not_measured = {s: d.not_alone for s, d in declared.items() if d.not_alone is not None}
    # FSDP2's on a fake group of two, where it runs its copies; unless torch.distributed is up
    # already (a world of one): then on that one rank, as the others.
    sharded = [s for s in wanted if declared[s].wrapper == "fsdp"] if not dist.is_initialized() else []
    seconds: dict[str, float] = {}
    bare_times: list[float] = []
    base = dataclasses.replace(base, activation_checkpointing="none")

    def added(bare: Callable[[], None], wrapped: Callable[[], None]) -> float:
        """`wrapped`'s step minus the bare one, the two alternating over `rounds`."""
        diffs = []
        for _ in range(rounds):
            plain_s = median_step(bare)
            bare_times.append(plain_s)
            diffs.append(median_step(wrapped) - plain_s)
        return max(statistics.median(diffs), 0.0)

    def measure_each(bare: Callable[[], None], names: list[str]) -> None:
        for strategy in names:
            try:  # a second copy of the model and its optimizer state must fit beside the first
                net = copy.deepcopy(model)
                wrapped = stepper(*trainable(net, model_spec(net, model_cfg), dataclasses.replace(base, name=strategy),
                                             dev, loss, probe=True))
                wrapped()
                wrapped()  # warm: lazy initialisation (FSDP's, the reducer's) happens in the first steps
            except torch.OutOfMemoryError:
                net = wrapped = None  # free what was built before trying the next
                not_measured[strategy] = "no room for a second copy of the model on this device"
                continue
            except ContractError as err:
                not_measured[strategy] = str(err)
                continue
            seconds[strategy] = added(bare, wrapped)
            del net, wrapped

    with one_rank_group(dev) as usable:
        if not usable:
            reason = "torch.distributed is up with other ranks: no one-rank mesh"
            return Overheads({}, 0.0, {s: reason for s in wanted} | not_measured)
        # Unwrapped on one rank: its step calls no collective, so it runs on under the fake group.
        bare = stepper(*trainable(model, model_spec(model, model_cfg), base, dev, loss))
        bare()  # the optimizer's state is allocated on the first step
        measure_each(bare, [s for s in wanted if s not in sharded])
        split = _expert_dispatch(model, model_cfg, base, dev, loss, stepper)
        if split is not None:
            seconds[EXPERT_DISPATCH] = added(bare, split)
    if sharded:
        try:
            with fake_group(SHARDED_WORLD):
                measure_each(bare, sharded)
        except RuntimeError:  # a backend the fake group can't stand in for: on one rank, as before
            with one_rank_group(dev):
                measure_each(bare, sharded)
    return Overheads(seconds, statistics.median(bare_times) if bare_times else 0.0, not_measured)


def _expert_dispatch(model: nn.Module, model_cfg: ModelConfig, base: StrategyConfig, dev: torch.device, loss: LossFn,
                     stepper: Callable) -> Callable[[], None] | None:
    """A warm step of a copy of `model` whose experts modules are split by the real apply_ep over a
    one-rank expert group (its all-to-alls local copies, the rest of its work as at any degree):
    timed against the bare step, what expert parallelism's dispatch adds. None for a model without
    experts, or no room for the copy."""
    from training.contract.spec import model_spec
    from training.parallel.compose import trainable
    from training.parallel.dims import ParallelDims
    from training.parallel.ep import apply_ep, expert_groups

    if not model_spec(model, model_cfg).experts(model, whole=True):
        return None
    try:
        net = copy.deepcopy(model)
        spec = model_spec(net, model_cfg)
        apply_ep(spec.experts(net, whole=True), expert_groups(ParallelDims(), 1, dev.type))
        split = stepper(*trainable(net, spec, base, dev, loss))
        split()
        split()
    except torch.OutOfMemoryError:
        return None
    return split
