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
def test_microbatches_in_flight_on_the_rank_holding_stage_0():
    """Peak microbatch activations held, pp=2 and 4 microbatches, in stage units (one microbatch
    through one stage of a one-stage-per-rank pipeline), counted while autograd holds any tensor a
    (chunk, microbatch) saved (training/parallel/inflight.py). Measured (rank 0, rank 1):
    gpipe 4, 4; 1f1b 2, 1; interleaved_1f1b 2.5, 1.5; zero_bubble 3, 4; zbv 3, 4; dualpipev 3, 2.5.
    In saved bytes over one microbatch's, rank 0: 3.99, 2.00, 2.49, 2.37, 2.33, 2.63."""
    from tests.dist.test_strategies import DATA

    pp, m, v = 2, 4, 2
    peaks = run_world("tests.dist.pp_workers:in_flight", (GPT8, DATA["gpt"], IN_FLIGHT, 8), world=2, timeout_s=180)
    stage0 = {name: ranks[0]["stages"] for name, ranks in peaks.items()}
    assert stage0["gpipe"] == m, "GPipe: every microbatch's forward before any backward"
    assert stage0["1f1b"] == pp and peaks["1f1b"][1]["stages"] == 1, "1F1B: stage s holds pp - s"
    assert stage0["interleaved_1f1b"] == pp * (1 + (pp - 1) / (pp * v)), "Megatron's interleaved 1F1B"
    assert stage0["dualpipev"] == pp + 1, "DeepSeek-V3's table: PP + 1"
    # torch 2.13's zero-bubble schedules hold part of a microbatch's activations past its weight
    # pass (until the step ends): more than the papers' pp, never GPipe's m.
    for name in ("zero_bubble", "zbv"):
        assert pp < stage0[name] < m, name
    assert stage0["1f1b"] < stage0["interleaved_1f1b"] < min(stage0[n] for n in ("zero_bubble", "zbv", "dualpipev"))
    for name, ranks in peaks.items():
        held = ranks[0]["saved_bytes"] / ranks[0]["microbatch_bytes"]
        assert held <= ranks[0]["stages"] + 0.01, f"{name}: bytes can only be freed earlier than the last tensor"
