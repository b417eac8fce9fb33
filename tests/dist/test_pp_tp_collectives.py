"""Pipeline stages split by tensor parallelism (pp=2 x tp=2 on four gloo ranks): the collectives
each rank's step runs, counted by torch's profiler as tests/unit/test_loss_parallel.py counts them
at tp alone (a fake process group cannot run a pipeline: its stages exchange shapes and
activations), held against the cost model's; and the split-backward schedules with sequence
parallelism, which train as one process does."""

from __future__ import annotations

import pytest

from tests.dist.test_pipeline_schedules import GPT4, reference
from tests.dist.test_strategies import TOL, run
from tests.helpers import run_world
from training.config import ModelConfig, StrategyConfig
from training.contract.calls import build_model
from training.contract.spec import model_spec
from training.parallel.dims import ParallelDims
from training.parallel.schedules import V_SHAPED
from training.planner.comm import Link, comm_time
from training.planner.pipeline import rerun_shares

COUNTED = ModelConfig(name="gpt", kwargs=dict(vocab_size=512, d_model=64, n_layers=4, n_heads=4, seq_len=16))
"""Four blocks: two a pipeline rank, one a stage under two virtual stages a rank."""
DEEP = ModelConfig(name="gpt", kwargs={**COUNTED.kwargs, "n_layers": 8})
"""Eight: two a stage, so that under ZB-V the rank without the head makes the most calls (with one
a stage it ties with rank 0, which holds the head)."""


def _priced(strategy: StrategyConfig, model_cfg: ModelConfig = COUNTED) -> dict[str, int]:
    """The calls comm_time prices a rank for `strategy` (pp x tp, no data parallelism) on `model_cfg`."""
    from collections import Counter

    from training.planner.anatomy import shape_of

    model = build_model(model_cfg, 0)
    shape = shape_of(model, model_spec(model, model_cfg), model_cfg.kwargs["d_model"], model_cfg.kwargs["seq_len"])
    seen: Counter[str] = Counter()

    class Counting(Link):
        def time(self, collective: str, nbytes: float, n: int, calls: int = 1) -> float:
            if n > 1 and nbytes > 0 and collective in ("all_gather", "reduce_scatter", "all_reduce"):
                seen[collective] += calls
            return super().time(collective, nbytes, n, calls)

    comm_time(shape, "ddp", ParallelDims(pp=strategy.pp, tp=strategy.tp), 2 * strategy.microbatches, 1,
              strategy.microbatches, strategy.precision, lambda c, g: Counting(alpha_s=1e-5, busbw_gbps=1.0, world=2),
              sequence_parallel=strategy.sequence_parallel, recompute=strategy.activation_checkpointing,
              virtual=strategy.pp_virtual_stages, v_shaped=strategy.pp_schedule in V_SHAPED,
              rerun=rerun_shares(strategy.pp_schedule, strategy.pp, strategy.microbatches, strategy.pp_virtual_stages))
    return dict(seen)


def _busiest(ranks: list[dict[str, int]]) -> dict[str, int]:
    """The calls of the rank that makes the most: the one the step waits for, which the plan prices."""
    return max(ranks, key=lambda r: sum(r.values()))


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_each_pipeline_ranks_tp_collectives_are_the_cost_models(schedule, virtual, sequence_parallel):
    """Per rank, stage after stage and microbatch after microbatch: a layer's 4 all-reduces (SP: 6
    all-gathers and 4 reduce-scatters) once a microbatch, and under SP 2 all-gathers a microbatch
    for each stage the rank holds (its output, sent whole, and its input's gradient), whichever
    stage it is. The split head's 4 all-reduces a microbatch are the last stage's; the cost model
    prices the rank that holds it."""
    strategy = StrategyConfig(name="hybrid", pp=2, tp=2, dp_replicate=1, dp_shard=1, microbatches=2,
                              pp_schedule=schedule, pp_virtual_stages=virtual, sequence_parallel=sequence_parallel)
    ranks = run_world("tests.dist.workers:collectives_by_rank", (COUNTED, strategy, 4), world=4, timeout_s=180)
    first, last = ranks[0], ranks[2]  # ranks 0-1 hold stage 0 (and 2), ranks 2-3 the last stage
    assert ranks[1] == first and ranks[3] == last
    priced = _priced(strategy)
    assert last == priced
    head = 4 * 2  # the split head's all-reduces: 3 for the loss and its input's gradient, a microbatch
    if sequence_parallel:
        layers, ends = 2 * 2, 2 * virtual * 2  # a rank's layers, and 2 gathers a stage it holds, x microbatches
        assert first == {"all_gather": 6 * layers + ends, "reduce_scatter": 4 * layers, "all_reduce": 1}
        assert last == dict(first, all_reduce=1 + head)  # + the norms' partial gradients, summed once
    else:
        assert first == {"all_reduce": 4 * 2 * 2} and last == {"all_reduce": 4 * 2 * 2 + head}


