"""The per-rank device-memory budget on real gloo ranks: every rank leaves its peak for the driver,
the tracker sees what sharding saves (FSDP2's DTensor shards and resized storages), and a rank over
its budget fails the stage with one line, as CUDA's out-of-memory would."""

from __future__ import annotations

import dataclasses
import json
import tempfile

import pytest
import torch
import torch.distributed as dist

from pipelines.launchers.base import StageFailed
from pipelines.launchers.worker import MEMORY_FILE, peak_memory
from tests.dist.test_strategies import train_inputs
from tests.helpers import run_world
from training.config import DataConfig, ModelConfig, StrategyConfig
from training.units import GIB, MIB


def hold_on_rank1(n: int) -> None:
    """A stage function: rank 1 holds `n` float32 numbers, then every rank meets."""
    held = torch.ones(n) if dist.get_rank() == 1 else None
    dist.barrier()
    del held


def rank_peaks(workdir) -> list[int]:
    return [json.loads((workdir / MEMORY_FILE.format(rank=r)).read_text())["peak_bytes"] for r in range(2)]


@pytest.mark.slow
def test_every_rank_leaves_its_peak_and_zero3_holds_less_than_ddp(tmp_path):
    peaks = {}
    for name in ("ddp", "zero3"):
        workdir = tmp_path / name
        inputs = (train_inputs(StrategyConfig(name=name), steps=4, timing_warmup=1), tempfile.mkdtemp())
        result = run_world("tests.dist.workers:train_any", inputs, world=2, workdir=workdir, memory_budget_gib=1.0)
        peaks[name] = peak_memory(workdir)
        assert peaks[name] == max(rank_peaks(workdir))
        # Right after the optimizer step the rank holds its parameters, gradients and optimizer
        # state together (the train stage counts them from the tensors): the peak is above that.
        assert result.param_bytes + result.grad_bytes + result.optim_bytes <= peaks[name] < GIB
    assert peaks["zero3"] < peaks["ddp"]


def test_a_rank_over_its_budget_fails_the_stage_with_one_line(tmp_path):
    with pytest.raises(StageFailed) as failed:
        run_world("tests.dist.test_memory_budget:hold_on_rank1", MIB, world=2, workdir=tmp_path,
                  memory_budget_gib=1 / 1024)
    assert str(failed.value) == (
        "rank 1 failed: DeviceOutOfMemory: rank 1: device memory budget exceeded: 4.00 MiB in use > 1.00 MiB "
        f"(cluster.device_memory_gib=0.000976562) (logs: {tmp_path})")
    failed_rank = json.loads((tmp_path / MEMORY_FILE.format(rank=1)).read_text())["peak_bytes"]
    assert failed_rank < MIB, "left also by the rank that failed, without the allocation that failed"


# A GPT whose head and its loss (vocabulary 512) weigh like its blocks', so every term of the
# memory ruler shows: states, saved activations, the loss's temporaries, FSDP's gathered units.
MEASURED_GPT = ModelConfig(name="gpt", kwargs=dict(vocab_size=512, d_model=64, n_layers=4, n_heads=4, seq_len=32))
MEASURED_DATA = DataConfig(kwargs=dict(num_samples=256, seq_len=32, vocab_size=512))
LAYOUTS = {
    "ddp": dict(name="ddp"), "zero1": dict(name="zero1"), "zero2": dict(name="zero2"), "zero3": dict(name="zero3"),
    "tp": dict(name="tp"), "pp": dict(name="pp", microbatches=2),
}


