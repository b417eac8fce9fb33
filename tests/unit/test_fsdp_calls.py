"""FSDP2's collectives in the trainer's step, counted as rank 0 of a fake process group runs it,
are the ones the cost model prices (planner/comm.py comm_time): a call it misses is a latency it
never charges, which on a CPU host's gloo is most of what a small model's collective costs."""

from __future__ import annotations

import pytest

from tests.unit.test_loss_parallel import _link
from tests.unit.test_parallel_options import _step_all_reduces
from training.config import StrategyConfig
from training.contract.calls import build_model
from training.contract.spec import model_spec
from training.parallel.dims import ParallelDims
from training.planner.anatomy import shape_of
from training.planner.comm import comm_time, fsdp_units


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_the_trainers_fsdp_collectives_are_the_ones_the_cost_model_prices(compose_cfg, name):
    """gpt-tiny (2 blocks and the root: 3 units) under FSDP 2, one whole step with the clip: an
    all-gather per unit in forward; under ZeRO-3 one per block again in backward, the root staying
    gathered (training/parallel/fsdp.py); a reduce-scatter per unit; the clip's one all-reduce."""
    cfg = compose_cfg("model=gpt-tiny", "tracking=none").model
    strategy = StrategyConfig(name=name)
    gathers, scatters, reduces = (sum(_step_all_reduces(cfg, strategy, 2, c))
                                  for c in ("all_gather_single", "reduce_scatter_single", "all_reduce"))
    model = build_model(cfg, 0)
    shape = shape_of(model, model_spec(model, cfg), 64, 64)
    units = fsdp_units(shape)
    assert units == 3
    assert gathers == (2 * units - 1 if name == "zero3" else units)
    assert (scatters, reduces) == (units, 1)
    comm = comm_time(shape, name, ParallelDims(dp_shard=2), 2, 1, 1, "fp32", _link, clip=True)
    assert comm.calls == gathers + scatters + reduces
