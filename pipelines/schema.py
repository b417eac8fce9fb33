"""The whole configuration: engine-side groups here, training-side groups from training.config.

`register()` puts the mutable twins into Hydra's ConfigStore, so that a wrong type, an unknown
option or an unknown key fails at composition with Hydra's list of valid options.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from common.errors import ConfigError, one_of
from pipelines.configtools import Tagged, hydra_schema
from pipelines.redact import redact_mapping, redact_text
from training.config import DataConfig, ModelConfig, StrategyConfig, TrainConfig
from training.plan_config import BandwidthConfig, ClusterConfig, EnvConfig, LrFindConfig, PlanConfig

RESOURCES = ("driver", "one_device", "world")
BACKENDS = ("auto", "gloo", "nccl")
TRACKERS = ("mlflow", "none")
STUDY_ID = re.compile(r"[\w.:/-]{1,200}")
"""A study id goes into MLflow tag filters and file names: no quotes, no spaces."""


@dataclass(frozen=True)
class StageSpec:
    fn: str
    """`module:function` of the stage, e.g. `stages.train:run`."""
    needs: list[str] = field(default_factory=list)
    """Stages whose results this one receives, as keyword arguments of the same names."""
    after: list[str] = field(default_factory=list)
    """Stages that must succeed first without passing their results (gates, e.g. env)."""
    resources: str = "driver"
    """Where it runs: `driver` (in the driver process), `one_device` (one worker) or `world`
    (every rank of nodes x procs_per_node)."""
    baseline: bool = False
    """Also run this world stage on one device first (cached on its own) and pass that result
    as its `baseline` argument; `train` uses it for scaling efficiency."""
    cache: bool = True
    """False for a stage whose inputs lie outside the config (compare reads MLflow): it runs
    every time and its result is not stored (only logged, and published to the run dir)."""
    publish: str | None = None
    """A folder of the run dir to copy the stage's artifacts to (report -> report/)."""
    history: bool = False
    """Pass the stage earlier runs' measured train steps from MLflow as `history` (plan, when
    plan.calibrate=true); they join its cache key, so a new measurement re-plans."""
    fits: str | None = None
    """`module:function` that sizes a one_device stage, and a world stage's baseline, for a model
    larger than one device: called on the driver as `fn(inputs, budget_bytes, max_ranks)` under a
    per-rank memory budget, it returns how many ranks the smallest layout that holds the model
    needs (1: one device). Without a budget the stage runs on one device."""
    when: str | None = None
    """A config key (e.g. `plan.trials`): when its value is false or 0 the stage is not asked for;
    it is skipped without running and the stages that need it receive None."""
    echo: bool = False
    """Print the result's `text` (a report read in the terminal) before the summary table."""

    def __post_init__(self) -> None:
        if ":" not in self.fn:
            raise ConfigError("fn", self.fn, "must be 'module:function', e.g. stages.train:run")
        one_of("resources", self.resources, RESOURCES)
        if self.baseline and self.resources != "world":
            raise ConfigError("baseline", self.baseline, "only a resources=world stage can have a baseline")


@dataclass(frozen=True)
class PipelineConfig:
    name: str = "full"
    """Pipeline name, recorded in tags."""
    stages: dict[str, StageSpec] = field(default_factory=dict)
    """The stages by name, in any order; the DAG comes from `needs` and `after`."""
    reads_study: bool = False
    """Its input is a study already in MLflow (`study=`, `tracking=mlflow`): its invocation is a
    reading of that study (MLflow tag kind=study-reading), not a point of it."""
    precheck: str | None = None
    """`module:function` the CLI calls with the loaded config before anything is written or
    launched; a ConfigError it raises is the invocation's one line (compare: that the study exists,
    reports.studies:check_study)."""