def predicted_and_measured(strategy: StrategyConfig, world: int, tmp_path,
                           model: ModelConfig = MEASURED_GPT) -> tuple[float, int]:
    """The memory ruler's peak for `strategy` on `world` ranks (the plan's function, from the model
    counted on the meta device: its saved bytes per sample as the fit counts them, its shape as the
    plan measures it, on a sequence), and the highest rank's measured peak of the real train stage."""
    import torch

    from training.contract.calls import model_loss
    from training.parallel.dims import resolve_dims
    from training.planner.anatomy import build_on_meta, measure_anatomy
    from training.planner.fit import counted, rank_memory
    from training.strategies import flavour_of

    inputs = dataclasses.replace(train_inputs(strategy, steps=3, timing_warmup=1, global_batch=16),
                                 model=model, data=MEASURED_DATA)
    workdir = tmp_path / f"{strategy.name}-cp{strategy.cp_degree}-ep{strategy.ep}-{world}"
    result = run_world("tests.dist.workers:train_any", (inputs, tempfile.mkdtemp()), world=world, workdir=workdir,
                       memory_budget_gib=4.0)
    c = counted(model, MEASURED_DATA, 0, strategy.precision, strategy.activation_checkpointing)
    meta, spec = build_on_meta(model, 0)
    tokens = torch.zeros(1, MEASURED_DATA.kwargs["seq_len"], dtype=torch.long, device="meta")
    c = dataclasses.replace(c, shape=measure_anatomy(meta, spec, model_loss(model), (tokens, tokens)).anatomy.shape)
    memory = rank_memory(c, strategy, flavour_of(strategy, resolve_dims(strategy, world)), world, result.micro_batch)
    return memory.total, peak_memory(workdir)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_the_memory_ruler_predicts_each_ranks_measured_peak_within_10_pct(tmp_path, world):
    """ddp, zero1, zero2, zero3, hsdp, tp and pp as the trainer runs them, each rank's live tensor
    storages tracked (training/budget.py): the prediction within 10 % of the highest rank's peak
    (measured 0.97-1.03 for every layout at world 2 and 4, fp32, and for ddp, zero1 and zero3 in bf16)."""
    layouts = dict(LAYOUTS, **({"hsdp": dict(name="hybrid", dp_replicate=2, dp_shard=2)} if world == 4 else {}))
    ratios = {}
    for name, fields in layouts.items():
        predicted, measured = predicted_and_measured(StrategyConfig(**fields), world, tmp_path)
        ratios[name] = predicted / measured
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


@pytest.mark.slow
def test_the_memory_ruler_predicts_bf16_as_the_trainer_holds_it(tmp_path):
    ratios = {}
    for name in ("ddp", "zero1", "zero3"):
        predicted, measured = predicted_and_measured(StrategyConfig(name=name, precision="bf16"), 2, tmp_path)
        ratios[name] = predicted / measured
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


# The same GPT with a mixture of 4 experts (2 a token, no token dropped) in every block.
MEASURED_MOE = dataclasses.replace(MEASURED_GPT, kwargs=dict(MEASURED_GPT.kwargs, n_experts=4, top_k=2))


@pytest.mark.slow
def test_the_memory_ruler_predicts_a_mixture_of_experts_with_and_without_expert_parallelism(tmp_path):
    """Experts replicated (ddp), sharded like the rest (zero3), and split over ep=2 under each: the
    states per rank as `stage_params` counts them (experts / ep), the dispatch buffers among the
    activations the meta forward saves; and the same with cp=2, ep carved out of the CP ranks
    (ddp replicating over them, zero3 sharding over them; each rank's activations, loss
    temporaries included, of its half of each sequence). Measured: 0.98 to 1.00, ep=2 under zero3
    0.93 (its exchange's buffers are not counted), with cp=2 too."""
    ratios = {}
    for name, cp, ep in (("ddp", 1, 1), ("ddp", 1, 2), ("zero3", 1, 1), ("zero3", 1, 2), ("ddp", 2, 2),
                         ("zero3", 2, 1), ("zero3", 2, 2)):
        predicted, measured = predicted_and_measured(StrategyConfig(name=name, cp=cp, ep=ep), 2, tmp_path,
                                                     MEASURED_MOE)
        ratios[f"{name} cp={cp} ep={ep}"] = predicted / measured
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


@pytest.mark.slow
def test_the_memory_ruler_predicts_context_parallelism_under_ddp_as_replicas(tmp_path):
    """cp=2 at world 2 under ddp replicates over the CP ranks (whole states per rank, DDP's buckets),
    under zero3 shards over them: the ruler follows the trainer's wrapper (ParallelDims.uses_fsdp).
    Measured 0.99 and 1.02; before the ruler read the wrapper, ddp's was predicted sharded (0.77)."""
    ratios = {}
    for name in ("ddp", "zero3"):
        predicted, measured = predicted_and_measured(StrategyConfig(name=name, cp=2), 2, tmp_path)
        ratios[name] = predicted / measured
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios
