"""A strategy is one declaration: registering a toy one makes the config accept it, parallelize
apply it, the dry run lay it out, the overhead probe measure it and the cost model and advisor
predict it, with no other file touched."""

from __future__ import annotations

import dataclasses

import pytest

from common.errors import ConfigError
from training import strategies
from training.config import StrategyConfig
from training.strategies import Strategy

TOY = Strategy(name="toyshard", summary="FSDP sharding gradients and optimizer state, under another name",
               degrees={"dp_replicate": 1, "dp_shard": -1, "tp": 1, "pp": 1}, wrapper="fsdp",
               shards=frozenset({"optimizer", "gradients"}), reshard_after_forward=False)


@pytest.fixture
def toy():
    strategies.register(TOY)
    yield TOY
    strategies.REGISTRY.pop(TOY.name)


def test_the_config_accepts_a_registered_strategy_and_reads_its_declaration(toy):
    cfg = StrategyConfig(name="toyshard")
    assert cfg.degrees() == {"dp_replicate": 1, "dp_shard": -1, "tp": 1, "pp": 1}
    assert cfg.reshard is False and not cfg.shards_optimizer_only


def test_an_unregistered_strategy_is_one_line_listing_the_registered_ones():
    with pytest.raises(ConfigError, match=r"name='toyshard': must be one of ddp, zero1, zero2, zero3, tp, pp"):
        StrategyConfig(name="toyshard")


def test_parallelize_applies_it_and_the_dry_run_lays_it_out(toy):
    from tests.unit.test_dryrun import FULL_PARAM_BYTES, SMALL
    from training.parallel.compose import resolve_dims, techniques
    from training.planner.dryrun import plan_layout

    cfg = StrategyConfig(name="toyshard")
    assert techniques(cfg, resolve_dims(cfg, 8)) == techniques(StrategyConfig(name="zero2"),
                                                               resolve_dims(StrategyConfig(name="zero2"), 8))
    (share,) = plan_layout(SMALL, cfg, 8)
    assert share.param_bytes == pytest.approx(FULL_PARAM_BYTES * (1 + 1 / 8), rel=0.01), "gathered through backward"
    assert share.grad_bytes == pytest.approx(FULL_PARAM_BYTES / 8, rel=0.01)


def test_the_cost_model_and_the_advisor_predict_it_from_its_declaration(toy, compose_cfg):
    from tests.unit.test_advisor import plan_inputs
    from training.parallel.dims import ParallelDims
    from training.planner.memory import state_memory
    from training.planner.shape import Shape
    from training.strategies import pure

    shape = Shape(params=10**9, layers=10, block_linear_params=0, hidden=1024, seq_len=512, heads=16,
                  first_stage_params=0, last_stage_params=0)
    d = ParallelDims(dp_shard=8)
    assert state_memory(shape, "toyshard", d, precision="fp32") == state_memory(shape, "zero2", d, precision="fp32")
    assert "toyshard" in pure()
    from stages.plan import whatif

    result = whatif(dataclasses.replace(plan_inputs(compose_cfg, "cluster=h100-80g-ndr", "model=gpt-1b", "nodes=1"),
                                        strategy=StrategyConfig(name="toyshard")))
    mine = result.requested
    assert mine.strategy == "toyshard" and mine.dims["dp_shard"] == 8
    assert any(r.startswith("toyshard: ") for r in result.reasons) or result.recommended.strategy == "toyshard"


def test_the_overhead_probe_measures_it_on_one_rank(toy):
    import torch

    from training.config import ModelConfig
    from training.contract.calls import build_model, model_loss
    from training.data import first_samples, markov
    from training.overhead import measure_overheads

    cfg = ModelConfig(kwargs=dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2))
    model = build_model(cfg, seed=0)
    batch = first_samples(markov(8, 16, 64), 4)
    got = measure_overheads(model, cfg, model_loss(cfg), batch, ["toyshard", "pp"], torch.device("cpu"), None,
                            StrategyConfig(), rounds=1, steps=1)
    assert set(got.seconds) == {"toyshard"} and got.seconds["toyshard"] >= 0
    assert got.not_measured == {"pp": "a pipeline needs two stages: not measurable on one rank"}


def test_auto_and_hybrid_are_declarations_not_names():
    """What auto and hybrid do is read from their declarations: no module tests their names."""
    import re
    from pathlib import Path

    from training import strategies

    assert strategies.from_plan("auto") and not strategies.from_plan("hybrid")
    assert strategies.any_layout().name == "hybrid"
    root = Path(__file__).resolve().parents[2]
    tested = [f"{path.relative_to(root)}:{n}" for package in ("pipelines", "stages", "training", "reports")
              for path in (root / package).rglob("*.py")
              for n, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"""(==|!=)\s*["'](auto|hybrid)["']|["'](auto|hybrid)["']\s*(==|!=)""", line)
              and "backend" not in line and "address" not in line and "dtype" not in line]
    assert tested == []


def test_the_registry_is_every_module_of_the_package_in_the_declared_order():
    """No list of built-in names to keep in step: every module of training/strategies/ is imported,
    and the registry (the plan's tables and curves) follows each declaration's `listed`."""
    import pkgutil

    modules = {m.name for m in pkgutil.iter_modules(strategies.__path__)} - {"base"}
    assert modules == set(strategies.names())
    assert strategies.names() == ("ddp", "zero1", "zero2", "zero3", "tp", "pp", "hybrid", "auto")
    assert strategies.pure() == ["ddp", "zero1", "zero2", "zero3", "tp", "pp"]


def test_a_registered_strategy_takes_the_place_it_declares():
    last = dataclasses.replace(TOY, name="toylast")
    between = dataclasses.replace(TOY, name="toybetween", listed=3)
    try:
        strategies.register(last)
        strategies.register(between)
        names = strategies.names()
        assert names[-1] == "toylast", "a declaration that says nothing comes last"
        assert names[:5] == ("ddp", "zero1", "zero2", "toybetween", "zero3"), "listed=3 ties zero3: by name"
    finally:
        strategies.REGISTRY.pop("toylast", None)
        strategies.REGISTRY.pop("toybetween", None)
