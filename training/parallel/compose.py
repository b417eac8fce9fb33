"""One model-agnostic `apply_<technique>` per parallelism, composed here in torchtitan's order:
PP split -> TP -> activation checkpointing -> FSDP (ZeRO-2/3, HSDP) or DDP (with ZeRO-1's
sharded optimizer for zero1); context parallelism splits each batch's sequences and swaps the
attention while a step runs (training/parallel/cp.py). Each technique reads what the model
declared (its ModelSpec), never a module name of its own.

`parallelize` returns a `Parallel`: this rank's part of the model and the few operations the
training loop needs, so that the loop itself is the same for every strategy.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from training import strategies
from training.config import StrategyConfig
from training.contract.calls import Batch, LossFn, forward
from training.contract.spec import ExpertSite, ModelSpec
from training.contract.weights import Weights
from training.dist import is_dist, rank, world_size
from training.parallel.ac import apply_ac
from training.parallel.chunks import chunk_blocks, each, parts
from training.parallel.cp import ContextParallel
from training.parallel.ddp import BucketTimer, apply_ddp, time_buckets
from training.parallel.dims import ParallelDims, ddp_mesh, fsdp_mesh, resolve_dims  # noqa: F401 - re-exported
from training.parallel.ep import (
    ExpertGroups,
    apply_ep,
    expert_groups,
    expert_params,
    reduce_expert_grads,
    rescale_expert_grads,
)
from training.parallel.float8 import apply_float8
from training.parallel.fsdp import ExpertShards, apply_fsdp
from training.parallel.materialize import materialize
from training.parallel.pp import apply_pp, build_schedule, is_first, is_last
from training.parallel.precision import DTYPES, apply_low_precision
from training.parallel.schedules import checkpointing_problem, data_parallel_problem
from training.parallel.sp import sequence_layout
from training.parallel.tp import apply_tp, split_loss, sum_partial_grads


@dataclass
class Parallel:
    dims: ParallelDims
    model: nn.Module
    """This rank's part of the model, wrapped: what the optimizer steps. A pipeline rank holding
    several stages holds a PipelineChunks, one wrapped chunk per stage (training/parallel/chunks.py)."""
    dp_rank: int
    """Which slice of each global batch this rank trains on."""
    first_stage: bool
    last_stage: bool
    forward_backward: Callable[[Batch, float], torch.Tensor]
    """(batch, scale) -> this rank's detached loss x scale (0 where it computes none)."""
    no_sync: Callable[[], contextlib.AbstractContextManager]
    """Context that defers the gradient reduction (all but the last accumulation micro-batch)."""
    pp_group: dist.ProcessGroup | None
    scaler: torch.amp.GradScaler | None
    shard_optimizer: bool
    dp_group: dist.ProcessGroup | None
    bucket_timer: BucketTimer | None
    """Per-bucket all-reduce times (strategy.time_buckets with DDP)."""
    masters: dict[nn.Parameter, torch.Tensor]
    """bf16 parameter -> the fp32 parameter it was cast from (layouts without FSDP in bf16): the
    optimizer's master weights (training/optim.py). Empty where the parameters are their own."""
    cp: ContextParallel | None = None
    """This rank's context parallelism (cp > 1): its split of the sequence, its K/V traffic."""
    experts: ExpertGroups | None = None
    """Expert parallelism (strategy.ep > 1): the ranks splitting the experts and their replicas."""
    after_backward: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    """Run after a step's last backward, in order: the reductions of gradients no wrapper reduces
    (experts split over ranks under DDP, reduced over their replicas alone; the TP ranks' partial
    gradients without FSDP) and the experts' rescaling under FSDP."""
    expert_sites: list[ExpertSite] = dataclasses.field(default_factory=list)
    """The experts modules this rank holds (the model's expert plan): their loads are counted."""

    @property
    def loss_owners(self) -> int:
        """Ranks that compute a loss each step (the last pipeline stage of every replica)."""
        return self.dims.world_size // self.dims.pp


