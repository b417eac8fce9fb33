"""`python run.py` end to end in a subprocess, as a user runs it: the six stages, the cache,
summary.json, MLflow's parent and nested runs, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import asked_statuses, host_to_itself, wait_for_mlflow_record

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["env", "bandwidth", "lr_find", "plan", "trials", "train", "report"]
ASKED = [s for s in STAGES if s != "trials"]  # plan.trials=0: the trials stage is not asked for
SMOKE = ["experiment=smoke"]
PEAK = "train.peak_flops=1e11"  # a device peak for MFU (CPUs list none)
PROBE = ["bandwidth.max_bytes=1048576", "bandwidth.warmup_iters=5", "bandwidth.iters=20"]
"""The probe up to the size of gpt-tiny's gradients (543 KB, one DDP bucket), 20 timed calls a size: smoke's
64 KiB and 3 calls left the plan's communication an extrapolation from latency-bound sizes, once 4x too slow."""
# gpt-tiny (vocab 256, width 64, 2 blocks, 4 heads, 64 positions) on smoke's 32-token samples,
# exactly: 6 FLOPs per linear weight per token (2 blocks x 12 x 64^2 + the 64 x 256 head = 114,688;
# the embeddings' lookups and the norms count none), plus causal attention's score and value
# products, half of the full matrix's 12 x blocks x width x tokens^2 (flops_convention causal_half).
GPT_TINY_FLOPS_PER_SAMPLE = 6 * (2 * 12 * 64**2 + 64 * 256) * 32 + 6 * 2 * 64 * 32 * 32