@dataclass(frozen=True)
class LauncherConfig(Tagged):
    """What every launcher takes; each launcher's own options are in its schema (LAUNCHER_SCHEMAS),
    so a key of another launcher (`launcher=local launcher.partition=gpu`) is an error naming the
    launcher that has it, not an option silently ignored."""

    name: str = "local"
    """Where world and one_device stages run: `local` starts worker processes on this machine."""
    backend: str = "auto"
    """torch.distributed backend: `auto` (nccl with CUDA, gloo otherwise), `gloo` or `nccl`."""
    timeout_s: float = 180.0
    """Collective timeout: a rank that waits longer on a peer fails instead of hanging."""
    grace_s: float = 10.0
    """After one rank fails, how long the others get to exit on their own before being killed."""
    stage_timeout_s: dict[str, float] = field(default_factory=dict)
    """A stage's own collective timeout, by stage name (e.g. {train: 600}); the others take timeout_s."""
    checkpoint_timeout_s: float = 1800.0
    """Collective timeout while a checkpoint is saved or loaded: writing a large model's shards to a
    shared filesystem takes longer than any step's collective should."""

    @classmethod
    def schemas(cls) -> dict[str, type]:
        return LAUNCHER_SCHEMAS

    def identity(self) -> list:
        """What makes two invocations' workers the same kind of place for calibration."""
        return [self.name]

    def __post_init__(self) -> None:
        one_of("name", self.name, LAUNCHER_SCHEMAS)
        one_of("backend", self.backend, BACKENDS)
        if self.timeout_s <= 0:
            raise ConfigError("timeout_s", self.timeout_s, "must be a number of seconds > 0")
        if self.grace_s < 0:
            raise ConfigError("grace_s", self.grace_s, "must be a number of seconds >= 0")
        if self.checkpoint_timeout_s <= 0:
            raise ConfigError("checkpoint_timeout_s", self.checkpoint_timeout_s, "must be a number of seconds > 0")
        for stage, seconds in self.stage_timeout_s.items():
            if not isinstance(seconds, int | float) or seconds <= 0:
                raise ConfigError(f"stage_timeout_s.{stage}", seconds, "must be a number of seconds > 0")

    def timeout_for(self, stage: str) -> float:
        """The collective timeout of `stage`'s process group."""
        return float(self.stage_timeout_s.get(stage, self.timeout_s))


@dataclass(frozen=True)
class RayLauncherConfig(LauncherConfig):
    """`launcher=ray`: one Ray Train worker group for the invocation."""

    name: str = "ray"
    address: str | None = None
    """null starts a local Ray instance for the invocation (and stops it at the end); `auto` or
    `ray://host:port` joins an existing cluster and leaves it running."""
    spread_nodes: bool = False
    """Place every worker on a different Ray node (STRICT_SPREAD) instead of packing them."""
    max_failures: int = 0
    """Worker-group restarts allowed; a restarted train resumes from its last checkpoint."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per worker."""
    use_gpu: bool | None = None
    """One GPU per worker. null: when the Ray cluster's resources list GPUs (read from the cluster
    once joined, never from the driver's own devices: a CPU head or a ray:// client has none)."""

    def identity(self) -> list:
        return [self.name, self.address]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_failures < 0:
            raise ConfigError("max_failures", self.max_failures, "must be an integer >= 0")
        if self.cpus_per_worker <= 0:
            raise ConfigError("cpus_per_worker", self.cpus_per_worker, "must be a number > 0")
        if self.address is not None and not (self.address == "auto" or self.address.startswith("ray://")
                                             or ":" in self.address):
            raise ConfigError("address", self.address, "must be null (start a local Ray), auto, ray://host:port or host:port")


@dataclass(frozen=True)
class SlurmLauncherConfig(LauncherConfig):
    """`launcher=slurm`: one allocation per invocation, every stage a job step in it."""

    name: str = "slurm"
    partition: str | None = None
    """Partition (-p)."""
    account: str | None = None
    """Account (-A)."""
    qos: str | None = None
    """Quality of service."""
    constraint: str | None = None
    """Node features (-C)."""
    gpus_per_node: int | None = None
    """GPUs per node (`--gpus-per-node`). null: one per task (procs_per_node) on a cluster whose
    accelerator is cuda (`cluster=gpu`), none otherwise."""
    gpu_bind: str | None = None
    """`--gpu-bind` for the allocation and every step (e.g. `single:1`, `closest`); each task then
    sees its own GPU(s) and selects index 0 of what it sees."""
    cpus_per_task: int | None = None
    """CPUs per task (rank). null: the partition's cores per node (sinfo) divided by the tasks per
    node, so that each rank has its share for Python, the DataLoader and NCCL's proxy threads."""
    container_image: str | None = None
    """Run every step in this container (pyxis/enroot `--container-image`, e.g. nvcr.io#nvidia/pytorch:25.01-py3)."""
    container_mounts: list[str] = field(default_factory=list)
    """`src:dst` mounts for the container; the repository and the outputs directory must appear at
    the same paths inside it (the driver's paths are passed to the steps)."""
    dry_run: bool = False
    """Write the allocation's job script, with each stage's srun line, to `<run dir>/slurm/
    allocation.sbatch`, print it and stop: nothing is submitted."""
    mem_gb: float | None = None
    """Memory per node in GB; null leaves the partition's default."""
    timeout_min: int = 60
    """Time limit of the allocation, in minutes."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before each task (e.g. `module load cuda`, `source .venv/bin/activate`)."""
    additional_parameters: dict[str, str] = field(default_factory=dict)
    """Other sbatch options, e.g. {exclusive: ""}."""
    submit_only: bool = False
    """Submit the allocation with the driver as its batch script, print its id and where its
    outputs will be, and return at once."""
    max_requeues: int = 3
    """How often a preempted or timed-out allocation is requeued and the stage resumed."""
    poll_s: float = 1.0
    """Seconds between job-state polls (a progress line per job while waiting)."""

    def identity(self) -> list:
        return [self.name, self.partition]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_requeues < 0:
            raise ConfigError("max_requeues", self.max_requeues, "must be an integer >= 0")
        if self.poll_s <= 0:
            raise ConfigError("poll_s", self.poll_s, "must be a number > 0")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ConfigError("cpus_per_task", self.cpus_per_task, "must be an integer >= 1, or null")
        if self.timeout_min < 1:
            raise ConfigError("timeout_min", self.timeout_min, "must be an integer >= 1")
        for mount in self.container_mounts:
            if ":" not in mount:
                raise ConfigError("container_mounts", mount, "must be src:dst[:flags]")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ConfigError("gpus_per_node", self.gpus_per_node, "must be an integer >= 0, or null")
        for line in self.setup:  # they go into generated sbatch scripts: a secret would sit in clear on disk
            if redact_text(line) != line:
                raise ConfigError("setup", redact_text(line), "would write a secret into generated job scripts; "
                                  "export it in the submitting shell instead (Slurm passes the environment on)")
        shown = redact_mapping(self.additional_parameters)  # #SBATCH lines of the allocation's script, too
        if shown != self.additional_parameters:
            raise ConfigError("additional_parameters", shown, "would write a secret into generated job scripts; "
                              "export it in the submitting shell instead (Slurm passes the environment on)")


