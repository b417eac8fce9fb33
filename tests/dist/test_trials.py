"""The trials stage on real gloo ranks: an out-of-memory error on one rank, mid-step while its peer
waits in that step's collective, is agreed by both within seconds (far under the collective
timeout), both record the same trial as out of memory and choose the same layout; and a trial
leaves no process group behind."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from stages.trials import TrialsInputs
from tests.dist.test_strategies import DATA, GPT
from tests.helpers import run_world
from training.config import StrategyConfig, TrainConfig
from training.plan_config import PlanConfig
from training.planner.predict import Prediction
from training.planner.ranking import Candidate

COLLECTIVE_TIMEOUT_S = 120.0
STEPS = 4
BUDGET_MIB = 0.6
"""Below what rank 1 holds at its peak in any of these first trials (0.7-0.8 MiB), above what it
holds once the model is sharded: crossed mid-trial."""


def candidate(strategy: str, flavour: str, **dims: int) -> Candidate:
    dims = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, **dims}
    predicted = Prediction(strategy, 2, True, 2**20, 0.1, 1000.0, 0.9, 80.0, 0.01, 0.0, compute_s=0.09,
                           collective_calls=4)
    return Candidate(strategy=strategy, flavour=flavour, dims=dims, micro_batch=4, grad_accum=1,
                     activation_checkpointing="none", precision="fp32", pp_schedule="gpipe", microbatches=1,
                     bucket_cap_mb=25.0, fits=True, memory_per_device_bytes=2**20, step_time_s=0.1,
                     tokens_per_s=1000.0, mfu_pct=None, scaling_efficiency=0.9,
                     command=f"python run.py strategy={strategy} {' '.join(f'{k}={v}' for k, v in dims.items())}",
                     prediction=predicted)


DDP = candidate("ddp", "ddp", dp_replicate=2)
ZERO3 = candidate("zero3", "zero3", dp_shard=2)
TP = candidate("tp", "ddp", tp=2)
PP = dataclasses.replace(candidate("pp", "ddp", pp=2), microbatches=2)


def trials_inputs(n: int) -> TrialsInputs:
    train = TrainConfig(steps=STEPS, global_batch=8, lr=1e-2, log_every=STEPS, timing_warmup=2, warmup_steps=0,
                        schedule="constant", grad_clip=0.5)
    return TrialsInputs(PlanConfig(trials=n, trial_steps=STEPS), train, GPT, DATA["gpt"], StrategyConfig(), seed=0)


def run_trials(inputs: tuple) -> dict:
    """A stage function: the real trials stage over `layouts`, every rank leaving what it saw in
    `out/rank<r>.json`: each trial's error, the chosen layout, each trial's start, end and how it
    ended, the process groups it held at the agreement after each trial. In its first trial,
    `fail_rank` (if any) raises the budget's out-of-memory error at the start of the second step
    (after waiting a second, so that its peer is surely inside that step's collectives), or with
    `budget_mib` runs under a budget of its own, which fails it wherever it is crossed."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import stages.trials as trials
    import training.isolation as isolation
    import training.loop as loop
    from training.budget import DeviceOutOfMemory, StorageTracker
    from training.units import MIB

    cfg, layouts, out, fail_rank, budget_mib = inputs
    rank = dist.get_rank()
    seen: dict = {"calls": [], "groups_at_agreement": [], "groups_in_trial": [], "log": [], "failed_at": None}
    steps = iter(range(10**9))
    original_step, original_measure, original_agree, original_log = (loop.optimizer_step, trials._measure,
                                                                     isolation._agree, trials.log)

    def step(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - optimizer_step's own
        if next(steps) == 1 and rank == fail_rank and budget_mib is None:
            time.sleep(1.0)
            seen["failed_at"] = time.time()
            raise DeviceOutOfMemory(f"rank {rank}: device memory budget exceeded: 1.50 MiB in use > 1.00 MiB "
                                    "(cluster.device_memory_gib=0.000976562)")
        return original_step(*args, **kwargs)

    def measure(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        call = {"start": time.time()}
        seen["calls"].append(call)
        budget = rank == fail_rank and budget_mib is not None and len(seen["calls"]) == 1
        try:
            with StorageTracker(int(budget_mib * MIB), rank) if budget else contextlib.nullcontext():
                out = original_measure(*args, **kwargs)
            call["outcome"] = "ok"
            return out
        except BaseException as err:
            call["outcome"] = f"{type(err).__name__}: {str(err)[:300]}"  # never the error itself: it holds the trial
            raise
        finally:
            call["end"] = time.time()
            seen["groups_in_trial"].append(len(c10d._world.pg_map))

    def agree(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen["groups_at_agreement"].append(len(c10d._world.pg_map))
        return original_agree(*args, **kwargs)

    def log(stage: str, message: str) -> None:
        seen["log"].append(message)
        original_log(stage, message)

    loop.optimizer_step, trials._measure, isolation._agree, trials.log = step, measure, agree, log
    plan = SimpleNamespace(layouts=layouts, world_size=dist.get_world_size())
    lr_find = SimpleNamespace(scaled=lambda batch: 1e-2)
    seen["groups_before"] = len(c10d._world.pg_map)
    result = trials.run(cfg, plan=plan, lr_find=lr_find)
    seen["groups_after"] = len(c10d._world.pg_map)
    seen["errors"] = [t.error for t in result.trials]
    seen["chosen"] = result.chosen.command if result.chosen else None
    seen["step_s"] = [t.step_time_s for t in result.trials]
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    return seen


def ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_an_out_of_memory_on_one_rank_is_agreed_by_both_within_seconds(tmp_path):
    layouts = [DDP, ZERO3, TP]
    started = time.time()
    run_world("tests.dist.test_trials:run_trials", (trials_inputs(3), layouts, str(tmp_path), 1, None), world=2,
              workdir=tmp_path / "work", timeout_s=COLLECTIVE_TIMEOUT_S)
    elapsed = time.time() - started
    r0, r1 = ranks(tmp_path)
    # Rank 1 failed mid-step; rank 0, waiting in that step's all-reduce, was released from it.
    assert r1["calls"][0]["outcome"].startswith("DeviceOutOfMemory: rank 1: device memory budget exceeded")
    assert r0["calls"][0]["outcome"].startswith(("RuntimeError", "DistBackendError")), r0["calls"][0]
    assert "out of memory" not in r0["calls"][0]["outcome"].lower()
    released_after_s = r0["calls"][0]["end"] - r1["failed_at"]
    next_trial_after_s = r0["calls"][1]["start"] - r1["failed_at"]
    assert 0 <= released_after_s < 10 and next_trial_after_s < 30, (released_after_s, next_trial_after_s)
    assert elapsed < COLLECTIVE_TIMEOUT_S / 2, elapsed
    # Both record the first trial as out of memory (rank 1's words) and measured the others alike.
    for r in (r0, r1):
        assert r["errors"][0].startswith("DeviceOutOfMemory: rank 1: device memory budget exceeded"), r["errors"]
        assert r["errors"][1:] == [None, None]
        assert len(r["calls"]) == 5, "the failed layout is left out of the second round"
    assert r0["errors"] == r1["errors"] and r0["step_s"] == r1["step_s"]
    assert r0["chosen"] == r1["chosen"] and r0["chosen"] in (ZERO3.command, TP.command)
    # The failed trial's groups went too.
    for r in (r0, r1):
        assert r["groups_at_agreement"] == [r["groups_before"]] * 5 and r["groups_after"] == r["groups_before"]
        assert not [line for line in r["log"] if "process group" in line], r["log"]


@pytest.mark.slow
def test_trials_leave_no_process_group_behind(tmp_path):
    """Each trial's groups (a stand-in world, the mesh's) are destroyed and freed after it: the
    registry holds after every trial what it held before the first, and no group outlives it."""
    run_world("tests.dist.test_trials:run_trials", (trials_inputs(3), [DDP, ZERO3, TP], str(tmp_path), None, None),
              world=2, workdir=tmp_path / "work", timeout_s=COLLECTIVE_TIMEOUT_S)
    for r in ranks(tmp_path):
        assert r["errors"] == [None, None, None] and all(c["outcome"] == "ok" for c in r["calls"])
        assert len(r["calls"]) == 6
        assert all(n > r["groups_before"] for n in r["groups_in_trial"]), "each trial made groups of its own"
        assert r["groups_at_agreement"] == [r["groups_before"]] * 6
        assert r["groups_after"] == r["groups_before"]
        assert not [line for line in r["log"] if "process group" in line], r["log"]


@pytest.mark.slow
@pytest.mark.parametrize("first", [DDP, ZERO3, TP, PP], ids=lambda c: c.strategy)
def test_a_rank_over_its_own_budget_mid_trial_is_agreed_by_both(tmp_path, first):
    """Rank 1 alone under a budget its first trial crosses (wherever the allocation that crosses it
    falls: in the forward, the backward, FSDP's gathered parameters, a pipeline stage, whose error
    the schedule wraps in its own): rank 0 is released from the collective it waits in, both record
    that trial as out of memory, and measure the next alike."""
    run_world("tests.dist.test_trials:run_trials", (trials_inputs(2), [first, DDP if first is not DDP else ZERO3],
                                                    str(tmp_path), 1, BUDGET_MIB),
              world=2, workdir=tmp_path / "work", timeout_s=COLLECTIVE_TIMEOUT_S)
    r0, r1 = ranks(tmp_path)
    assert r0["calls"][0]["outcome"].startswith(("RuntimeError", "DistBackendError")), r0["calls"][0]
    assert "out of memory" not in r0["calls"][0]["outcome"].lower(), "released, not out of memory itself"
    assert r0["calls"][0]["end"] - r1["calls"][0]["end"] < 10
    for r in (r0, r1):
        assert r["errors"][0].startswith("DeviceOutOfMemory: rank 1: device memory budget exceeded"), r["errors"]
        assert r["errors"][1] is None and len(r["calls"]) == 3
        assert r["groups_at_agreement"] == [r["groups_before"]] * 3
    assert r0["errors"] == r1["errors"] and r0["step_s"] == r1["step_s"] and r0["chosen"] == r1["chosen"]
