"""Production layouts planned on one CPU: a fake process group and the meta device (no processes)."""

from __future__ import annotations

import pytest

from training.config import ModelConfig, StrategyConfig
from training.planner.dryrun import plan_layout

SMALL = ModelConfig(name="gpt-small", kwargs=dict(vocab_size=50304, seq_len=1024, d_model=768, n_layers=12, n_heads=12))
FULL_PARAM_BYTES = plan_layout(SMALL, StrategyConfig(name="ddp"), 1)[0].param_bytes


def test_ddp_holds_everything_and_zero1_shards_only_the_optimizer():
    ddp = plan_layout(SMALL, StrategyConfig(name="ddp"), 8)[0]
    zero1 = plan_layout(SMALL, StrategyConfig(name="zero1"), 8)[0]
    assert ddp.param_bytes == ddp.grad_bytes == FULL_PARAM_BYTES and ddp.optim_bytes == 2 * FULL_PARAM_BYTES
    assert zero1.param_bytes == FULL_PARAM_BYTES and zero1.optim_bytes == pytest.approx(2 * FULL_PARAM_BYTES / 8, rel=0.01)


def test_zero3_on_32_ranks_holds_a_32nd_of_everything():
    (share,) = plan_layout(SMALL, StrategyConfig(name="zero3"), 32)
    assert share.param_bytes == pytest.approx(FULL_PARAM_BYTES / 32, rel=0.01)
    assert share.grad_bytes == share.param_bytes and share.optim_bytes == 2 * share.param_bytes


def test_zero2_keeps_full_parameters_through_backward():
    """Its fp32 shard, and the gathered copy it computes with (fp32 here) from forward to backward."""
    (share,) = plan_layout(SMALL, StrategyConfig(name="zero2"), 8)
    assert share.param_bytes == pytest.approx(FULL_PARAM_BYTES * (1 + 1 / 8), rel=0.01)
    assert share.grad_bytes == pytest.approx(FULL_PARAM_BYTES / 8, rel=0.01)


def test_8_rank_3d_layout_has_one_share_per_pipeline_stage():
    shares = plan_layout(SMALL, StrategyConfig(name="hybrid", dp_shard=2, tp=2, pp=2), 8)
    assert [s.rank for s in shares] == [0, 4]
    assert [s.coordinates["pp"] for s in shares] == [0, 1] and [s.layers for s in shares] == [6, 6]
    # Each stage holds about half the model, split 2 ways by TP (block linears) and 2 by FSDP.
    assert sum(s.param_bytes for s in shares) < FULL_PARAM_BYTES / 2


def test_64_rank_hsdp_with_tp():
    (share,) = plan_layout(SMALL, StrategyConfig(name="hybrid", dp_replicate=2, dp_shard=8, tp=4), 64)
    assert share.coordinates == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0, "dp": 0}
    assert FULL_PARAM_BYTES / 32 < share.param_bytes < FULL_PARAM_BYTES / 8


def test_impossible_degrees_name_both_numbers():
    with pytest.raises(ValueError, match="= 12, but the world size is 8"):
        plan_layout(SMALL, StrategyConfig(name="hybrid", dp_shard=3, tp=4), 8)