@pytest.mark.slow
@pytest.mark.parametrize("schedule,sequence_parallel,checkpointing", [
    ("zero_bubble", True, "none"), ("zbv", True, "none"), ("zero_bubble", True, "full"), ("zbv", False, "full")])
def test_a_split_backwards_weight_pass_collectives_are_the_cost_models(schedule, sequence_parallel, checkpointing):
    """A split backward's weight pass runs each layer's backward again on every stage but the first
    (whose input needs no gradient: its backward runs whole), and what that backward gathers with
    it: under SP 4 all-gathers a layer more; under full checkpointing the recomputed forward too,
    SP 16 all-gathers and 8 reduce-scatters a layer more, TP alone 8 all-reduces. The plan prices
    the busiest rank of each kind (zbv: rank 0 holds stage 0 and the head, rank 2 two middle ones)."""
    strategy = StrategyConfig(name="hybrid", pp=2, tp=2, dp_replicate=1, dp_shard=1, microbatches=2,
                              pp_schedule=schedule, pp_virtual_stages=2, sequence_parallel=sequence_parallel,
                              activation_checkpointing=checkpointing)
    ranks = run_world("tests.dist.workers:collectives_by_rank", (DEEP, strategy, 4), world=4, timeout_s=180)
    assert _priced(strategy, DEEP) == _busiest(ranks)
    layer_runs = 4 * 2  # a rank's four layers, each run a microbatch
    past_first = {0: 2 * 2, 2: 4 * 2}  # those on stages past the first: rank 0 holds stage 0
    head = {0: 8 * (schedule == "zbv"), 2: 8 * (schedule != "zbv")}  # the split head's 4 a microbatch
    full = checkpointing == "full"
    for rank in (0, 2):
        if sequence_parallel:
            expected = {"all_gather": 6 * layer_runs + 2 * 2 * 2 + (16 if full else 4) * past_first[rank],
                        "reduce_scatter": (5 if full else 4) * layer_runs + 8 * full * past_first[rank],
                        "all_reduce": 1 + head[rank]}
        else:  # full checkpointing
            expected = {"all_reduce": 5 * layer_runs + 8 * past_first[rank] + head[rank]}
        assert ranks[rank] == expected, rank


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel,checkpointing", [(True, "none"), (False, "full"), (True, "full")])
def test_dualpipev_runs_again_only_the_weight_passes_its_table_splits(sequence_parallel, checkpointing):
    """DualPipeV splits only some backwards (torch's action table at pp=2, m=4: 2 weight passes past
    the first stage on rank 1 of its 8 stage runs, 1 on rank 0, which holds the head): the plan
    reads the shares from the table and prices the busier rank; each rank makes the calls its
    share of the table says, the head's rank and the other alike."""
    from training.planner.pipeline import rerun_shares

    strategy = StrategyConfig(name="hybrid", pp=2, tp=2, dp_replicate=1, dp_shard=1, microbatches=4,
                              pp_schedule="dualpipev", pp_virtual_stages=2, sequence_parallel=sequence_parallel,
                              activation_checkpointing=checkpointing)
    assert rerun_shares("dualpipev", 2, 4, 2) == (1 / 8, 2 / 8)
    ranks = run_world("tests.dist.workers:collectives_by_rank", (DEEP, strategy, 8), world=4, timeout_s=180)
    assert _priced(strategy, DEEP) == _busiest(ranks)
    layer_runs = 4 * 2 * 2  # microbatches x the V's two stages x two layers a stage
    full = checkpointing == "full"
    for rank, share, head in ((0, 1 / 8, 4 * 4), (2, 2 / 8, 0)):  # rank 0 holds stages 0 and 3 (the head)
        reruns = round(share * layer_runs)
        if sequence_parallel:
            expected = {"all_gather": 6 * layer_runs + 2 * 2 * 4 + (16 if full else 4) * reruns,
                        "reduce_scatter": (5 if full else 4) * layer_runs + 8 * full * reruns,
                        "all_reduce": 1 + head}
        else:  # full checkpointing
            expected = {"all_reduce": 5 * layer_runs + 8 * reruns + head}
        assert ranks[rank] == expected, rank


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv", "dualpipev"])
def test_a_split_backward_schedule_with_tp_and_sp_matches_one_process(schedule):
    """Each stage's output goes on as a tensor of its own, not a view of the gathered one: a split
    backward detaches the stage's output in place after the input pass, which torch refuses on a
    view (it failed so before)."""
    strategy = StrategyConfig(name="hybrid", pp=2, tp=2, dp_replicate=1, dp_shard=1, microbatches=4,
                              pp_schedule=schedule, pp_virtual_stages=2, sequence_parallel=True)
    result = run(strategy, 4, GPT4)
    assert result.dims == [1, 1, 2, 2]
    assert result.losses == pytest.approx(reference().losses, **TOL)
    assert result.ranks_in_sync