@dataclass(frozen=True)
class Techniques:
    """Which apply_<technique> a strategy uses on these degrees."""

    pp: bool
    tp: bool
    fsdp: bool
    ddp: bool
    cp: bool = False
    cp_replicates: bool = False
    """The CP ranks are replicas of the gradient wrapper (DDP strategies), not FSDP shards."""


def techniques(strategy: StrategyConfig, dims: ParallelDims, probe: bool = False) -> Techniques:
    """The techniques of `strategy` at `dims`. `probe`: apply the strategy's wrappers even at degree
    1 (the overhead probe measures them on a one-rank group).

    CP ranks hold the same parameters, so the gradient wrapper reduces over them too
    (ParallelDims.gradient_ranks: FSDP shards over dp_shard x cp, DDP replicates over
    dp_replicate x cp)."""
    named = probe and dims.world_size == 1
    declared = strategies.get(strategy.name)
    cp_replicates = dims.cp_enabled and declared.wrapper == "ddp"
    replicas, _ = dims.gradient_ranks(declared.wrapper)
    tp = dims.tp_enabled or (named and declared.degrees["tp"] == -1)
    fsdp = dims.uses_fsdp(declared.wrapper) or (named and declared.wrapper == "fsdp")
    ddp = not fsdp and (replicas > 1 or (named and declared.wrapper == "ddp"))
    return Techniques(pp=dims.pp_enabled, tp=tp, fsdp=fsdp, ddp=ddp, cp=dims.cp_enabled, cp_replicates=cp_replicates)