def holdings(model_cfg: ModelConfig, strategy: StrategyConfig, world: int, rank: int,
             stage_ranks: int) -> dict[str, tuple[int, float]]:
    """What `rank` holds, built as in the dry run: parameter name -> (elements held locally, ranks
    of its stage holding the same elements). A DTensor is replicated over the mesh dimensions whose
    placement is Replicate, and over the stage's ranks outside its mesh (an embedding sharded by
    FSDP alone is whole on each tp rank); a plain tensor on every rank of the stage."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from training.contract.calls import build_model, model_loss
    from training.contract.spec import model_spec
    from training.parallel.compose import parallelize

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        with torch.device("meta"):
            model = build_model(model_cfg, seed=0)
        parallel = parallelize(model, model_spec(model, model_cfg), strategy, torch.device("cpu"),
                               model_loss(model_cfg), layout_only=True)
        out = {}
        for name, p in parallel.model.named_parameters():
            if isinstance(p, DTensor):
                copies = stage_ranks / p.device_mesh.size()
                for size, placement in zip(p.device_mesh.shape, p.placements, strict=True):
                    copies *= size if isinstance(placement, Replicate) else 1
                out[name] = (p.to_local().numel(), copies)
            else:
                out[name] = (p.numel(), stage_ranks)
        return out
    finally:
        dist.destroy_process_group()


def test_the_3d_layout_holds_every_parameter_exactly_once():
    """pp 2 x dp_shard 2 x tp 2 on 8 ranks, every rank built: each parameter lives in one pipeline
    stage, and its stage's 4 ranks hold its elements exactly once (counting the copies its
    placements declare, e.g. a LayerNorm replicated over tp)."""
    import torch

    from training.contract.calls import build_model

    with torch.device("meta"):
        full = {n: p.numel() for n, p in build_model(SMALL, seed=0).named_parameters()}
    strategy = StrategyConfig(name="hybrid", dp_shard=2, tp=2, pp=2)
    ranks = [holdings(SMALL, strategy, 8, r, stage_ranks=4) for r in range(8)]
    stages = [set(ranks[0]), set(ranks[4])]  # ranks 0-3 hold stage 0, ranks 4-7 stage 1
    assert all(set(ranks[r]) == stages[r // 4] for r in range(8))
    assert not stages[0] & stages[1] and stages[0] | stages[1] == set(full)
    for name, numel in full.items():
        stage = 0 if name in stages[0] else 1
        held = [ranks[r][name] for r in range(4 * stage, 4 * stage + 4)]
        assert sum(local / copies for local, copies in held) == numel, name
        if copies_of(held) == 1:  # a block linear, split by tp and sharded by FSDP: a quarter each
            assert {local for local, _ in held} == {numel // 4}, name
    assert sum(copies_of([ranks[0][n]]) == 1 for n in stages[0]) >= 6 * 4, "every block linear of stage 0 is split"


def copies_of(held: list[tuple[int, float]]) -> float:
    return held[0][1]


# ~7.5 B parameters: LLaMA-7B's width (4096, 32 heads) at 36 layers, the ZeRO paper's Ψ.
SEVEN_B = ModelConfig(name="gpt-7.5b", kwargs=dict(vocab_size=32000, seq_len=2048, d_model=4096, n_layers=36,
                                                   n_heads=32, ffn_mult=4))
LAYOUTS_64 = {
    "ddp": dict(name="ddp"), "zero1": dict(name="zero1"), "zero2": dict(name="zero2"), "zero3": dict(name="zero3"),
    "hsdp": dict(name="hybrid", dp_replicate=8, dp_shard=8), "fsdp8xtp8": dict(name="hybrid", dp_shard=8, tp=8),
    "tp8": dict(name="hybrid", dp_replicate=8, tp=8), "ddp8xpp8": dict(name="hybrid", dp_replicate=8, pp=8),
    "tp8xpp8": dict(name="hybrid", tp=8, pp=8), "pp2xfsdp4xtp8": dict(name="hybrid", pp=2, dp_shard=4, tp=8),
}


def seven_b_shape():
    import torch

    from training.contract.calls import build_model
    from training.contract.spec import model_spec
    from training.planner.anatomy import shape_of

    with torch.device("meta"):
        model = build_model(SEVEN_B, seed=0)
    return shape_of(model, model_spec(model, SEVEN_B), hidden=4096, positions=2048)


def dry_run_states(strategy: StrategyConfig, world: int) -> float:
    """The most any rank holds in states, counted from the sharded model and its optimizer."""
    return max(s.param_bytes + s.grad_bytes + s.optim_bytes for s in plan_layout(SEVEN_B, strategy, world))


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("layout", list(LAYOUTS_64))
def test_the_plans_states_are_what_the_dry_run_counts_at_7_5b_on_64_ranks(layout, precision):
    """The memory ruler describes the program that trains: its states per rank equal what the
    trainer's own layout allocates (parameters as stored, their gradients, the optimizer it
    builds), measured at 0.99-1.00 for every layout here."""
    from training.parallel.compose import resolve_dims
    from training.planner.memory import state_memory

    strategy = StrategyConfig(precision=precision, **LAYOUTS_64[layout])
    predicted = state_memory(seven_b_shape(), strategy.name, resolve_dims(strategy, 64), precision, strategy.reshard)
    assert predicted.states == pytest.approx(dry_run_states(strategy, 64), rel=0.05)


def test_bf16_zero_stages_are_the_zero_papers_on_64_ranks():
    """P_os = 2 + 2 + 12/N, P_os+g = 2 + 14/N, P_os+g+p = 16/N bytes per parameter (ZeRO, Figure 1),
    counted by the dry run within 10 %: zero1 shards the fp32 masters with the moments."""
    psi, n = seven_b_shape().params, 64
    assert 7.4e9 < psi < 7.6e9
    paper = {"zero1": 2 + 2 + 12 / n, "zero2": 2 + 14 / n, "zero3": 16 / n}
    for name, per_param in paper.items():
        counted = dry_run_states(StrategyConfig(name=name, precision="bf16"), n)
        assert counted == pytest.approx(per_param * psi, rel=0.10), name