def run_cli(cwd: Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """One smoke run then an identical second run, in a fresh working directory."""
    cwd = tmp_path_factory.mktemp("e2e")
    with host_to_itself():  # its step time is held against the plan's (beside a worker's ranks: 4.6x)
        first = run_cli(cwd, *SMOKE, PEAK, *PROBE, "hydra.run.dir=runs/first")
    second = run_cli(cwd, *SMOKE, PEAK, *PROBE, "hydra.run.dir=runs/second")
    if second.returncode == 0:  # fully cached: its MLflow run is logged in the background
        wait_for_mlflow_record(cwd / "runs/second/summary.json")
    return cwd, first, second


@pytest.mark.slow
def test_first_run_runs_every_stage(workspace):
    cwd, first, _ = workspace
    assert first.returncode == 0, first.stdout + first.stderr
    summary = summary_of(cwd / "runs/first")
    assert list(summary["stages"]) == STAGES
    assert asked_statuses(summary) == dict.fromkeys(ASKED, "ran")
    assert summary["stages"]["trials"]["error"] == "not asked for (plan.trials=0)"
    assert f"summary: {cwd / 'runs/first/summary.json'}" in first.stdout
    stage = summary["stages"]
    assert stage["env"]["result"]["world_size"] == 2 and stage["env"]["result"]["consistent"]
    assert {"world_size", "ranks", "consistent"} <= set(stage["env"]["result"])
    for m in stage["bandwidth"]["result"]["results"]:
        assert set(m) == {"collective", "bytes", "time_us", "algbw_gbps", "busbw_gbps"} and m["busbw_gbps"] > 0
    assert stage["bandwidth"]["result"]["verdict"]
    assert {"suggested_lr", "finder_batch", "lr_scaling", "rule", "curve"} <= set(stage["lr_find"]["result"])
    assert summary["run"]["world_size"] == 2 and summary["run"]["global_batch"] == train_batch(summary)
    assert {"recommended_strategy", "reasons", "peak_memory_bytes", "flops_per_sample"} <= set(stage["plan"]["result"])
    passes, plan = stage["plan"]["result"]["rulers"]["passes"], stage["plan"]["result"]  # the step split per pass
    assert passes["micro"] == 4 and 0 < passes["pass_share"] and 0 < passes["step_share"] < 1 - passes["pass_share"]
    assert any(r.startswith("compute: the ") and "a forward and backward pass whatever its size" in r for r in plan["reasons"])
    train = stage["train"]["result"]
    keys = {"strategy", "world_size", "steps", "final_loss", "losses", "samples_per_s", "baseline_samples_per_s",
            "scaling_efficiency"}
    assert keys <= set(train)
    assert train["world_size"] == 2 and len(train["losses"]) == train["steps"] == 8
    assert train["scaling_efficiency"] == pytest.approx(
        train["samples_per_s"] / (2 * train["baseline_samples_per_s"])
    )
    assert stage["train"]["baseline"]["status"] == "ran"
    fields = {"strategy", "devices", "fits", "memory_per_device_bytes", "step_time_s", "tokens_per_s",
              "scaling_efficiency"}
    predictions = stage["plan"]["result"]["predictions"]
    assert predictions and all(fields <= set(p) for p in predictions)
    assert {p["devices"] for p in predictions} >= {1, 2, 1024}
    assert train["flops_per_sample"] == GPT_TINY_FLOPS_PER_SAMPLE
    assert stage["plan"]["result"]["flops_convention"] == "causal_half"
    assert train["mfu_pct"] == pytest.approx(100 * train["flops_per_sample"] * train["samples_per_s_per_device"] / 1e11)
    # Every run is held against the plan's prediction for what it trained (the requested layout's),
    # the error as (measured - predicted) / measured. Memory to the goal of 10 %. How close the step
    # time comes is judged by make bench, side by side (bench_planner: each point of ddp and zero3 at
    # world 1, 2 and 4 against its 15 % goal); an 8-step run on a 2-core host, to itself (the
    # fixture's `host_to_itself`), is held to 2.5x either way.
    check = train["prediction"]
    assert check["step_time_s"] == pytest.approx(stage["plan"]["result"]["requested"]["step_time_s"])
    measured = train["step_time_s"]
    assert check["step_time_error_pct"] == pytest.approx(100 * (measured - check["step_time_s"]) / measured)
    assert abs(check["memory_error_pct"]) < 10
    assert 1 / 2.5 < check["step_time_s"] / measured < 2.5
    report = cwd / "runs/first/report"
    text = (report / "report.md").read_text()
    facts = dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", text.split("## Plan")[0], re.M))
    assert facts["strategy"] == "ddp" and facts["world size"] == "2 (2 nodes)"
    assert facts["global batch"] == "8 (4 x 1 accumulation x 2)"
    assert facts["scaling efficiency"] == f"{train['scaling_efficiency']:.3f}"
    assert facts["MFU"] == f"{train['mfu_pct']:.1f} %"
    assert facts["loss"].endswith(f"-> {train['final_loss']:.4f} in 8 steps")
    assert facts["learning rate"] == f"{train['lr']:.3e} from {train['lr_source']}"
    assert f"Recommended strategy: **{stage['plan']['result']['recommended_strategy']}**" in text
    assert f"run it: {stage['plan']['result']['recommended']['command']}" in text
    for plot in ("lr_find.png", "busbw.png", "loss.png"):
        assert f"![{plot}]({plot})" in text and (report / plot).stat().st_size > 1000


def train_batch(summary: dict) -> int:
    return summary["stages"]["train"]["result"]["global_batch"]


@pytest.mark.slow
def test_second_identical_run_is_all_cached(workspace):
    cwd, first, second = workspace
    assert second.returncode == 0, second.stdout + second.stderr
    summary = summary_of(cwd / "runs/second")
    assert asked_statuses(summary) == dict.fromkeys(ASKED, "cached")
    assert summary["stages"]["train"]["baseline"]["status"] == "cached"
    assert summary["stages"]["train"]["result"] == summary_of(cwd / "runs/first")["stages"]["train"]["result"]


@pytest.mark.slow
def test_a_fully_cached_rerun_imports_no_torch(workspace):
    """What makes a no-op re-run take about a second: the driver decides from the cache alone, and
    nothing it imports on that path loads torch (Python's own import log, -X importtime)."""
    cwd, first, _ = workspace
    assert first.returncode == 0, first.stdout + first.stderr
    third = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "run.py"), *SMOKE, PEAK, *PROBE,
                            "tracking=none", "hydra.run.dir=runs/third"], cwd=cwd, capture_output=True, text=True,
                           timeout=300)
    assert third.returncode == 0, third.stdout + third.stderr
    assert asked_statuses(summary_of(cwd / "runs/third")) == dict.fromkeys(ASKED, "cached")
    imported = {line.rsplit("|", 1)[1].strip() for line in third.stderr.splitlines() if line.startswith("import time:")}
    assert "hydra" in imported and "pipelines.runner" in imported, "the import log was read"
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}


