"""make gpu-smoke: what one GPU can prove of the CUDA paths this project cannot run on CPU, as one
prepared, asserting run of at most ten minutes. It prints a table, one row per check (what was
measured, and whether it holds), and exits non-zero if any check fails.

    python scripts/gpu_smoke.py            # one GPU (make gpu-smoke)
    python scripts/gpu_smoke.py --multi    # every GPU of the machine, and Ray / Slurm where present

One GPU: CUDA, NCCL and driver versions and the device; a bf16 matmul against the peak table;
env + train at world 1 on nccl (memory from the CUDA allocator, MFU, a DataLoader with two
workers, the profiler's split against the step); a run with no visible device refused in one
line; the DDP bucket hook's times against CUDA events; the plan's memory prediction against
`max_memory_reserved` and `mem_get_info`; FLOPs counted at sequence 2048; bf16 losses of ddp and
zero3 over 20 steps; a checkpoint resumed, zero1's included; the kernels of scripts/gpu_kernels.py
(Float8's product against the CPU's emulation, context parallelism's causal chunks against one
call).

--multi (a machine with two or more GPUs): nccl at world N (env, bandwidth, train ddp and zero3),
each rank on its own GPU (distinct bus ids) under launcher=local, launcher=ray, and launcher=slurm
when a Slurm cluster with GPUs answers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.gpu_kernels import cp_attention_kernels, float8_against_emulation  # noqa: E402

COMMON = ["tracking=none", "model=gpt-small", "data=markov", "data.num_samples=2048", "lr_find.num_iters=30",
          "train.micro_batch=8", "train.log_every=5", "strategy.precision=bf16", "cluster=gpu"]
STEPS = 20
LOSS_RTOL = 0.01
"""bf16 ddp vs zero3 at world 1: the same program but for FSDP's mixed-precision casts."""
MEMORY_RATIO = (0.8, 1.25)
"""The plan's memory prediction over the allocator's max_memory_reserved."""
MATMUL_FRACTION = (0.3, 1.05)
"""A large bf16 matmul's achieved FLOP/s over the datasheet's dense peak."""


@dataclass
class Row:
    check: str
    ok: bool
    detail: str


class Smoke:
    """Runs checks in order, each isolated: a failing one is a row, not the end of the run."""

    def __init__(self, out: Path):
        self.out = out
        self.rows: list[Row] = []
        self.runs: dict[str, dict] = {}

    def check(self, name: str, fn: Callable[[], str]) -> None:
        start = time.monotonic()
        try:
            detail, ok = fn(), True
        except Exception as err:  # noqa: BLE001 - every failure is a row of the table
            detail, ok = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}", False
        self.rows.append(Row(name, ok, f"{detail} ({time.monotonic() - start:.0f} s)"))
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {self.rows[-1].detail}", flush=True)

    def run(self, name: str, *overrides: str, env: dict[str, str] | None = None) -> dict:
        """run.py in its own run dir and cache; its summary.json (raises with its last lines on failure)."""
        run_dir = self.out / name
        args = [sys.executable, str(ROOT / "run.py"), *COMMON, f"cache_dir={self.out / 'cache' / name}",
                f"hydra.run.dir={run_dir}", *overrides]
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
        if done.returncode != 0:
            tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
            raise RuntimeError(f"run.py {' '.join(overrides)} exited {done.returncode}: {' | '.join(tail)}")
        self.runs[name] = json.loads((run_dir / "summary.json").read_text())
        return self.runs[name]

    def table(self) -> str:
        width = max(len(r.check) for r in self.rows)
        lines = [f"{'check'.ljust(width)} | ok   | measured", f"{'-' * width}-+------+---------"]
        lines += [f"{r.check.ljust(width)} | {'yes ' if r.ok else 'NO  '} | {r.detail}" for r in self.rows]
        return "\n".join(lines)


def result(summary: dict, stage: str) -> dict:
    record = summary["stages"][stage]
    assert record["status"] in ("ran", "cached"), f"{stage} {record['status']}: {record.get('error')}"
    return record["result"]


