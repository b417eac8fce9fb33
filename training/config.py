"""What the stages train and measure with: one frozen dataclass per config group.

These are the schemas of the `model`, `data`, `strategy`, `train`, `lr_find`, `bandwidth`,
`plan` and `env` config groups. Each field is documented by the docstring under it. Checks that
need only the field itself live in `__post_init__` and raise `ConfigError`, which the engine
turns into one sentence naming the full key (`train.steps=0: ...`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.errors import ConfigError
from training import strategies
from training.parallel.schedules import PP_SCHEDULES, virtual_stages_problem


def _at_least(key: str, value: int | float | None, low: float, what: str = "an integer") -> None:
    if value is not None and value < low:
        raise ConfigError(key, value, f"must be {what} >= {low:g}")


def _one_of(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(key, value, f"must be one of {', '.join(options)}")


DEGREES = ("dp_replicate", "dp_shard", "tp", "pp")
AC_MODES = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
WHATIF_PRECISIONS = ("fp8",)
"""Precisions only a what-if plan of a described cluster predicts: nothing trains in them here."""
SCHEDULES = ("cosine", "constant")
SUGGESTION_RULES = ("steepest", "min_div_10")
LR_SCALING_RULES = ("linear", "sqrt", "none")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


TARGET_KEY = "_target_"
"""Hydra's key for the factory a config group instantiates."""
SP_STYLE = "sequence_parallel"
"""Hugging Face's style for a module that runs sharded over the sequence under sequence parallelism
(a norm: its parameters replicated, its input and output split by position)."""
TP_STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", SP_STYLE)
"""Tensor-parallel styles in Hugging Face's words: split a linear by output columns or input rows;
`_rep` replicates the output of a column split (or expects a replicated input to a row split);
`sequence_parallel` names a norm that strategy.sequence_parallel runs split by sequence."""
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
    colwise_rep, rowwise_rep, or sequence_parallel for a norm (strategy.sequence_parallel). null takes
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
            _one_of(f"tp_plan.{pattern}", style, TP_STYLES)
        for pattern, style in (self.sp_plan or {}).items():
            _one_of(f"sp_plan.{pattern}", style, (SP_STYLE,))
        for pattern, role in (self.ep_plan or {}).items():
            _one_of(f"ep_plan.{pattern}", role, EP_ROLES)


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
        _at_least("num_workers", self.num_workers, 0)


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
    data-parallel ranks, tokens sent to them by all-to-all (training/parallel/ep.py); must divide
    the data-parallel size and the experts. 1: experts are weights like any other."""
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
    loss scaling (CUDA only), or `fp8`: bf16 with the linears' matmuls in Float8 (torchao's dynamic
    scaling, as torchtitan's Float8 runs), a what-if precision for a described cluster with
    `cluster.fp8_peak_flops` (pipeline=plan): nothing trains in it here."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB."""
    find_unused_parameters: bool = False
    """DDP: tolerate parameters that get no gradient (costs a graph traversal per step)."""
    time_buckets: bool = False
    """DDP/zero1: time each gradient bucket's all-reduce through a comm hook and log it."""

    def __post_init__(self) -> None:
        _one_of("name", self.name, strategies.names())
        for key in (*DEGREES, "cp"):
            value = getattr(self, key)
            if value is not None and (value == 0 or value < -1):
                raise ConfigError(key, value, "must be >= 1, -1 (the leftover ranks) or null (the preset)")
        _at_least("ep", self.ep, 1)
        _at_least("microbatches", self.microbatches, 1)
        _one_of("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        _at_least("pp_virtual_stages", self.pp_virtual_stages, 1)
        problem = virtual_stages_problem(self.pp_schedule, self.pp_virtual_stages)
        if problem is not None:
            raise ConfigError("pp_virtual_stages", self.pp_virtual_stages, problem)
        _one_of("activation_checkpointing", self.activation_checkpointing, AC_MODES)
        _one_of("precision", self.precision, PRECISIONS)
        _at_least("bucket_cap_mb", self.bucket_cap_mb, 1e-3, "a number")

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
        _at_least("system_metrics_s", self.system_metrics_s, 0, "a number")
        for key in ("steps", "micro_batch", "grad_accum", "log_every"):
            _at_least(key, getattr(self, key), 1)
        _at_least("global_batch", self.global_batch, 1)
        for key in ("warmup_steps", "timing_warmup", "ckpt_every", "profile_steps"):
            _at_least(key, getattr(self, key), 0)
        if self.lr is not None and self.lr <= 0:
            raise ConfigError("lr", self.lr, "must be a number > 0, or null to use lr_find's LR")
        _at_least("weight_decay", self.weight_decay, 0, "a number")
        _one_of("schedule", self.schedule, SCHEDULES)
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError("grad_clip", self.grad_clip, "must be > 0, or null to disable")
        if self.timing_warmup >= self.steps:
            raise ConfigError("timing_warmup", self.timing_warmup, f"must be < steps={self.steps}")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ConfigError("peak_flops", self.peak_flops, "must be > 0, or null")

    def micro_batch_for(self, dp_size: int) -> int:
        """Per-rank micro-batch: `micro_batch`, or derived from a fixed `global_batch`."""
        if self.global_batch is None:
            return self.micro_batch
        per_rank, rest = divmod(self.global_batch, dp_size * self.grad_accum)
        if rest or not per_rank:
            raise ConfigError("train.global_batch", self.global_batch,
                              f"must be a multiple of data-parallel size {dp_size} x grad_accum {self.grad_accum}")
        return per_rank


@dataclass(frozen=True)
class LrFindConfig:
    min_lr: float = 1e-5
    """First LR of the exponential ramp."""
    max_lr: float = 1.0
    """Last LR of the ramp."""
    num_iters: int = 100
    """Steps of the ramp (fewer if the loss diverges first)."""
    batch: int | None = None
    """Samples per finder step; null uses train.micro_batch."""
    beta: float = 0.9
    """EMA smoothing of the loss (bias-corrected). Its lag is ~1/(1-beta) iterations: 0.98 over a
    100-step ramp would trail the real curve by half the LR range and push the suggestion late."""
    diverge_threshold: float = 4.0
    """Stop when the smoothed loss exceeds this multiple of the best seen."""
    suggestion: str = "steepest"
    """`steepest`: LR of the steepest descent of the smoothed loss against log-LR;
    `min_div_10`: a tenth of the LR at the minimum smoothed loss."""
    lr_scaling: str = "linear"
    """Rule from the finder's batch to the run's global batch: `linear`, `sqrt` or `none`."""

    def __post_init__(self) -> None:
        if self.min_lr <= 0:
            raise ConfigError("min_lr", self.min_lr, "must be > 0")
        if self.max_lr <= self.min_lr:
            raise ConfigError("max_lr", self.max_lr, f"must be > min_lr={self.min_lr}")
        _at_least("num_iters", self.num_iters, 5)
        _at_least("batch", self.batch, 1)
        if not 0 <= self.beta < 1:
            raise ConfigError("beta", self.beta, "must be in [0, 1)")
        if self.diverge_threshold <= 1:
            raise ConfigError("diverge_threshold", self.diverge_threshold, "must be > 1")
        _one_of("suggestion", self.suggestion, SUGGESTION_RULES)
        _one_of("lr_scaling", self.lr_scaling, LR_SCALING_RULES)


@dataclass(frozen=True)
class BandwidthConfig:
    collectives: list[str] = field(default_factory=lambda: list(COLLECTIVES))
    """Collectives to probe, nccl-tests style."""
    min_bytes: int = 8
    """Smallest message size in bytes."""
    max_bytes: int = 64 * 1024 * 1024
    """Largest message size in bytes; the verdict is taken here."""
    factor: int = 4
    """Each size is the previous one times this."""
    warmup_iters: int = 5
    """Untimed iterations per size (nccl-tests: 5)."""
    iters: int = 20
    """Timed iterations per size (nccl-tests: 20)."""
    ruler_gbps: float = 20.0
    """The bandwidth ruler: all_reduce busbw at the largest size below this keeps data parallelism
    within a few devices."""
    shared_cores: bool = True
    """CPU ranks: also measure what every rank working at once costs each (training/shared_cores.py,
    3-10 s on 2 cores); off, the plan time-shares the cores by threads x ranks / cores alone."""

    def __post_init__(self) -> None:
        if not self.collectives:
            raise ConfigError("collectives", self.collectives, f"must name at least one of {', '.join(COLLECTIVES)}")
        for name in self.collectives:
            _one_of("collectives", name, COLLECTIVES)
        _at_least("min_bytes", self.min_bytes, 4)
        if self.max_bytes < self.min_bytes:
            raise ConfigError("max_bytes", self.max_bytes, f"must be >= min_bytes={self.min_bytes}")
        if self.max_bytes > 16 * 1024**3:
            raise ConfigError("max_bytes", self.max_bytes, "must be <= 16 GiB")
        _at_least("factor", self.factor, 2)
        _at_least("warmup_iters", self.warmup_iters, 0)
        _at_least("iters", self.iters, 1)
        if self.ruler_gbps <= 0:
            raise ConfigError("ruler_gbps", self.ruler_gbps, "must be > 0")


@dataclass(frozen=True)
class PlanConfig:
    memory_fraction: float = 0.7
    """The memory ruler: a strategy fits when its peak is below this fraction of device memory."""
    device_memory_bytes: int | None = None
    """Memory of one device; null measures it (CUDA: total device memory; CPU: host memory
    divided by the ranks per node)."""
    max_dp_low_bandwidth: int = 8
    """With busbw below the ruler, keep data parallelism within this many devices."""
    max_devices: int = 1024
    """Predict step time and efficiency for 1, 2, 4 ... up to this many devices."""
    overlap: float | None = None
    """Fraction of the backward pass that data-parallel communication can hide behind; null: 1 on
    GPUs (NCCL runs on its own stream beside the backward), 0 on CPU hosts (gloo's all-reduce needs
    the same cores the backward does, so nothing hides)."""
    strategies: list[str] | None = None
    """Only recommend these (among ddp, zero1, zero2, zero3, tp, pp, hybrid); null: every layout the
    model allows. The scaling curves are drawn for the pure ones among them."""
    precisions: list[str] | None = None
    """Precisions the search may choose; null: the run's own, and bf16 where the devices support it
    (a described GPU cluster; a measured cluster is planned in the precision it was measured in)."""
    trials: int = 0
    """Measure the best this many layouts (each at its best predicted setting) with short real runs
    on the current launcher (the trials stage) and recommend the fastest measured; 0: the cost
    model decides alone."""
    trial_steps: int = 10
    """Optimizer steps of each trial, in each of its two rounds (the first two are warm-up, not timed)."""
    calibrate: bool = False
    """Refine the model's compute and communication terms from earlier runs of the same model and
    batch on the same cluster and launcher, found in MLflow (a study's earlier points included)."""

    def __post_init__(self) -> None:
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError("memory_fraction", self.memory_fraction, "must be in (0, 1]")
        _at_least("device_memory_bytes", self.device_memory_bytes, 1)
        _at_least("max_dp_low_bandwidth", self.max_dp_low_bandwidth, 1)
        _at_least("max_devices", self.max_devices, 1)
        if self.overlap is not None and not 0 <= self.overlap <= 1:
            raise ConfigError("overlap", self.overlap, "must be in [0, 1]")
        for name in self.strategies or []:
            allowed = [n for n in strategies.names() if not strategies.from_plan(n)]
            if name not in allowed:
                raise ConfigError("strategies", name, f"must be among {', '.join(allowed)}")
        for name in self.precisions or []:
            _one_of("precisions", name, PRECISIONS)
        _at_least("trials", self.trials, 0)
        _at_least("trial_steps", self.trial_steps, 3)


ACCELERATORS = ("cpu", "cuda")


@dataclass(frozen=True)
class ClusterConfig:
    name: str = "cpu-local"
    """Preset name. `cpu-local` is this machine, measured by the probes; the others describe
    hardware you don't have, for what-if plans, with each number's public source in its file."""
    measured: bool = True
    """True: take device memory, compute speed and link bandwidth from this run's measurements
    (the plan and bandwidth stages); the numbers below are then ignored, but for
    `device_memory_gib`, which is then each rank's budget."""
    accelerator: str = "cpu"
    """What a rank computes on: `cpu` (this machine's cores, gloo) or `cuda` (one GPU per rank).
    On a measured cluster it is what the launcher asks for: launcher=slurm requests a GPU per rank
    (`launcher.gpus_per_node` defaults to `procs_per_node`) only for `cuda`."""
    devices_per_node: int = 1
    """Devices (GPUs) per host; collectives within a node use the intra-node link."""
    device_memory_gib: float | None = None
    """Memory of one device. On a measured cluster (this machine's CPUs), each rank's device-memory
    budget: a rank whose live tensor storage goes over it fails as CUDA's out-of-memory would
    (training/budget.py); null: no budget."""
    peak_flops: float | None = None
    """Dense bf16 peak FLOP/s of one device (datasheet)."""
    fp32_peak_flops: float | None = None
    """Dense fp32 (TF32 on tensor cores) peak FLOP/s of one device; null: fp32 is not planned for."""
    fp8_peak_flops: float | None = None
    """Dense fp8 peak FLOP/s of one device, what strategy.precision=fp8's Float8 linears run at
    (the rest of the step at `peak_flops`); null: the device has no fp8 tensor cores."""
    achievable_mfu: float = 0.4
    """Fraction of the peak a well-tuned transformer step reaches (what-if compute time)."""
    intra_node_gbps: float | None = None
    """Bus bandwidth of collectives inside a node (GB/s, nccl-tests busbw)."""
    intra_node_latency_us: float | None = None
    inter_node_gbps: float | None = None
    """Bus bandwidth of collectives across nodes (GB/s)."""
    inter_node_latency_us: float | None = None

    def __post_init__(self) -> None:
        _at_least("devices_per_node", self.devices_per_node, 1)
        if self.accelerator not in ACCELERATORS:
            raise ConfigError("accelerator", self.accelerator, f"must be one of {', '.join(ACCELERATORS)}")
        if self.measured and self.device_memory_gib is not None and self.device_memory_gib <= 0:
            raise ConfigError("device_memory_gib", self.device_memory_gib, "must be > 0 GiB, or null for no budget")
        if not 0 < self.achievable_mfu <= 1:
            raise ConfigError("achievable_mfu", self.achievable_mfu, "must be in (0, 1]")
        if self.fp8_peak_flops is not None and self.fp8_peak_flops <= 0:
            raise ConfigError("fp8_peak_flops", self.fp8_peak_flops, "must be > 0, or null (no fp8 tensor cores)")
        if not self.measured:
            for key in ("device_memory_gib", "peak_flops", "intra_node_gbps", "intra_node_latency_us",
                        "inter_node_gbps", "inter_node_latency_us"):
                value = getattr(self, key)
                if value is None or value <= 0:
                    raise ConfigError(key, value, f"cluster={self.name} describes hardware by its numbers: must be > 0")


@dataclass(frozen=True)
class EnvConfig:
    require_cuda: bool = False
    """Fail when a rank has no CUDA device."""
    min_free_device_memory_gib: float = 0.0
    """Fail when a rank's GPU has less free memory than this."""
    require_active_ib: bool = True
    """Fail when a node shows an InfiniBand port that is not Active (read with `ibstat`; nodes
    without it are not checked). false: for hosts with ports left unplugged on purpose."""

    def __post_init__(self) -> None:
        _at_least("min_free_device_memory_gib", self.min_free_device_memory_gib, 0, "a number")
