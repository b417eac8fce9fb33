"""launcher=ray on real Ray instances: a private local one (shared by the class that needs it) and a
2-node `ray.cluster_utils.Cluster` joined by address. Each class starts and stops its own Ray, with
HOME and RAY_TMPDIR pointed at temporary directories so that nothing lands in ~/.ray or /tmp/ray."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from common.errors import ConfigError
from pipelines.launchers.base import StageFailed, Task, WorldSpec
from pipelines.schema import RayLauncherConfig
from stages.env_check import EnvInputs
from tests.dist.test_strategies import TOL, train_inputs
from tests.helpers import run_world
from training.config import StrategyConfig
from training.plan_config import EnvConfig

pytestmark = pytest.mark.slow

STEPS, EVERY, KILL = 10, 4, 6
DDP = StrategyConfig(name="ddp")


@pytest.fixture(scope="class")
def ray_env(tmp_path_factory):
    """HOME and RAY_TMPDIR in temporary directories (short: Ray's socket paths must stay < 108 chars)."""
    short = Path(tempfile.mkdtemp(prefix="ss-rt-"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(tmp_path_factory.mktemp("home")))
        mp.setenv("RAY_TMPDIR", str(short))
        try:
            yield mp
        finally:
            shutil.rmtree(short, ignore_errors=True)


def launch(launcher, fn: str, inputs, world: WorldSpec, workdir: Path):
    return launcher.run(Task(stage="test", fn=fn, inputs=inputs, workdir=workdir), world)


def test_an_unreachable_address_is_a_config_error_at_once(tmp_path):
    from pipelines.launchers.ray import RayLauncher

    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"launcher\.address='127\.0\.0\.1:1': cannot reach a Ray cluster"):
        RayLauncher(RayLauncherConfig(address="127.0.0.1:1"), tmp_path)
    assert time.monotonic() - start < 10


class TestLocalInstance:
    @pytest.fixture(scope="class")
    def launcher(self, ray_env, tmp_path_factory):
        from pipelines.launchers.ray import RayLauncher

        launcher = RayLauncher(RayLauncherConfig(max_failures=1, timeout_s=60), tmp_path_factory.mktemp("run"))
        try:
            yield launcher
        finally:
            launcher.close()

    @pytest.fixture(scope="class")
    def clean(self, launcher, tmp_path_factory):
        """An uninterrupted 2-worker ddp run through Ray (checkpointing every EVERY steps)."""
        tmp = tmp_path_factory.mktemp("clean")
        inputs = (train_inputs(DDP, steps=STEPS, ckpt_every=EVERY), str(tmp / "ckpt"))
        return launch(launcher, "tests.dist.workers:train_any", inputs, WorldSpec(2, 1), tmp / "logs")

    def test_two_workers_train_the_same_loss_curve_as_launcher_local(self, clean, tmp_path):
        local = run_world("tests.dist.workers:train_any", (train_inputs(DDP, steps=STEPS, ckpt_every=EVERY),
                                                           str(tmp_path / "ckpt")), world=2)
        assert clean.world_size == 2 and clean.resumed_from == 0 and len(clean.losses) == STEPS
        assert clean.losses == pytest.approx(local.losses, **TOL)

    def test_a_killed_worker_restarts_the_group_which_resumes_from_the_checkpoint(self, launcher, clean, tmp_path):
        marker = tmp_path / "killed"
        inputs = (train_inputs(DDP, steps=STEPS, ckpt_every=EVERY), str(tmp_path / "ckpt"), str(marker), KILL)
        resumed = launch(launcher, "tests.dist.workers:train_crash_once", inputs, WorldSpec(2, 1), tmp_path / "logs")
        assert marker.exists(), "rank 1 was never killed"
        assert resumed.resumed_from == EVERY
        assert len(resumed.losses) == STEPS and len(resumed.lrs) == STEPS
        assert resumed.losses == pytest.approx(clean.losses, **TOL)

    def test_no_preemption_watcher_runs_beside_the_ranks(self, launcher, clean):
        """Ray Train's PreemptionWatcher is a process per worker group that cost the ranks ~12 % of
        their samples/s on a 2-core host (pipelines/launchers/ray.py): the group runs without it."""
        import ray._private.state

        alive = [a["ActorClassName"] for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]
        assert sum("RayTrainWorker" in name for name in alive) == 2, alive
        assert not [name for name in alive if "PreemptionWatcher" in name], alive

    def test_one_worker_group_runs_every_stage_in_the_same_processes(self, launcher, tmp_path):
        """env, a one-device stage and env again: the same worker processes every time (rank 0 takes
        the one-device stage, without a process group), the group started once."""
        groups = len(launcher.groups)
        env = EnvInputs(EnvConfig())
        first = launch(launcher, "stages.env_check:run", env, WorldSpec(2, 1), tmp_path / "a")
        alone = launcher.run(Task(stage="one", fn="stages.env_check:run", inputs=env, workdir=tmp_path / "b"),
                             WorldSpec(1, 1, distributed=False))
        again = launch(launcher, "stages.env_check:run", env, WorldSpec(2, 1), tmp_path / "c")
        pids = [r.pid for r in first.ranks]
        assert [r.pid for r in again.ranks] == pids and [r.pid for r in alone.ranks] == pids[:1]
        assert alone.ranks[0].backend == "none" and first.ranks[0].backend == "gloo"
        assert len(launcher.groups) == groups, "no new worker group"
        assert {w["pid"] for w in launcher.record()["worker_groups"][-1]["workers"]} == set(pids)

    def test_more_workers_than_cpus_fail_at_once_saying_what_the_cluster_has(self, launcher, tmp_path):
        start = time.monotonic()
        with pytest.raises(StageFailed, match=r"asked for 8 Ray workers x 1 CPU, but the cluster has 1 alive node"):
            launch(launcher, "tests.dist.workers:ranks_sum", None, WorldSpec(8, 1), tmp_path)
        assert time.monotonic() - start < 30


class TestTwoNodeCluster:
    @pytest.fixture(scope="class")
    def launcher(self, ray_env, tmp_path_factory):
        """Two Ray nodes of one CPU each on this machine, joined by address with spread_nodes."""
        from ray.cluster_utils import Cluster

        from pipelines.launchers.ray import RayLauncher

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1}, shutdown_at_exit=False)
        launcher = None
        try:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            cfg = RayLauncherConfig(address=cluster.address, spread_nodes=True, timeout_s=15)
            launcher = RayLauncher(cfg, tmp_path_factory.mktemp("run"))
            yield launcher
        finally:
            if launcher is not None:
                launcher.close()
            cluster.shutdown()

    def test_spread_workers_land_on_two_nodes_and_env_sees_two_nodes(self, launcher, tmp_path):
        env, node_ids = launch(launcher, "tests.integration.ray_workers:env_with_node_ids",
                               EnvInputs(EnvConfig()), WorldSpec(2, 1), tmp_path)
        assert len(set(node_ids)) == 2
        assert env.world_size == 2 and env.nodes == 2
        assert sorted(r.node for r in env.ranks) == [0, 1]

    def test_a_raising_rank_fails_the_stage_naming_it_and_the_group_serves_the_next(self, launcher, tmp_path):
        with pytest.raises(StageFailed, match="rank 1 failed: ValueError: planted failure on rank 1"):
            launch(launcher, "tests.dist.workers:raise_on_rank1", None, WorldSpec(2, 1), tmp_path / "a")
        pids = sorted(int(p.read_text()) for p in (tmp_path / "a").glob("rank*.pid"))
        assert "Traceback" in (tmp_path / "a" / "rank1.log").read_text()
        result = launch(launcher, "tests.dist.workers:ranks_sum", None, WorldSpec(2, 1), tmp_path / "b")
        assert result["sum"] == 3.0 and result["pid"] in pids, "the same workers run the next stage"

    def test_a_hung_rank_fails_on_the_collective_timeout_and_its_process_ends(self, launcher, tmp_path):
        start = time.monotonic()
        with pytest.raises(StageFailed, match=r"rank 0 failed.*killed: ranks \[1\]"):
            launch(launcher, "tests.dist.workers:hang_rank1", None, WorldSpec(2, 1), tmp_path / "a")
        assert time.monotonic() - start < 15 + 45, "the 15 s collective timeout, plus a little"
        hung = int((tmp_path / "a" / "rank1.pid").read_text())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and Path(f"/proc/{hung}").exists():
            time.sleep(0.5)
        assert not Path(f"/proc/{hung}").exists(), "the hung rank's process was ended"
        # A new group serves the next stage.
        assert launch(launcher, "tests.dist.workers:ranks_sum", None, WorldSpec(2, 1), tmp_path / "b")["sum"] == 3.0

    def test_a_spread_world_larger_than_the_cluster_fails_at_once(self, launcher, tmp_path):
        start = time.monotonic()
        with pytest.raises(StageFailed, match=r"asked for 4 Ray workers x 1 CPU on 4 distinct nodes .* 2 alive node"):
            launch(launcher, "tests.dist.workers:ranks_sum", None, WorldSpec(4, 1), tmp_path)
        assert time.monotonic() - start < 30


