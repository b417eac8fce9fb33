"""How the ranks of a CPU host slow each other down, measured with every rank working at once.

On a GPU each rank has its own device and NCCL moves the bytes on the GPU's own engines: compute
and communication overlap, and one rank's work does not slow its neighbour's. On a CPU host
(gloo) neither holds. The ranks' threads share the host's cores, and a collective runs on the
same cores as the compute around it. Two things follow that a bandwidth probe alone cannot see,
since it times its collectives back to back with nothing else running:

- compute: a rank's work runs slower when every rank works than when it runs alone: by the
  time-sharing of cores once the threads outnumber them, and by more than that share when they
  do (a training step's many small operations suffer more than one big matmul: 4 ranks on the
  2 cores this was written on ran gpt-tiny's step 2.27x slower, a matmul loop 2.0x, a small
  MLP's forward and backward 2.3-2.8x);
- communication: a collective issued between compute, as a training step issues it, costs more
  than the same call in a back-to-back loop. The ranks reach it at different moments (it waits
  for the slowest) and wake its threads after a stretch of compute; the longer the stretch, the
  further apart they drift. On that host, at 2 ranks, DDP's one all-reduce after a 10 ms
  backward cost 2.2-2.6 ms more than back to back, each of zero3's nine calls between ~1 ms
  units about 0.2 ms more; at 4 ranks, where every wake-up waits for a time slice, about 3 ms
  more per call, whatever the size (4 KiB to 4 MiB).

`measure` times both with a small MLP's forward and backward as the compute (the dispatcher,
allocator and autograd work of a training step, not only its matmuls), after a short and a long
stretch of it: a line, the per-call cost and the drift per second of compute, beyond what the
bandwidth probe's α–β fit gives the call (which the plan charges it first). The numbers are
the host's, not the model's, and it needs only an initialised process group, like
training.collectives.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KERNEL_S = (0.001, 0.008)
"""The short and long stretches of compute a collective is issued after (a small model's unit
and whole backward pass on a CPU)."""
KERNEL_WIDTH = 64
"""Width of the MLP the kernel trains (64 -> 256 -> 64, a layer norm, 64 rows): gpt-tiny's."""
SIZES = (8, 1024 * 1024)
"""The all_reduce sizes the per-call cost is measured at (at most the probe's largest)."""
SHORT_ITERS = 4
"""The short stretch's calls are timed this many times as often as the long one's: it is the gap
FSDP's many calls a step follow (the line's value there is what they are charged), a call's cost
there is heavy-tailed (gpt-tiny's zero3 calls at world 2: median 0.45 ms, mean 0.85 ms), and its
iterations are cheap. With the long stretch's count, five repeated plans on the 2-core host this
was written on charged zero3's calls 0.18-1.0 ms each at that gap."""
ROUNDS = 5
"""Rounds of every measurement, interleaved; each number is the median over them. On the 2-core
host this was written on one round's per-call cost ranged from 0 to 2.6 ms at 2 ranks: a moment's
noise, which interleaving and the median keep out of what the plan predicts from."""


def time_share(world: int, threads_per_rank: int, cores: int) -> float:
    """How much slower each rank computes when `world` ranks of `threads_per_rank` threads share
    `cores` cores, by time-sharing alone: 1 until the threads outnumber the cores."""
    return max(1.0, world * threads_per_rank / cores)


@dataclass(frozen=True)
class SharedCores:
    """What every rank working at once costs each rank on a CPU host, measured at `world` ranks."""

    world: int
    threads_per_rank: int
    """torch's intra-op threads on each rank (the largest, if they differ)."""
    cores: int
    """The cores the ranks may run on (the affinity of the first rank)."""
    alone_s: float
    """The long stretch of the kernel on rank 0 while every other rank waits (its mean; the median
    of ROUNDS)."""
    together_s: float
    """The same on every rank at once: the slowest rank's mean (the median of ROUNDS)."""
    call_s: float
    """What a collective issued right after compute costs beyond what the bandwidth probe's fit gives
    it: the line's value at no compute (the call's time in a loop of stretch and call, less the
    slowest rank's stretch and the fit's time; the median of ROUNDS x SIZES at each of the two
    stretches). Below the fit (a call can run faster than its fit says) it counts as 0."""
    drift: float = 0.0
    """And per second of compute since the last call: the line's slope (at least 0)."""

    @property
    def compute_factor(self) -> float:
        """How much slower compute runs with every rank working (at least 1: alone is the best case)."""
        return max(1.0, self.together_s / self.alone_s)

    def oversubscription(self, world: int) -> float:
        """time_share at `world` ranks of this host's threads and cores."""
        return time_share(world, self.threads_per_rank, self.cores)

    def contention(self, world: int) -> float:
        """The compute slow-down at `world` ranks: measured at this probe's world; elsewhere the
        cores' time-sharing, times what the measurement found beyond it where the cores are
        oversubscribed (at one rank, nothing)."""
        if world <= 1:
            return 1.0
        if world == self.world:
            return self.compute_factor
        share = self.oversubscription(world)
        if share <= 1.0:
            return 1.0
        return share * max(1.0, self.compute_factor / self.oversubscription(self.world))

    def call_cost(self, world: int, gap_s: float) -> float:
        """Seconds a collective issued after `gap_s` of compute adds at `world` ranks: the line
        measured at this probe's world; elsewhere its per-call part scaled by the cores'
        time-sharing (a rank that waits for the slowest waits longer when each has less of a core)."""
        if world <= 1:
            return 0.0
        return self.call_s * self.oversubscription(world) / self.oversubscription(self.world) + self.drift * gap_s

    def describe(self) -> str:
        return (f"shared cores ({self.world} ranks x {self.threads_per_rank} threads on {self.cores} cores, measured): "
                f"compute {self.compute_factor:.2f}x slower with every rank working "
                f"({self.together_s * 1e3:.1f} vs {self.alone_s * 1e3:.1f} ms alone), each collective issued "
                f"between compute +{self.call_s * 1e3:.2f} ms beyond the probe's fit and "
                f"+{self.drift * 1e3:.0f} us per ms of compute since the last call (the ranks drift apart)")


