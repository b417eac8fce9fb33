"""The experts' GEMMs the plan times (training/expert_gemms.py): the rows each expert runs at each
expert-parallel degree and the GEMM an expert is taken as, by hand; what is timed and said (no
processes; timings are not asserted, only what they are of)."""

from __future__ import annotations

import pytest
import torch

from training.expert_gemms import ExpertGemms, expert_width, measure_expert_gemms, routed_rows
from training.planner.shape import Shape


def test_each_expert_runs_ep_times_the_rows_at_ep():
    """gpt-moe-tiny's smoke plan: micro-batch 4 of 32 tokens, 2 of 4 experts a token: 128 x 2 / 4 =
    64 rows an expert on one rank; at ep=2 each rank's 2 experts also get the other rank's 64."""
    assert routed_rows(4 * 32, 2, 4, 1) == 64
    assert routed_rows(4 * 32, 2, 4, 2) == 128
    assert routed_rows(4 * 32, 2, 4, 4) == 256
    assert routed_rows(3, 1, 8, 1) == 1, "at least a row: a GEMM still runs"


def test_an_expert_is_one_gemm_of_its_parameters_over_hidden():
    """The built-in MoE's experts: w1 (E x d x 4d) and w2 (E x 4d x d), 2 layers of 4 at d=64: an
    expert's 2 x 64 x 256 parameters are one 64 x 512 GEMM's weight."""
    shape = Shape(params=0, layers=2, block_linear_params=0, hidden=64, seq_len=32, heads=4, first_stage_params=0,
                  last_stage_params=0, experts=(4, 4), expert_params=2 * 4 * 2 * 64 * 256, top_k=2)
    assert expert_width(shape.expert_params, shape.moe_layers, max(shape.experts), shape.hidden) == 512


def test_the_measurement_times_each_degree_and_stays_within_its_memory():
    gemms = measure_expert_gemms(16, 32, 4, 2, 16, [1, 2, 4], torch.float32, torch.device("cpu"))
    assert gemms is not None
    assert (gemms.degrees, gemms.rows, gemms.width, gemms.hidden) == ([1, 2, 4], [8, 16, 32], 32, 16)
    assert len(gemms.efficiency) == 3 and all(e > 0 for e in gemms.efficiency)
    # One layer of 64 experts of 4096 x 16384 fp32 is 16 GiB: not allocated, None.
    assert measure_expert_gemms(4096, 16384, 64, 8, 1024, [1], torch.float32, torch.device("cpu")) is None


@pytest.mark.parametrize(("efficiency", "noted"), [([0.6, 0.9], True), ([0.9, 0.9], False)])
def test_a_gain_at_a_higher_degree_is_noted_not_predicted(efficiency, noted):
    gemms = ExpertGemms([1, 2], [64, 128], efficiency, 512, 64)
    said = gemms.describe()
    assert said.startswith("experts' GEMMs: ") and f"ep=1 64 rows {efficiency[0]:.2f}" in said
    assert ("at ep=2 the experts may run 1.50x as fast as the prediction says (noted, not added to it)" in said) == noted
