"""Data dealing, data sources, models, schedule, memory and FLOP counting; no processes."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import default_collate

from training.config import ModelConfig, StrategyConfig
from training.contract.calls import batch_loss, build_model, model_loss
from training.contract.spec import model_spec
from training.data import (
    GlobalBatches,
    StepSampler,
    blobs,
    first_samples,
    markov,
    python_text,
    python_text_files,
)
from training.loop import lr_lambda
from training.memory import SavedActivations, state_bytes
from training.planner.anatomy import measure_anatomy

TINY = ModelConfig(kwargs=dict(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2))


def _rows(micro: int, accum: int, world: int, step: int) -> list[torch.Tensor]:
    deal = [GlobalBatches(100, micro, accum, r, world, seed=3) for r in range(world)]
    return [d.rows(step, a) for d in deal for a in range(accum)]


@pytest.mark.parametrize(("micro", "accum", "world"), [(8, 1, 1), (4, 1, 2), (2, 2, 2), (1, 2, 4)])
def test_global_batch_is_the_same_rows_whatever_the_split(micro, accum, world):
    for step in (0, 1, 12):  # step 12 straddles an epoch boundary of the 100-row pool
        rows = torch.cat(_rows(micro, accum, world, step))
        if step < 12:  # within an epoch no row repeats; across the boundary one may
            assert len(set(rows.tolist())) == len(rows) == 8, "ranks and micro-batches are disjoint"
        assert sorted(rows.tolist()) == sorted(torch.cat(_rows(8, 1, 1, step)).tolist())


def test_the_step_sampler_reads_each_steps_micro_batches_in_order():
    deal = GlobalBatches(100, 2, 2, 1, 2, seed=3)
    batches = list(StepSampler(deal, first=3, steps=5))
    assert batches == [deal.rows(s, a).tolist() for s in (3, 4) for a in (0, 1)]


def test_built_in_data_sets_are_seeded_and_shaped():
    for data in (markov(32, 16, 64, seed=1), python_text(32, 16)):
        x, y = first_samples(data, 32)
        assert x.shape == y.shape == (32, 16) and len(data) == 32
        assert torch.equal(x[:, 1:], y[:, :-1]), "targets are the inputs shifted by one"
    assert torch.equal(first_samples(markov(32, 16, 64, seed=1), 32)[0], first_samples(markov(32, 16, 64, seed=1), 32)[0])
    x, y = first_samples(blobs(50, 5, 3, seed=1), 50)
    assert x.shape == (50, 5) and int(y.max()) < 3


def test_text_is_pythons_own_source():
    x, _ = first_samples(python_text(4, 32), 4)
    first = python_text_files()[0].read_bytes()[:32]
    assert bytes(x[0].tolist()) == first


def test_markov_tokens_have_few_successors_even_with_a_large_vocabulary():
    for vocab in (16, 32000):
        x, y = first_samples(markov(256, 32, vocab, branching=3), 256)
        successors = {}
        for a, b in zip(x.flatten().tolist(), y.flatten().tolist(), strict=True):
            successors.setdefault(a, set()).add(b)
        assert max(len(s) for s in successors.values()) <= 3


def test_gpt_starts_near_uniform_loss():
    model = build_model(TINY, seed=0)
    x, y = batch = first_samples(markov(8, 16, 64), 8)
    assert model(x).shape == (8, 16, 64)
    assert batch_loss(model, batch, model_loss(TINY)).item() == pytest.approx(math.log(64), rel=0.05)


def test_schedule_warms_up_then_decays_to_a_tenth():
    f = lr_lambda(warmup_steps=4, total_steps=20, schedule="cosine")
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(20) == pytest.approx(0.1)
    assert lr_lambda(2, 20, "constant")(10) == 1.0


def test_memory_and_flops_are_counted_from_the_model():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))
    x, y = torch.randn(4, 10), torch.randint(3, (4,))
    opt = torch.optim.Adam(model.parameters())
    with SavedActivations(model) as saved:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    params, grads, optim = state_bytes(model, opt)
    n = sum(p.numel() for p in model.parameters())
    assert params == grads == 4 * n and optim >= 8 * n
    assert saved.bytes >= 4 * 4 * 20, "at least the hidden activations are saved"
    cfg = ModelConfig(target="torch.nn.Linear")
    anatomy = measure_anatomy(model, model_spec(model, cfg), model_loss(cfg), (x, y)).anatomy
    # fwd 2N + bwd 4N per weight, except the first layer, which needs no gradient of its input.
    assert anatomy.flops_per_sample == 4 * 10 * 20 + 6 * 20 * 3
    assert anatomy.tokens_per_sample == 1 and anatomy.shape.params == n


def test_strategy_overheads_are_measured_on_a_one_rank_group_that_is_then_gone():
    """The real wrappers (DDP, ZeroRedundancyOptimizer, FSDP2, DTensor TP) on a one-member gloo
    group, FSDP2 on a fake group of two (on one rank it skips its all-gathers and their copies:
    here it runs them): FSDP2's hooks, copies and DTensor optimizer cost a gpt-tiny step time on
    any machine; the bare model's parameters are left untouched (the copies are wrapped, not it)."""
    from unittest import mock

    import torch.distributed as dist

    from training.overhead import measure_overheads

    torch.set_num_threads(1)
    cfg = ModelConfig()
    model = build_model(cfg, seed=0)
    batch = default_collate([markov(8, 64, 256)[i] for i in range(8)])
    gathers, plain = [], dist.all_gather_single
    with mock.patch.object(dist, "all_gather_single",
                           lambda *a, **k: gathers.append(dist.get_world_size()) or plain(*a, **k)):
        result = measure_overheads(model, cfg, model_loss(cfg), batch, ["ddp", "zero1", "zero3", "tp", "pp"],
                                   torch.device("cpu"), grad_clip=1.0, base=StrategyConfig(), rounds=2, steps=2)
    assert gathers and set(gathers) == {2}, "FSDP2's all-gathers ran, on the group of two"
    assert set(result.seconds) == {"ddp", "zero1", "zero3", "tp"}
    assert result.seconds["zero3"] > 0 and result.bare_step_s > 0
    assert all(v >= 0 for v in result.seconds.values())
    assert "pp" in result.not_measured
    assert not dist.is_initialized()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_expert_parallelisms_dispatch_is_measured_for_a_mixture_of_experts():
    """A MoE GPT's experts split by the real apply_ep over a one-rank expert group: the dispatch's
    host work (grouping by expert, counts read back, regrouping, the local all-to-all copies) timed
    against the bare step, under its own key; the model measured keeps its own experts."""
    import torch.distributed as dist

    from training.overhead import measure_overheads
    from training.planner.hardware import EXPERT_DISPATCH

    torch.set_num_threads(1)
    cfg = ModelConfig(kwargs=dict(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4, n_experts=4, top_k=2))
    model = build_model(cfg, seed=0)
    batch = default_collate([markov(8, 32, 256)[i] for i in range(4)])
    result = measure_overheads(model, cfg, model_loss(cfg), batch, ["ddp"], torch.device("cpu"), grad_clip=1.0,
                               base=StrategyConfig(), rounds=2, steps=2)
    assert set(result.seconds) == {"ddp", EXPERT_DISPATCH}
    assert result.seconds[EXPERT_DISPATCH] > 0, "measured: about 0.8 of gpt-moe-tiny's bare step on this host"
    assert not dist.is_initialized()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert not any(type(m.forward).__name__ == "ExpertParallel" for m in model.modules() if "forward" in vars(m))


def test_step_marks_time_each_step_on_the_host(monkeypatch):
    """On CPU a mark is the host clock at each step's start: the intervals are the differences
    (a scripted clock, so a loaded host can't move the answer)."""
    from training import loop

    clock = iter([10.0, 10.5, 10.75, 12.0])
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
    marks = loop.StepMarks(torch.device("cpu"))
    for _ in range(4):
        marks.mark()
    assert marks.intervals() == [0.5, 0.25, 1.25]
