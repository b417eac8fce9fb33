"""What a 4 x 8 GPU cluster under Slurm or Ray needs decided from the workers, not the driver,
held on this GPU-less machine with the workers' facts injected: Slurm's GPUs per node, Ray's
resources, device selection under --gpu-bind, nccl without a GPU, the placement check, env's
per-node GPU and InfiniBand checks, the flight recorder and the collective timeouts."""

from __future__ import annotations

import os
import sys

import pytest

from common.errors import ConfigError
from pipelines.launchers.resources import SlurmNodes, gpus_in_gres, parse_sinfo
from pipelines.placement import NodeIdentity, Placement
from pipelines.schema import RayLauncherConfig
from tests.unit.test_slurm_params import ROOT, check_golden

H100 = "NVIDIA H100 80GB HBM3"


def node(name: str, gpus: int, visible: str | None = None, cuda: str | None = "12.8") -> NodeIdentity:
    return NodeIdentity(name=name, hostname=name, cpu_model="x", cpus=64, memory_gib=512, python="3.11",
                        torch="2.13.0", cuda=cuda, gpus=[f"{H100} 0000:{i:02x}:00.0" for i in range(gpus)],
                        visible_devices=visible)


def test_gres_and_sinfo_are_read_as_slurm_writes_them():
    assert gpus_in_gres("gpu:h100:8(S:0-1)") == 8
    assert gpus_in_gres("gpu:4,nvme:1") == 4
    assert gpus_in_gres("(null)") == 0
    assert parse_sinfo("128 gpu:h100:8(S:0-1)\n96+ gpu:h100:4\n") == SlurmNodes(cpus=96, gpus=4)
    assert parse_sinfo("") is None


@pytest.fixture
def eight_gpus_per_node(monkeypatch):
    """A Slurm partition whose nodes report 8 GPUs and 128 cores (sinfo), seen from a driver (this
    machine) that has no GPU at all."""
    nodes = SlurmNodes(cpus=128, gpus=8)
    monkeypatch.setattr("pipelines.launchers.resources.slurm_nodes", lambda partition: nodes)
    monkeypatch.setattr("pipelines.launchers.slurm_commands.slurm_nodes", lambda partition: nodes)
    monkeypatch.setattr("pipelines.launchers.resources.visible_gpus", lambda: 0)


def resolved(*overrides: str):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipelines.configtools import from_dict
    from pipelines.schema import Config, register
    from pipelines.validate import resolve

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        dcfg = compose(config_name="config", overrides=list(overrides))
    return resolve(from_dict(Config, OmegaConf.to_container(dcfg, resolve=True)))


def test_slurm_ranks_and_gpus_per_node_come_from_the_partition_not_the_driver(eight_gpus_per_node, tmp_path):
    from pipelines.launchers.slurm_commands import render_dry_run

    cfg = resolved("launcher=slurm", "cluster=gpu", "nodes=4", "tracking=none")
    assert cfg.procs_per_node == 8 and cfg.launcher.gpus_per_node == 8
    text = render_dry_run(cfg, tmp_path / "run")
    assert (tmp_path / "run" / "slurm" / "allocation.sbatch").read_text() == text
    assert "#SBATCH --gpus-per-node=8" in text and "#SBATCH --ntasks-per-node=8" in text
    assert "#SBATCH --cpus-per-task=16" in text, "the node's 128 cores shared by its 8 tasks"
    check_golden("slurm_gpu_dry_run.sbatch", text, {str(tmp_path): "<TMP>", sys.executable: "<PYTHON>"})


def test_slurm_on_a_gpu_cluster_asks_one_gpu_per_rank_and_binds_when_told(eight_gpus_per_node, tmp_path):
    from pipelines.launchers.slurm_commands import launcher_backend, render_dry_run

    cfg = resolved("launcher=slurm", "cluster=gpu", "nodes=2", "procs_per_node=4", "launcher.gpu_bind=single:1",
                   "launcher.container_image='nvcr.io#nvidia/pytorch:25.01-py3'",
                   "launcher.container_mounts=[/shared:/shared]", "tracking=none")
    assert cfg.launcher.gpus_per_node == 4 and launcher_backend(cfg.launcher) == "nccl"
    text = render_dry_run(cfg, tmp_path)
    train = next(line for line in text.splitlines() if line.startswith("# train: srun"))
    for option in ("--gpus-per-node=4", "--gpu-bind=single:1", "--container-image=nvcr.io#nvidia/pytorch:25.01-py3",
                   "--container-mounts=/shared:/shared", "--ntasks=8", "--cpus-per-task=32"):
        assert option in train, option
    assert "exec python -m pipelines.launchers.worker" in train, "the container's python, not the driver's"


