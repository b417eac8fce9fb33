"""A pipeline schedule in closed form: the bubble, and the microbatches each stage keeps in flight.

GPipe and 1F1B idle (p - 1) / (m + p - 1) of the step (Narayanan et al. 2021); interleaving
divides that by the stages per rank; the zero-bubble schedules (SPLIT_BACKWARD) fill it with the
weight-gradient half of backward (Qi et al. 2023, 2024; DeepSeek-V3's DualPipe).
Held against torch's own schedule tables in training/parallel/bubble.py.
"""

from __future__ import annotations

from typing import NamedTuple

from training.parallel.schedules import SINGLE, SPLIT_BACKWARD, V_SHAPED


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
    if schedule not in SINGLE and not _full(schedule, pp, microbatches):
        from training.parallel.bubble import table_bubble

        return table_bubble(schedule, pp, microbatches, virtual)
    idle = (pp - 1) / (3 if schedule in SPLIT_BACKWARD else 1)
    return idle / (virtual * microbatches + idle)


def rerun_shares(schedule: str, pp: int, microbatches: int, virtual: int) -> tuple[float, float]:
    """The share of a rank's layer runs whose backward a split backward's weight pass runs again (with
    what it gathers or recomputes: planner/comm.py), on the rank holding the head and on the busiest
    other: every weight pass of a stage past the first (the first stage's input needs no gradient,
    and its backward runs whole). Interleaved zero bubble splits every microbatch, its head on the
    last rank; ZB-V too, its head on rank 0 beside stage 0; DualPipeV only some (torch's action
    tables, training/parallel/bubble.py). Counted on the trainer at pp=2 x tp=2:
    tests/dist/test_pp_tp_collectives.py."""
    if schedule not in SPLIT_BACKWARD or pp <= 1:
        return 0.0, 0.0
    if schedule == "zero_bubble":
        return 1.0, 1.0 if pp > 2 else (virtual - 1) / virtual
    if schedule == "zbv":
        return 0.5, 1.0
    from training.parallel.bubble import weight_pass_shares

    return weight_pass_shares(schedule, pp, microbatches, virtual)


def _full(schedule: str, pp: int, microbatches: int) -> bool:
    """Whether the pipeline fills (m >= p looped, m >= 2p a V), where the closed forms equal torch's tables."""
    return microbatches >= pp * (2 if schedule in V_SHAPED else 1)


class InFlightCounts(NamedTuple):
    """Microbatches in flight at a schedule's peak, in units of one microbatch through one stage
    of a one-stage-per-rank pipeline."""

    first: float
    """On the first rank."""
    last: float
    """On the last rank."""
    ends: float
    """Of the last stage's own part (the head, the loss: what is saved outside the blocks), on the
    rank that holds it: the last rank, or the first under a V."""


