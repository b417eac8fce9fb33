"""Hugging Face models through the strategies, split by their own declarations: the presets
model=hf-llama and model=hf-qwen2 (composed from conf/), ddp, zero3, tp and pp (its
base_model_pp_plan) at world 2 against one process, step for step; the mixtures of experts
hf-mixtral and hf-qwen3-moe under ddp, zero3 and pp, and with their experts split over ranks by
their base_model_ep_plan."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest

from stages.train import TrainInputs
from tests.dist.test_strategies import TOL
from tests.helpers import run_world
from training.config import StrategyConfig, TrainConfig

pytestmark = pytest.mark.slow
_RUNS: dict = {}


def run(compose_cfg, preset: str, strategy: str, world: int, ep: int = 1, tp: int = 1):
    key = (preset, strategy, world, ep, tp)
    if key not in _RUNS:
        cfg = compose_cfg(f"model={preset}", "data.num_samples=256", "data.seq_len=16", "tracking=none")
        train = TrainConfig(steps=6, global_batch=8, lr=1e-2, log_every=3, timing_warmup=2, warmup_steps=2,
                            schedule="constant", grad_clip=0.5)
        degrees = dict(dp_replicate=1, dp_shard=world // tp, tp=tp) if strategy == "hybrid" else {}
        inputs = TrainInputs(train, cfg.model, cfg.data, StrategyConfig(name=strategy, ep=ep, **degrees), seed=0)
        _RUNS[key] = run_world("tests.dist.workers:train_any", (inputs, tempfile.mkdtemp()), world=world, timeout_s=120)
    return _RUNS[key]


@pytest.mark.parametrize("preset", ["hf-llama", "hf-qwen2"])
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "tp", "pp"])
def test_a_hugging_face_model_at_world_2_matches_one_process(compose_cfg, preset, strategy):
    one = run(compose_cfg, preset, "ddp", 1)
    two = run(compose_cfg, preset, strategy, 2)
    assert two.world_size == 2 and two.strategy == strategy and two.ranks_in_sync
    assert two.losses == pytest.approx(one.losses, **TOL)
    assert one.losses[-1] < one.losses[0]
    if strategy == "tp":
        # Its own plan split q/k/v/o and the MLP: each rank holds half of those weights.
        assert two.param_bytes < 0.8 * one.param_bytes


@pytest.mark.parametrize("preset", ["hf-mixtral", "hf-qwen3-moe"])
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "pp", "tp"])
def test_a_hugging_face_mixture_of_experts_at_world_2_matches_one_process(compose_cfg, preset, strategy):
    """Mixtral's and Qwen3-MoE's own layers (their experts run through transformers' grouped
    implementation), replicated, sharded or split by their base_model_pp_plan like any weight, or
    their attention split by their base_model_tp_plan: Qwen3-MoE's names its per-head q/k norms
    `replicated_with_grad_allreduce`, kept whole with their gradients summed over the TP ranks (a
    norm's gradient from half the heads would put the ranks out of sync: ranks_in_sync)."""
    one = run(compose_cfg, preset, "ddp", 1)
    two = run(compose_cfg, preset, strategy, 2)
    assert two.world_size == 2 and two.ranks_in_sync
    assert two.losses == pytest.approx(one.losses, **TOL)
    assert one.losses[-1] < one.losses[0]
    # Their loads are counted from the experts module's calls, as the built-in's are; a pipeline's
    # first step is not counted (torch's shape inference runs through the experts then).
    skipped = two.expert_first_step - 1
    assert skipped == (1 if strategy == "pp" else 0) and len(two.expert_imbalance) == 6 - skipped
    assert two.expert_imbalance == pytest.approx(one.expert_imbalance[skipped:])
    if not skipped:
        assert two.expert_load == one.expert_load, "each rank routes its half of the batch as one process does"


@pytest.mark.parametrize(("preset", "strategy", "world"),
                         [("hf-mixtral", "ddp", 2), ("hf-mixtral", "zero3", 2), ("hf-mixtral", "zero3", 4),
                          ("hf-qwen3-moe", "ddp", 2), ("hf-qwen3-moe", "zero3", 2)])
def test_a_hugging_face_mixture_of_experts_split_over_ranks_matches_one_process(compose_cfg, preset, strategy, world):
    """strategy.ep=2 from the model's own base_model_ep_plan: each rank holds half of the experts of
    every layer (transformers' own experts module, run on this rank's part of its stacked weights),
    tokens sent to them by all-to-all; at world 4 two expert groups whose replicas reduce them."""
    one = run(compose_cfg, preset, "ddp", 1)
    split = run(compose_cfg, preset, strategy, world, ep=2)
    assert split.ep == 2 and split.world_size == world and split.ranks_in_sync
    assert split.losses == pytest.approx(one.losses, **TOL)
    assert split.expert_load == one.expert_load
    assert len(split.expert_load) == 2, "both layers' experts modules counted"
    assert split.param_bytes < one.param_bytes, "each rank holds half of the experts"


@pytest.mark.parametrize("preset", ["hf-mixtral", "hf-qwen3-moe"])
def test_a_hugging_face_mixture_of_experts_with_ep_beside_tp_matches_one_process(compose_cfg, preset):
    """World 4, FSDP over 2 x TP 2 with strategy.ep=2: attention split by the family's own TP plan
    (Qwen3-MoE's q/k norms kept whole, their gradients summed), each TP rank routing its half of the
    tokens through its expert group, the experts' replicas the other FSDP rank and the TP partner."""
    one = run(compose_cfg, preset, "ddp", 1)
    split = run(compose_cfg, preset, "hybrid", 4, ep=2, tp=2)
    assert split.ep == 2 and split.world_size == 4 and split.ranks_in_sync
    assert split.losses == pytest.approx(one.losses, **TOL)
    assert split.expert_load == one.expert_load


def pretrained_llama(compose_cfg, directory) -> tuple[object, float]:
    """A seeded tiny Llama saved as Hugging Face saves a checkpoint (config.json, model.safetensors),
    and its loss on the first global batch the train stage will draw (8 samples, seed 0)."""
    import torch

    from training.data import GlobalBatches, build_dataset
    from training.contract.calls import batch_loss, build_model, model_loss

    cfg = compose_cfg("model=hf-llama", "data.num_samples=256", "data.seq_len=16", "tracking=none")
    torch.manual_seed(1234)
    saved = build_model(cfg.model, seed=1234)
    saved.save_pretrained(directory)
    dataset = build_dataset(cfg.data)
    rows = GlobalBatches(len(dataset), 8, 1, 0, 1, 0).rows(0, 0)
    batch = torch.utils.data.default_collate([dataset[int(i)] for i in rows])
    with torch.no_grad():
        return cfg, batch_loss(saved, batch, model_loss(cfg.model)).item()


def test_a_pretrained_checkpoint_is_read_shard_by_shard_and_trains_as_one_process(compose_cfg, tmp_path):
    """model.pretrained: each rank reads only its shard of each tensor from the safetensors file
    (zero3 at world 2); the first loss is the saved model's, and the run is one process's."""
    cfg, saved_loss = pretrained_llama(compose_cfg, tmp_path / "ckpt")
    model = dataclasses.replace(cfg.model, kwargs={**cfg.model.kwargs, "pretrained": str(tmp_path / "ckpt")})
    train = TrainConfig(steps=4, global_batch=8, lr=1e-2, log_every=2, timing_warmup=1, warmup_steps=1,
                        schedule="constant", grad_clip=0.5)
    runs = {}
    for name, world in (("ddp", 1), ("zero3", 2)):
        inputs = TrainInputs(train, model, cfg.data, StrategyConfig(name=name), seed=0)
        runs[name] = run_world("tests.dist.workers:train_any", (inputs, tempfile.mkdtemp()), world=world, timeout_s=120)
    assert runs["ddp"].losses[0] == pytest.approx(saved_loss, rel=1e-5), "the checkpoint's weights, not an init"
    assert runs["zero3"].losses == pytest.approx(runs["ddp"].losses, **TOL)


@pytest.mark.parametrize("family", ["Mixtral", "Qwen3Moe"])
def test_the_projects_expert_dispatch_computes_what_transformers_own_does(family):
    """One plan, two dispatches: the same base_model_ep_plan applied by training/parallel/ep.py and by
    transformers' own expert parallelism (its all_to_all implementation, which runs on gloo) gives
    the same outputs, input gradients and expert-weight gradients on each rank's own tokens."""
    import torch

    ours, theirs = run_world("tests.dist.workers:ep_against_transformers", family, world=2, timeout_s=120)
    assert torch.allclose(ours[0], theirs[0], atol=1e-6)
    assert torch.allclose(ours[1], theirs[1], atol=1e-6)
    for a, b in zip(ours[2], theirs[2], strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-6)