@pytest.mark.slow
def test_mlflow_holds_a_parent_and_six_nested_runs_per_invocation(workspace):
    from mlflow.tracking import MlflowClient

    cwd, _, _ = workspace
    client = MlflowClient(tracking_uri=f"sqlite:///{cwd}/outputs/mlflow.db")
    experiment = client.get_experiment_by_name("scalestudy")
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 2
    for parent in parents:
        assert parent.data.tags["strategy"] == "ddp" and parent.data.tags["world_size"] == "2"
        assert parent.data.params["train.steps"] == "8"
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(c.data.tags["stage"] for c in children) == sorted(STAGES)
        train = next(c for c in children if c.data.tags["stage"] == "train")
        history = client.get_metric_history(train.info.run_id, "train/loss")
        assert [m.step for m in history] == list(range(1, 9)), "every step once"
        assert "train/scaling_efficiency" in parent.data.metrics
    summary = summary_of(cwd / "runs/second")
    second = client.get_run(summary["mlflow_run_id"])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == second.info.run_id]
    asked = [c for c in children if c.data.tags["stage"] in ASKED]
    assert len(asked) == len(ASKED) and {c.data.tags["cached"] for c in asked} == {"true"}
    assert all(c.data.metrics for c in asked if c.data.tags["stage"] != "report")


def test_bad_override_is_one_line_and_writes_nothing(tmp_path):
    result = run_cli(tmp_path, "nodes=0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: nodes=0: must be an integer >= 1"]
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "outputs").exists(), "nothing launched, nothing written"


@pytest.mark.parametrize("multirun", [False, True])
def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path, multirun):
    (tmp_path / "taken").write_text("a file where the run dir's parent would be")
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    result = run_cli(tmp_path, *(["-m"] if multirun else []), f"{key}={tmp_path}/taken/run")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {key}={tmp_path}/taken/run: cannot be created: {tmp_path}/taken is a file, not a directory"]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")
def test_a_run_dir_the_filesystem_refuses_is_one_line_even_where_permissions_allow(tmp_path):
    """/proc passes os.access for root, and refuses a new directory all the same: Hydra's own
    mkdir used to end in a traceback (exit 1)."""
    result = run_cli(tmp_path, "hydra.run.dir=/proc/forbidden/run")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: hydra.run.dir=/proc/forbidden/run: cannot be created: /proc refuses a new directory "
        "(No such file or directory)"]
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "outputs").exists()


