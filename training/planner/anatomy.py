"""What the cost model needs to know of a model, measured from the built module.

Nothing is derived from a shape only one model has: the parameters are counted, the FLOPs of one
forward + backward are counted by torch's FlopCounterMode, the bytes autograd saves for backward
are counted by saved-tensor hooks, and a block's output is looked at for its width and positions.
On the meta device all of it works without memory or compute (a 70 B model at its real shape in
seconds on a laptop), which is how every plan measures a model, whatever its size or sequence.

Attention is counted as the fused kernels run it (no b x heads x s x s matrix saved), and causal
attention's FLOPs as half of the full score matrix (FlopCount).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from common.errors import ContractError
from training.config import REPLICATED_STYLE, ModelConfig
from training.contract.calls import (
    Batch,
    LossFn,
    batch_loss,
    batch_size,
    build_model,
    model_loss,
    tokens_per_sample,
)
from training.contract.experts import capacity_factor_of
from training.contract.spec import ExpertSite, ModelSpec, model_spec, tp_divisors
from training.memory import AuditRow, SavedActivations, memory_audit
from training.parallel.float8 import float8_linears
from training.planner.counting import FlopCount, fused_attention_on_meta
from training.planner.shape import Activations, Anatomy, Shape, extended, kept_share


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list):
        return next((o for o in output if isinstance(o, torch.Tensor)), None)
    for attr in ("last_hidden_state", "logits"):
        if isinstance(getattr(output, attr, None), torch.Tensor):
            return getattr(output, attr)
    return None


@dataclass(frozen=True)
class Counted:
    """A model's anatomy, and the convention its FLOPs were counted by."""

    anatomy: Anatomy
    flops_convention: str
    """`causal_half`: causal attention's score and value products were counted as half of the full
    s x s matrix (NVIDIA NeMo's model-FLOPs formulas and FlashAttention's benchmarks: the fused
    kernels skip the masked half); `full`: nothing was halved (no causal attention was seen)."""


def measure_anatomy(model: nn.Module, spec: ModelSpec, loss: LossFn, batch: Batch) -> Counted:
    """One counted forward and backward of `batch` through `model`, on the meta device (no memory,
    no compute; the plan's way) or the CPU; attention as the fused kernels run it (FlopCount)."""
    seen: dict[str, torch.Tensor] = {}
    watched = spec.blocks[0].module if spec.blocks else model

    def keep_output(module: nn.Module, args: object, output: object) -> None:
        tensor = _first_tensor(output)
        if tensor is not None and "out" not in seen:
            seen["out"] = tensor

    from training.parallel.cp import count_attention_calls, takes_position_ids

    hook = watched.register_forward_hook(keep_output)
    saved = SavedActivations(model)
    sites = expert_sites(model, spec)
    top_k: dict[str, int] = {}
    routes = [s.module.register_forward_pre_hook(_record_top_k(top_k, s.name), with_kwargs=True) for s in sites]
    try:
        with FlopCount() as flops, saved, count_attention_calls() as attention:
            batch_loss(model, batch, loss).backward()
    finally:
        for handle in [hook, *routes]:
            handle.remove()
        model.zero_grad(set_to_none=True)
    samples = batch_size(batch)
    out = seen.get("out")
    hidden = out.shape[-1] if out is not None and out.dim() >= 2 else 1
    positions = out.numel() // (samples * hidden) if out is not None else 1
    shape = shape_of(model, spec, hidden, positions)
    # Context parallelism splits attention that goes through scaled_dot_product_attention, in a
    # model that takes the true positions of its tokens (training/parallel/cp.py).
    splittable = attention.calls > 0 and takes_position_ids(model) and positions > 1
    experts = expert_flops_per_token(sites, top_k)
    anatomy = Anatomy(
        shape=dataclasses.replace(shape, context_parallel=splittable, kv_width=attention.kv_width,
                                  top_k=max(top_k.values(), default=0),
                                  expert_flops_share=experts * positions / max(flops.total / samples, 1)),
        flops_per_sample=flops.total / samples,
        activations=Activations(saved=saved.bytes / samples),
        tokens_per_sample=tokens_per_sample(batch),
    )
    return Counted(anatomy, flops.convention)


def expert_sites(model: nn.Module, spec: ModelSpec) -> list[ExpertSite]:
    """The experts modules the model's expert plan names; none where it declares none or its plan
    does not fit (expert parallelism is then not an option for it)."""
    try:
        return spec.experts(model)
    except ContractError:
        return []


