"""What the Slurm launcher asks of Slurm, as text: sbatch's options, the allocation's batch script
(its heartbeat and requeue trap), a job step's srun line, the dry run's rendering of them, and a
failed step's stderr read back.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from common.files import write_atomic
from pipelines.launchers.base import WorldSpec
from pipelines.launchers.resources import cpus_per_task, slurm_nodes
from pipelines.launchers.tasks import describe_failure
from pipelines.launchers.worker import ERROR_FILE
from pipelines.schema import Config, LauncherConfig

SIGNAL_DELAY_S = 90
"""Seconds before the time limit at which Slurm sends the allocation USR2 (it requeues itself)."""


HEARTBEAT_S = 5.0
HEARTBEAT_STALE_S = 120
"""An allocation whose driver has not touched its heartbeat for this long releases itself."""


TASK_DIED = re.compile(r"srun: error: (\S+): tasks? ([\d\-,]+): (.+)")


def sbatch_options(cfg: LauncherConfig, world: WorldSpec, name: str, output: Path, cpus: int | None = None) -> list[str]:
    """The #SBATCH lines of an invocation's allocation: `world` with the launcher's resources,
    requeueable, with USR2 to the batch script before the time limit. `cpus`: CPUs per task when
    launcher.cpus_per_task is null (the node's cores shared by its tasks); None: Slurm's default."""
    cpus = cfg.cpus_per_task or cpus
    options = [
        f"--job-name={name}",
        f"--nodes={world.nodes}",
        f"--ntasks-per-node={world.procs_per_node}",
        *([f"--cpus-per-task={cpus}"] if cpus else []),
        f"--time={cfg.timeout_min}",
        "--requeue",
        "--open-mode=append",
        # B: the batch script alone gets it, and requeues the allocation; the signal must come
        # inside the time limit, or a short allocation is "timed out" at once.
        f"--signal=B:USR2@{min(SIGNAL_DELAY_S, cfg.timeout_min * 60 // 2)}",
        f"--output={output}",
    ]
    options += gpu_options(cfg)
    if cfg.mem_gb is not None:
        options.append(f"--mem={cfg.mem_gb:g}G")
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(cfg, key) is not None:
            options.append(f"--{key}={getattr(cfg, key)}")
    for key, value in cfg.additional_parameters.items():
        options.append(f"--{key.replace('_', '-')}" + (f"={value}" if value not in ("", None, True) else ""))
    return [f"#SBATCH {option}" for option in options]


def gpu_options(cfg: LauncherConfig) -> list[str]:
    """The GPUs of an allocation or step: `--gpus-per-node` (validate.py fills a null one in from
    the cluster's accelerator) and `--gpu-bind`."""
    options = [f"--gpus-per-node={cfg.gpus_per_node}"] if cfg.gpus_per_node else []
    return options + ([f"--gpu-bind={cfg.gpu_bind}"] if cfg.gpu_bind else [])


def launcher_backend(cfg: LauncherConfig) -> str:
    """`auto` resolved from what the allocation asks for: nccl with GPUs, gloo without; the workers
    never fall back on their own (a rank without the GPU nccl needs fails, worker.py)."""
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if cfg.gpus_per_node else "gloo"


def step_command(cfg: LauncherConfig, job_id: str, world: WorldSpec, cpus: int | None, workdir: Path, stage: str,
                 task_file: Path, nodelist: list[str] | None = None) -> list[str]:
    """The srun line of one stage: `world`'s tasks in the allocation `job_id`, each running the
    worker (in the launcher's container, when it names one). `nodelist`: where a stage smaller
    than the allocation runs (its first nodes)."""
    procs = world.procs_per_node if world.distributed else 1
    nodes = world.nodes if world.distributed else 1
    cpus = cfg.cpus_per_task or cpus
    cmd = ["srun", f"--jobid={job_id}", f"--nodes={nodes}", f"--ntasks={nodes * procs}", f"--ntasks-per-node={procs}",
           *([f"--cpus-per-task={cpus}"] if cpus else []), *gpu_options(cfg), "--kill-on-bad-exit=1", "--overlap",
           f"--output={workdir}/rank%t.log", f"--job-name=scalestudy-{stage}"]
    if nodelist:
        cmd.append(f"--nodelist={','.join(nodelist)}")
    python = sys.executable
    if cfg.container_image:
        # pyxis/enroot: the image's python; the repository and outputs mounted at the same paths.
        cmd += [f"--container-image={cfg.container_image}", f"--container-workdir={os.getcwd()}"]
        if cfg.container_mounts:
            cmd.append(f"--container-mounts={','.join(cfg.container_mounts)}")
        python = "python"
    # The worker selects its own GPU among those its task sees (worker.py: device_index).
    run_worker = f"exec {shlex.quote(python)} -m pipelines.launchers.worker {shlex.quote(str(task_file))}"
    return [*cmd, "bash", "-c", "; ".join([*cfg.setup, run_worker])]


def requeue_trap(max_requeues: int) -> list[str]:
    return [
        "# Preempted, or at the time limit: back in the queue (at most launcher.max_requeues times); the",
        "# driver re-runs the stage that was running, which resumes from its checkpoint.",
        f"trap 'if [ \"${{SLURM_RESTART_COUNT:-0}}\" -lt {max_requeues} ]; then scontrol requeue \"$SLURM_JOB_ID\"; fi;"
        " exit 0' USR2",
    ]


def allocation_script(cfg: LauncherConfig, world: WorldSpec, folder: Path, cpus: int | None = None) -> str:
    """The batch script that holds an invocation's allocation while its driver runs stages in it."""
    release, heartbeat = folder / "release", folder / "heartbeat"
    lines = [
        "#!/bin/bash",
        *sbatch_options(cfg, world, "scalestudy", folder / "allocation-%j.out", cpus),
        *requeue_trap(cfg.max_requeues),
        'echo "allocation $SLURM_JOB_ID on $SLURM_JOB_NODELIST, attempt ${SLURM_RESTART_COUNT:-0}"',
        f"# Held until the driver releases it, or stops touching its heartbeat for {HEARTBEAT_STALE_S} s (it died).",
        f"while [ ! -e {shlex.quote(str(release))} ] && "
        f"[ $(( $(date +%s) - $(stat -c %Y {shlex.quote(str(heartbeat))} 2>/dev/null || date +%s) )) "
        f"-lt {HEARTBEAT_STALE_S} ]; do sleep 1 & wait $!; done",
    ]
    return "\n".join(lines) + "\n"


def node_share(cfg: LauncherConfig, tasks_per_node: int) -> int | None:
    """launcher.cpus_per_task, else each task's share of the partition's cores per node (sinfo);
    None when sinfo can't say."""
    if cfg.cpus_per_task:
        return cfg.cpus_per_task
    nodes = slurm_nodes(cfg.partition)
    return cpus_per_task(nodes.cpus if nodes is not None else None, tasks_per_node)


DRY_RUN_FILE = "allocation.sbatch"


def render_dry_run(cfg: Config, run_dir: Path) -> str:
    """launcher.dry_run: the allocation's job script as it would be submitted, with the srun line of
    each stage the invocation would run below it (as comments, in order), written to
    `<run dir>/slurm/allocation.sbatch` and returned for printing. Nothing is submitted."""
    from pipelines.dag import build

    world = WorldSpec(cfg.nodes, cfg.procs_per_node)
    folder = Path(run_dir).resolve() / "slurm"
    cpus = node_share(cfg.launcher, world.procs_per_node)
    lines = [allocation_script(cfg.launcher, world, folder, cpus).rstrip("\n"), ""]
    if cpus is None:
        lines.append("# --cpus-per-task left to Slurm: sinfo could not say the nodes' cores; set launcher.cpus_per_task")
    lines.append("# The job steps the driver would run in this allocation, in order (launcher.dry_run: nothing submitted):")
    dag = build(cfg.pipeline)
    selected = set(dag.closure(cfg.only)) if cfg.only else set(dag.order)
    steps = [("placement", "world")] + [(n, dag.stages[n].spec.resources) for n in dag.order if n in selected]
    for name, resources in steps:
        if resources == "driver":
            continue
        # A one-device stage under a memory budget may need the smallest world that holds the model.
        step_world = world if resources == "world" else WorldSpec(1, 1, distributed=False)
        logs = folder.parent / "logs" / name
        cmd = step_command(cfg.launcher, "<job id>", step_world, cpus, logs, name, logs / "task.pkl",
                           ["<first node>"] if step_world.size < world.size else None)
        lines.append(f"# {name}: {shlex.join(cmd)}")
    text = "\n".join(lines) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / DRY_RUN_FILE, text)
    return text


SIGNAL_WORDS = {"Killed": "SIGKILL", "Terminated": "SIGTERM", "Aborted": "SIGABRT", "Segmentation fault": "SIGSEGV",
                "Bus error": "SIGBUS", "Interrupt": "SIGINT"}


def ended_tasks(stderr: str) -> dict[int, str]:
    """The tasks srun reports as ended badly, in the order it reports them, with how (in the words
    launcher=local uses): `srun: error: node2: task 1: Killed` -> {1: "was killed by SIGKILL"}."""
    ended: dict[int, str] = {}
    for _, tasks, what in TASK_DIED.findall(stderr):
        code = re.match(r"Exited with exit code (\d+)", what)
        signal_name = next((name for word, name in SIGNAL_WORDS.items() if what.startswith(word)), None)
        how = (f"exited with code {code.group(1)}" if code else f"was killed by {signal_name}" if signal_name
               else f"ended: {what.strip()}")
        for part in tasks.split(","):
            low, _, high = part.partition("-")
            for task in range(int(low), int(high or low) + 1):
                ended.setdefault(task, how)
    return ended


def step_failure(workdir: Path, ranks: int, stderr: str, job_id: str) -> str:
    """The root cause of a failed step (as launcher=local names it), and the ranks srun then killed
    (--kill-on-bad-exit: a rank that still waited in a collective, say)."""
    ended = ended_tasks(stderr)
    # srun reports tasks in the order they ended: the first ended on its own, the rest it may have
    # killed because of it (--kill-on-bad-exit).
    first = next(iter(ended), None)
    message = describe_failure(workdir, ranks, {first: ended[first]} if first is not None else {},
                               note=f"Slurm allocation {job_id}, srun log {workdir}/srun.err")
    reported = {r for r in range(ranks) if (workdir / ERROR_FILE.format(rank=r)).exists()}
    killed = [r for r, how in ended.items() if r != first and r not in reported and "killed" in how]
    return message + (f"; still running and killed: ranks {killed}" if killed else "")