def test_slurm_on_a_cpu_cluster_asks_no_gpus_and_resolves_gloo(eight_gpus_per_node):
    from pipelines.launchers.slurm_commands import launcher_backend

    cfg = resolved("launcher=slurm", "nodes=2", "tracking=none")
    assert cfg.procs_per_node == 1 and cfg.launcher.gpus_per_node == 0
    assert launcher_backend(cfg.launcher) == "gloo"


def test_a_gpu_run_asking_for_no_gpus_is_refused_in_one_line(eight_gpus_per_node):
    with pytest.raises(ConfigError, match=r"cluster='gpu': computes on CUDA GPUs and launcher=slurm asks for none"):
        resolved("launcher=slurm", "cluster=gpu", "launcher.gpus_per_node=0", "tracking=none")
    with pytest.raises(ConfigError, match=r"launcher.backend='nccl': needs a CUDA GPU per rank and launcher=slurm asks"):
        resolved("launcher=slurm", "launcher.backend=nccl", "tracking=none")
    with pytest.raises(ConfigError, match=r"procs_per_node=8: ranks per node, but launcher.gpus_per_node=4"):
        resolved("launcher=slurm", "cluster=gpu", "procs_per_node=8", "launcher.gpus_per_node=4", "tracking=none")


def test_nccl_and_fp16_are_not_refused_from_a_gpu_less_driver_of_a_gpu_cluster(eight_gpus_per_node):
    cfg = resolved("launcher=slurm", "cluster=gpu", "launcher.backend=nccl", "strategy.precision=fp16", "tracking=none")
    assert cfg.procs_per_node == 8


def test_a_joined_ray_cluster_on_gpus_needs_procs_per_node_said(monkeypatch):
    monkeypatch.setattr("pipelines.launchers.resources.visible_gpus", lambda: 0)
    with pytest.raises(ConfigError, match=r"procs_per_node=None: launcher=ray cannot say how many GPUs"):
        resolved("launcher=ray", "launcher.address=auto", "cluster=gpu", "tracking=none")
    assert resolved("launcher=ray", "launcher.address=auto", "cluster=gpu", "procs_per_node=8",
                    "tracking=none").procs_per_node == 8


def test_ray_workers_ask_for_gpus_when_the_cluster_lists_them():
    from pipelines.launchers.ray import wants_gpus

    assert wants_gpus(RayLauncherConfig(address="auto"), {"CPU": 256.0, "GPU": 32.0})
    assert not wants_gpus(RayLauncherConfig(address="auto"), {"CPU": 8.0})
    assert not wants_gpus(RayLauncherConfig(address="auto", use_gpu=False), {"CPU": 8.0, "GPU": 8.0})


def test_a_task_that_sees_one_gpu_uses_index_0_whatever_its_local_rank():
    from pipelines.launchers.worker import NoDevice, device_index

    assert device_index(3, 1) == 0, "SLURM_LOCALID=3 under --gpu-bind sees its GPU as device 0"
    assert device_index(3, 8) == 3
    with pytest.raises(NoDevice, match="local index is 3 but it sees 2 CUDA device"):
        device_index(3, 2)


def test_nccl_on_a_rank_without_a_gpu_is_an_error_not_a_fallback():
    from pipelines.launchers.worker import NoDevice, resolve_backend

    with pytest.raises(NoDevice, match="the backend is nccl but rank .* sees no CUDA device"):
        resolve_backend("nccl", None)
    assert resolve_backend("auto", None) == "gloo"
    assert resolve_backend("auto", 0) == "nccl"