def expert_flops_per_token(sites: list[ExpertSite], top_k: dict[str, int]) -> float:
    """Forward and backward FLOPs of one token through the routed experts: in each experts module,
    6 x the parameters of the `top_k[name]` experts it is sent to (2 FLOPs a parameter forward, 4
    backward), times the share of the slots a capacity factor below 1 keeps when routing is
    balanced (what the meta count ran)."""
    return sum(6 * top_k.get(s.name, 0) * count_params(s.module) / s.n_experts * kept_share(capacity_factor_of(s.module))
               for s in sites)


def _record_top_k(seen: dict[str, int], name: str) -> Callable[..., None]:
    """A pre-hook on an experts module: the experts each token is sent to, as its forward is called
    (`top_k_index`: tokens x k). Counted, not read from a config: each family names it its own way."""

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        seen[name] = int(index.shape[-1])

    return record


def shape_of(model: nn.Module, spec: ModelSpec, hidden: int, positions: int) -> Shape:
    """The parameter layout the cost model reasons about: blocks, what tensor parallelism splits,
    what only the first and last pipeline stage hold, and what the TP degree must divide."""
    params = count_params(model)
    block_params = sum(count_params(b.module) for b in spec.blocks)
    try:
        plan = spec.tp_plan(model) if spec.plan is not None else {}
    except ContractError:
        plan = {}  # a plan we can't apply: TP is not an option for this model
    split = sum(count_params(model.get_submodule(name)) for name, style in plan.items() if style != REPLICATED_STYLE)
    whole = [model.get_submodule(name) for name, style in plan.items() if style == REPLICATED_STYLE]
    try:
        norms = [model.get_submodule(name) for name in spec.sp_norms(model)] if plan else []
    except ContractError:
        norms = []  # sequence parallelism is not an option for this model
    head = spec.head(model) if plan else None
    sites = expert_sites(model, spec)
    in_float8 = {id(m) for m in float8_linears([b.module for b in spec.blocks], [s.module for s in sites])}
    split_styles = [style for name, style in plan.items() if id(model.get_submodule(name)) in in_float8]
    divisors = tp_divisors(model, plan) if plan else {}
    heads = max((v for k, v in divisors.items() if not k.endswith("_features")), default=1)
    try:
        layout = spec.layout(model)
        first = sum(count_params(m) for m in layout.parts(model, layout.first))
        last = sum(count_params(m) for m in layout.parts(model, layout.last))
        pipeline = True
    except ContractError:
        first, last, pipeline = params - block_params, 0, False
    # Whatever belongs to neither a block nor a declared end (a shared norm, say) sits with the first stage.
    first += params - block_params - first - last
    return Shape(
        experts=tuple(s.n_experts for s in sites),
        expert_params=sum(count_params(s.module) for s in sites),
        capacity_factor=min((f for s in sites if (f := capacity_factor_of(s.module)) is not None), default=None),
        params=params,
        layers=len(spec.blocks),
        block_linear_params=split,
        tp_whole_params=sum(count_params(m) for m in whole),
        sequence_norm_params=sum(count_params(m) for m in norms),
        tp_whole_tensors=sum(len(list(m.parameters())) for m in whole),
        sequence_norm_tensors=sum(len(list(m.parameters())) for m in norms),
        hidden=hidden,
        seq_len=positions,
        heads=heads,
        first_stage_params=first,
        last_stage_params=last,
        tp_sizes=tuple(sorted(set(divisors.values()))),
        pipeline=pipeline,
        head_params=count_params(model.get_submodule(head)) if head is not None else 0,
        tp_column_linears=sum(style.startswith("colwise") for style in split_styles),
        tp_row_linears=sum(style.startswith("rowwise") for style in split_styles),
    )


@dataclass(frozen=True)
class VariantCost:
    """One precision and activation-checkpointing setting of a model, per sample."""

    precision: str
    activation_checkpointing: str
    executed_flops_per_sample: float
    """What the device computes: the model's FLOPs, plus the recomputed forward under checkpointing."""
    activations: Activations
    """Saved for backward, as a GPU's fused attention saves it, with the loss's gradient temporaries
    at the start of backward, and how TP and SP split it (training/activations.py)."""
    float8_flops_per_sample: float = 0.0
    """Of the executed FLOPs, those fp8's Float8 linears run on fp8 tensor cores (every linear's
    matmuls, forward and backward, the recomputed ones included); 0 in any other precision."""


