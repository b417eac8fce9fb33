"""The cost model's pipeline bubble against the action tables torch's own schedules execute
(training/parallel/bubble.py plays them out, a forward, input- and weight-gradient pass one unit
each): the closed forms equal the tables once the pipeline is full, and below that the tables are
what the cost model reads, checked here against timelines worked by hand."""

from __future__ import annotations

import pytest

from training.parallel.bubble import table_bubble
from training.parallel.schedules import microbatches_problem
from training.planner.pipeline import pipeline_bubble

FULL = [(schedule, pp, m) for schedule, per_pp in
        [("interleaved_1f1b", (1, 3)), ("zero_bubble", (1, 3)), ("zbv", (2, 3)), ("dualpipev", (2, 3))]
        for pp in (2, 3, 4, 8) for m in range(per_pp[0] * pp, per_pp[1] * pp + 1, max(1, pp // 2))
        if microbatches_problem(schedule, pp, 2, m) is None]


@pytest.mark.parametrize(("schedule", "pp", "m"), FULL)
def test_the_closed_forms_are_torchs_tables_once_the_pipeline_is_full(schedule, pp, m):
    """(p − 1) / (v·m + p − 1) for interleaved 1F1B, a third of the idle time for the zero-bubble
    family: what torch's tables give with m >= p microbatches (m >= 2p for a V)."""
    from training.parallel.schedules import SPLIT_BACKWARD

    idle = (pp - 1) / (3 if schedule in SPLIT_BACKWARD else 1)
    assert table_bubble(schedule, pp, m, 2) == pytest.approx(idle / (2 * m + idle), rel=1e-12)
    assert pipeline_bubble(pp, m, schedule, 2) == pytest.approx(idle / (2 * m + idle), rel=1e-12)


@pytest.mark.parametrize(("schedule", "pp", "m", "virtual", "expected"), [
    # One microbatch relayed through 4 stages on 2 ranks: 4 forwards then 4 backwards of 2 units,
    # one after the other (12 units); each rank computes 2 + 4 of them.
    ("interleaved_1f1b", 2, 1, 2, 6 / 12),
    # pp=4, v=2, m=2: each loop of 4 stages has 2 microbatches in it, so a rank's second stage
    # waits for the loop; the span is 3 (v·p + m − 1) = 27 units, a rank busy 3·v·m = 12.
    ("interleaved_1f1b", 4, 2, 2, 15 / 27),
    # ZB-V with one microbatch on 2 ranks (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2):
    # forwards 0-1-2-3 take 4 units, input gradients 3-2-1-0 four more, each weight pass right after
    # its input pass on the same rank, so rank 0's last (stage 0's) ends at 10; each rank computes 6.
    ("zbv", 2, 1, 2, 4 / 10),
])
def test_below_a_full_pipeline_the_cost_model_reads_torchs_tables(schedule, pp, m, virtual, expected):
    assert table_bubble(schedule, pp, m, virtual) == pytest.approx(expected, rel=1e-12)
    assert pipeline_bubble(pp, m, schedule, virtual) == pytest.approx(expected, rel=1e-12)
    closed = (pp - 1) / (1 if schedule == "interleaved_1f1b" else 3)
    assert expected > closed / (virtual * m + closed), "the closed form would promise less idle time"


def test_a_schedule_without_a_table_is_refused():
    with pytest.raises(ValueError, match="1f1b runs no action table"):
        table_bubble("1f1b", 4, 8, 1)


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv", "dualpipev"])
def test_the_weight_passes_waiting_at_each_ranks_peak_are_torchs_tables(schedule):
    """planner/pipeline.waiting_weight_passes' closed forms against torch's own action tables
    played in each rank's order (bubble.waiting_points), over pp 2-8, full pipelines, v 2-4."""
    from training.parallel.bubble import waiting_points
    from training.planner.pipeline import waiting_weight_passes

    for pp in (2, 3, 4, 8):
        for m in (pp, 2 * pp, 4 * pp):
            for v in ((2, 3, 4) if schedule == "zero_bubble" else (2,)):
                if m < pp * (2 if schedule != "zero_bubble" else 1):
                    continue
                closed = tuple(tuple(sorted(tuple(at) for at in rank)) for rank in waiting_weight_passes(schedule, pp, m, v))
                assert closed == waiting_points(schedule, pp, m, v), (schedule, pp, m, v)


def test_the_weight_passes_waiting_by_hand():
    """pp=2, m=4, v=2, in stage units: interleaved zero bubble's first rank peaks with 2 stages in
    flight, one chunk (half a stage) waiting; its last with 2 in flight, both its chunks' waiting,
    the last stage's (2 microbatches). ZB-V's bottom rank also peaks with 1.5 in flight, all waiting.
    A schedule that doesn't split backward waits for nothing."""
    from training.planner.pipeline import Waiting, waiting_weight_passes

    assert waiting_weight_passes("zero_bubble", 2, 4, 2) == ((Waiting(2, 0.5, 0),), (Waiting(2, 1.0, 2),))
    assert waiting_weight_passes("zbv", 2, 4, 2)[1] == (Waiting(2, 0.5, 0), Waiting(1.5, 1.5, 0))
    assert waiting_weight_passes("1f1b", 2, 4) == ((Waiting(2, 0, 0),), (Waiting(1, 0, 0),))