def test_the_placement_check_refuses_nodes_without_the_gpus_the_run_needs(compose_cfg):
    from pipelines.validate import check_placement

    cfg = compose_cfg("nodes=2", "procs_per_node=8")
    gpu = compose_cfg("launcher=slurm", "nodes=2", "procs_per_node=8", "cluster=gpu", gpus=8)
    check_placement(gpu, Placement("slurm", "nccl", [node("a", 8), node("b", 8)]))
    check_placement(gpu, Placement("slurm", "nccl", [node("a", 8, visible="0"), node("b", 8, visible="0")]))
    check_placement(cfg, Placement("slurm", "gloo", [node("a", 0), node("b", 0)]))
    with pytest.raises(ConfigError, match=r"launcher.backend='nccl': needs a CUDA GPU for every rank, but node b"):
        check_placement(cfg, Placement("slurm", "nccl", [node("a", 8), node("b", 0)]))
    with pytest.raises(ConfigError, match=r"node a .* shows none to its ranks \(8 GPUs, CUDA_VISIBLE_DEVICES=''\)"):
        check_placement(gpu, Placement("slurm", "nccl", [node("a", 8, visible="")]))
    with pytest.raises(ConfigError, match=r"torch 2.13.0 is built without CUDA"):
        check_placement(gpu, Placement("ray", "gloo", [node("a", 8, cuda=None)]))
    with pytest.raises(ConfigError, match=r"procs_per_node=8: node a .* has 4 GPU\(s\) for 8 ranks"):
        check_placement(gpu, Placement("slurm", "nccl", [node("a", 4)]))


def test_the_placement_lists_the_nodes_gpus_without_mapping_visible_indices(monkeypatch, tmp_path):
    """Slurm renumbers the devices a task may use: CUDA_VISIBLE_DEVICES=0 is not the node's first
    GPU in bus order. The node's GPUs are its hardware; the visible set is kept as given."""
    import pipelines.placement as placement

    for bus in ("0000:1b:00.0", "0000:9a:00.0"):
        (tmp_path / "gpus" / bus).mkdir(parents=True)
        (tmp_path / "gpus" / bus / "information").write_text(f"Model: \t {H100}\n")
    monkeypatch.setattr(placement, "NVIDIA_PROC", tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    me = placement.node_identity("n")
    assert me.gpus == [f"{H100} 0000:1b:00.0", f"{H100} 0000:9a:00.0"]
    assert me.visible_devices == "1"


def ranks(*rows: dict) -> list[dict]:
    base = {"backend": "nccl", "has_gpu": True, "hostname": "h", "ib_ports": None}
    return [{**base, "rank": i, **row} for i, row in enumerate(rows)]


def test_env_refuses_two_ranks_of_a_node_on_one_gpu_and_nccl_without_a_gpu():
    from training.envinfo import check_devices

    fine = ranks({"node_name": "a", "gpu_bus_id": "0000:1b:00.0"}, {"node_name": "a", "gpu_bus_id": "0000:9a:00.0"},
                 {"node_name": "b", "gpu_bus_id": "0000:1b:00.0"})
    assert check_devices(fine) == []
    shared = ranks({"node_name": "a", "gpu_bus_id": "0000:1b:00.0"}, {"node_name": "a", "gpu_bus_id": "0000:1b:00.0"})
    assert check_devices(shared) == ["ranks 0, 1 on a share GPU 0000:1b:00.0"]
    assert check_devices(ranks({"node_name": "a", "has_gpu": False, "gpu_bus_id": None})) == [
        "rank 0 has no CUDA device but the backend is nccl"]


def test_env_fails_a_fleet_with_a_down_infiniband_port_in_its_table():
    from stages.env_check import FleetMismatch, check_fleet
    from training.envinfo import check_ports, collect_local, parse_ibstat
    from training.plan_config import EnvConfig

    ibstat = ("CA 'mlx5_0'\n\tPort 1:\n\t\tState: Active\n\t\tRate: 400\n\t\tLink layer: InfiniBand\n"
              "CA 'mlx5_1'\n\tPort 1:\n\t\tState: Down\n\t\tRate: 10\n\t\tLink layer: InfiniBand\n")
    ports = parse_ibstat(ibstat)
    assert check_ports(ranks({"node_name": "a", "ib_ports": ports})) == ["a InfiniBand port mlx5_1/1 is Down"]
    facts = {**collect_local(), "ib_ports": ports}
    with pytest.raises(FleetMismatch) as info:
        check_fleet(facts, EnvConfig())
    assert "mlx5_1/1 Down" in str(info.value) and "env.require_active_ib=false" in str(info.value)
    assert check_fleet(facts, EnvConfig(require_active_ib=False)).consistent


def test_env_records_the_nccl_settings_each_rank_runs_with(monkeypatch):
    from training.envinfo import collect_local

    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0,mlx5_1")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    env = collect_local()["nccl_env"]
    assert env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_the_flight_recorder_dumps_into_the_stage_logs_and_a_failure_names_them(monkeypatch, tmp_path):
    from pipelines.launchers.tasks import describe_failure
    from pipelines.launchers.worker import flight_recorder

    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    flight_recorder(tmp_path / "train")
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "train" / "nccl-trace" / "rank")
    flight_recorder(tmp_path / "bandwidth")  # the next stage of a long-lived worker (launcher=ray)
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "bandwidth" / "nccl-trace" / "rank")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")  # the user's own setting wins
    flight_recorder(tmp_path / "train")
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
    (tmp_path / "train" / "nccl-trace" / "rank1").write_bytes(b"trace")  # as the watchdog leaves it
    message = describe_failure(tmp_path / "train", 2, {1: "was killed by SIGABRT"})
    assert message.startswith("rank 1 was killed by SIGABRT")
    assert f"NCCL flight recorder dumps: {tmp_path / 'train' / 'nccl-trace' / 'rank1'}" in message