def parallelize(model: nn.Module, spec: ModelSpec, strategy: StrategyConfig, dev: torch.device, loss: LossFn,
                layout_only: bool = False, probe: bool = False) -> Parallel:
    """Apply `strategy` to `model` (on `dev`, or on the meta device pending its shards) over the
    default process group, in torchtitan's order: PP split -> TP -> activation checkpointing ->
    FSDP, then the shards materialized on `dev`, then bf16 parameters or DDP.

    `spec` is what the model declared (its blocks, plans). `layout_only` stops at the sharded model
    (no DDP wrapper, no pipeline schedule): what a dry run on a fake process group and the meta
    device needs to measure each rank's share. `probe` applies the wrappers on a one-rank group."""
    dims = resolve_dims(strategy, world_size())
    use = techniques(strategy, dims, probe)
    dtype = DTYPES[strategy.precision]
    wrapped = use.tp or use.fsdp or use.ddp or use.pp or use.cp
    mesh, dp_mesh = dims.build_mesh(dev.type) if is_dist() and wrapped else (None, None)
    cp = ContextParallel(mesh["cp"].get_group(), mesh["cp"].get_local_rank(), dims.cp) if use.cp else None
    if cp is not None:
        cp.install(model)  # the module whose forward takes position_ids (a wrapper's forward passes them on)
    first = last = True
    specs = [spec]  # each chunk's spec (its own blocks): one, unless a rank holds several stages
    if use.pp:
        model, specs = _split(model, spec, strategy, dims, mesh["pp"])
        first = is_first(mesh["pp"], strategy.pp_schedule, strategy.pp_virtual_stages)
        last = is_last(mesh["pp"], strategy.pp_schedule, strategy.pp_virtual_stages)
    # Each part's experts (split under ep, counted always), named before checkpointing renames blocks.
    sites = [part_spec.experts(part, whole=not use.pp) for part, part_spec in zip(parts(model), specs, strict=True)]
    all_sites = [s for part_sites in sites for s in part_sites]
    if strategy.precision == "fp8":  # before TP, checkpointing and FSDP wrap the blocks' linears
        apply_float8([b.module for ps in specs for b in ps.live_blocks()], [s.module for s in all_sites], dev)
    split_logits = False
    if use.tp:
        for part, part_spec in zip(parts(model), specs, strict=True):
            sequence = (sequence_layout(part, part_spec, strategy.activation_checkpointing)
                        if strategy.sequence_parallel else None)
            split_logits |= apply_tp(part, part_spec.tp_plan(part), mesh["tp"], sequence, part_spec.head(part))
    if split_logits:  # the loss on vocabulary-split logits: torch's, under loss_parallel, backward too
        loss = split_loss(loss)
    if strategy.activation_checkpointing != "none":
        apply_ac(spec.live_blocks(), strategy.activation_checkpointing)
    experts = (expert_groups(dims, strategy.ep, dev.type, mesh["tp"] if use.tp else None)
               if strategy.ep > 1 and mesh is not None else None)
    if experts is not None:
        apply_ep(all_sites, experts)
    dp_group = None
    masters: dict[nn.Parameter, torch.Tensor] = {}
    if use.fsdp:
        shard_mesh = fsdp_mesh(mesh, dims, use.cp_replicates)
        for part, part_spec, part_sites in zip(parts(model), specs, sites, strict=True):
            shards = ExpertShards([s.module for s in part_sites], experts.replicas) if experts is not None else None
            apply_fsdp(part, part_spec.live_blocks(), shard_mesh, strategy.reshard, dtype, shards)
        dp_group = dp_mesh.get_group()
    if spec.pending is not None and not layout_only:
        # Sharded on the meta device: now each rank allocates and initialises its shard alone.
        pending = spec.pending
        weights = Weights(pending.weights_dir) if pending.weights_dir else None
        materialize(model, pending.names, pending.init, dev, pending.seed, weights)
        spec.pending = None
    if dtype is torch.bfloat16 and not use.fsdp:
        # FSDP's numerics without FSDP: bf16 parameters, the fp32 ones kept as the optimizer's masters.
        masters = {new: old for part in parts(model) for new, old in apply_low_precision(part, dtype).items()}
    after_backward: list[Callable[[], None]] = []
    if use.fsdp and experts is not None:
        after_backward.append(rescale_expert_grads(expert_params(all_sites), experts))
    if use.ddp:
        dp_group = ddp_mesh(mesh, dims).get_group() if mesh is not None else None
        if experts is not None:  # DDP leaves the split experts alone: their replicas reduce them
            for part, part_sites in zip(parts(model), sites, strict=True):
                own = set(expert_params(part_sites))
                part._ddp_params_and_buffers_to_ignore = [n for n, p in part.named_parameters() if p in own]
            after_backward.append(reduce_expert_grads(expert_params(all_sites), experts))
        if not layout_only:
            model = each(model, lambda m: apply_ddp(m, dev, strategy.bucket_cap_mb, strategy.find_unused_parameters
                                                    or dims.pp_enabled, process_group=dp_group, force=probe))
    if use.tp and not use.fsdp:  # FSDP sums the TP ranks' partial gradients in its own reduction
        after_backward.append(sum_partial_grads([p for part in parts(model) for p in part.parameters()], mesh["tp"]))
    # fp16 without FSDP stays on autocast over fp32 parameters: its GradScaler needs fp32 gradients.
    autocast = dtype is torch.float16 and not use.fsdp
    scaler = _scaler(strategy, use.fsdp)
    coords = dims.coordinates(rank()) if mesh is not None else {"dp": 0}
    pp_group = mesh["pp"].get_group() if use.pp else None

    def ctx():
        return torch.autocast(dev.type, dtype=dtype) if autocast else contextlib.nullcontext()

    if use.pp and not layout_only:
        loss_box = _ScaledLoss(loss)
        schedule = build_schedule(model, mesh["pp"], dev, strategy.microbatches, strategy.pp_schedule, loss_box,
                                  strategy.pp_virtual_stages)
        forward_backward = _pipeline_step(schedule, loss_box, strategy.microbatches, first, last, dev, ctx, scaler)
    else:
        forward_backward = _plain_step(model, loss, ctx, scaler)
    if split_logits:
        forward_backward = _within(loss_parallel, forward_backward)
    if cp is not None:
        forward_backward = cp.wrap(forward_backward)
    no_sync = _no_sync(model, use.fsdp)
    timer = time_buckets(parts(model)) if strategy.time_buckets else None
    return Parallel(dims, model, coords["dp"], first, last, forward_backward, no_sync, pp_group, scaler,
                    strategy.shards_optimizer_only, dp_group, timer, masters, cp, experts, after_backward, all_sites)


