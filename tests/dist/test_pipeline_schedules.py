"""Pipeline schedules with several stages per rank (interleaved 1F1B, interleaved zero bubble, ZB-V,
DualPipeV) on real gloo ranks: the same loss curve as one process, composed with FSDP, resumed from
a checkpoint; and the microbatches each schedule keeps in flight on the rank holding stage 0."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest

from tests.dist.test_strategies import GPT, TOL, run, train_inputs
from tests.helpers import run_world
from training.config import ModelConfig, StrategyConfig

GPT4 = dataclasses.replace(GPT, kwargs={**GPT.kwargs, "n_layers": 4})
"""Four blocks: pp=2 x 2 virtual stages, one block a stage."""
SCHEDULES = {
    "interleaved_1f1b": StrategyConfig(name="pp", pp_schedule="interleaved_1f1b", pp_virtual_stages=2, microbatches=4),
    "zero_bubble": StrategyConfig(name="pp", pp_schedule="zero_bubble", pp_virtual_stages=2, microbatches=4),
    "zbv": StrategyConfig(name="pp", pp_schedule="zbv", pp_virtual_stages=2, microbatches=4),
    "dualpipev": StrategyConfig(name="pp", pp_schedule="dualpipev", pp_virtual_stages=2, microbatches=4),
}


def reference(model: ModelConfig = GPT4):
    return run(StrategyConfig(name="ddp"), 1, model)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_each_schedule_at_pp2_matches_one_process(name):
    result = run(SCHEDULES[name], 2, GPT4)
    assert result.world_size == 2 and result.dims[3] == 2
    assert result.losses == pytest.approx(reference().losses, **TOL)
    assert result.ranks_in_sync


@pytest.mark.parametrize("name", ["gpipe", "interleaved_1f1b"])
def test_accumulation_over_schedule_steps_matches_the_larger_micro_batch(name):
    """Two micro-batches of 4 per optimizer step, each its own step of the schedule: one process's
    curve (the schedule must not divide the first one's gradients again at the second)."""
    strategy = SCHEDULES.get(name) or StrategyConfig(name="pp", pp_schedule=name, microbatches=4)
    result = run(strategy, 2, GPT4, grad_accum=2)
    assert result.micro_batch == 4 and result.grad_accum == 2
    assert result.losses == pytest.approx(reference().losses, **TOL)


def test_a_rank_of_two_virtual_stages_holds_its_two_chunks():
    """Rank 0 of interleaved pp=2 x 2 holds stages 0 and 2: the embeddings and blocks 0 and 2,
    neither the final norm nor the head; its byte counts see both chunks."""
    one, two = reference(), run(SCHEDULES["interleaved_1f1b"], 2, GPT4)
    g = GPT4.kwargs
    d = g["d_model"]
    block = 4 * (4 * d * d + 2 * d * 4 * d) + 4 * 4 * d
    head_and_norm = 4 * (d * g["vocab_size"] + 2 * d)
    assert two.param_bytes == one.param_bytes - head_and_norm - 2 * block
    assert two.grad_bytes == two.param_bytes and two.optim_bytes == 2 * two.param_bytes


def _run_hf(cfg, strategy: StrategyConfig, world: int):
    from stages.train import TrainInputs
    from training.config import TrainConfig

    train = TrainConfig(steps=6, global_batch=8, lr=1e-2, log_every=3, timing_warmup=2, warmup_steps=2,
                        schedule="constant", grad_clip=0.5)
    inputs = TrainInputs(train, cfg.model, cfg.data, strategy, seed=0)
    return run_world("tests.dist.workers:train_any", (inputs, tempfile.mkdtemp()), world=world, timeout_s=120)


@pytest.mark.slow
def test_a_hugging_face_llama_interleaved_over_its_pp_plan_matches_one_process(compose_cfg):
    """model=hf-llama at four layers, cut by its config's base_model_pp_plan into pp=2 x 2 stages:
    each rank's two chunks run Hugging Face's own forward with the parts they lack skipped."""
    cfg = compose_cfg("model=hf-llama", "model.num_hidden_layers=4", "data.num_samples=256", "data.seq_len=16",
                      "tracking=none")
    one, two = (_run_hf(cfg, strategy, world) for strategy, world in
                ((StrategyConfig(name="ddp"), 1), (SCHEDULES["interleaved_1f1b"], 2)))
    assert two.losses == pytest.approx(one.losses, **TOL)
    assert two.ranks_in_sync and one.losses[-1] < one.losses[0]


@pytest.mark.slow
def test_interleaved_1f1b_composed_with_fsdp_on_four_ranks_matches_one_process():
    strategy = StrategyConfig(name="hybrid", dp_shard=2, pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
    result = run(strategy, 4, GPT4)
    assert result.dims == [1, 2, 1, 2]
    assert result.losses == pytest.approx(reference().losses, **TOL)
    assert result.ranks_in_sync


@pytest.mark.slow
def test_an_interleaved_run_killed_mid_way_resumes_from_its_checkpoint(tmp_path):
    """Saved under the whole model's names: the resumed run ends as the uninterrupted one."""
    from pipelines.launchers.base import StageFailed

    strategy = SCHEDULES["interleaved_1f1b"]
    steps, every, kill = 10, 4, 6
    ckpt, marker = tmp_path / "ckpt", tmp_path / "killed"
    inputs = (train_inputs(strategy, GPT4, steps=steps, ckpt_every=every), str(ckpt), str(marker), kill)
    with pytest.raises(StageFailed, match="rank 1 was killed by SIGKILL"):
        run_world("tests.dist.workers:train_crash_once", inputs, world=2)
    resumed = run_world("tests.dist.workers:train_crash_once", inputs, world=2)
    clean = run_world("tests.dist.workers:train_any", (inputs[0], tempfile.mkdtemp()), world=2)
    assert resumed.resumed_from == every and len(resumed.losses) == steps
    assert resumed.losses == pytest.approx(clean.losses, **TOL)


GPT8 = dataclasses.replace(GPT, kwargs={**GPT.kwargs, "n_layers": 8})
"""Eight blocks: four a stage at one stage per rank, two at two."""
IN_FLIGHT = {"gpipe": StrategyConfig(name="pp", pp_schedule="gpipe", microbatches=4),
             "1f1b": StrategyConfig(name="pp", pp_schedule="1f1b", microbatches=4), **SCHEDULES}


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8)])
def test_microbatches_in_flight_on_the_first_and_the_last_rank_are_the_planners(pp, m):
    """Peak microbatch activations held on each pipeline rank, in stage units (one microbatch
    through one stage of a one-stage-per-rank pipeline), counted while autograd holds any tensor a
    (chunk, microbatch) saved (training/parallel/inflight.py), against the memory ruler's counts
    (planner/pipeline.in_flight). Measured (first rank, last rank, the last stage's chunk): pp=2,
    m=4: gpipe 4, 4, 4; 1f1b 2, 1, 1; interleaved_1f1b 2.5, 1.5, 1; zero_bubble 2, 2, 2; zbv 2, 2, 1;
    dualpipev 2.5, 2.5, 1. pp=4, m=8: 8, 8, 8; 4, 1, 1; 5.5, 2.5, 1; 4, 4, 4; 4, 4, 1; 4.5, 4.5, 1. In saved bytes over one
    microbatch's, 0.94 to 1 of the count (a chunk partly freed counts whole)."""
    from tests.dist.test_strategies import DATA
    from training.parallel.schedules import V_SHAPED
    from training.planner.pipeline import in_flight

    strategies = {name: dataclasses.replace(s, microbatches=m) for name, s in IN_FLIGHT.items()}
    peaks = run_world("tests.dist.pp_workers:in_flight", (GPT8, DATA["gpt"], strategies, 2 * m), world=pp,
                      timeout_s=300)
    for name, ranks in peaks.items():
        holder = ranks[0 if name in V_SHAPED else -1]  # the rank holding the last stage, as its last chunk
        measured = (ranks[0]["stages"], ranks[-1]["stages"], holder["chunk_microbatches_each"][-1])
        assert measured == in_flight(name, pp, m, strategies[name].pp_virtual_stages), name
        for rank in ranks:
            held = rank["saved_bytes"] / rank["microbatch_bytes"]
            assert 0.9 * rank["stages"] <= held <= rank["stages"] + 0.01, f"{name}: bytes as the count"
    assert [r["stages"] for r in peaks["1f1b"]] == [pp - r for r in range(pp)], "1F1B: stage s holds pp - s"


def view_output_gpt(**kwargs) -> object:
    """The built-in GPT whose blocks hand on a view of their output (as a block ending in a reshape
    or a slice does): a split-backward schedule detaches a stage's output in place, which autograd
    refuses on a view unless the stage hands on its own tensor."""
    from training.models.gpt import build

    model = build(**kwargs)
    for block in model.layers.values():
        block.forward = lambda *args, _forward=block.forward, **kw: _forward(*args, **kw).view(-1).view(args[0].shape)
    return model


VIEW_GPT4 = dataclasses.replace(GPT4, target="tests.dist.test_pipeline_schedules.view_output_gpt")


@pytest.mark.parametrize("name", ["zero_bubble", "zbv", "dualpipev"])
def test_a_stage_whose_output_is_a_view_trains_under_each_split_backward_schedule(name):
    result = run(SCHEDULES[name], 2, VIEW_GPT4)
    assert result.losses == pytest.approx(reference(VIEW_GPT4).losses, **TOL)
