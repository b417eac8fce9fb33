"""A pipeline schedule's idle fraction, read from the action tables torch's own schedules execute.

The multi-stage schedules the trainer builds (training/parallel/pp.py: interleaved 1F1B,
interleaved zero bubble, ZB-V, DualPipeV) run each rank's list of actions in order, `pipeline_order`,
which every rank computes for all ranks when the schedule is constructed. Here the schedule is
constructed around stand-ins of its stages (no process group, no model: the tables depend only on
the ranks, the stages each holds and the microbatches) and its tables are played out with each
microbatch's forward, input-gradient and weight-gradient passes one unit each (a full backward
two), every action starting when its rank is free and what it needs is done. The idle fraction is
the rank's share of the span it waits.

The cost model's closed forms (training/planner/pipeline.py pipeline_bubble) equal these tables once the
pipeline is full, and not before: with fewer microbatches than ranks a looped schedule waits a
whole loop for each microbatch (pp=4, v=2, m=2: 0.56 idle against the closed form's 0.43), ZB-V
until 1.5x as many (tests/unit/test_pipeline_bubble.py). Importing torch.distributed.pipelining
costs a second, so this is only read where the closed forms don't hold.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from training.parallel.schedules import SINGLE, rank_stages

UNITS = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
"""A pass's time in units of a forward: ZB's equal F, B (input) and W (weight) passes (Qi et al. 2023)."""
KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


@functools.lru_cache(maxsize=1024)
def table_bubble(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """The idle fraction of a step of `schedule` over `pp` ranks of `virtual` stages each, from
    torch's own action tables (a multi-stage schedule: not gpipe or 1f1b, which run no table)."""
    if schedule in SINGLE:
        raise ValueError(f"{schedule} runs no action table")
    actions = _tables(schedule, pp, microbatches, virtual)
    stages = pp * virtual
    ends: dict[tuple[int, str, int], float] = {}
    clock = dict.fromkeys(actions, 0.0)
    busy = dict.fromkeys(actions, 0.0)
    at = dict.fromkeys(actions, 0)
    left = sum(len(a) for a in actions.values())
    while left:
        moved = False
        for rank, todo in actions.items():
            while at[rank] < len(todo):
                stage, kind, mb = todo[at[rank]]
                needs = _needs(stage, kind, mb, stages)
                done = [_end(ends, need) for need in needs]
                if any(end is None for end in done):
                    break
                clock[rank] = max([clock[rank], *done]) + UNITS[kind]
                busy[rank] += UNITS[kind]
                ends[stage, kind, mb] = clock[rank]
                at[rank] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError(f"{schedule}'s tables at pp={pp}, m={microbatches}, v={virtual} wait on themselves")
    span = max(clock.values())
    return 1 - min(busy.values()) / span


def _needs(stage: int, kind: str, mb: int, stages: int) -> list[tuple[int, str, int]]:
    """What an action waits for: a forward its previous stage's; a backward (full or input) this
    stage's forward and the next stage's backward; a weight pass this stage's input pass."""
    if kind == "F":
        return [(stage - 1, "F", mb)] if stage > 0 else []
    if kind == "W":
        return [(stage, "I", mb)]
    return [(stage, "F", mb)] + ([(stage + 1, "B|I", mb)] if stage < stages - 1 else [])


def _end(ends: dict[tuple[int, str, int], float], need: tuple[int, str, int]) -> float | None:
    stage, kind, mb = need
    if kind == "B|I":
        return ends.get((stage, "B", mb), ends.get((stage, "I", mb)))
    return ends.get(need)


def _tables(schedule: str, pp: int, microbatches: int, virtual: int) -> dict[int, list[tuple[int, str, int]]]:
    """Each rank's compute actions, in order: (stage, F/B/I/W, microbatch); an overlapped pair
    (DualPipeV's forward of one stage beside a backward of the other) as its two passes."""
    from training.parallel.pp import SCHEDULES

    stages = pp * virtual
    held = [SimpleNamespace(group_size=pp, group_rank=0, num_stages=stages, stage_index=i, is_first=i == 0,
                            is_last=i == stages - 1, stage_index_to_group_rank=None, submod=torch.nn.Identity())
            for i in rank_stages(schedule, 0, pp, virtual)]
    order = SCHEDULES[schedule](held, n_microbatches=microbatches).pipeline_order
    tables = {}
    for rank, row in order.items():
        passes = []
        for action in filter(None, row):
            for one in getattr(action, "sub_actions", None) or [action]:
                kind = KINDS.get(one.computation_type.name)
                if kind is not None:
                    passes.append((one.stage_index, kind, one.microbatch_index))
        tables[rank] = passes
    return tables


@functools.lru_cache(maxsize=1024)
def waiting_points(schedule: str, pp: int, microbatches: int,
                   virtual: int) -> tuple[tuple[tuple[float, float, float], ...], ...]:
    """planner/pipeline.waiting_weight_passes read from the tables: the first and the last rank's
    (in flight, weight passes waiting, the last stage's of them) after each of its actions, in
    stage units, the points no other point is above in all three."""
    actions = _tables(schedule, pp, microbatches, virtual)
    last = pp * virtual - 1
    rows = []
    for rank in (0, pp - 1):
        forwarded: set[tuple[int, int]] = set()
        waiting: set[tuple[int, int]] = set()
        points = set()
        for stage, kind, mb in actions[rank]:
            if kind == "F":
                forwarded.add((stage, mb))
            elif kind == "I":
                waiting.add((stage, mb))
            else:  # a full backward or a weight pass ends the microbatch's stay
                forwarded.discard((stage, mb))
                waiting.discard((stage, mb))
            points.add((len(forwarded) / virtual, sum(s > 0 for s, _ in waiting) / virtual,
                        sum(s == last for s, _ in waiting)))
        highest = [p for p in points
                   if not any(q != p and all(a >= b for a, b in zip(q, p, strict=True)) for q in points)]
        rows.append(tuple(sorted(highest)))
    return rows[0], rows[1]


@functools.lru_cache(maxsize=1024)
def weight_pass_shares(schedule: str, pp: int, microbatches: int, virtual: int) -> tuple[float, float]:
    """planner/pipeline.rerun_shares read from the tables: the weight passes of stages past the first
    over the rank's stage runs (microbatches x stages held), on the rank holding the last stage and
    on the busiest other rank."""
    actions = _tables(schedule, pp, microbatches, virtual)
    last = pp * virtual - 1
    head = next(rank for rank, row in actions.items() if any(stage == last for stage, _, _ in row))

    def share(rank: int) -> float:
        return sum(kind == "W" and stage > 0 for stage, kind, _ in actions[rank]) / (microbatches * virtual)

    return share(head), max((share(rank) for rank in actions if rank != head), default=0.0)
