"""Loss parallelism: which head tensor parallelism splits by vocabulary, the collectives that
costs as the trainer runs it (a fake process group: no ranks), and the memory and communication
the cost model charges for it."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from unittest import mock

import pytest
import torch

from training.config import ModelConfig, StrategyConfig, Target
from training.contract.calls import build_model
from training.contract.spec import model_spec
from training.parallel.dims import ParallelDims
from training.planner.comm import comm_time
from training.planner.memory import activation_memory, params_per_rank
from training.planner.shape import Activations, Shape
from training.planner.workload import Workload

V, H = 512, 64
GPT = ModelConfig(name="gpt", kwargs=dict(vocab_size=V, d_model=H, n_layers=2, n_heads=4, seq_len=16))
OWN_LOSS = dataclasses.replace(GPT, loss=Target(target="training.contract.calls.cross_entropy", kwargs={}))


def test_the_head_is_the_pipeline_layouts_last_linear_unless_the_loss_is_the_users(compose_cfg):
    gpt = build_model(GPT, 0)
    assert model_spec(gpt, GPT).head(gpt) == "output"
    assert model_spec(gpt, OWN_LOSS).head(gpt) is None, "a loss of the user's own gets whole logits"
    llama_cfg = compose_cfg("model=hf-llama", "tracking=none").model
    llama = build_model(llama_cfg, 0)
    assert model_spec(llama, llama_cfg).head(llama) == "lm_head"
    tied_cfg = compose_cfg("model=hf-llama", "+model.tie_word_embeddings=true", "tracking=none").model
    tied = build_model(tied_cfg, 0)
    assert model_spec(tied, tied_cfg).head(tied) is None, "a head tied to the embeddings stays whole"


def test_the_shape_counts_the_heads_parameters():
    from training.planner.anatomy import shape_of

    gpt = build_model(GPT, 0)
    assert shape_of(gpt, model_spec(gpt, GPT), H, 16).head_params == V * H
    assert shape_of(gpt, model_spec(gpt, OWN_LOSS), H, 16).head_params == 0


@contextlib.contextmanager
def _counting_collectives():
    """Counts DTensor's and torch's loss-parallel collectives, by name, as they are called (each
    goes through torch's functional collectives module)."""
    import torch.distributed._functional_collectives as funcol

    counts: Counter[str] = Counter()

    def counted(name: str):  # noqa: ANN202
        original = getattr(funcol, name)

        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            counts[name] += 1
            return original(*args, **kwargs)

        return mock.patch.object(funcol, name, call)

    with counted("all_reduce"), counted("all_gather_single"), counted("reduce_scatter_single"):
        yield counts


def _collectives(model_cfg: ModelConfig, tp: int = 2, strategy: StrategyConfig | None = None) -> tuple[int, int]:
    """(all-reduces, all collectives) of one forward + backward of the trainer's step at `tp`
    (`strategy`: plain TP), as rank 0 of a fake process group runs it."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from training.contract.calls import model_loss
    from training.parallel.compose import parallelize

    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        model = build_model(model_cfg, 0)
        parallel = parallelize(model, model_spec(model, model_cfg), strategy or StrategyConfig(name="tp"),
                               torch.device("cpu"), model_loss(model_cfg))
        tokens = torch.zeros(2, 16, dtype=torch.long)
        with _counting_collectives() as counts:
            parallel.forward_backward((tokens, tokens), 1.0)
        return counts["all_reduce"], sum(counts.values())
    finally:
        dist.destroy_process_group()


BACKEND_OPS = {"c10d::allreduce_": "all_reduce", "c10d::allgather_into_tensor_coalesced_": "all_gather",
               "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter"}
"""The process group's own operations under DTensor's collectives, by the cost model's names."""


def _executed(model_cfg: ModelConfig, strategy: StrategyConfig, tp: int = 2) -> Counter[str]:
    """The collectives a step's forward + backward (and the gradient sums after it) runs at `tp`, as rank 0 of a
    fake process group runs it: the process group's operations, as torch's profiler records them.
    Counted there, not at torch's Python functions: a reduction selective checkpointing keeps is
    called again in the recomputed forward, and the checkpoint's cache answers it without the
    process group (ProcessGroup calls made from Python under a dispatch mode, which TP makes none
    of, would be recorded twice)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from training.contract.calls import model_loss
    from training.parallel.compose import parallelize

    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        model = build_model(model_cfg, 0)
        parallel = parallelize(model, model_spec(model, model_cfg), strategy, torch.device("cpu"), model_loss(model_cfg))
        tokens = torch.zeros(2, 16, dtype=torch.long)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            parallel.forward_backward((tokens, tokens), 1.0)
            for finish in parallel.after_backward:  # the step's sums of partial gradients
                finish()
        return Counter(BACKEND_OPS[e.name] for e in prof.events() if e.name in BACKEND_OPS)
    finally:
        dist.destroy_process_group()


def _priced(shape: Shape, strategy: StrategyConfig) -> Counter[str]:
    """The calls comm_time prices for `strategy` at tp=2 on `shape`, by collective."""
    from training.planner.comm import Link

    seen: Counter[str] = Counter()

    class Counting(Link):
        def time(self, collective: str, nbytes: float, n: int, calls: int = 1) -> float:
            if n > 1 and nbytes > 0:
                seen[collective] += calls
            return super().time(collective, nbytes, n, calls)

    comm_time(shape, "ddp", ParallelDims(tp=2), 2, 1, 1, strategy.precision,
              lambda c, g: Counting(alpha_s=1e-5, busbw_gbps=1.0, world=2), recompute=strategy.activation_checkpointing,
              sequence_parallel=strategy.sequence_parallel)
    return seen


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_the_trainers_tp_collectives_are_the_cost_models(precision, sequence_parallel, checkpointing):
    """A 2-layer GPT at tp=2, its head split by vocabulary and without (the user's own loss), in
    bf16 and fp8, with and without SP, under each checkpointing mode: the collectives its step runs,
    by kind, are the ones the cost model prices from the model's shape. Per layer: TP 2 all-reduces
    forward and 2 backward (q, k and v share one: SharingColwise, which under checkpointing
    shares too), full checkpointing one more (attention's row split recomputed; the block's last
    not); SP 6 all-gathers and 4 reduce-scatters (one more under full) and 2 all-gathers outside
    the blocks, and after backward one all-reduce of the norms' partial gradients; fp8 20 scalar
    all-reduces of its scales (28 under checkpointing). The split head adds 4 all-reduces (the
    loss's three per position and the head's input gradient)."""
    from training.planner.anatomy import shape_of

    strategy = StrategyConfig(name="tp", precision=precision, sequence_parallel=sequence_parallel,
                              activation_checkpointing=checkpointing)
    for cfg in (GPT, OWN_LOSS):
        model = build_model(cfg, 0)
        shape = shape_of(model, model_spec(model, cfg), H, 16)
        assert (shape.tp_column_linears, shape.tp_row_linears) == (4 * 2, 2 * 2)  # q, k, v, w1; wo, w2
        assert _executed(cfg, strategy) == _priced(shape, strategy)
    layer_scales = 0 if precision == "bf16" else 20 + 8 * (checkpointing != "none")
    split_head = 4
    if sequence_parallel:
        expected = {"all_gather": 2 * 6 + 2, "reduce_scatter": 2 * (4 + (checkpointing == "full")),
                    "all_reduce": 2 * layer_scales + split_head + 1}  # + the norms' partial gradients, summed
    else:
        expected = {"all_reduce": 2 * (4 + (checkpointing == "full") + layer_scales) + split_head}
    assert _executed(GPT, strategy) == expected


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("model,split", [("hf-llama", (5, 2)), ("hf-qwen3-moe", (3, 1))])
def test_hugging_face_models_tp_collectives_in_fp8_are_the_cost_models(compose_cfg, model, split,
                                                                        sequence_parallel, checkpointing):
    """Hugging Face's Llama (its own plan: q, k, v, gate and up split by columns, o and down by
    rows; the head by vocabulary) and Qwen3-MoE (attention split as Llama's, its per-head q/k norms
    kept whole; its mixture of experts in no plan, so without TP's collectives, and in bf16) at tp=2
    in fp8: each Float8 linear's scale reductions, and the rest, as the cost model prices them from
    the model's shape."""
    from training.planner.anatomy import shape_of

    cfg = compose_cfg(f"model={model}", "tracking=none").model
    strategy = StrategyConfig(name="tp", precision="fp8", sequence_parallel=sequence_parallel,
                              activation_checkpointing=checkpointing)
    model = build_model(cfg, 0)
    shape = shape_of(model, model_spec(model, cfg), model.config.hidden_size, 16)
    assert (shape.tp_column_linears, shape.tp_row_linears) == (split[0] * shape.layers, split[1] * shape.layers)
    assert _executed(cfg, strategy) == _priced(shape, strategy)


@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_a_moe_layer_under_sequence_parallelism_takes_whole_tokens_and_reduce_scatters_nothing(checkpointing):
    """tp=2 with sequence parallelism, a 2-layer GPT and the same with 4 experts in each block: the
    MoE layers take the gathered norm output whole and cut their output by position, so against
    the dense blocks they make 2 reduce-scatters fewer each (forward and backward) and, where the
    column-split linears re-gather their saved shard (no checkpointing), one all-gather fewer: what
    the cost model takes off."""
    from training.planner.anatomy import shape_of

    moe = dataclasses.replace(OWN_LOSS, kwargs={**OWN_LOSS.kwargs, "n_experts": 4, "top_k": 2})
    strategy = StrategyConfig(name="tp", sequence_parallel=True, activation_checkpointing=checkpointing)
    model = build_model(moe, 0)
    shape = shape_of(model, model_spec(model, moe), H, 16)
    assert shape.experts == (4, 4)
    executed, dense = _executed(moe, strategy), _executed(OWN_LOSS, strategy)
    assert executed == _priced(shape, strategy)
    assert dense["reduce_scatter"] - executed["reduce_scatter"] == 2 * 2
    assert dense["all_gather"] - executed["all_gather"] == 2 * (checkpointing == "none")


def _link(collective, group):  # noqa: ANN001, ANN202 - any α–β link: only the calls are counted
    from training.planner.comm import Link

    return Link(alpha_s=1e-5, busbw_gbps=1.0, world=2)


SHAPE = Shape(params=2000, layers=4, block_linear_params=800, hidden=8, seq_len=4, heads=2,
              first_stage_params=300, last_stage_params=200, head_params=180)


def _workload(**kw) -> Workload:
    fields = dict(shape=SHAPE, micro_batch=2, grad_accum=1, microbatches=1, precision="fp32", checkpointing="none",
                  tokens_per_sample=4, activations=Activations(saved=1000.0, tp_replicated=600.0, outside_blocks=450.0,
                                                               loss_temp=200.0, head=100.0))
    return Workload(**{**fields, **kw})


def test_tp_splits_the_heads_logits_and_the_losss_temporaries_with_the_head():
    """Per sample at tp=4: whole 600 - 100 (logits) - 200 (temporaries) = 300; split (1000 - 200 -
    300) / 4 = 125; the temporaries three copies of the rank's share, 200 x 1.5 / 4 = 75."""
    d = ParallelDims(tp=4)
    assert activation_memory(_workload(), d) == pytest.approx(2 * (300 + 125 + 75))
    whole = dataclasses.replace(_workload(), shape=dataclasses.replace(SHAPE, head_params=0))
    assert activation_memory(whole, d) == pytest.approx(2 * (600 + 400 / 4))
    assert _workload().loss_temps(ParallelDims()) == 200, "at tp=1 the fused kernels' two copies"


def test_the_last_stage_holds_its_share_of_the_head_and_each_stage_its_own_blocks():
    """The head (180 of the last stage's 200) split over tp=2; four blocks of 375 parameters
    (1500, of which the linears 800 split) over three stages as the pipeline cuts them: 1, 1, 2."""
    blocks = (1500 - 800) + 800 / 2
    assert params_per_rank(SHAPE, ParallelDims(tp=2)) == 300 + (200 - 90) + blocks
    per_block = blocks / 4
    assert params_per_rank(SHAPE, ParallelDims(tp=2, pp=3)) == max(300 + per_block, per_block, 2 * per_block + 110)


def test_a_v_shaped_schedule_puts_both_ends_on_the_first_rank():
    """ZB-V and DualPipeV cut the four blocks into 2p stages and give rank r stages r and 2p − 1 − r:
    at pp=2 each rank holds two blocks, rank 0 the embeddings (300) and the head's share (110) too."""
    per_block = ((1500 - 800) + 800 / 2) / 4
    assert params_per_rank(SHAPE, ParallelDims(tp=2, pp=2), v_shaped=True) == 300 + 110 + 2 * per_block
    assert params_per_rank(SHAPE, ParallelDims(tp=2, pp=2)) == 300 + 2 * per_block
