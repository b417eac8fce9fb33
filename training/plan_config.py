"""The schemas of the config groups that measure and plan, one frozen dataclass each: `lr_find`,
`bandwidth`, `plan`, `cluster` and `env` (training/config.py holds those that train: model, data,
strategy, train). Each field is documented by the docstring under it; checks that need only the
field live in `__post_init__` and raise ConfigError.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import ConfigError, at_least, one_of
from training import strategies
from training.config import PRECISIONS

SUGGESTION_RULES = ("steepest", "min_div_10")
LR_SCALING_RULES = ("linear", "sqrt", "none")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


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
        at_least("num_iters", self.num_iters, 5)
        at_least("batch", self.batch, 1)
        if not 0 <= self.beta < 1:
            raise ConfigError("beta", self.beta, "must be in [0, 1)")
        if self.diverge_threshold <= 1:
            raise ConfigError("diverge_threshold", self.diverge_threshold, "must be > 1")
        one_of("suggestion", self.suggestion, SUGGESTION_RULES)
        one_of("lr_scaling", self.lr_scaling, LR_SCALING_RULES)


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
    rounds: int = 5
    """Sizes whose timed loop lasts under 0.1 s (the small ones, whose latency the plan fits) are
    measured this many times, in turn, and the median kept (training.collectives.SHORT_LOOP_S)."""
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
            one_of("collectives", name, COLLECTIVES)
        at_least("min_bytes", self.min_bytes, 4)
        if self.max_bytes < self.min_bytes:
            raise ConfigError("max_bytes", self.max_bytes, f"must be >= min_bytes={self.min_bytes}")
        if self.max_bytes > 16 * 1024**3:
            raise ConfigError("max_bytes", self.max_bytes, "must be <= 16 GiB")
        at_least("factor", self.factor, 2)
        at_least("warmup_iters", self.warmup_iters, 0)
        at_least("iters", self.iters, 1)
        at_least("rounds", self.rounds, 1)
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
        at_least("device_memory_bytes", self.device_memory_bytes, 1)
        at_least("max_dp_low_bandwidth", self.max_dp_low_bandwidth, 1)
        at_least("max_devices", self.max_devices, 1)
        if self.overlap is not None and not 0 <= self.overlap <= 1:
            raise ConfigError("overlap", self.overlap, "must be in [0, 1]")
        for name in self.strategies or []:
            allowed = [n for n in strategies.names() if not strategies.from_plan(n)]
            if name not in allowed:
                raise ConfigError("strategies", name, f"must be among {', '.join(allowed)}")
        for name in self.precisions or []:
            one_of("precisions", name, PRECISIONS)
        at_least("trials", self.trials, 0)
        at_least("trial_steps", self.trial_steps, 3)


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
        at_least("devices_per_node", self.devices_per_node, 1)
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
        at_least("min_free_device_memory_gib", self.min_free_device_memory_gib, 0, "a number")