# ---- one GPU -------------------------------------------------------------------------------


def versions() -> str:
    import torch

    from training.envinfo import driver_version, nccl_version

    assert torch.cuda.is_available()
    return (f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl_version()}, driver "
            f"{driver_version()}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")


def matmul_against_peak() -> str:
    import torch

    from training.flops import peak_for_name

    name = torch.cuda.get_device_name(0)
    peak = peak_for_name(name, "bf16", tf32=False)
    assert peak is not None, f"{name} is not in training/flops.py's peak table"
    n, iters = 8192, 50
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(5):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize()
    achieved = 2 * n**3 * iters / (start.elapsed_time(end) / 1e3)
    fraction = achieved / peak
    low, high = MATMUL_FRACTION
    assert low <= fraction <= high, f"{achieved / 1e12:.0f} TFLOP/s is {fraction:.2f} of the {peak / 1e12:.0f} peak"
    return f"{achieved / 1e12:.0f} TFLOP/s bf16 = {fraction:.2f} of the table's {peak / 1e12:.1f} for {name}"


def world_one(smoke: Smoke) -> str:
    summary = smoke.run("ddp", "nodes=1", "procs_per_node=1", "launcher.backend=nccl", "strategy=ddp",
                        f"train.steps={STEPS}", "data.num_workers=2", "only=[env,train]")
    env, train = result(summary, "env"), result(summary, "train")
    assert env["ranks"][0]["backend"] == "nccl", env["ranks"][0]["backend"]
    assert train["memory_source"] == "cuda_allocator", train["memory_source"]
    assert train["mfu_pct"] is not None and 0 < train["mfu_pct"] < 100, train["mfu_pct"]
    return (f"nccl, {train['tokens_per_s']:.0f} tokens/s, MFU {train['mfu_pct']:.1f} % of {train['mfu_peak_precision']}, "
            f"peak {train['peak_memory_bytes'] / 2**30:.2f} GiB (cuda_allocator), DataLoader 2 workers")


def profiler_split(smoke: Smoke) -> str:
    train = result(smoke.runs["ddp"], "train")
    split_ms = sum(s["ms_per_step"] for s in train["time_split"])
    step_ms = train["step_time_s"] * 1e3
    assert train["time_split"], "no time split"
    assert 0.2 * step_ms <= split_ms <= 1.1 * step_ms, f"kernels {split_ms:.1f} ms vs step {step_ms:.1f} ms"
    kinds = ", ".join(f"{s['kind']} {s['ms_per_step']:.1f}" for s in train["time_split"])
    return f"GPU kernels {split_ms:.1f} ms of a {step_ms:.1f} ms step ({kinds})"


def memory_prediction(smoke: Smoke) -> str:
    import torch

    train = result(smoke.runs["ddp"], "train")
    check = train["prediction"]
    assert check is not None, "train carries no prediction"
    ratio = check["memory_bytes"] / train["peak_memory_bytes"]
    low, high = MEMORY_RATIO
    free, total = torch.cuda.mem_get_info(0)
    assert low <= ratio <= high, f"predicted {check['memory_bytes'] / 2**30:.2f} GiB vs reserved " \
                                 f"{train['peak_memory_bytes'] / 2**30:.2f} GiB"
    assert check["memory_bytes"] <= free, "the prediction exceeds the device's free memory"
    return (f"predicted {check['memory_bytes'] / 2**30:.2f} GiB / max_memory_reserved "
            f"{train['peak_memory_bytes'] / 2**30:.2f} GiB = {ratio:.2f}; mem_get_info free {free / 2**30:.1f} of "
            f"{total / 2**30:.1f} GiB")


