"""What the stages train with: one frozen dataclass per config group.

These are the schemas of the `model`, `data`, `strategy` and `train` config groups (those that
measure and plan, `lr_find`, `bandwidth`, `plan`, `cluster` and `env`: training/plan_config.py). Each field is documented by the docstring under it. Checks that
need only the field itself live in `__post_init__` and raise `ConfigError`, which the engine
turns into one sentence naming the full key (`train.steps=0: ...`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.errors import ConfigError, at_least, one_of
from training import strategies
from training.parallel.schedules import PP_SCHEDULES, virtual_stages_problem

DEGREES = ("dp_replicate", "dp_shard", "tp", "pp")
AC_MODES = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
SCHEDULES = ("cosine", "constant")


TARGET_KEY = "_target_"
"""Hydra's key for the factory a config group instantiates."""
SP_STYLE = "sequence_parallel"
"""Hugging Face's style for a module that runs sharded over the sequence under sequence parallelism
(a norm: its parameters replicated, its input and output split by position)."""
REPLICATED_STYLE = "replicated_with_grad_allreduce"
"""Hugging Face's style for a module inside a split region whose parameters stay whole (Qwen3's
per-head q/k norms, which see only this rank's heads): its gradients are summed over the TP ranks."""
TP_STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", SP_STYLE, REPLICATED_STYLE)
"""Tensor-parallel styles in Hugging Face's words: split a linear by output columns or input rows;
`_rep` replicates the output of a column split (or expects a replicated input to a row split);
`sequence_parallel` names a norm that strategy.sequence_parallel runs split by sequence;
`replicated_with_grad_allreduce` a module between a column and a row split that is not split."""
EP_EXPERTS, EP_WEIGHTS, EP_ROUTER = "ep_dispatch_experts", "grouped_gemm", "ep_router"
EP_ROLES = (EP_EXPERTS, EP_WEIGHTS, EP_ROUTER)
"""Expert-parallel roles in Hugging Face's words (`base_model_ep_plan`): the experts module, each of
its parameters stacked along the experts, the router."""


def _check_target(key: str, target: str) -> None:
    if not isinstance(target, str) or "." not in target.strip("."):
        raise ConfigError(key, target, "must name an importable factory as 'package.module.function' "
                          "(Hydra's _target_), e.g. my_pkg.models.build")


class TargetConfig:
    """A config group that names a factory by `_target_` and passes it every key the schema does not
    declare as keyword arguments, exactly as `hydra.utils.instantiate` reads such a node. Subclasses
    are frozen dataclasses with a `target` field (`_target_` in YAML) and a `kwargs` field."""

    target: str
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Target(TargetConfig):
    """A bare `_target_` plus keyword arguments (e.g. a custom loss)."""

    target: str = ""
    """The factory, `package.module.function`."""
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_target(TARGET_KEY, self.target)


@dataclass(frozen=True)
class ModelConfig(TargetConfig):
    """The user's model: a factory returning an `nn.Module`, its keyword arguments, and what only
    the model can say about itself (its blocks, its tensor-parallel plan, its loss)."""

    target: str = "training.models.gpt.build"
    """`_target_`: the factory that returns the `nn.Module` (a function or a class)."""
    name: str = "model"
    """Name recorded in tags and reports (the preset's file name for the built-in ones)."""
    blocks: str | None = None
    """Dotted path of the model's repeated blocks (an `nn.ModuleList`/`ModuleDict`): the FSDP,
    activation-checkpointing and pipeline unit. null finds them: the model's `_no_split_modules`
    classes, else the longest list of same-class children."""
    tp_plan: dict[str, str] | None = None
    """Tensor-parallel plan: module-name pattern (`*` matches one name) -> colwise, rowwise,
    colwise_rep, rowwise_rep, sequence_parallel for a norm (strategy.sequence_parallel), or
    replicated_with_grad_allreduce for a module inside a split region that stays whole. null takes
    the model's own (`config.base_model_tp_plan`, `_tp_plan`)."""
    sp_plan: dict[str, str] | None = None
    """Sequence-parallel entries added to whichever tensor-parallel plan applies: module-name pattern
    -> `sequence_parallel`, for the norms of a model whose own plan doesn't name them (Hugging
    Face's base_model_tp_plan). null: the plan's own entries, if any."""
    ep_plan: dict[str, str] | None = None
    """Expert-parallel plan, in Hugging Face's `base_model_ep_plan` words: module-name pattern ->
    `ep_dispatch_experts` (an experts module called as `(tokens, top_k_index, top_k_weights)`),
    `grouped_gemm` (each of its parameters, stacked along the experts in dim 0) or `ep_router`
    (accepted; the router stays whole). null takes the model's own (`config.base_model_ep_plan`,
    `_ep_plan`)."""
    loss: Target | None = None
    """`loss._target_`: a factory returning `fn(output, target) -> scalar`. null: the model's own
    `.loss` when it returns one (Hugging Face, given labels), else cross-entropy of its logits."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Every other key of the group: the factory's keyword arguments."""

    def __post_init__(self) -> None:
        _check_target(TARGET_KEY, self.target)
        for pattern, style in (self.tp_plan or {}).items():
            one_of(f"tp_plan.{pattern}", style, TP_STYLES)
        for pattern, style in (self.sp_plan or {}).items():
            one_of(f"sp_plan.{pattern}", style, (SP_STYLE,))
        for pattern, role in (self.ep_plan or {}).items():
            one_of(f"ep_plan.{pattern}", role, EP_ROLES)


