"""A measured step's compute by sample, pass and optimizer step (training/planner/hardware.py
PassCost): measured from timings (stages/rulers.py pass_cost), and what each layout pays."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from training.parallel.dims import ParallelDims
from training.planner.comm import Link
from training.planner.hardware import Hardware, PassCost
from training.planner.predict import predict_layout
from training.planner.shape import Activations, Shape
from training.planner.workload import Workload

SAMPLE_S, PASS_S, OPTIMIZER_S = 0.001, 0.002, 0.003


def test_three_steps_timed_in_turn_give_the_parts_of_a_step():
    """A step that sleeps 2 ms a pass, 1 ms a sample and 3 ms for its optimizer: the step of 4
    samples (9 ms), with a second pass (15 ms) and of 2 samples (7 ms) give back each part."""
    from stages.rulers import pass_cost

    def step(batches: list[int]) -> None:
        time.sleep(sum(PASS_S + SAMPLE_S * n for n in batches) + OPTIMIZER_S)

    got = pass_cost(step, lambda n: n, 4, torch.device("cpu"))
    assert got is not None and got.micro == 4
    sample, fixed_pass, fixed_step = got.parts(0.009 / 4)
    assert (sample, fixed_pass, fixed_step) == pytest.approx((SAMPLE_S, PASS_S, OPTIMIZER_S), abs=5e-4)
    whole = pass_cost(step, lambda n: n, 1, torch.device("cpu"))  # no half of one sample
    assert whole is not None and whole.pass_share == 0
    assert whole.step_share == pytest.approx(OPTIMIZER_S / (PASS_S + SAMPLE_S + OPTIMIZER_S), abs=0.05)


def test_a_step_pays_the_pass_per_microbatch_and_the_optimizer_once():
    """At the measured micro-batch the parts add up to the measured step; microbatches and
    accumulation pay the fixed part of each pass, the optimizer once; TP splits a sample's work, not
    a pass's ops; a pipeline stage runs its share of both."""
    passes = PassCost(micro=4, pass_share=PASS_S / 0.009, step_share=OPTIMIZER_S / 0.009)
    hw = Hardware(1e12, 10**9, {}, {}, seconds_per_sample=0.009 / 4, passes=passes)
    per_sample = hw.seconds_per_sample
    assert hw.compute_s(per_sample, 4, 1, ParallelDims()) == pytest.approx(0.009)
    assert hw.compute_s(per_sample, 8, 2, ParallelDims()) == pytest.approx(2 * (PASS_S + 4 * SAMPLE_S) + OPTIMIZER_S)
    assert hw.compute_s(per_sample, 8, 4, ParallelDims(pp=2)) == pytest.approx(
        (4 * PASS_S + 8 * SAMPLE_S + OPTIMIZER_S) / 2)
    assert hw.compute_s(per_sample, 4, 1, ParallelDims(tp=2)) == pytest.approx(
        PASS_S + 4 * SAMPLE_S / 2 + OPTIMIZER_S / 2)
    # Whatever rescales the per-sample time (checkpointing's recomputation, a calibration's basis)
    # rescales every part.
    assert hw.compute_s(2 * per_sample, 8, 2, ParallelDims()) == pytest.approx(
        2 * (2 * (PASS_S + 4 * SAMPLE_S) + OPTIMIZER_S))
    described = dataclasses.replace(hw, passes=None)  # a preset: FLOPs at a peak, all per sample
    assert described.compute_s(per_sample, 8, 4, ParallelDims(pp=2)) == pytest.approx(8 * per_sample / 2)


def test_a_pipeline_of_more_microbatches_is_predicted_slower_on_a_measured_host():
    """predict_layout on one host's measured parts: a pipeline's stage at 8 microbatches pays 8
    passes where 2 pay 2; the per-sample time alone predicted both alike."""
    shape = Shape(params=1024, layers=2, block_linear_params=0, hidden=64, seq_len=32, heads=4,
                  first_stage_params=0, last_stage_params=0)
    link = {"all_reduce": Link(alpha_s=0.0, busbw_gbps=float("inf"), world=4)}
    passes = PassCost(micro=4, pass_share=PASS_S / 0.009, step_share=OPTIMIZER_S / 0.009)
    hw = Hardware(1e12, 10**9, link, link, seconds_per_sample=0.009 / 4, passes=passes)
    d = ParallelDims(pp=2, dp_replicate=2)

    def compute(k: int, hardware: Hardware) -> float:
        w = Workload(shape, micro_batch=8, grad_accum=1, microbatches=k, precision="fp32", checkpointing="none",
                     tokens_per_sample=32, activations=Activations())
        return predict_layout(w, hardware, "ddp", d, float("inf"), 0.0, 1.0).compute_s

    assert compute(8, hw) - compute(2, hw) == pytest.approx(6 * PASS_S / 2)
    flat = dataclasses.replace(hw, passes=None)
    assert compute(8, flat) == compute(2, flat) == pytest.approx(8 * 0.009 / 4 / 2)
