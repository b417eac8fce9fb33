"""Worker functions that the distributed tests run on real ranks (importable by the workers)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist


def ranks_sum(_inputs: object) -> dict:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"sum": t.item(), "world": dist.get_world_size(), "pid": os.getpid()}


def rendezvous_seen(_inputs: object) -> dict:
    """How this rank met its peers: MASTER_PORT (unset under launcher=local), the `host:port`
    rank 0 published in the launch's file, and the port of the store the group runs on."""
    from pathlib import Path

    from pipelines.launchers.worker import RENDEZVOUS_ENV

    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    dist.barrier()
    return {"master_port": os.environ.get("MASTER_PORT"), "published": Path(os.environ[RENDEZVOUS_ENV]).read_text(),
            "store_port": store.port}


def raise_on_rank1(_inputs: object) -> None:
    if dist.get_rank() == 1:
        raise ValueError("planted failure on rank 1")
    dist.barrier()


def kill_rank1(_inputs: object) -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)


def hang_rank1(_inputs: object) -> None:
    """Rank 1 never joins the collective: rank 0 must fail on the collective timeout."""
    if dist.get_rank() == 1:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)


def hang_rank1_in_a_subgroup(_inputs: object) -> None:
    """As hang_rank1, in a group made after the default one (as a DeviceMesh makes its dimensions')."""
    group = dist.new_group([0, 1])
    if dist.get_rank() == 1:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t, group=group)


def train_ddp(inputs: object) -> object:
    """The real train stage, with the two upstream results it reads stubbed by plain values."""
    import tempfile
    from pathlib import Path
    from types import SimpleNamespace

    from stages.train import run

    plan = SimpleNamespace(flops_per_sample=1.0, recommended=None, prediction_for_run=lambda strategy, world: None)
    lr_find = SimpleNamespace(suggested_lr=1e-2, lr_scaling="none", finder_batch=8)
    return run(inputs, plan=plan, lr_find=lr_find, trials=None, baseline=None, checkpoints=Path(tempfile.mkdtemp()))


def train_any(inputs: object) -> object:
    """The real train stage for any strategy, checkpointing into the path the test gives."""
    from pathlib import Path
    from types import SimpleNamespace

    from stages.train import run

    inputs, ckpt = inputs
    plan = SimpleNamespace(flops_per_sample=1.0, recommended=None, prediction_for_run=lambda strategy, world: None)
    lr_find = SimpleNamespace(suggested_lr=1e-2, lr_scaling="none", finder_batch=8)
    return run(inputs, plan=plan, lr_find=lr_find, trials=None, baseline=None, checkpoints=Path(ckpt))


def train_crash_once(inputs: object) -> object:
    """train_any, but rank 1 SIGKILLs itself at `kill_step` unless `marker` exists (it creates
    it first), so that the first attempt dies mid-run and the second one resumes."""
    from pathlib import Path

    import training.loop as loop

    inputs, ckpt, marker, kill_step = inputs
    original = loop.optimizer_step
    steps = iter(range(10**9))

    def crashing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - optimizer_step's own
        if next(steps) == kill_step and dist.get_rank() == 1 and not Path(marker).exists():
            Path(marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    loop.optimizer_step = crashing
    return train_any((inputs, ckpt))


def ep_against_transformers(family: str) -> object:
    """One Mixtral/Qwen3-MoE layer's experts split over the 2 ranks twice, on the same weights and on
    each rank's own tokens: by the project's dispatch (training/parallel/ep.py) and by transformers'
    own (transformers.distributed.expert_parallel, all_to_all), both from the model's
    base_model_ep_plan. Returns rank 0's view: (outputs, input gradients, this rank's expert-weight
    gradients), each pair (project, transformers)."""
    import torch
    import transformers
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    from training.config import ModelConfig
    from training.contract.experts import local_part
    from training.contract.spec import model_spec
    from training.parallel.dims import ParallelDims
    from training.parallel.ep import apply_ep, expert_groups

    experts_key = {"Mixtral": "num_local_experts", "Qwen3Moe": "num_experts"}[family]
    config = getattr(transformers, f"{family}Config")(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_experts_per_tok=2, **{experts_key: 4})
    config._experts_implementation = "eager"
    groups = expert_groups(ParallelDims(dp_replicate=1, dp_shard=2, tp=1, pp=1, ep=2), 2, "cpu")
    results = []
    for side in ("project", "transformers"):
        torch.manual_seed(0)
        model = getattr(transformers, f"{family}ForCausalLM")(config)
        spec = model_spec(model, ModelConfig())
        sites = spec.experts(model)
        if side == "project":
            apply_ep(sites, groups)
        else:
            plan = {f"{s.name}.{w}": "grouped_gemm" for s in sites for w in s.weights}
            plan.update({s.name: "ep_dispatch_experts" for s in sites})
            tp = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "tp"))["tp"]
            apply_expert_parallelism(model, groups.mesh["ep"], tp, plan, "all_to_all")
        block = model.model.layers[0].mlp
        torch.manual_seed(1 + torch.distributed.get_rank())
        x = torch.randn(2, 6, 16, requires_grad=True)
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        weights = [local_part(getattr(sites[0].module, w).grad).clone() for w in sites[0].weights]
        results.append((out.detach(), x.grad.clone(), weights))
    return results