def in_flight(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> InFlightCounts:
    """The schedule's microbatches in flight, as counted on real runs by
    training/parallel/inflight.py (pp=2, m=4 and pp=4, m=8; k = min(m, p)):

    - GPipe: m on every rank, the last stage's part too.
    - 1F1B: p − r on rank r (k and 1); the last stage backwards each microbatch it forwards.
    - interleaved 1F1B with v stages a rank: (2(p − r − 1) + (v − 1)p + 1)/v, Megatron's warm-up
      plus one, a chunk being 1/v of a stage: k·(1 + (p − 1)/(p·v)) on the first rank (Narayanan
      et al.) and k − (k − 1)/v on the last; its last stage holds one.
    - torch 2.13's zero-bubble: k on every rank (the ZB papers' "as 1F1B's first rank", balanced),
      the last stage's part of k (their weight passes wait).
    - ZB-V: k on every rank; DualPipeV p + 1/2 (2p + 1 chunks of half a stage); the V's last stage,
      on the first rank, holds one.

    Earlier counts here (zero bubble's last rank holding every microbatch, DualPipeV p + 1) were the
    counting probe's own doing: its saved-tensor hook kept graphs alive (training/memory.py packed)."""
    m = microbatches
    k = min(m, pp)
    if schedule == "gpipe":
        return InFlightCounts(m, m, m)
    if schedule == "interleaved_1f1b":
        return InFlightCounts(k * (1 + (pp - 1) / (pp * virtual)), k - (k - 1) / virtual, 1)
    if schedule == "dualpipev":
        return InFlightCounts(pp + 0.5, pp + 0.5, 1)
    if schedule == "zero_bubble":
        return InFlightCounts(k, k, k)
    if schedule == "zbv":
        return InFlightCounts(k, k, 1)
    return InFlightCounts(k, 1, 1)


def receive_buffers(schedule: str, microbatches: int, virtual: int = 1) -> tuple[float, float]:
    """Microbatch-sized receive buffers torch's PipelineStage allocates once for the step's every
    microbatch (a stage's input from the stage before, unless it is the first; its output's
    gradient from the stage after, unless it is the last), on the first rank and on the rank
    holding the last stage. Stages next to each other on one rank (the bottom of a V) pass tensors
    without them. One stage a rank: m on the first, m on the last; v looped stages: (2v − 1)·m on
    each; a V: 2m on its first rank, which holds both ends (4m on the others, not counted here)."""
    m = microbatches
    if schedule in V_SHAPED:
        return 2 * m, 2 * m
    return (2 * virtual - 1) * m, (2 * virtual - 1) * m


class Waiting(NamedTuple):
    """A point a split-backward schedule's rank may peak at: its microbatches in flight and, of
    them, those whose weight pass waits (input gradients done), in units of one microbatch through
    one stage of a one-stage-per-rank pipeline."""

    in_flight: float
    waiting: float
    """Weight passes waiting, the first stage's not counted: torch runs the first stage's whole
    backward in its weight pass (its input needs no gradient), so it holds nothing meanwhile."""
    waiting_ends: float
    """Of the waiting passes, the last stage's, in microbatches: each also keeps the gradients of
    the head's and the final norm's outputs (a language model's logits)."""


def waiting_weight_passes(schedule: str, pp: int, microbatches: int,
                          virtual: int = 1) -> tuple[tuple[Waiting, ...], tuple[Waiting, ...]]:
    """The points the first rank and the last rank (pp − 1) may peak at under a split-backward
    schedule (SPLIT_BACKWARD); one point, nothing waiting, for the others. torch's input-gradient
    pass (stage_backward_input) keeps, until the weight pass, the gradient of each op's output
    where a weight meets the activations (a linear's, a norm's), so a waiting pass holds those
    beside its activations. Read from torch's own action tables, played in each rank's order
    (training/parallel/bubble.py waiting_points), once the pipeline is full (m >= p looped,
    m >= 2p a V; tests/unit/test_pipeline_bubble.py holds these to the tables):

    - zero_bubble: rank r peaks with its k·v chunks in flight, r + 1 of them waiting; the last
      rank's are all the last stage's.
    - zbv: every rank with 2p chunks in flight, one waiting (rank 0's: the last stage's); rank
      p − 1 also with 2p − 1 in flight, all waiting (the bottom of the V, its backwards done last).
    - dualpipev: rank 0 with 2p in flight, one waiting (the last stage's), or 2p + 1, none; rank
      p − 1 with 2p + 1 in flight, none, or p, all waiting.
    Below a full pipeline the tables themselves are read."""
    m, p, v = microbatches, pp, virtual
    if schedule not in SPLIT_BACKWARD or p <= 1:
        held = in_flight(schedule, p, m, v)
        return (Waiting(held.first, 0.0, 0.0),), (Waiting(held.last, 0.0, 0.0),)
    if not _full(schedule, p, m):
        from training.parallel.bubble import waiting_points

        first, last = waiting_points(schedule, p, m, v)
        return tuple(Waiting(*at) for at in first), tuple(Waiting(*at) for at in last)
    if schedule == "zero_bubble":
        return (Waiting(p, 1 / v, 0),), (Waiting(p, p / v, p),)
    if schedule == "zbv":
        return (Waiting(p, 0.5, 1),), (Waiting(p, 0.5, 0), Waiting(p - 0.5, p - 0.5, 0))
    return (Waiting(p, 0.5, 1), Waiting(p + 0.5, 0, 0)), (Waiting(p + 0.5, 0, 0), Waiting(p / 2, p / 2, 0))