def build_on_meta(cfg: ModelConfig, seed: int, precision: str = "fp32",
                  checkpointing: str = "none") -> tuple[nn.Module, ModelSpec]:
    """The model at its real shape on the meta device (nothing allocated), in `precision` as the
    trainer runs it (low-precision parameters, floating inputs cast at its entry:
    training/parallel/precision.py) and with `checkpointing`."""
    from training.contract.hf import count_experts_as_routed
    from training.parallel.ac import apply_ac
    from training.parallel.float8 import apply_float8
    from training.parallel.precision import DTYPES, apply_low_precision

    with torch.device("meta"):
        model = build_model(cfg, seed)
    count_experts_as_routed(model)  # a Hugging Face MoE's experts, countable on the meta device
    if DTYPES[precision] is not None:
        apply_low_precision(model, DTYPES[precision])
    spec = model_spec(model, cfg)
    if precision == "fp8":  # the blocks' linears, as the trainer converts them (training/parallel/compose.py)
        apply_float8([b.module for b in spec.blocks], [site.module for site in expert_sites(model, spec)])
    if checkpointing != "none":
        apply_ac(spec.blocks, checkpointing)
    return model, spec


_MEASURED: dict[str, VariantCost] = {}


def measure_variant(cfg: ModelConfig, seed: int, sample: Batch, precision: str, checkpointing: str) -> VariantCost:
    """The model at its real shape on the meta device, in `precision` with `checkpointing`: its
    saved activations and executed FLOPs for one sample (`sample`, on the meta device). Once per
    process for the same model, sample shape and settings: the meta run is deterministic, and it
    is what a what-if plan of a large model spends its time on (~13 s per variant for Llama 3 405B
    here), which a study or the published table repeats for every cluster fraction it tries."""
    shapes = [(k, tuple(t.shape), t.dtype) for k, t in (sample.items() if isinstance(sample, dict) else enumerate(sample))]
    key = repr((cfg, seed, shapes, precision, checkpointing))
    if key not in _MEASURED:
        _MEASURED[key] = _by_layers(cfg, seed, sample, precision, checkpointing)
    return _MEASURED[key]


BUILTIN_GPT = "training.models.gpt.build"
DEPTH_KEYS = {BUILTIN_GPT: "n_layers", "training.models.hf.causal_lm": "num_hidden_layers"}
"""The model factories whose depth is one keyword, and the keyword."""

_ALIKE: dict[str, bool] = {}


def _uniform_depth(cfg: ModelConfig) -> int | None:
    """The depth of a model whose counts are extended from one layer and two (_by_layers): one
    deeper than 2 whose factory takes its depth as a keyword (DEPTH_KEYS) and whose blocks are all
    alike; None for any other model (counted whole)."""
    key = DEPTH_KEYS.get(cfg.target)
    layers = cfg.kwargs.get(key) if key is not None else None
    if not isinstance(layers, int) or layers <= 2:
        return None
    return layers if _blocks_alike(cfg) else None


def _blocks_alike(cfg: ModelConfig) -> bool:
    """Whether every block of the model is the same computation: the built-in GPT's are; a Hugging
    Face model's when its decoder layers print alike (class, submodules, shapes: not so with dense
    first layers or MLP-only layers) and no per-layer list in its config varies (sliding-window
    layer types, layers without RoPE), which the modules don't show."""
    if cfg.target == BUILTIN_GPT:
        return True
    key = repr(cfg)
    if key not in _ALIKE:
        with torch.device("meta"):
            model = build_model(cfg, 0)
        blocks = [b.module for b in model_spec(model, cfg).blocks]
        config = getattr(model, "config", None)
        per_layer = [v for v in (vars(config).values() if config is not None else ())
                     if isinstance(v, list | tuple) and len(v) == len(blocks) and len(set(map(repr, v))) > 1]
        _ALIKE[key] = len({repr(b) for b in blocks}) == 1 and not per_layer
    return _ALIKE[key]


def _at_depth(cfg: ModelConfig, layers: int) -> ModelConfig:
    return dataclasses.replace(cfg, kwargs=dict(cfg.kwargs, **{DEPTH_KEYS[cfg.target]: layers}))


def _by_layers(cfg: ModelConfig, seed: int, sample: Batch, precision: str, checkpointing: str) -> VariantCost:
    """A large model's meta forward runs every layer op by op (DeepSeek-V3's shape, 256 experts x 61
    layers: 197 s for one variant here; Llama 3 405B's 126 layers, ~13 s). When its blocks are all
    alike (_uniform_depth), every count is what lies outside the blocks plus the layers times one
    block's: the counts of the same model at one layer and at two give every count of it exactly."""
    layers = _uniform_depth(cfg)
    if layers is None:
        return _measure_variant(cfg, seed, sample, precision, checkpointing)
    one, two = (_measure_variant(_at_depth(cfg, n), seed, sample, precision, checkpointing) for n in (1, 2))
    counts = {f.name: extended(getattr(one, f.name), getattr(two, f.name), layers)
              for f in dataclasses.fields(VariantCost) if isinstance(getattr(one, f.name), float)}
    return dataclasses.replace(one, **counts, activations=one.activations.extended(two.activations, layers))