LAUNCHER_SCHEMAS: dict[str, type[LauncherConfig]] = {
    "local": LauncherConfig, "ray": RayLauncherConfig, "slurm": SlurmLauncherConfig}
"""Each launcher's schema, by `launcher.name`: a new launcher adds its own here."""


@dataclass(frozen=True)
class TrackingConfig:
    name: str = "mlflow"
    """`mlflow` logs one top-level run per invocation and one nested run per stage; `none` logs nothing."""
    uri: str = "sqlite:///outputs/mlflow.db"
    """MLflow tracking URI: a sqlite file (default, no server) or an http(s) server."""
    experiment: str = "scalestudy"
    """MLflow experiment name."""

    def __post_init__(self) -> None:
        one_of("name", self.name, TRACKERS)
        if self.name == "mlflow" and not self.uri:
            raise ConfigError("uri", self.uri, "must be an MLflow tracking URI, e.g. sqlite:///outputs/mlflow.db")
        if self.name == "mlflow" and not self.experiment:
            raise ConfigError("experiment", self.experiment, "must be a non-empty experiment name")


@dataclass(frozen=True)
class Config:
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    bandwidth: BandwidthConfig = field(default_factory=BandwidthConfig)
    lr_find: LrFindConfig = field(default_factory=LrFindConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    nodes: int = 2
    """Hosts of the target world; with launcher=local, groups of local worker processes."""
    procs_per_node: int | None = None
    """Ranks per node; null means the GPUs per node, or 1 on CPU."""
    seed: int = 0
    """Seed of the model initialisation and the data order."""
    only: list[str] = field(default_factory=list)
    """Run just these stages (their missing upstream results are computed first)."""
    force: list[str] = field(default_factory=list)
    """Re-run these stages even when cached."""
    cache_dir: str = "outputs/cache"
    """Where stage results are stored under their content keys."""
    study: str | None = None
    """Study id. Invocations with the same id are one study: MLflow runs tagged `study=<id>` (grouped
    by it in the UI's study view), and one study report. A `-m` sweep is a study of its own (id: its sweep
    dir) unless set. With pipeline=compare: the study id, or an MLflow experiment name, to rebuild
    the study report from."""
    dry_run: bool = False
    """Build the real mesh and sharded model for the requested world on a fake process group,
    print each rank's memory for parameters, gradients and optimizer state, and exit: no stage
    runs, nothing is launched or logged."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError("nodes", self.nodes, "must be an integer >= 1")
        if self.procs_per_node is not None and self.procs_per_node < 1:
            raise ConfigError("procs_per_node", self.procs_per_node, "must be an integer >= 1, or null")
        if self.study is not None and not STUDY_ID.fullmatch(self.study):
            raise ConfigError("study", self.study, "must be 1-200 characters of letters, digits and . _ - : /")


def register() -> None:
    """Store the schema of the top-level config in Hydra's ConfigStore as `base_config`."""
    ConfigStore.instance().store(name="base_config", node=hydra_schema(Config))
