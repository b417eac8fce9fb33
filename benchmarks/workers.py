"""Worker functions the benchmarks run on real ranks: each measures two things in the same
processes, alternating, so that machine noise hits both alike."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from stages.train import TrainInputs
from stages.train import run as train_stage
from training.contract.calls import build_model
from training.data import GlobalBatches, build_dataset
from training.dist import device, rank, synchronize, world_size


def hand_written_loop(inputs: TrainInputs) -> float:
    """The same model, batches and strategy as plain PyTorch (a DataLoader over the same samples,
    cross-entropy, clipping, AdamW): samples/s after warm-up."""
    t, dev = inputs.train, device()
    model = build_model(inputs.model, inputs.seed).to(dev)
    if inputs.strategy.name == "zero3":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
    elif world_size() > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    dataset = build_dataset(inputs.data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr)
    batches = GlobalBatches(len(dataset), t.micro_batch, 1, rank(), world_size(), inputs.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=[batches.rows(s, 0).tolist() for s in range(t.steps)])
    for step, (x, y) in enumerate(loader):
        if step == t.timing_warmup:
            synchronize(dev)
            start = time.perf_counter()
        logits = model(x.to(dev))
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(dev).reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(dev)
    return (t.steps - t.timing_warmup) * batches.global_batch / (time.perf_counter() - start)


def train_vs_hand(inputs: TrainInputs, repeats: int = 10) -> dict:
    """Median samples/s of the train stage and of the hand-written loop over `repeats` (even) pairs,
    each side going first in every other pair: the one that follows another run meets warmer caches
    and allocator, and a row whose side always went first carried that (zero3 read 0.975 and 0.994
    in two full benches with the train stage always first, five pairs)."""
    ours, theirs = [], []
    plan = SimpleNamespace(flops_per_sample=1.0, recommended=None, prediction_for_run=lambda strategy, world: None)
    lr_find = SimpleNamespace(suggested_lr=inputs.train.lr, lr_scaling="none", finder_batch=8)

    def train() -> None:
        with tempfile.TemporaryDirectory() as checkpoints:
            ours.append(train_stage(inputs, plan=plan, lr_find=lr_find, trials=None, baseline=None,
                                    checkpoints=Path(checkpoints)).samples_per_s)

    def hand() -> None:
        theirs.append(hand_written_loop(inputs))

    for i in range(repeats + repeats % 2):
        for side in ((train, hand) if i % 2 == 0 else (hand, train)):
            side()
    return {"ours": statistics.median(ours), "theirs": statistics.median(theirs)}


PROBE_REPEATS_BYTES = 512 * 1024 * 1024
"""What each side of a probe row sends over its repeats, at least 8 of them: 512 at 1 MiB. A loop of
20 calls at 1 MiB lasts ~35 ms on this 2-core host, and one loop's mean call time spreads ~3x
(10th-90th percentile 0.83-2.3 ms over 512 loops, 2026-12-05; 20 or 200 calls a loop alike): the
state the ranks' threads are in. The row is a ratio of two medians of that; bootstrapped from runs of
512 and 256 measured repeats a side, its 95 % interval was 0.89-1.13 with one bare loop a repeat and 128
repeats (the full bench before read 0.91), 0.92-1.08 with the bare side in rounds as the probe
(probe_vs_bare), and 0.96-1.04 with those and 512 repeats: the goal of 0.95 resolvable. At 16 MiB
(one loop a side) a loop's busbw spreads far less, 1.21-1.39 GB/s (10th-90th percentile over 128
repeats a side, both sides alike, 2026-12-05), and the row's bootstrapped 95 % interval is 0.97-1.04
with its 32 repeats (0.98-1.03 with 64): its one reading of 0.948 in three full benches was the
host's state during that run, not too few repeats."""


def probe_repeats(size: int) -> int:
    """The repeats of a probe row at `size` bytes: an even number, so each side goes first as often."""
    repeats = max(8, PROBE_REPEATS_BYTES // size)
    return repeats + repeats % 2


def probe_vs_bare(job: tuple[str, list[int]], iters: int = 20) -> dict:
    """`collective`'s busbw from the bandwidth probe and from a bare timing loop, per size: warm-up 5
    and 20 timed iterations as nccl-tests' defaults, the slowest rank's mean time, the median of
    `probe_repeats(size)`; the two take turns going first (the one that follows a loop meets a
    warmer link). The probe is what the bandwidth stage runs, with its default rounds (a size whose
    loop lasts under 0.1 s, 1 MiB here, is measured in rounds and keeps the median); the bare side
    is nccl-tests' loop, timed as often (the median of `rounds` loops where the probe takes
    rounds). all_to_all sends each rank's whole buffer, 1/n of it to
    each rank, as nccl-tests' alltoall does."""
    from training.collectives import SHORT_LOOP_S, bus_factor, probe
    from training.plan_config import BandwidthConfig

    collective, sizes = job
    dev = device()
    n = world_size()
    rounds = BandwidthConfig().rounds

    def loop(tensor: torch.Tensor, received: torch.Tensor) -> float:
        """One timed loop as nccl-tests times it: the slowest rank's mean seconds a call."""

        def once() -> None:
            if collective == "all_to_all":
                dist.all_to_all_single(received, tensor)
            else:
                dist.all_reduce(tensor)

        for _ in range(5):
            once()
        synchronize(dev)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            once()
        synchronize(dev)
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    def bare(size: int) -> float:
        # As many loops as the probe times at this size (its rounds where the loop is short), the
        # median of them: the two sides at equal effort, so that the row compares their loops, not
        # one loop's spread against a median's.
        tensor = torch.zeros(size // 4, device=dev)
        received = torch.zeros_like(tensor)
        seconds = [loop(tensor, received)]
        if seconds[0] * iters < SHORT_LOOP_S:
            seconds += [loop(tensor, received) for _ in range(rounds - 1)]
        return size / statistics.median(seconds) / 1e9 * bus_factor(collective, n)

    out = {}
    for size in sizes:
        ours, theirs = [], []
        for repeat in range(probe_repeats(size)):
            for which in ("ours", "bare") if repeat % 2 == 0 else ("bare", "ours"):
                if which == "ours":
                    ours.append(probe([collective], [size], 5, iters, rounds=rounds)[0].busbw_gbps)
                else:
                    theirs.append(bare(size))
        out[size] = {"ours": statistics.median(ours), "theirs": statistics.median(theirs)}
    return out