def empty_visible_devices(smoke: Smoke) -> str:
    args = [sys.executable, str(ROOT / "run.py"), *COMMON, f"hydra.run.dir={smoke.out / 'hidden'}",
            f"cache_dir={smoke.out / 'cache' / 'hidden'}", "only=[env]"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    message = done.stderr.strip()
    assert done.returncode != 0, "a run with no visible device succeeded"
    assert "Traceback" not in done.stderr and len(message.splitlines()) == 1, message
    assert "GPU" in message, message
    return f"exit {done.returncode}: {message}"


def bucket_hook_against_events() -> str:
    """DDP over one rank (forced), buckets of 4 MiB: the hook's per-bucket times against the same
    all-reduce timed with CUDA events."""
    import datetime

    import torch
    import torch.distributed as dist

    from training.parallel.ddp import apply_ddp, time_buckets

    store = dist.FileStore(tempfile.mktemp(prefix="smoke-store-"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60),
                            device_id=torch.device("cuda", 0))
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
        ddp = apply_ddp(model, torch.device("cuda", 0), bucket_cap_mb=4, find_unused_parameters=False, force=True)
        timer = time_buckets(ddp)
        x = torch.randn(64, 2048, device="cuda")
        for _ in range(10):
            ddp(x).sum().backward()
        torch.cuda.synchronize()
        hook = statistics.median(timer.ms)
        flat = torch.zeros(4 * 2**20 // 4, device="cuda")
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(flat)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        events = statistics.median(times)
    finally:
        dist.destroy_process_group()
    assert hook > 0 and hook <= 10 * events + 0.05, f"hook {hook:.3f} ms vs events {events:.3f} ms"
    return f"hook median {hook:.3f} ms per bucket ({len(timer.ms)} buckets) vs CUDA events {events:.3f} ms (4 MiB)"


def flops_at_2048(smoke: Smoke) -> str:

    summary = smoke.run("plan-2048", "nodes=1", "procs_per_node=1", "model.seq_len=2048", "only=[plan]")
    plan = result(summary, "plan")
    assert plan["flops_per_sample"] > 0 and plan["anatomy"]["shape"]["seq_len"] == 2048, plan["anatomy"]["shape"]
    return (f"{plan['flops_per_sample']:.3e} FLOPs per sample at sequence 2048 ({plan['flops_convention']}), the plan "
            f"timed on the device with peak {plan['peak_memory_bytes'] / 2**30:.2f} GiB")


def ddp_vs_zero3(smoke: Smoke) -> str:
    summary = smoke.run("zero3", "nodes=1", "procs_per_node=1", "launcher.backend=nccl", "strategy=zero3",
                        f"train.steps={STEPS}", "only=[train]")
    ddp, zero3 = result(smoke.runs["ddp"], "train")["losses"], result(summary, "train")["losses"]
    assert len(ddp) == len(zero3) == STEPS
    worst = max(abs(a - b) / abs(a) for a, b in zip(ddp, zero3, strict=True))
    assert worst <= LOSS_RTOL, f"losses differ by {worst:.2%}"
    return f"{STEPS} bf16 steps, largest relative loss difference {worst:.3%} ({ddp[-1]:.3f} vs {zero3[-1]:.3f})"


def checkpoint_resume() -> str:
    """train twice into one checkpoint directory: the second resumes from the first's last
    checkpoint and reproduces its losses (ddp, zero1 and zero3; one GPU, nccl)."""
    from tests.dist.test_strategies import train_inputs
    from tests.helpers import run_world
    from training.config import StrategyConfig

    worsts = []
    for name in ("ddp", "zero1", "zero3"):
        ckpt = tempfile.mkdtemp(prefix=f"smoke-ckpt-{name}-")
        inputs = (train_inputs(StrategyConfig(name=name, precision="bf16"), steps=10, ckpt_every=4), ckpt)
        first = run_world("tests.dist.workers:train_any", inputs, world=1, timeout_s=120)
        again = run_world("tests.dist.workers:train_any", inputs, world=1, timeout_s=120)
        assert again.resumed_from == 8, f"{name}: resumed from {again.resumed_from}"
        worst = max(abs(a - b) / abs(a) for a, b in zip(first.losses, again.losses, strict=True))
        assert worst <= 1e-3, f"{name}: resumed losses differ by {worst:.2%}"
        worsts.append(worst)
    return f"ddp, zero1, zero3 each resumed at step 8; largest relative loss difference {max(worsts):.1e}"


def one_gpu(smoke: Smoke) -> None:
    smoke.check("versions", versions)
    smoke.check("bf16 matmul vs peak table", matmul_against_peak)
    smoke.check("env + train, world 1, nccl", lambda: world_one(smoke))
    smoke.check("profiler split vs step", lambda: profiler_split(smoke))
    smoke.check("memory prediction vs allocator", lambda: memory_prediction(smoke))
    smoke.check("no visible device refused", lambda: empty_visible_devices(smoke))
    smoke.check("DDP bucket hook vs CUDA events", bucket_hook_against_events)
    smoke.check("FLOPs at sequence 2048", lambda: flops_at_2048(smoke))
    smoke.check("bf16 ddp vs zero3, 20 steps", lambda: ddp_vs_zero3(smoke))
    smoke.check("checkpoint resume (ddp, zero1, zero3)", checkpoint_resume)
    smoke.check("fp8: CUDA float8 product vs the CPU's emulation", float8_against_emulation)
    smoke.check("cp attention: the lower-right causal kernel vs one call", cp_attention_kernels)


# ---- several GPUs --------------------------------------------------------------------------


def distinct_devices(env: dict) -> str:
    buses = [r["gpu_bus_id"] for r in env["ranks"]]
    assert len(set(buses)) == len(buses), f"ranks share GPUs: {buses}"
    return f"{len(buses)} ranks on {len(set(buses))} distinct GPUs"


def scaled_train(smoke: Smoke, strategy: str, world: list[str]) -> str:
    train = result(smoke.run(f"multi-{strategy}", *world, f"strategy={strategy}", f"train.steps={STEPS}",
                             "only=[train]"), "train")
    return f"{train['tokens_per_s']:.0f} tokens/s, scaling efficiency {train['scaling_efficiency']:.2f}"


def slurm_answers() -> bool:
    import shutil

    return shutil.which("sinfo") is not None and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0


def multi_gpu(smoke: Smoke, gpus: int) -> None:
    world = ["nodes=1", f"procs_per_node={gpus}", "launcher.backend=nccl"]
    smoke.check(f"local: env + bandwidth, nccl x{gpus}",
                lambda: distinct_devices(result(smoke.run("multi-local", *world, "only=[env,bandwidth]"), "env")))
    for strategy in ("ddp", "zero3"):
        smoke.check(f"local: train {strategy} x{gpus}", lambda s=strategy: scaled_train(smoke, s, world))
    smoke.check(f"ray: env, a GPU per worker x{gpus}",
                lambda: distinct_devices(result(smoke.run("multi-ray", "launcher=ray", *world, "only=[env]"), "env")))
    if slurm_answers():
        smoke.check(f"slurm: env, --gpus-per-node x{gpus}", lambda: distinct_devices(result(
            smoke.run("multi-slurm", "launcher=slurm", *world, "only=[env]"), "env")))
    else:
        smoke.rows.append(Row("slurm: env", True, "not checked: no Slurm cluster answers on this machine"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--multi", action="store_true", help="every GPU of the machine, and Ray / Slurm")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "gpu-smoke"))
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < (2 if args.multi else 1):
        seen = "no CUDA device" if gpus == 0 else f"{gpus} CUDA device"
        print(f"gpu-smoke: {seen} visible (torch {torch.__version__}); it needs "
              f"{'two or more' if args.multi else 'one'}: nothing checked", file=sys.stderr)
        return 1
    smoke = Smoke(Path(args.out))
    if args.multi:
        multi_gpu(smoke, gpus)
    else:
        one_gpu(smoke)
    print()
    print(smoke.table())
    failed = [r.check for r in smoke.rows if not r.ok]
    print(f"gpu-smoke: {len(smoke.rows) - len(failed)} of {len(smoke.rows)} checks hold"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