def test_stage_timeouts_are_per_stage_and_named_stages_only(compose_cfg):
    cfg = compose_cfg("+launcher.stage_timeout_s={train: 600}")
    assert cfg.launcher.timeout_for("train") == 600 and cfg.launcher.timeout_for("env") == 180
    with pytest.raises(ConfigError, match=r"launcher.stage_timeout_s='trian': is not a stage of pipeline=full"):
        compose_cfg("+launcher.stage_timeout_s={trian: 600}")


def test_checkpoints_get_their_own_collective_timeout(monkeypatch, tmp_path):
    """The default group's timeout is raised while a checkpoint is written and set back after (gloo,
    one process: torch's own setter, as it works on NCCL)."""
    import datetime

    import torch
    import torch.distributed as dist

    from training.dist import CHECKPOINT_TIMEOUT_ENV, TIMEOUT_ENV, checkpoint_timeout

    def timeout() -> datetime.timedelta:
        return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=180))
    try:
        monkeypatch.setenv(TIMEOUT_ENV, "180")
        monkeypatch.setenv(CHECKPOINT_TIMEOUT_ENV, "1800")
        with checkpoint_timeout():
            assert timeout() == datetime.timedelta(seconds=1800)
        assert timeout() == datetime.timedelta(seconds=180)
    finally:
        dist.destroy_process_group()


def test_a_placement_without_the_gpus_nccl_needs_fails_every_stage_before_any_runs(compose_cfg, tmp_path):
    """What Slurm's or Ray's probe reports from a node whose tasks see no GPU, while the launcher
    resolved nccl from what it asked for: one line, and no stage launched."""
    import json

    from pipelines.launchers.local import LocalLauncher
    from pipelines.runner import Runner
    from pipelines.tracking import NullTracker

    class NoGpuNodes(LocalLauncher):
        def placement(self, world):
            return Placement("slurm", "nccl", [node(f"node{i}", 8, visible="NoDevFiles") for i in range(world.nodes)])

        def run(self, task, world):
            raise AssertionError(f"{task.stage} was launched")

    cfg = compose_cfg("nodes=2", "procs_per_node=1", "tracking=none", f"cache_dir={tmp_path / 'cache'}")
    (tmp_path / "run").mkdir()
    summary = Runner(cfg, tmp_path / "run", NullTracker(), NoGpuNodes(cfg.launcher), echo=lambda *_: None).run()
    stages = json.loads(summary.path.read_text())["stages"]
    assert stages["env"]["status"] == "failed"
    assert stages["env"]["error"].startswith("placement: launcher.backend='nccl': needs a CUDA GPU for every rank, "
                                             "but node node0 of launcher=slurm shows none to its ranks")
    assert "\n" not in stages["env"]["error"]
    assert {s["status"] for s in stages.values()} <= {"failed", "skipped"}


def test_the_driver_counts_only_the_gpus_cuda_visible_devices_leaves(monkeypatch, tmp_path):
    """launcher=local's workers are this machine: its GPUs count, as CUDA_VISIBLE_DEVICES leaves them."""
    import pipelines.placement as placement
    from pipelines.launchers.resources import visible_gpus

    for bus in ("0000:1b:00.0", "0000:9a:00.0"):
        (tmp_path / "gpus" / bus).mkdir(parents=True)
        (tmp_path / "gpus" / bus / "information").write_text(f"Model: \t {H100}\n")
    monkeypatch.setattr(placement, "NVIDIA_PROC", tmp_path)
    monkeypatch.setattr(placement, "torch_cuda_build", lambda: "12.8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert visible_gpus() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == 0


def test_gpu_smoke_without_cuda_says_so_in_one_line():
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: `make gpu-smoke` runs the checks themselves")
    for args in ([], ["--multi"]):
        done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_smoke.sh"), *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr.startswith("gpu-smoke: no CUDA device visible") and done.stderr.count("\n") == 1