def count_on_meta(cfg: ModelConfig, seed: int, batch: Batch) -> Counted:
    """measure_anatomy of the model built on the meta device at its real shape. A model whose blocks
    are all alike is run at one layer and at two (DeepSeek-V3's shape whole: 94 s here) and its
    FLOPs and saved bytes extended to its depth, exactly as _by_layers does; its Shape is read from
    the whole model, built but not run."""
    layers = _uniform_depth(cfg)
    if layers is None:
        model, spec = build_on_meta(cfg, seed)
        return measure_anatomy(model, spec, model_loss(cfg), batch)
    counted = [count_on_meta(_at_depth(cfg, n), seed, batch) for n in (1, 2)]
    one, two = (c.anatomy for c in counted)
    flops = extended(one.flops_per_sample, two.flops_per_sample, layers)
    model, spec = build_on_meta(cfg, seed)
    sites = expert_sites(model, spec)
    small = one.shape
    experts = expert_flops_per_token(sites, {s.name: small.top_k for s in sites})
    shape = dataclasses.replace(shape_of(model, spec, small.hidden, small.seq_len),
                                context_parallel=small.context_parallel, kv_width=small.kv_width, top_k=small.top_k,
                                expert_flops_share=experts * small.seq_len / max(flops, 1))
    anatomy = Anatomy(shape=shape, flops_per_sample=flops,
                      activations=one.activations.extended(two.activations, layers),
                      tokens_per_sample=one.tokens_per_sample)
    return Counted(anatomy, counted[0].flops_convention)


def _measure_variant(cfg: ModelConfig, seed: int, sample: Batch, precision: str, checkpointing: str) -> VariantCost:
    from training.activations import backward_temporaries, measure_tp_split
    from training.parallel.ac import apply_ac

    model, spec = build_on_meta(cfg, seed, precision)
    try:  # fully checkpointed blocks save only their inputs, whole under TP: nothing to split
        plan = spec.tp_plan(model) if checkpointing != "full" and spec.plan is not None else {}
    except ContractError:
        plan = {}
    norms = _sequence_norms(model, spec)
    head = spec.head(model) if spec.plan is not None else None
    experts = [site.module for site in expert_sites(model, spec)]
    if checkpointing != "none":  # after the plan's names are read: the wrappers rename the blocks' modules
        apply_ac(spec.blocks, checkpointing)
    blocks = [b.module for b in spec.blocks]
    with FlopCount() as flops:
        split = measure_tp_split(model, plan, lambda: batch_loss(model, sample, model_loss(cfg)), blocks, norms,
                                 model.get_submodule(head) if head is not None else None, experts)
    samples = batch_size(sample)
    # A block's backward temporaries at twice the batch tell the part that grows with it from the rest.
    doubled = _doubled(sample)
    with fused_attention_on_meta():  # as FlopCount runs it
        at_double = backward_temporaries(model, blocks, lambda: batch_loss(model, doubled, model_loss(cfg)))
    per_sample = max(at_double - split.block_backward_bytes, 0) / samples
    activations = dataclasses.replace(split.per_sample(samples, bool(norms)), block_backward=per_sample,
                                      block_backward_fixed=max(split.block_backward_bytes - per_sample * samples, 0))
    return VariantCost(precision, checkpointing, flops.total / samples, activations,
                       flops.float8 / samples)


def _doubled(batch: Batch) -> Batch:
    """`batch` twice over, along its first dimension."""
    if isinstance(batch, dict):
        return {k: torch.cat([v, v]) for k, v in batch.items()}
    return type(batch)(torch.cat([t, t]) for t in batch)


def _sequence_norms(model: nn.Module, spec: ModelSpec) -> list[nn.Module]:
    """The model's sequence-parallel norms; none when it declares none."""
    try:
        return [model.get_submodule(name) for name in spec.sp_norms(model)]
    except ContractError:
        return []


def meta_memory_audit(cfg: ModelConfig, seed: int, batch: Batch, precision: str) -> list[AuditRow]:
    """training/memory.py's audit of one forward and backward of `batch` (on the meta device), the
    model built there in `precision` as the trainer runs it: the live set counted from the tensors,
    attention as the fused kernels save it; nothing allocated at any size."""
    model, spec = build_on_meta(cfg, seed, precision)
    loss = model_loss(cfg)
    with fused_attention_on_meta():
        return memory_audit(model, [b.module for b in spec.blocks], lambda: batch_loss(model, batch, loss),
                            torch.device("meta"))
