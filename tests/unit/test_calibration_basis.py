"""A calibrated plan predicts on the compute timing its scales were fitted on, per thread count."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.test_costmodel import gpt
from training.parallel.dims import ParallelDims
from training.planner.comm import Link
from training.planner.shape import Activations


def test_a_calibrated_plan_predicts_on_the_timing_its_scales_were_fitted_on(monkeypatch):
    """A plan re-times its compute; on a busy host that timing moves by a third. The scales were
    fitted to components computed from the earlier plans' timing, so a calibrated prediction is
    made on that basis: the fit's own points come back as measured whatever the new timing read."""
    import training.planner.calibration as calibration_fit
    from training.planner.calibration import MeasuredStep, fit_calibration
    from training.planner.hardware import Hardware
    from training.planner.predict import predict_layout
    from training.planner.workload import Workload

    monkeypatch.setattr(calibration_fit, "PRIOR_WEIGHT", 0.0)  # an exact fit: the basis is what is held here
    w = Workload(gpt()[0].anatomy.shape, micro_batch=8, grad_accum=1, microbatches=1, precision="fp32", checkpointing="none",
                 tokens_per_sample=64, activations=Activations(1e3))
    link = {"all_reduce": Link(alpha_s=1e-4, busbw_gbps=0.5, world=2)}
    earlier = Hardware(1e12, 10**9, link, link, seconds_per_sample=1e-3)
    layouts = [("ddp", ParallelDims(dp_replicate=2)), ("zero3", ParallelDims(dp_shard=2)), ("ddp", ParallelDims())]

    def predicted(hw, flavour, d, cal=None):
        return predict_layout(w, hw, flavour, d, float("inf"), 0.0, 1.0, cal)

    def measured(p):  # the host: compute 1.3x slower, communication 2x
        return 1.3 * p.compute_s + 2.0 * p.exposed_comm_s

    points = [MeasuredStep(f, d.world_size, (p := predicted(earlier, f, d)).components, measured(p)) for f, d in layouts]
    cal = fit_calibration(points)
    assert cal.basis(1) == pytest.approx(1e-3)
    busy_moment = dataclasses.replace(earlier, seconds_per_sample=1.5e-3)
    for (f, d), point in zip(layouts, points, strict=True):
        assert predicted(cal.on_basis(busy_moment), f, d, cal).step_time_s == pytest.approx(point.measured_step_s)
        assert predicted(busy_moment, f, d, cal).step_time_s > 1.2 * point.measured_step_s  # what it did before
    # Points recorded before the basis was: the plan's own timing, as before.
    old = fit_calibration([dataclasses.replace(p, predicted=dataclasses.replace(p.predicted, seconds_per_sample=0.0))
                           for p in points])
    assert old.bases == () and old.on_basis(busy_moment) == busy_moment
    # Each basis is its thread count's: a run alone times with every core (here 2 threads, 0.6 ms
    # a sample), a rank of several with one; a plan with 2 threads predicts on the first alone,
    # and one with a count no point was timed with on its own timing.
    alone = dataclasses.replace(earlier, seconds_per_sample=0.6e-3, threads_per_device=2)
    both = fit_calibration([*points, MeasuredStep("ddp", 1, predicted(alone, "ddp", ParallelDims()).components, 5e-3)])
    assert [t for t, _ in both.bases] == [1, 2] and [s for _, s in both.bases] == pytest.approx([1e-3, 0.6e-3])
    assert both.on_basis(dataclasses.replace(alone, seconds_per_sample=0.9e-3)).seconds_per_sample == pytest.approx(0.6e-3)
    four = dataclasses.replace(earlier, threads_per_device=4, seconds_per_sample=0.2e-3)
    assert both.on_basis(four) == four