class _ScaledLoss:
    """The pipeline's loss function, scaled by 1/(accumulation x microbatches) for the step it runs
    in. The loss, not the gradients: torch's schedules would divide every gradient by the
    microbatches at the end of each step, an earlier accumulation micro-batch's again with it
    (torchtitan scales the loss too)."""

    def __init__(self, loss: LossFn):
        self.loss, self.scale = loss, 1.0

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(output, target) * self.scale


def _within(context: Callable[[], contextlib.AbstractContextManager], step: Callable) -> Callable:
    def within(batch: Batch, scale: float) -> torch.Tensor:
        with context():
            return step(batch, scale)

    return within


def _plain_step(model: nn.Module, loss_fn: LossFn, ctx, scaler) -> Callable:
    def step(batch: Batch, scale: float) -> torch.Tensor:
        with ctx():
            output, target = forward(model, batch)
            loss = loss_fn(output, target) * scale
        del output  # the logits: autograd keeps what backward needs; this name would keep them all
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss.detach().float()

    return step


def _pipeline_step(schedule, loss_box: _ScaledLoss, microbatches: int, first: bool, last: bool, dev, ctx,
                   scaler) -> Callable:
    if scaler is not None:
        raise ValueError("strategy.precision=fp16 is not supported with pipeline parallelism; use bf16")

    def step(batch: Batch, scale: float) -> torch.Tensor:
        assert not isinstance(batch, dict), "pipeline parallelism takes (input, target) batches (checked up front)"
        inputs, targets = batch
        loss_box.scale = scale / microbatches
        losses: list[torch.Tensor] = []
        # return_outputs=False: else the last stage keeps every microbatch's logits to the step's
        # end, to hand them back merged, and the trainer needs only the losses.
        with ctx():
            if first and last:
                schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
            elif first:
                schedule.step(inputs, return_outputs=False)
            elif last:
                schedule.step(target=targets, losses=losses, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
        if not losses:
            return torch.zeros((), device=dev)
        # Each microbatch's loss came scaled by 1/microbatches: their sum is the micro-batch's mean.
        return torch.stack([loss.detach().float() for loss in losses]).sum()

    return step


def _split(model: nn.Module, spec: ModelSpec, strategy: StrategyConfig, dims: ParallelDims,
           pp_mesh) -> tuple[nn.Module, list[ModelSpec]]:
    """This rank's pipeline stages of `model` (training/parallel/pp.py) and each chunk's spec; `spec`
    then holds this rank's blocks, in the chunks they now live in."""
    problem = (data_parallel_problem(strategy.pp_schedule, dims.world_size // (dims.pp * dims.tp))
               or checkpointing_problem(strategy.pp_schedule, strategy.activation_checkpointing))
    if problem is not None:
        raise ValueError(f"strategy.pp_schedule={strategy.pp_schedule}: {problem}")
    layout = spec.layout(model)
    model = apply_pp(model, layout, pp_mesh, strategy.pp_schedule, strategy.pp_virtual_stages)
    specs = [dataclasses.replace(spec, blocks=chunk_blocks(part, layout)) for part in parts(model)]
    spec.blocks = [block for part_spec in specs for block in part_spec.blocks]
    if spec.pending is not None:  # the chunks' copies of the modules above the blocks, by their names
        spec.pending.names.update({m: n for part in parts(model) for n, m in part.named_modules()})
    return model, specs


def _no_sync(model: nn.Module, fsdp: bool) -> Callable[[], contextlib.AbstractContextManager]:
    """Context that defers every chunk's gradient reduction (FSDP's, or DDP's no_sync)."""
    each_chunk = [_fsdp_no_sync(part) if fsdp else getattr(part, "no_sync", None) or contextlib.nullcontext
                  for part in parts(model)]
    if len(each_chunk) == 1:
        return each_chunk[0]

    @contextlib.contextmanager
    def no_sync():
        with contextlib.ExitStack() as stack:
            for chunk_no_sync in each_chunk:
                stack.enter_context(chunk_no_sync())
            yield

    return no_sync


def _fsdp_no_sync(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    @contextlib.contextmanager
    def no_sync():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return no_sync


def _scaler(strategy: StrategyConfig, fsdp: bool) -> torch.amp.GradScaler | None:
    if strategy.precision != "fp16":
        return None
    if fsdp:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler("cuda")
    return torch.amp.GradScaler("cuda")


def build_optimizer(parallel: Parallel, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over this rank's parameters, its state created now and stepped a chunk at a time
    (training/optim.py): over fp32 masters of bf16 parameters where the layout has no FSDP,
    sharded over the data-parallel ranks under zero1 (ZeRO's P_os: each rank updates and
    broadcasts its share), split experts over their replicas."""
    from training.optim import MasterAdamW

    params = [p for p in parallel.model.parameters() if p.requires_grad]
    shard_over = None
    if parallel.shard_optimizer and parallel.dp_group is not None:
        # Split experts differ between data-parallel ranks: only their replicas share them out.
        split = set(expert_params(parallel.expert_sites)) if parallel.experts is not None else set()
        dense = [p for p in params if p not in split]
        shard_over = [(dense, parallel.dp_group)]
        if split:
            shard_over.append(([p for p in params if p in split], parallel.experts.replicas.get_group()))
    optimizer = MasterAdamW(params, parallel.masters, lr, weight_decay, shard_over)
    parallel.masters.clear()  # the optimizer holds the masters of its partition; the rest are freed
    return optimizer


def clip_grad_norm(parallel: Parallel, max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm over every rank's part of the model (sharded gradients are
    DTensors, split experts among them; pipeline stages each hold some layers, so their squared
    norms are summed)."""
    return clip_model_grads(parallel.model, max_norm, parallel.pp_group)


def clip_model_grads(model: nn.Module, max_norm: float, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """clip_grad_norm on a model, wrapped or not; `pp_group` sums the pipeline stages' norms."""
    # TP mixes DTensor gradients with plain (replicated) ones, and FSDP+TP puts DTensors on two
    # meshes; norms don't mix those, so take each group's norm and combine the squares.
    params = [p for p in model.parameters() if p.grad is not None]
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    squared = torch.zeros((), device=params[0].device if params else None)
    for group in by_mesh.values():
        norm = nn.utils.get_total_norm([p.grad for p in group])
        squared = squared + (norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2
    if pp_group is not None:
        dist.all_reduce(squared, group=pp_group)
    norm = squared.sqrt()
    for group in by_mesh.values():
        nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


TIMED_LR = 1e-4
"""The learning rate of a step that is only timed or measured (plan's rulers, the overhead probe):
AdamW's work does not depend on it."""


def trainable(model: nn.Module, spec: ModelSpec, strategy: StrategyConfig, dev: torch.device, loss: LossFn,
              lr: float = TIMED_LR, weight_decay: float = 0.0,
              probe: bool = False) -> tuple[Parallel, torch.optim.Optimizer]:
    """`model` made trainable by `strategy`: parallelized (`parallelize`) and its optimizer at `lr`
    (`build_optimizer`). The one way a setting is set up wherever a step runs: train and trials
    (stages/setting.py), lr_find's ramp, plan's timed step and the overhead probe."""
    parallel = parallelize(model, spec, strategy, dev, loss, probe=probe)
    return parallel, build_optimizer(parallel, lr, weight_decay)