class TestClusterThatListsGpus:
    """A Ray cluster whose node lists GPUs (declared: this machine has none) while the driver has
    none: the workers ask for them, decided from the cluster's resources, not the driver's devices."""

    @pytest.fixture(scope="class")
    def launcher(self, ray_env, tmp_path_factory):
        from ray.cluster_utils import Cluster

        from pipelines.launchers.ray import RayLauncher

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2}, shutdown_at_exit=False)
        launcher = None
        try:
            # backend gloo: the declared GPUs are not real, and nccl would (rightly) refuse them.
            launcher = RayLauncher(RayLauncherConfig(address=cluster.address, backend="gloo", timeout_s=30),
                                   tmp_path_factory.mktemp("run"))
            yield launcher
        finally:
            if launcher is not None:
                launcher.close()
            cluster.shutdown()

    def test_workers_request_a_gpu_each_when_the_cluster_lists_them(self, launcher, tmp_path):
        assert launcher.use_gpu
        got = launch(launcher, "tests.integration.ray_workers:gpus_of_workers", None, WorldSpec(2, 1), tmp_path)
        assert launcher.group.resources == {"CPU": 1.0, "GPU": 1}
        ids = [ids for ids, _ in got]
        assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == 2, got
        assert [visible for _, visible in got] == [i[0] for i in ids], "Ray shows each worker its own GPU"

    def test_auto_resolves_nccl_and_nodes_without_real_gpus_are_refused_before_any_stage(self, launcher, compose_cfg):
        import dataclasses

        from pipelines.validate import check_placement

        launcher.cfg = dataclasses.replace(launcher.cfg, backend="auto")
        try:
            placement = launcher.placement(WorldSpec(2, 1))
        finally:
            launcher.cfg = dataclasses.replace(launcher.cfg, backend="gloo")
        assert placement.backend == "nccl"
        cfg = compose_cfg("launcher=ray", "launcher.address=auto", "procs_per_node=1", "nodes=2")
        with pytest.raises(ConfigError, match=r"launcher.backend='nccl': needs a CUDA GPU for every rank, but node "):
            check_placement(cfg, placement)