@dataclass(frozen=True)
class DataConfig(TargetConfig):
    """The user's data: a factory returning a map-style `Dataset` of `(input, target)` items or
    dicts (Hugging Face style: `input_ids`, `labels`), and how to load it."""

    target: str = "training.data.markov"
    """`_target_`: the factory that returns the `torch.utils.data.Dataset`."""
    name: str = "data"
    """Name recorded in tags and reports."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0 loads in the training process)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Every other key of the group: the factory's keyword arguments."""

    def __post_init__(self) -> None:
        _check_target(TARGET_KEY, self.target)
        at_least("num_workers", self.num_workers, 0)


@dataclass(frozen=True)
class StrategyConfig:
    name: str = "ddp"
    """A registered strategy (training/strategies/: ddp, zero1, zero2, zero3, tp, pp, hybrid, auto)."""
    dp_replicate: int | None = None
    """Data-parallel replicas; null takes the strategy's preset; -1 means the leftover ranks."""
    dp_shard: int | None = None
    """Data-parallel shards (FSDP); null takes the preset; -1 means the leftover ranks."""
    tp: int | None = None
    """Tensor-parallel degree; null takes the preset (`tp`: all ranks, others 1)."""
    pp: int | None = None
    """Pipeline stages; null takes the preset (`pp`: all ranks, others 1)."""
    cp: int | None = None
    """Context-parallel degree: each sequence split over this many ranks (load-balanced for causal
    attention, K/V all-gathered per layer; training/parallel/cp.py); null takes the preset (1);
    -1 means the leftover ranks. The sequence length must be a multiple of 2 x cp."""
    ep: int = 1
    """Expert-parallel degree: each mixture-of-experts layer's experts split over this many
    neighbouring ranks, tokens sent to them by all-to-all (training/parallel/ep.py); must divide
    dp_replicate x dp_shard x cp x tp (the ranks that route tokens of their own) and the experts.
    1: experts are weights like any other."""
    microbatches: int = 2
    """Pipeline microbatches per micro-batch (pp > 1); must divide the micro-batch."""
    pp_schedule: str = "gpipe"
    """Pipeline schedule: `gpipe` or `1f1b` (one stage per rank), `interleaved_1f1b` or `zero_bubble`
    (pp_virtual_stages >= 2 looped stages per rank), `zbv` or `dualpipev` (two stages per rank in a V)."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank (the model is cut into pp x this many): 1 for gpipe/1f1b, >= 2 for
    interleaved_1f1b/zero_bubble, 2 for zbv/dualpipev."""
    reshard_after_forward: bool | None = None
    """FSDP: free gathered parameters after forward (zero3) or keep them for backward (zero2);
    null takes the strategy's choice (true except for zero2)."""
    activation_checkpointing: str = "none"
    """`none`; `selective`: each block keeps its matmuls' and attention's outputs and recomputes the
    rest (norms, pointwise ops) in backward; `full`: recompute every block's activations in backward."""
    sequence_parallel: bool = False
    """With tp > 1, Megatron's sequence parallelism: the norms and the residual stream between the
    split linears are split over the sequence too (their all-reduces become an all-gather and a
    reduce-scatter); the model's plan must name its norms `sequence_parallel`. With tp = 1 a no-op."""
    precision: str = "fp32"
    """`fp32`, `bf16` (autocast, or FSDP's mixed precision with fp32 reduction), `fp16` with
    loss scaling (CUDA only), or `fp8`: bf16 with the blocks' linears' matmuls in float8, scaled
    per tensor (torchao's "tensorwise" Float8 recipe, as torchtitan runs it: training/parallel/float8.py),
    trained on CUDA GPUs of compute capability 8.9+ and on CPUs (an emulated product: the same
    numbers) under every layout, predicted on a described cluster with `cluster.fp8_peak_flops`."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB."""
    find_unused_parameters: bool = False
    """DDP: tolerate parameters that get no gradient (costs a graph traversal per step)."""
    time_buckets: bool = False
    """DDP/zero1: time each gradient bucket's all-reduce through a comm hook and log it."""

    def __post_init__(self) -> None:
        one_of("name", self.name, strategies.names())
        for key in (*DEGREES, "cp"):
            value = getattr(self, key)
            if value is not None and (value == 0 or value < -1):
                raise ConfigError(key, value, "must be >= 1, -1 (the leftover ranks) or null (the preset)")
        at_least("ep", self.ep, 1)
        at_least("microbatches", self.microbatches, 1)
        one_of("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        at_least("pp_virtual_stages", self.pp_virtual_stages, 1)
        problem = virtual_stages_problem(self.pp_schedule, self.pp_virtual_stages)
        if problem is not None:
            raise ConfigError("pp_virtual_stages", self.pp_virtual_stages, problem)
        one_of("activation_checkpointing", self.activation_checkpointing, AC_MODES)
        one_of("precision", self.precision, PRECISIONS)
        at_least("bucket_cap_mb", self.bucket_cap_mb, 1e-3, "a number")

    def degrees(self) -> dict[str, int]:
        """dp_replicate, dp_shard, tp, pp: the explicit ones, else the strategy's preset (cp apart,
        `cp_degree`: what reads these four reads them as before)."""
        preset = strategies.get(self.name).degrees
        return {k: getattr(self, k) if getattr(self, k) is not None else preset[k] for k in DEGREES}

    @property
    def cp_degree(self) -> int:
        """The context-parallel degree: `cp`, else the strategy's preset (1; -1: the leftover ranks)."""
        return self.cp if self.cp is not None else strategies.get(self.name).degrees.get("cp", 1)

    @property
    def shards_optimizer_only(self) -> bool:
        """ZeRO-1: DDP for gradients, ZeRO's optimizer for sharded optimizer state."""
        return strategies.get(self.name).shards_optimizer_only

    @property
    def reshard(self) -> bool:
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return strategies.get(self.name).reshard_after_forward

    @property
    def from_plan(self) -> bool:
        """A placeholder for the plan's recommendation (strategy=auto; Strategy.from_plan)."""
        return strategies.from_plan(self.name)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    """Optimizer steps of the scaled run (and of its 1-device baseline)."""
    micro_batch: int = 8
    """Samples per data-parallel rank per forward/backward (weak scaling: fixed per device).
    Ignored when global_batch is set."""
    global_batch: int | None = None
    """Samples per optimizer step, fixed across strategies and world sizes; the micro-batch is then
    global_batch / (data-parallel size x grad_accum) and must divide exactly."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    lr: float | None = None
    """Peak learning rate; null takes lr_find's scaled LR."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    schedule: str = "cosine"
    """`cosine` (to 10 % of peak) or `constant`, both after linear warm-up."""
    warmup_steps: int = 5
    """Linear warm-up steps at the start of the schedule."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this; null disables."""
    log_every: int = 10
    """Steps between host syncs that read the loss (the hot loop never syncs otherwise)."""
    timing_warmup: int = 3
    """First steps excluded from throughput (allocator and cache warm-up)."""
    profile_steps: int = 2
    """Steps profiled with torch.profiler (after the first, before the timed window) to split a
    step's time into communication, matmul, memcpy and other; 0 disables."""
    ckpt_every: int = 0
    """Save a distributed checkpoint every this many steps (0: never); a re-run after a crash
    resumes from the last one."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU; null uses the GPU's dense datasheet peak in the run's
    precision (training/flops.py), or reports no MFU (CPUs and unlisted GPUs)."""
    tf32: bool = True
    """On CUDA, fp32 matmuls and convolutions use TF32 tensor cores (an fp32 run's MFU is then
    against the TF32 peak); false holds them to full fp32."""
    system_metrics_s: float = 10.0
    """Seconds between per-node system metric samples (CPU, memory, and through NVML each GPU's
    utilisation, memory and power) during the run, logged as MLflow's system/<node id>/... metrics;
    0 disables."""

    def __post_init__(self) -> None:
        at_least("system_metrics_s", self.system_metrics_s, 0, "a number")
        for key in ("steps", "micro_batch", "grad_accum", "log_every"):
            at_least(key, getattr(self, key), 1)
        at_least("global_batch", self.global_batch, 1)
        for key in ("warmup_steps", "timing_warmup", "ckpt_every", "profile_steps"):
            at_least(key, getattr(self, key), 0)
        if self.lr is not None and self.lr <= 0:
            raise ConfigError("lr", self.lr, "must be a number > 0, or null to use lr_find's LR")
        at_least("weight_decay", self.weight_decay, 0, "a number")
        one_of("schedule", self.schedule, SCHEDULES)
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError("grad_clip", self.grad_clip, "must be > 0, or null to disable")
        if self.timing_warmup >= self.steps:
            raise ConfigError("timing_warmup", self.timing_warmup, f"must be < steps={self.steps}")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ConfigError("peak_flops", self.peak_flops, "must be > 0, or null")

    def global_batch_for(self, dp_size: int) -> int:
        """Samples per optimizer step over `dp_size` data-parallel replicas."""
        return self.micro_batch_for(dp_size) * self.grad_accum * dp_size

    def micro_batch_for(self, dp_size: int) -> int:
        """Per-rank micro-batch: `micro_batch`, or derived from a fixed `global_batch`."""
        if self.global_batch is None:
            return self.micro_batch
        per_rank, rest = divmod(self.global_batch, dp_size * self.grad_accum)
        if rest or not per_rank:
            raise ConfigError("train.global_batch", self.global_batch,
                              f"must be a multiple of data-parallel size {dp_size} x grad_accum {self.grad_accum}")
        return per_rank