def train_counting_all_to_alls(inputs: object) -> object:
    """train_any, with every token all-to-all of expert parallelism (training/parallel/ep.py's
    forward dispatch and combine) recorded on every rank: (rank 0's result, per rank the bytes
    each call sent, in call order)."""
    import torch.distributed as dist

    from training.parallel import ep

    sent: list[int] = []
    real = ep._all_to_all

    def recorded(output, x, output_splits, input_splits, group):  # noqa: ANN001, ANN202 - ep._all_to_all's own
        sent.append(x.numel() * x.element_size())
        return real(output, x, output_splits, input_splits, group)

    ep._all_to_all = recorded
    try:
        result = train_any(inputs)
    finally:
        ep._all_to_all = real
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, sent)
    return result, per_rank


def probe_rounds(_inputs: object) -> dict:
    """training.collectives.probe at 8 B, 4 KiB and 8 MiB with rounds=3, every measurement it
    makes recorded: how many per size, their times, and the time it kept."""
    from training import collectives

    measured: dict[int, list[float]] = {}
    real = collectives.measure

    def recording(collective: str, nbytes: int, *args: object) -> collectives.Measurement:
        result = real(collective, nbytes, *args)
        measured.setdefault(result.bytes, []).append(result.time_us)
        return result

    collectives.measure = recording
    try:
        kept = collectives.probe(["all_reduce"], [8, 4096, 8 << 20], 2, 20, rounds=3)
    finally:
        collectives.measure = real
    return {"rounds": {size: len(times) for size, times in measured.items()}, "times": measured,
            "kept": {m.bytes: m.time_us for m in kept}}



def collectives_by_rank(inputs: object) -> list[dict[str, int]]:
    """Every rank's process-group collectives of one forward + backward of the trainer's step (and
    the gradient sums after it), counted by torch's profiler as tests/unit/test_loss_parallel.py
    counts them on a fake process group, here on real ranks, where a pipeline's stages exchange
    activations (a fake group cannot). The step is run once unprofiled first: a pipeline infers
    its stages' shapes then. `inputs`: (ModelConfig, StrategyConfig, rows of the batch)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from tests.unit.test_loss_parallel import BACKEND_OPS
    from training.contract.calls import build_model, model_loss
    from training.contract.spec import model_spec
    from training.parallel.compose import parallelize

    model_cfg, strategy, rows = inputs
    model = build_model(model_cfg, 0)
    parallel = parallelize(model, model_spec(model, model_cfg), strategy, torch.device("cpu"), model_loss(model_cfg))
    tokens = torch.zeros(rows, model_cfg.kwargs["seq_len"], dtype=torch.long)
    parallel.forward_backward((tokens, tokens), 1.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        parallel.forward_backward((tokens, tokens), 1.0)
        for finish in parallel.after_backward:
            finish()
    counts = dict(Counter(BACKEND_OPS[e.name] for e in prof.events() if e.name in BACKEND_OPS))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, counts)
    return everyone
