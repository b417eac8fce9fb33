"""The LR range test: the ramp, the smoothing, the suggestion rules, scaling, and a real tiny run."""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from training.lr_finder import RangeTest, lr_at, range_test, scale_lr, smooth, suggest


def test_lr_at_hits_both_endpoints() -> None:
    assert lr_at(0, 50, 1e-6, 1.0) == pytest.approx(1e-6)
    assert lr_at(49, 50, 1e-6, 1.0) == pytest.approx(1.0)


def test_lr_at_is_geometric() -> None:
    lrs = [lr_at(i, 7, 1e-6, 1.0) for i in range(7)]
    ratios = [b / a for a, b in itertools.pairwise(lrs)]
    assert ratios == pytest.approx([10.0] * 6)


def test_smooth_matches_hand_computed_bias_correction() -> None:
    # beta=0.5: raw EMA 0.5, 1.25, 2.125, divided by 1-0.5, 1-0.25, 1-0.125.
    assert smooth([1.0, 2.0, 3.0], beta=0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])


def test_smooth_of_a_constant_is_the_constant() -> None:
    assert smooth([3.7] * 20, beta=0.98) == pytest.approx([3.7] * 20)


def _synthetic_curve() -> tuple[list[float], list[float]]:
    """Flat, a steep tanh fall centred on lr=1e-3, then a quadratic rise past lr=1e-1."""
    log_lr = np.linspace(-6, 0, 121)
    loss = 2.0 - np.tanh(3 * (log_lr + 3)) + 2 * np.maximum(0.0, log_lr + 1) ** 2
    return list(10**log_lr), list(loss)


def test_steepest_finds_the_fall() -> None:
    lrs, loss = _synthetic_curve()
    lr = suggest(lrs, loss, "steepest")
    assert 0.5e-3 <= lr <= 2e-3


def test_steepest_ignores_a_drop_in_the_first_points() -> None:
    lrs, loss = _synthetic_curve()
    # An EMA still settling can make the first points fall sharply; that is not the answer.
    loss[0] += 50.0
    assert 0.5e-3 <= suggest(lrs, loss, "steepest") <= 2e-3


def test_min_div_10_is_a_tenth_of_the_lr_at_the_minimum() -> None:
    lrs, loss = _synthetic_curve()
    assert suggest(lrs, loss, "min_div_10") == lrs[int(np.argmin(loss))] / 10


def test_suggest_works_on_three_points() -> None:
    assert suggest([1e-3, 1e-2, 1e-1], [1.0, 0.5, 0.4], "steepest") in (1e-3, 1e-2)


@pytest.mark.parametrize("n", [0, 2])
def test_suggest_rejects_too_few_points(n: int) -> None:
    with pytest.raises(ValueError, match="too few"):
        suggest([1e-3] * n, [1.0] * n, "steepest")


def test_suggest_rejects_an_unknown_rule() -> None:
    with pytest.raises(ValueError, match="steepest, min_div_10"):
        suggest([1e-3, 1e-2, 1e-1], [1.0, 0.5, 0.4], "valley")


@pytest.mark.parametrize(("rule", "expected"), [("linear", 4e-3), ("sqrt", 2e-3), ("none", 1e-3)])
def test_scale_lr(rule: str, expected: float) -> None:
    assert scale_lr(1e-3, rule, finder_batch=8, target_batch=32) == pytest.approx(expected)


def test_scale_lr_rejects_an_unknown_rule() -> None:
    with pytest.raises(ValueError, match="linear, sqrt, none"):
        scale_lr(1e-3, "cubic", finder_batch=8, target_batch=32)


# --- range_test on a real model --------------------------------------------------------------------


def _mse(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.mse_loss(model(inputs), targets)


Batches = Iterator[tuple[Tensor, Tensor]]
MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]