class _Kernel:
    """A small MLP's forward and backward, `repeats` times per call."""

    def __init__(self) -> None:
        import torch

        w = KERNEL_WIDTH
        self.mlp = torch.nn.Sequential(torch.nn.Linear(w, 4 * w), torch.nn.GELU(), torch.nn.Linear(4 * w, w),
                                       torch.nn.LayerNorm(w))
        self.x = torch.randn(w, w)

    def __call__(self, repeats: int) -> None:
        for _ in range(repeats):
            self.mlp(self.x).sum().backward()


def _mean_time(fn: Any, iters: int, warmup: int) -> float:
    """Seconds per call of `fn`: the mean, as the probe's (and a step time, which is a throughput)
    is; a stall now and then is part of what a step pays."""
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _after_compute(stretch: Any, call: Any, iters: int, warmup: int) -> tuple[float, float]:
    """Seconds per iteration of `stretch()` then `call()`, and of the stretch within them, timed in
    one loop: what the call adds is their difference, free of the host's drift between two loops
    (timed apart, the stretch's own mean moved by ~0.3 ms on the 2-core host this was written on,
    as much as the cost it was subtracted to find)."""
    for _ in range(warmup):
        stretch()
        call()
    inside = 0.0
    start = time.perf_counter()
    for _ in range(iters):
        began = time.perf_counter()
        stretch()
        inside += time.perf_counter() - began
        call()
    return (time.perf_counter() - start) / iters, inside / iters


def _slowest(seconds: float) -> float:
    """The largest of every rank's `seconds` (a collective)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure(max_bytes: int, iters: int, warmup: int, expected: Callable[[int], float]) -> SharedCores:
    """Time the kernel alone and on every rank at once, and all_reduce issued after a short and a
    long stretch of it against `expected(nbytes)`, what the bandwidth probe's fit gives that call (the
    time the plan charges it before this line), on every rank of the initialised (CPU) process
    group; every rank returns the same result. Against the fit, not a back-to-back loop of its own:
    the plan adds this line to the fit, so the two together are the call as measured after compute
    whatever the loop would have read (the same 0.54 MB all_reduce back to back read 0.8-2.2 ms from
    one 100-call loop to the next at 2 ranks on the 2-core host this was written on, and the line
    held against it moved as much)."""
    import os

    import torch
    import torch.distributed as dist

    from training.collectives import element_count

    world, rank = dist.get_world_size(), dist.get_rank()
    iters = max(5, iters // 2)  # each iteration is a stretch of compute: ROUNDS of half the probe's count
    kernel = _Kernel()
    # Rank 0 sizes the stretches alone and every rank uses its counts, so that all do the same work.
    repeats = torch.tensor([0] * len(KERNEL_S))
    if rank == 0:
        once = _mean_time(lambda: kernel(10), 5, 2) / 10
        repeats[:] = torch.tensor([max(1, round(length / once)) for length in KERNEL_S])
    dist.broadcast(repeats, src=0)
    short, long = (lambda n=int(n): kernel(n) for n in repeats.tolist())
    buffers = [torch.zeros(count) for count in sorted({element_count(min(s, max_bytes), world) for s in SIZES})]
    alone, together, costs = [], {short: [], long: []}, {short: [], long: []}
    for _ in range(ROUNDS):
        lone = torch.tensor([0.0], dtype=torch.float64)
        if rank == 0:  # the others wait in the broadcast: blocked, not spinning
            lone[0] = _mean_time(long, iters, warmup)
        dist.broadcast(lone, src=0)
        alone.append(lone.item())
        for stretch, count in ((short, SHORT_ITERS * iters), (long, iters)):
            dist.barrier()
            together[stretch].append(_slowest(_mean_time(stretch, count, warmup)))
            for buffer in buffers:
                dist.barrier()
                after, inside = _after_compute(stretch, lambda buffer=buffer: dist.all_reduce(buffer), count, warmup)
                costs[stretch].append(_slowest(after) - _slowest(inside) - expected(buffer.numel() * buffer.element_size()))
    (x0, y0), (x1, y1) = ((statistics.median(together[s]), statistics.median(costs[s])) for s in (short, long))
    # A call that costs no more than its fit after the long stretch costs nothing beyond it anywhere.
    drift = max(0.0, (y1 - y0) / (x1 - x0)) if x1 > x0 and y1 > 0 else 0.0
    threads = int(_slowest(float(torch.get_num_threads())))
    cores = torch.tensor([len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1])
    dist.broadcast(cores, src=0)
    return SharedCores(world=world, threads_per_rank=threads, cores=int(cores.item()),
                       alone_s=statistics.median(alone), together_s=x1, call_s=max(0.0, y0 - drift * x0), drift=drift)
