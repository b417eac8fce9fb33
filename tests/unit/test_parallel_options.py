"""Selective activation checkpointing's saved bytes per block, measured, and the config checks of
both options of issue #25 (selective checkpointing, sequence parallelism): one process, no ranks."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from common.errors import ConfigError, ContractError
from training.activations import measure_tp_split
from training.config import ModelConfig, StrategyConfig
from training.contract.calls import batch_loss, build_model, model_loss
from training.contract.spec import model_spec, tp_divisors
from training.parallel.ac import apply_ac
from training.planner.anatomy import measure_variant

B, S, H, LAYERS = 2, 32, 256, 2
SBH = S * B * H
GPT = ModelConfig(name="gpt", kwargs=dict(vocab_size=256, d_model=H, n_layers=LAYERS, n_heads=4, seq_len=S))


def saved_per_block(mode: str) -> float:
    """Bytes a GPT block saves for backward in one real fp32 forward on the CPU under `mode`."""
    model = build_model(GPT, 0)
    spec = model_spec(model, GPT)
    if mode != "none":
        apply_ac(spec.blocks, mode)
    tokens = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(0))
    split = measure_tp_split(model, {}, lambda: batch_loss(model, (tokens, tokens), model_loss(GPT)),
                             [b.module for b in spec.blocks])
    return (split.saved_bytes - split.outside_blocks_bytes) / LAYERS


def test_selective_checkpointing_saves_between_full_and_none():
    """Measured per block, fp32, b=2, s=32, h=256: none 1,050,624 bytes (16 sbh elements: the norms'
    inputs and outputs, q/k/v, attention's output, the MLP's 4h activation twice), selective
    721,920 (11 sbh: the block's input and every matmul's and attention's output), full 65,536
    (1 sbh: the block's input)."""
    none, selective, full = (saved_per_block(mode) for mode in ("none", "selective", "full"))
    assert full < selective < none
    assert none == pytest.approx(16 * 4 * SBH, rel=0.02)
    assert selective == pytest.approx(11 * 4 * SBH, rel=0.02)
    assert full == 4 * SBH


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_the_plans_count_on_the_meta_device_is_the_measured_one(mode):
    """measure_variant (what the plan reads, one sample on the meta device) per block, per sample,
    against the real CPU step's."""
    tokens = torch.zeros(1, S, dtype=torch.long, device="meta")
    cost = measure_variant(GPT, 0, (tokens, tokens), "fp32", mode)
    in_blocks = cost.activations.saved - cost.activations.loss_temp - cost.activations.outside_blocks
    assert in_blocks / LAYERS == pytest.approx(saved_per_block(mode) / B, rel=0.01)


def test_selective_checkpointing_recomputes_no_matmul():
    """Its executed FLOPs are the model's (full checkpointing's are a forward more)."""
    tokens = torch.zeros(1, S, dtype=torch.long, device="meta")
    none, selective, full = (measure_variant(GPT, 0, (tokens, tokens), "fp32", m).executed_flops_per_sample
                             for m in ("none", "selective", "full"))
    assert selective == none < full


def test_the_gpt_and_hugging_face_presets_declare_their_sequence_parallel_norms(compose_cfg):
    gpt = build_model(GPT, 0)
    assert model_spec(gpt, GPT).sp_norms(gpt) == ["layers.0.attention_norm", "layers.0.ffn_norm",
                                                  "layers.1.attention_norm", "layers.1.ffn_norm", "norm"]
    llama_cfg = compose_cfg("model=hf-llama", "tracking=none").model
    llama = build_model(llama_cfg, 0)
    spec = model_spec(llama, llama_cfg)
    assert len(spec.sp_norms(llama)) == 2 * 2 + 1
    assert "q_proj" in " ".join(spec.tp_plan(llama)), "its own TP plan is kept"


def test_a_split_backward_stage_hands_on_its_own_tensor_where_its_output_is_a_view():
    """pp.py's hook on every stage but the last under zero_bubble, zbv and dualpipev (which detach a
    stage's output in place): a view (a reshape's, full_tensor()'s) is copied, anything else passes
    as it is (tests/dist/test_pipeline_schedules.py trains such a stage under each schedule)."""
    from training.parallel.pp import _own_output

    x = torch.randn(2, 3, requires_grad=True) * 1.0
    view = x.view(6)
    out = _own_output(torch.nn.Identity(), (), view)
    assert not out._is_view() and torch.equal(out, view) and out.requires_grad
    assert _own_output(torch.nn.Identity(), (), x) is x
    first, second = _own_output(torch.nn.Identity(), (), (view, x))
    assert not first._is_view() and second is x


def test_a_model_without_sequence_parallel_norms_is_refused_at_tp_above_1(compose_cfg):
    with pytest.raises(ConfigError, match=r"strategy.sequence_parallel=True: LlamaForCausalLM declares no "
                                          r"sequence-parallel norms: give model.sp_plan"):
        compose_cfg("model=hf-llama", "model.sp_plan=null", "strategy=tp", "nodes=2", "strategy.sequence_parallel=true",
                    "tracking=none")
    # At tp = 1 there is nothing to split: a no-op, not an error.
    compose_cfg("model=hf-llama", "model.sp_plan=null", "strategy=ddp", "nodes=2", "strategy.sequence_parallel=true",
                "tracking=none")


def test_an_sp_plan_entry_must_be_sequence_parallel_and_match_a_module():
    with pytest.raises(ConfigError, match=r"sp_plan.norm='colwise': must be one of sequence_parallel"):
        ModelConfig(sp_plan={"norm": "colwise"})
    cfg = ModelConfig(name="gpt", kwargs=GPT.kwargs, tp_plan={"layers.*.attention.wq": "colwise",
                                                              "layers.*.nrom": "sequence_parallel"})
    model = build_model(cfg, 0)
    with pytest.raises(ContractError, match=r"\['layers.\*.nrom'\] matches no module of GPT"):
        model_spec(model, cfg).sp_norms(model)


def test_a_module_kept_whole_in_a_split_region_and_a_familys_unused_entries(compose_cfg):
    """Qwen3-MoE's own plan: its per-head q/k norms are `replicated_with_grad_allreduce` (not split:
    no width for the TP degree to divide, no split parameters), and its dense-MLP entries, which a
    config whose every layer is a mixture of experts doesn't build, split nothing. A user's plan is
    checked whole: a typo in model.tp_plan is an error, as is the style on a module with no weights."""
    from training.planner.anatomy import shape_of

    cfg = compose_cfg("model=hf-qwen3-moe", "tracking=none").model
    model = build_model(cfg, 0)
    spec = model_spec(model, cfg)
    plan = spec.tp_plan(model)
    assert plan["model.layers.0.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert not any("mlp.gate_proj" in name for name in plan)
    assert {plan[n] for n in plan if n.startswith("model.layers.1.self_attn.")} == {
        "colwise", "rowwise", "replicated_with_grad_allreduce"}
    shape = shape_of(model, spec, 64, 16)
    norms = [model.get_submodule(n) for n in plan if n.endswith(("q_norm", "k_norm"))]
    assert len(norms) == 4 and shape.tp_whole_params == sum(p.numel() for m in norms for p in m.parameters()) == 4 * 16
    assert shape.sequence_norm_params == (2 * 2 + 1) * 64, "two norms a layer and the final one, 64 wide"
    attention = sum(p.numel() for n in plan if n.endswith("_proj") for p in model.get_submodule(n).parameters())
    assert shape.block_linear_params == attention
    assert not any("norm" in key for key in tp_divisors(model, plan))

    typo = ModelConfig(name="gpt", kwargs=GPT.kwargs, tp_plan={"layers.*.attention.wq": "colwise",
                                                               "layers.*.attention.wqq": "rowwise"})
    gpt = build_model(typo, 0)
    with pytest.raises(ContractError, match=r"model.tp_plan\['layers.\*.attention.wqq'\] matches no module of GPT"):
        model_spec(gpt, typo).tp_plan(gpt)
    weightless = ModelConfig(name="gpt", kwargs=GPT.kwargs, tp_plan={"layers.*.attention.wq": "colwise",
                                                                     "layers.*.dropout": "replicated_with_grad_allreduce"})
    with pytest.raises(ContractError, match=r"which has no parameters to keep whole"):
        model_spec(gpt, weightless).tp_plan(gpt)


def _buckets_as_they_are(state, bucket):  # noqa: ANN001, ANN202 - unannotated: DDP checks a hook's annotations
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _step_all_reduces(model_cfg: ModelConfig, strategy: StrategyConfig, world: int = 2,
                      collective: str = "all_reduce") -> tuple[int, int]:
    """All-reduces (or `collective`'s calls of torch.distributed) of one whole optimizer step
    (forward, backward, the gradients' sums, the clip, AdamW) on a fake process group of `world`
    ranks, rank 0: (in forward and backward, after them). DDP's bucket all-reduces are left out:
    the fake process group's futures carry no tensor, which DDP's reducer refuses, so a DDP-wrapped
    model's buckets come back as they went."""
    from unittest import mock

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.unit.test_loss_parallel import _counting_collectives
    from training.contract.calls import model_loss
    from training.parallel.compose import build_optimizer, parallelize
    from training.step import optimizer_step

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        model = build_model(model_cfg, 0)
        parallel = parallelize(model, model_spec(model, model_cfg), strategy, torch.device("cpu"), model_loss(model_cfg))
        if isinstance(parallel.model, DistributedDataParallel):
            parallel.model.register_comm_hook(None, _buckets_as_they_are)
        optimizer = build_optimizer(parallel, 1e-3, 0.0)
        tokens = torch.zeros(2, 16, dtype=torch.long)
        plain = getattr(dist, collective)
        calls = [0]

        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[0] += 1
            return plain(*args, **kwargs)

        forward_backward = parallel.forward_backward
        with _counting_collectives() as counts, mock.patch.object(dist, collective, counted):
            def counting_forward_backward(*args):  # noqa: ANN002, ANN202
                out = forward_backward(*args)
                inside.append(counts[collective] + calls[0])
                return out

            inside: list[int] = []
            parallel.forward_backward = counting_forward_backward
            optimizer_step(parallel, optimizer, [(tokens, tokens)], 1, 1.0, torch.device("cpu"))
        return inside[0], counts[collective] + calls[0] - inside[0]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_trainers_gradient_sums_of_whole_modules_are_the_cost_models(compose_cfg, sequence_parallel):
    """Qwen3-MoE at tp=2, one optimizer step on a fake process group: parameters kept whole beside
    split activations (its q/k norms, and under sequence parallelism its norms) get partial
    gradients, summed over the TP ranks in one all-reduce after backward (the same plan without the
    q/k norms: none without sequence parallelism), and nothing after it reduces them again: the
    clip's one all-reduce of its norm and no more (DTensor would sum a partial gradient in every
    operation that reads it: 37 all-reduces for these 9 parameters). The cost model counts the same
    from the shape."""
    import dataclasses

    from tests.unit.test_loss_parallel import _link
    from training.parallel.dims import ParallelDims
    from training.planner.anatomy import shape_of
    from training.planner.comm import comm_time

    cfg = compose_cfg("model=hf-qwen3-moe", "tracking=none").model
    model = build_model(cfg, 0)
    own = {f"model.{k}": v for k, v in model.config.base_model_tp_plan.items()}
    without = dataclasses.replace(cfg, tp_plan={k: v for k, v in own.items() if not k.endswith("_norm") and ".mlp." not in k})
    strategy = StrategyConfig(name="tp", sequence_parallel=sequence_parallel)
    shape = shape_of(model, model_spec(model, cfg), 64, 16)

    def calls(whole: int, norms: int = shape.sequence_norm_params) -> int:
        return comm_time(dataclasses.replace(shape, tp_whole_params=whole, sequence_norm_params=norms), "ddp",
                         ParallelDims(tp=2), 2, 1, 1, "fp32", _link, sequence_parallel=sequence_parallel).calls

    (inside, after), (inside_without, after_without) = _step_all_reduces(cfg, strategy), _step_all_reduces(without, strategy)
    assert inside == inside_without, "the q/k norms' gradients are not summed in backward"
    assert after == 1 + 1, "one sum of the partial gradients, one of the clip's norm"
    assert after_without == 1 + sequence_parallel
    assert after - after_without == calls(shape.tp_whole_params) - calls(0) == 1 - sequence_parallel
    assert calls(shape.tp_whole_params) - calls(0, 0) == 1, "one sum a step, whatever needs it"



def test_under_fsdp_each_whole_tensors_partial_gradient_is_summed_as_the_cost_model_counts(compose_cfg):
    """Qwen3-MoE at FSDP 2 x TP 2 on a fake process group of 4: FSDP sums each whole tensor's
    partial gradient over the TP ranks before its reduce-scatter, one all-reduce a tensor in
    backward (its 4 q/k norms: 4 calls; under sequence parallelism also its 5 norms, while the 2
    layers' attention all-reduces, forward and backward, become gathers and scatters: 5 - 4 more),
    and nothing after backward sums them again (the clip's 3: its norm over the 2 x 2 mesh, summed
    one dimension at a time, with or without them). The cost model counts the same calls."""
    import dataclasses

    from tests.unit.test_loss_parallel import _link
    from training.parallel.dims import ParallelDims
    from training.planner.anatomy import shape_of
    from training.planner.comm import comm_time

    cfg = compose_cfg("model=hf-qwen3-moe", "tracking=none").model
    model = build_model(cfg, 0)
    own = {f"model.{k}": v for k, v in model.config.base_model_tp_plan.items()}
    without = dataclasses.replace(cfg, tp_plan={k: v for k, v in own.items() if not k.endswith("_norm") and ".mlp." not in k})
    shape = shape_of(model, model_spec(model, cfg), 64, 16)
    assert (shape.tp_whole_tensors, shape.sequence_norm_tensors) == (4, 5)

    def calls(sequence_parallel: bool, whole: int, norms: int) -> int:
        counted = dataclasses.replace(shape, tp_whole_params=whole and shape.tp_whole_params, tp_whole_tensors=whole,
                                      sequence_norm_params=norms and shape.sequence_norm_params, sequence_norm_tensors=norms)
        return comm_time(counted, "zero3", ParallelDims(dp_shard=2, tp=2), 2, 1, 1, "fp32", _link,
                         sequence_parallel=sequence_parallel).calls

    runs = {(sp, plan is cfg): _step_all_reduces(plan, StrategyConfig(name="hybrid", dp_shard=2, tp=2,
                                                                      sequence_parallel=sp), 4)
            for sp in (False, True) for plan in (cfg, without)}
    for sp in (False, True):
        (inside, after), (inside_without, after_without) = runs[sp, True], runs[sp, False]
        assert inside - inside_without == 4 == calls(sp, 4, 5) - calls(sp, 0, 5), "one sum a q/k norm tensor"
        assert after == after_without == 3
    assert runs[True, False][0] - runs[False, False][0] == 5 - 4
    assert calls(True, 0, 5) - calls(True, 0, 0) == 5, "one sum a norm tensor"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero1_broadcasts_each_share_as_the_cost_model_counts(precision):
    """zero1 at world 4 with ep=2, on a fake process group: after the step each rank broadcasts
    the dense share it updated over the 4 data-parallel ranks and the experts' share over their 2
    replicas, one call a rank of each group (4 + 2), none in forward or backward; the cost model's
    zero1 makes that many calls more than its ddp."""
    from tests.unit.test_loss_parallel import _link
    from training.parallel.dims import ParallelDims
    from training.planner.anatomy import shape_of
    from training.planner.comm import comm_time

    moe = ModelConfig(name="gpt", kwargs=dict(vocab_size=256, d_model=32, n_layers=2, n_heads=4, seq_len=16,
                                              n_experts=4, top_k=2))
    inside, after = _step_all_reduces(moe, StrategyConfig(name="zero1", ep=2, precision=precision), 4, "broadcast")
    assert (inside, after) == (0, 4 + 2)
    model = build_model(moe, 0)
    shape = shape_of(model, model_spec(model, moe), 32, 16)

    def calls(strategy: str) -> int:
        return comm_time(shape, strategy, ParallelDims(dp_replicate=4, ep=2), 2, 1, 1, precision, _link).calls

    assert calls("zero1") - calls("ddp") == after
