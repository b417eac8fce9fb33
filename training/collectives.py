"""An nccl-tests-style bandwidth probe of torch.distributed collectives.

For each collective and message size: warm-up iterations, a barrier, then `iters` back-to-back
operations timed on the host; the per-operation time of the slowest rank gives the algorithm
bandwidth (bytes / time) and the bus bandwidth (algbw times nccl-tests' bus factor, which makes
the numbers comparable with the link speed whatever the collective and the world size).
Model-agnostic: it needs only an initialised process group.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from training.dist import device as current_device
from training.dist import synchronize

if TYPE_CHECKING:
    import torch

ELEMENT_BYTES = 4
"""float32, as nccl-tests' default data type."""
SHORT_LOOP_S = 0.1
"""A size whose timed loop lasts less than this is measured in rounds (probe's `rounds`). On the
2-core CPU host this was written on, a loop of all_reduce at 8 B to 32 KiB read 0.25 to 2.8 ms a
call from one loop to the next, in no order of size, with 20 iterations as with 200: the state the
ranks' threads happen to be in, not a hiccup a longer loop averages out. The latency the plan fits
comes from these sizes. Large sizes' loops last long enough to be steady and are measured once."""

_BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' busbw / algbw ratio for `collective` on `n` ranks."""
    if collective not in _BUS_FACTORS:
        raise ValueError(f"collective={collective!r}: must be one of {', '.join(_BUS_FACTORS)}")
    if n < 1:
        raise ValueError(f"n={n}: the world size must be >= 1")
    return _BUS_FACTORS[collective](n)


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Sizes from `min_bytes` multiplied by `factor` while <= `max_bytes`, ending with `max_bytes`
    itself when the series steps over it (the verdict is taken at the largest size)."""
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"message sizes need 1 <= min_bytes <= max_bytes and factor >= 2, got "
                         f"min_bytes={min_bytes}, max_bytes={max_bytes}, factor={factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    if sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


def element_count(nbytes: int, world: int) -> int:
    """float32 elements for a buffer of about `nbytes`: rounded down to a multiple of the world
    size, so that every rank's shard is equal, and at least one element per rank."""
    return max(world, nbytes // ELEMENT_BYTES // world * world)


@dataclass(frozen=True)
class Measurement:
    """One row of the probe, as nccl-tests prints it (out-of-place where the collective has two
    buffers, in place for all_reduce and broadcast)."""

    collective: str
    bytes: int
    """The buffer size actually used: all_gather's output, reduce_scatter's input."""
    time_us: float
    """Mean time of one operation on the slowest rank, in microseconds."""
    algbw_gbps: float
    """bytes / time, in GB/s (1e9 bytes per second)."""
    busbw_gbps: float
    """algbw times the collective's bus factor, in GB/s."""

    @classmethod
    def from_time(cls, collective: str, nbytes: int, time_us: float, world: int) -> Measurement:
        """The measurement of `nbytes` moved by `collective` on `world` ranks in `time_us`."""
        assert time_us > 0, f"a collective cannot take {time_us} us"
        algbw = nbytes / (time_us * 1e-6) / 1e9
        return cls(collective, nbytes, time_us, algbw, algbw * bus_factor(collective, world))

    def row(self) -> str:
        """One aligned progress line."""
        return (f"{self.collective:<14} {self.bytes:>12} B {self.time_us:>12.1f} us  "
                f"algbw {self.algbw_gbps:8.3f} GB/s  busbw {self.busbw_gbps:8.3f} GB/s")


def _operation(collective: str, count: int, world: int, dev: torch.device, group: Any = None) -> Callable[[], object]:
    """A zero-argument call that runs `collective` once on `count` elements over `group` (None:
    every rank), reusing buffers allocated here so that the timed loop allocates nothing."""
    import torch
    import torch.distributed as dist

    # Zeros stay finite under repeated sums; garbage from torch.empty could hold denormals,
    # which slow the CPU reduction down and would be measured as a slow link.
    full = torch.zeros(count, dtype=torch.float32, device=dev)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if collective == "broadcast":
        return lambda: dist.broadcast(full, group_src=0, group=group)
    shard = torch.zeros(count // world, dtype=torch.float32, device=dev)
    if collective == "all_gather":
        return lambda: dist.all_gather_single(full, shard, group=group)
    if collective == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(shard, full, group=group)
    if collective == "all_to_all":
        received = torch.zeros_like(full)
        return lambda: dist.all_to_all_single(received, full, group=group)
    raise ValueError(f"collective={collective!r}: must be one of {', '.join(_BUS_FACTORS)}")


def measure(collective: str, nbytes: int, warmup_iters: int, iters: int, device: torch.device,
            group: Any = None) -> Measurement:
    """Time `collective` on a buffer of about `nbytes` over `group` (None: every rank of the
    initialised process group; a subgroup: every rank's subgroup at once, as nccl-tests run on
    each node); every rank returns the same measurement (the slowest rank's time)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    count = element_count(nbytes, world)
    op = _operation(collective, count, world, device, group)
    for _ in range(warmup_iters):
        op()
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    synchronize(device)
    seconds = (time.perf_counter() - start) / iters
    # The slowest rank bounds a collective, so report its time (nccl-tests' `-a 3`).
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return Measurement.from_time(collective, count * ELEMENT_BYTES, slowest.item() * 1e6, world)


def probe(collectives: Sequence[str], sizes: Sequence[int], warmup_iters: int, iters: int,
          progress: Callable[[str], None] | None = None, group: Any = None, rounds: int = 1) -> list[Measurement]:
    """Measure every collective at every size on this rank's device, over `group` (None: every
    rank); `progress` gets one line per measurement. Sizes that round to the same buffer are
    measured once. Sizes whose loop lasts under SHORT_LOOP_S are measured `rounds` times, the
    rounds going over those sizes in turn, and keep the median time: every rank decides alike,
    since each measurement is the slowest rank's."""
    import torch.distributed as dist

    dev = current_device()
    world = dist.get_world_size(group)
    results: list[Measurement] = []
    for collective in collectives:
        counts = list(dict.fromkeys(element_count(size, world) for size in sizes))
        times = {count: [measure(collective, count * ELEMENT_BYTES, warmup_iters, iters, dev, group).time_us]
                 for count in counts}
        short = [count for count in counts if times[count][0] * 1e-6 * iters < SHORT_LOOP_S]
        for _ in range(rounds - 1):
            for count in short:
                times[count].append(measure(collective, count * ELEMENT_BYTES, warmup_iters, iters, dev, group).time_us)
        for count in counts:
            result = Measurement.from_time(collective, count * ELEMENT_BYTES, statistics.median(times[count]), world)
            if progress is not None:
                progress(result.row())
            results.append(result)
    return results