def test_unknown_option_lists_the_valid_ones(tmp_path):
    result = run_cli(tmp_path, "strategy=zero9")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: strategy=zero9: no such option; available: auto, ddp, hybrid, pp, tp, zero1, zero2, zero3"
    )
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_a_sweep_runs_each_point_and_world_one_measures_no_bandwidth(tmp_path):
    result = run_cli(tmp_path, "-m", *SMOKE, "nodes=1,2", "tracking=none", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    summaries = sorted((tmp_path / "outputs/multirun").rglob("summary.json"))
    assert len(summaries) == 2
    by_world = {}
    for path in summaries:
        data = json.loads(path.read_text())
        by_world[data["stages"]["train"]["result"]["world_size"]] = data
    one = by_world[1]["stages"]
    assert one["bandwidth"]["result"]["results"] == []
    assert "world size 1" in one["bandwidth"]["result"]["skipped_reason"]
    assert one["train"]["result"]["scaling_efficiency"] == 1.0
    assert "baseline" not in one["train"], "a world of one is its own baseline"


def test_dry_run_plans_a_32_rank_layout_in_seconds(tmp_path):
    result = run_cli(tmp_path, "strategy=hybrid", "nodes=4", "procs_per_node=8", "dry_run=true", "strategy.tp=4",
                     "strategy.pp=2", "tracking=none", "hydra.run.dir=dry", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "world=32 = pp 2 x dp_replicate 1 x dp_shard 4 x tp 4" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "16"], "one rank per pipeline stage"
    cache = tmp_path / "outputs" / "cache"
    assert not [p for p in cache.glob("*") if p.name != "contract"], "a dry run runs no stage"


HUB_MODEL = """from training.models.gpt import build as gpt


def build(api_token: str, mirror: str, **shape):
    \"\"\"gpt-tiny, as a factory that takes credentials (a model hub's token and mirror) would.\"\"\"
    return gpt(**shape)
"""


@pytest.mark.slow
def test_planted_secrets_never_reach_mlflow_or_the_summary(tmp_path):
    # Secrets arrive where users put them: in their own model factory's arguments (a hub token, a
    # mirror URL with credentials). Launcher options that go into job scripts refuse them instead.
    (tmp_path / "hub_models.py").write_text(HUB_MODEL)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    model = ["model=gpt-tiny", "model._target_=hub_models.build"]
    result = run_cli(tmp_path, "experiment=smoke", "nodes=1", "only=[lr_find]", "hydra.run.dir=secret", *model,
                     "+model.api_token=s3cr3tvalue", "+model.mirror=https://u:t0kenvalue@h", env=env)
    assert result.returncode == 0, result.stderr
    sweep = run_cli(tmp_path, "-m", "experiment=smoke", "nodes=1", "only=[lr_find]", "hydra.sweep.dir=sweep",
                    "tracking=none", *model, "+model.api_token=s3cr3tvalue,an0thers3cr3t", "+model.mirror=m", env=env)
    assert sweep.returncode == 0, sweep.stderr
    assert "api_token: '***'" in (tmp_path / "secret" / "config.yaml").read_text()
    assert not (tmp_path / "secret" / ".hydra").exists()
    # Everything the tool wrote: MLflow, run dirs (config, logs, task files), the sweep's files.
    written = [tmp_path / "outputs" / "mlflow.db", *(tmp_path / "outputs" / "cache").rglob("*"), *(tmp_path / "outputs" / "mlartifacts").rglob("*"),
               *(tmp_path / "secret").rglob("*"), *(tmp_path / "sweep").rglob("*")]
    assert (tmp_path / "sweep" / "multirun.yaml") in written
    for path in [*written, *(p.parent for p in written)]:
        assert "s3cr3t" not in str(path) and "t0kenvalue" not in str(path), path
    for path in written:
        if path.is_file():
            blob = path.read_bytes()
            assert b"s3cr3t" not in blob and b"t0kenvalue" not in blob, path
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    run = client.get_run(json.loads((tmp_path / "secret" / "summary.json").read_text())["mlflow_run_id"])
    assert run.data.params["model.api_token"] == "***"
    assert run.data.params["model.mirror"] == "https://***@h"


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_killed_driver_takes_its_workers_and_the_rerun_completes(tmp_path, signame):
    import signal
    import time

    args = ["experiment=smoke", "tracking=none", "only=[train]", "train.steps=3000", "train.log_every=1000"]
    # The driver as a terminal's foreground job has it: Ctrl-C's SIGINT not ignored, whatever this
    # suite inherited (a shell without job control starts its background jobs ignoring SIGINT, and
    # Python then installs no KeyboardInterrupt handler).
    driver = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args, "hydra.run.dir=killed"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in driver.stdout:
        if re.match(r"\[\d+/\d+\] train: .*\.\.\.$", line):
            break
    time.sleep(4)  # the baseline, then the 2-rank run, are under way
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(driver.pid)], capture_output=True, text=True)
    workers = [int(pid) for pid in children.stdout.split()]
    assert workers, "the driver had started its workers"
    driver.send_signal(getattr(signal, signame))
    rest = driver.communicate(timeout=60)[0]
    # The exit-code contract: 130 on Ctrl-C, the interruption written to summary.json; a
    # terminated or killed driver ends by its signal (nothing to write, nothing half-written).
    if signame == "SIGINT":
        assert driver.returncode == 130, rest[-2000:]
        assert rest.strip().endswith("interrupted")
        stages = summary_of(tmp_path / "killed")["stages"]
        assert stages["train"] == {**stages["train"], "status": "failed", "error": "interrupted (Ctrl-C)"}
        assert stages["report"]["error"] == "interrupted (Ctrl-C)"
    else:
        assert driver.returncode == -getattr(signal, signame)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in workers), f"no worker outlives a driver killed by {signame}"
    assert not list((tmp_path / "outputs/cache").glob("train*/[!.]*")), "no half-written train result"
    again = run_cli(tmp_path, "experiment=smoke", "tracking=none", "only=[train]", "hydra.run.dir=again")
    assert again.returncode == 0, again.stderr
    assert summary_of(tmp_path / "again")["stages"]["train"]["status"] == "ran"
    assert not list((tmp_path / "outputs/cache").glob("*/.tmp-*")), "the dead driver's staging was gone or swept"


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_four_invocations_at_once_share_outputs_and_the_sqlite_store(tmp_path):
    """Four drivers start together on a brand-new MLflow store (its schema is created under a lock)."""
    procs = [
        subprocess.Popen([sys.executable, str(ROOT / "run.py"), "experiment=smoke", "nodes=1", "only=[lr_find]",
                          f"seed={seed}", f"hydra.run.dir=run{seed}"], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for seed in range(4)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outputs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    experiment = client.get_experiment_by_name("scalestudy")
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    parents = {r.info.run_id for r in runs if "mlflow.parentRunId" not in r.data.tags}
    assert parents == {summary_of(tmp_path / f"run{seed}")["mlflow_run_id"] for seed in range(4)}
    entries = list((tmp_path / "outputs/cache/lr_find").iterdir())
    assert len(entries) == 4 and all((e / "entry.json").exists() for e in entries)


PLANTED = '''
import os
import torch
from torch import nn


class Fails(nn.Module):
    """A model that builds and passes the contract checks in the driver, then fails on a worker."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 8)  # the blobs: 32 features, 8 classes

    def forward(self, x):
        if "RANK" in os.environ:
            raise RuntimeError("planted failure on a worker")
        return self.linear(x)
'''


@pytest.mark.slow
def test_a_failing_stage_exits_1_and_the_summary_says_which_and_why(tmp_path):
    (tmp_path / "planted.py").write_text(PLANTED)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # Not experiment=smoke: it shortens data.seq_len, which the blobs take no part in.
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), "model=custom", "model._target_=planted.Fails",
                             "data=blobs", "data.num_samples=256", "bandwidth.max_bytes=65536", "lr_find.num_iters=5",
                             "train.steps=4", "train.timing_warmup=1", "tracking=none", "hydra.run.dir=run"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    summary = summary_of(tmp_path / "run")
    assert summary["ok"] is False
    failed = {n: s["error"] for n, s in summary["stages"].items() if s["status"] == "failed"}
    assert list(failed) == ["lr_find"] and "planted failure on a worker" in failed["lr_find"]
    assert summary["stages"]["plan"]["error"] == "upstream stage lr_find failed"
    assert summary["stages"]["train"]["status"] == "skipped"
    assert summary["stages"]["env"]["status"] == "ran", "stages that do not need it still ran"
