"""A pipeline schedule in closed form: the bubble, and the microbatches each stage keeps in flight.

GPipe and 1F1B idle (p - 1) / (m + p - 1) of the step (Narayanan et al. 2021); interleaving
divides that by the stages per rank; the zero-bubble schedules fill it with the weight-gradient
half of backward. Held against torch's own schedule tables in training/parallel/bubble.py.
"""

from __future__ import annotations

from training.parallel.schedules import SINGLE, V_SHAPED

ZERO_BUBBLE = ("zero_bubble", "zbv", "dualpipev")
"""Schedules that split backward into input- and weight-gradient passes and fill the bubble with
the weight passes (Qi et al. 2023, 2024; DeepSeek-V3's DualPipe)."""


def pipeline_bubble(pp: int, microbatches: int, schedule: str = "1f1b", virtual: int = 1) -> float:
    """Idle fraction of a step. GPipe and 1F1B: (p − 1) / (m + p − 1) (Narayanan et al. 2021);
    interleaved 1F1B with v stages per rank: the warm-up shrinks by v, (p − 1) / (v·m + p − 1) (same
    paper). The zero-bubble family: ZB-H1's bubble, a third of its interleaved base with equal
    forward, input- and weight-gradient times (Qi et al. 2023). These closed forms are torch's own
    action tables played out (training/parallel/bubble.py) once the pipeline is full: m >= p for a
    looped schedule, m >= 2p for a V; below that the tables themselves are read (a looped schedule
    then waits a loop per microbatch: pp=4, v=2, m=2 is 0.56 idle, not 0.43). No schedule was timed
    on GPUs here."""
    if pp <= 1:
        return 0.0
    filled = microbatches >= pp * (2 if schedule in V_SHAPED else 1)
    if schedule not in SINGLE and not filled:
        from training.parallel.bubble import table_bubble

        return table_bubble(schedule, pp, microbatches, virtual)
    idle = (pp - 1) / (3 if schedule in ZERO_BUBBLE else 1)
    return idle / (virtual * microbatches + idle)


def in_flight(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> tuple[float, float]:
    """Microbatches whose activations the first and the last pipeline rank hold at their peak, in
    units of one microbatch through one stage of a one-stage-per-rank pipeline (as measured by
    training/parallel/inflight.py at pp=2, m=4): GPipe m and m; 1F1B min(m, p) and 1; interleaved
    1F1B Megatron's min(m, p)·(1 + (p − 1)/(p·v)) and, as measured, 1 + (p − 1)/p; DualPipeV p + 1
    (DeepSeek-V3) on both; torch 2.13's zero-bubble and ZB-V p + 1 on the first rank and, as
    measured, every microbatch on the last (their weight passes keep saved tensors to the end of
    the step)."""
    m = microbatches
    if schedule == "gpipe":
        return m, m
    if schedule == "interleaved_1f1b":
        return min(m, pp) * (1 + (pp - 1) / (pp * virtual)), 1 + (pp - 1) / pp
    if schedule == "dualpipev":
        return min(m, pp + 1), min(m, pp + 1)
    if schedule in ZERO_BUBBLE:
        return min(m, pp + 1), m
    return min(m, pp), 1
