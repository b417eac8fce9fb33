"""Pipeline schedules: which stages a rank holds and what each schedule asks of the microbatches.

Kept free of torch.distributed.pipelining (a second to import) so that the driver's config checks
and the cost model can read the rules; training/parallel/pp.py builds the schedules themselves.

A rank holds `pp_virtual_stages` (v) stages of the pp·v the model is cut into:

- `gpipe`, `1f1b`: one stage (v = 1), stage = rank.
- `interleaved_1f1b`, `zero_bubble`: looped, stage = rank + i·pp for i < v (Megatron's
  interleaving); v >= 2.
- `zbv`, `dualpipev`: V-shaped, exactly two stages, rank r holds r and 2·pp−1−r, so rank 0
  holds the first stage and the last one.

The microbatch rules are torch 2.13's (the constructors raise them at the first step; checked up
front here, each measured on gloo): 1F1B needs at least pp microbatches; the interleaved schedules
run `max(1, m // pp)` rounds and need m to be a multiple of that count (any m <= pp works, and any
multiple of pp); DualPipeV needs m >= 2·pp, its stage count; ZB-V takes any m.
"""

from __future__ import annotations

SINGLE = ("gpipe", "1f1b")
"""One stage per rank."""
LOOPED = ("interleaved_1f1b", "zero_bubble")
"""Several stages per rank, rank r holding r, r + pp, r + 2·pp, ..."""
V_SHAPED = ("zbv", "dualpipev")
"""Two stages per rank in a V: r and 2·pp−1−r."""
PP_SCHEDULES = SINGLE + LOOPED + V_SHAPED
SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")
"""Schedules that run a backward as two passes, input gradients then weight gradients."""


def virtual_stages_problem(schedule: str, virtual: int) -> str | None:
    """Why `virtual` stages per rank don't suit `schedule`; None when they do."""
    if schedule in SINGLE and virtual != 1:
        return f"pp_schedule={schedule} runs one stage per rank: set pp_virtual_stages=1, or use interleaved_1f1b"
    if schedule in LOOPED and virtual < 2:
        return f"pp_schedule={schedule} interleaves several stages per rank: set pp_virtual_stages >= 2"
    if schedule in V_SHAPED and virtual != 2:
        return f"pp_schedule={schedule} holds exactly two stages per rank (a V): set pp_virtual_stages=2"
    return None


def microbatches_problem(schedule: str, pp: int, virtual: int, microbatches: int) -> str | None:
    """Why `schedule` can't run `microbatches` microbatches over `pp` ranks; None when it can."""
    m = microbatches
    if pp < 2:
        return None
    if schedule == "1f1b" and m < pp:
        return f"pp_schedule=1f1b needs at least pp={pp} microbatches"
    if schedule in LOOPED:
        rounds = max(1, m // pp)
        if m % rounds:
            return (f"pp_schedule={schedule} runs max(1, microbatches // pp) = {rounds} rounds and needs the "
                    f"microbatches to be a multiple of that: use a multiple of pp={pp}, or at most {pp}")
    if schedule == "dualpipev" and m < pp * virtual:
        return f"pp_schedule=dualpipev needs at least as many microbatches as stages, pp x 2 = {pp * virtual}"
    return None


def data_parallel_problem(schedule: str, replicas: int) -> str | None:
    """Why `schedule` can't run with its stages reduced over `replicas` ranks (dp_replicate x
    dp_shard x cp); None when it can. torch 2.13's split backward computes weight gradients with
    autograd.grad over the chunk's parameters, outside DDP's and FSDP's gradient hooks: measured
    at pp=2 x 2 replicas, ZB-V and interleaved zero bubble train other losses than one process
    under FSDP and leave DDP's replicas out of sync; DualPipeV under DDP fails in its backward."""
    if schedule in SPLIT_BACKWARD and replicas > 1:
        return (f"pp_schedule={schedule} splits backward into input and weight passes, which DDP's and FSDP's "
                "gradient reduction miss: use it with pp (and tp) alone, or use interleaved_1f1b with data "
                "parallelism")
    return None


def checkpointing_problem(schedule: str, checkpointing: str) -> str | None:
    """Why `schedule` can't run with activation checkpointing `checkpointing`; None when it can.
    Selective checkpointing lets a region be backwarded once, and a split backward does it twice
    (torch: "Trying to backward an extra time. You are only allowed to backward once on any region
    computed under selective activation checkpoint."); full checkpointing was measured to match."""
    if schedule in SPLIT_BACKWARD and checkpointing == "selective":
        return (f"pp_schedule={schedule} backwards each region twice (input, then weight gradients), which "
                "selective checkpointing forbids: use activation_checkpointing=full or none, or interleaved_1f1b")
    return None


def rank_stages(schedule: str, rank: int, pp: int, virtual: int) -> list[int]:
    """The stages (of pp·virtual) that pipeline rank `rank` holds, in the order its chunks are kept."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(virtual)]


def stage_blocks(names: list, stage: int, stages: int) -> list:
    """The contiguous run of block names stage `stage` of `stages` owns (balanced by count)."""
    n = len(names)
    return names[stage * n // stages : (stage + 1) * n // stages]