def _setup(make_optimizer: MakeOptimizer) -> tuple[nn.Module, torch.optim.Optimizer, Batches]:
    """A seeded linear regression, with the optimizer warmed up so it holds state to preserve."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    inputs = torch.randn(64, 4, generator=gen)
    targets = inputs @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(64, 1, generator=gen)
    batches = [(inputs[i : i + 16], targets[i : i + 16]) for i in range(0, 64, 16)]
    optimizer = make_optimizer(model)
    for x, y in batches[:2]:
        optimizer.zero_grad()
        _mse(model, x, y).backward()
        optimizer.step()
    return model, optimizer, itertools.cycle(batches)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _assert_same(a: object, b: object) -> None:
    """Bitwise equality through nested dicts and lists of tensors."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def stepper(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches,
            loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor] = _mse) -> Callable[[], Tensor]:
    """A training step on the next batch, as the finder is given one: its loss before the step."""

    def step() -> Tensor:
        inputs, targets = next(batches)
        loss = loss_fn(model, inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _run(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, max_lr: float, num_iters: int = 30
) -> RangeTest:
    return range_test(
        model, optimizer, stepper(model, optimizer, batches), 1e-5, max_lr, num_iters, beta=0.9, diverge_threshold=4.0
    )


@pytest.mark.parametrize("make_optimizer", [_sgd, _adam])
def test_small_max_lr_records_every_step(make_optimizer: MakeOptimizer) -> None:
    result = _run(*_setup(make_optimizer), max_lr=1e-2)
    assert not result.stopped_early
    assert len(result.lrs) == len(result.losses) == len(result.smoothed) == 30
    assert isinstance(result.lrs, list) and isinstance(result.losses, list)
    assert result.lrs[0] == pytest.approx(1e-5) and result.lrs[-1] == pytest.approx(1e-2)
    assert result.smoothed == pytest.approx(smooth(result.losses, 0.9))
    assert result.best_loss == min(result.smoothed)


def test_huge_max_lr_stops_early() -> None:
    result = _run(*_setup(_sgd), max_lr=1e4)
    assert result.stopped_early
    assert 3 <= len(result.lrs) < 30
    # The diverging point is kept: it is the one that crossed the threshold.
    assert result.smoothed[-1] > 4.0 * result.best_loss
    assert all(math.isfinite(x) for x in result.losses)


@pytest.mark.parametrize("make_optimizer", [_sgd, _adam])
@pytest.mark.parametrize("max_lr", [1e-2, 1e4])
def test_model_and_optimizer_are_restored_bitwise(make_optimizer: MakeOptimizer, max_lr: float) -> None:
    model, optimizer, batches = _setup(make_optimizer)
    model_before = copy.deepcopy(model.state_dict())
    optimizer_before = copy.deepcopy(optimizer.state_dict())
    _run(model, optimizer, batches, max_lr=max_lr)
    _assert_same(model.state_dict(), model_before)
    _assert_same(optimizer.state_dict(), optimizer_before)
    assert optimizer.param_groups[0]["lr"] == 0.01


def test_state_is_restored_when_the_loss_fn_raises() -> None:
    model, optimizer, batches = _setup(_adam)
    model_before = copy.deepcopy(model.state_dict())
    optimizer_before = copy.deepcopy(optimizer.state_dict())
    calls = itertools.count()

    def flaky(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        if next(calls) == 5:
            raise RuntimeError("boom")
        return _mse(model, inputs, targets)

    with pytest.raises(RuntimeError, match="boom"):
        range_test(model, optimizer, stepper(model, optimizer, batches, flaky), 1e-5, 1e-1, 30, beta=0.9,
                   diverge_threshold=4.0)
    _assert_same(model.state_dict(), model_before)
    _assert_same(optimizer.state_dict(), optimizer_before)


def test_a_non_finite_loss_stops_without_recording_it() -> None:
    model, optimizer, batches = _setup(_sgd)
    calls = itertools.count()

    def nan_at_ten(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        loss = _mse(model, inputs, targets)
        return loss * math.nan if next(calls) == 10 else loss

    result = range_test(
        model, optimizer, stepper(model, optimizer, batches, nan_at_ten), 1e-5, 1e-3, 30, beta=0.9, diverge_threshold=4.0
    )
    assert result.stopped_early and len(result.losses) == 10


def test_running_out_of_batches_is_a_clear_error() -> None:
    model, optimizer, _ = _setup(_sgd)
    batches = iter([(torch.zeros(2, 4), torch.zeros(2, 1))] * 3)
    with pytest.raises(ValueError, match="batches ran out after 3 of num_iters=30"):
        _run(model, optimizer, batches, max_lr=1e-2)
