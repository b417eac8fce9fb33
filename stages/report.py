"""report: one page of Markdown and its plots, from the results of every other stage."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from reports import plots
from stages.bandwidth import BandwidthResult
from stages.env_check import EnvResult
from stages.lr_find import LrFindResult
from stages.plan import PlanResult
from stages.train_result import TrainResult
from training.memory import audit_table
from training.profile import split_table
from training.units import GIB


@dataclass(frozen=True)
class ReportInputs:
    """The report reads only its upstream results."""


@dataclass(frozen=True)
class ReportResult:
    files: list[str]
    scaling_efficiency: float
    samples_per_s: float

    def headline(self) -> str:
        return f"{len(self.files)} files: {', '.join(self.files)}"


def markdown(env: EnvResult, bandwidth: BandwidthResult, lr: LrFindResult, plan: PlanResult,
             train: TrainResult, pngs: list[str]) -> str:
    mfu = f"{train.mfu_pct:.1f} %" if train.mfu_pct is not None else "n/a (peak FLOP/s unknown)"
    rows = [
        ("strategy", train.strategy),
        ("world size", f"{train.world_size} ({env.nodes} nodes)"),
        ("global batch", f"{train.global_batch} ({train.micro_batch} x {train.grad_accum} accumulation x {train.world_size})"),
        ("throughput", f"{train.samples_per_s:.1f} samples/s, {train.tokens_per_s:.0f} tokens/s"),
        ("per device", f"{train.samples_per_s_per_device:.1f} samples/s, {train.tokens_per_s_per_device:.0f} tokens/s"),
        ("1-device baseline", f"{train.baseline_samples_per_s:.1f} samples/s"),
        ("scaling efficiency", f"{train.scaling_efficiency:.3f}"),
        ("step time", f"{train.step_time_s * 1e3:.1f} ms"),
        ("MFU", mfu),
        ("peak memory per device", f"{train.peak_memory_bytes / GIB:.4f} GiB ({train.memory_source})"),
        ("loss", f"{train.losses[0]:.4f} -> {train.final_loss:.4f} in {train.steps} steps"),
        ("learning rate", f"{train.lr:.3e} from {train.lr_source}"),
        ("ranks in sync", str(train.ranks_in_sync)),
    ]
    if train.prediction is not None:
        p = train.prediction
        rows += [
            ("predicted step time", f"{p.step_time_s * 1e3:.1f} ms (error {p.step_time_error_pct:+.1f} %)"),
            ("predicted throughput", f"{p.samples_per_s:.1f} samples/s (error {p.samples_per_s_error_pct:+.1f} %)"),
            ("predicted efficiency", f"{p.scaling_efficiency:.3f} (error {p.efficiency_error_pct:+.1f} %)"),
            ("predicted memory", f"{p.memory_bytes / GIB:.4f} GiB (error {p.memory_error_pct:+.1f} %)"),
        ]
    lines = ["# scalestudy report", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    lines += ["## Plan", "", f"Recommended strategy: **{plan.recommended_strategy}**", ""]
    lines += [f"- {reason}" for reason in plan.reasons] + [""]
    lines += ["Predictions at this world size:", "", "```", plan.table(), "```", ""]
    lines += ["## Fleet", "", env.headline(), "", "## Bandwidth", "", bandwidth.verdict, ""]
    if bandwidth.results:
        lines += ["| collective | bytes | time (us) | algbw (GB/s) | busbw (GB/s) |", "|---|---:|---:|---:|---:|"]
        largest = max(m.bytes for m in bandwidth.results)
        lines += [
            f"| {m.collective} | {m.bytes} | {m.time_us:.1f} | {m.algbw_gbps:.3f} | {m.busbw_gbps:.3f} |"
            for m in bandwidth.results
            if m.bytes == largest
        ]
        lines.append("")
    if train.time_split:
        lines += ["## Where a step's time goes (torch.profiler, rank 0)", "", split_table(train.time_split)]
    if train.expert_load:
        lines += ["## Experts", "", *experts(train), ""]
    lines += ["## Learning rate", "", lr.headline(), ""]
    lines += [f"![{p}]({p})" for p in pngs]
    return "\n".join(lines) + "\n"


def experts(train: TrainResult) -> list[str]:
    """A mixture of experts' routing over the run: per MoE layer the slots routed, the busiest and
    the idlest expert against the mean, and what an expert-parallel step would wait for."""
    lines = [f"Slots routed per expert over {train.steps} steps, all ranks' tokens (chart: expert_load.png).", "",
             "| layer | experts | slots | busiest / mean | idlest / mean |", "|---|---:|---:|---:|---:|"]
    for layer, load in train.expert_load.items():
        mean = sum(load) / len(load)
        lines.append(f"| {layer} | {len(load)} | {sum(load)} | {max(load) / mean:.3f} | {min(load) / mean:.3f} |"
                     if mean else f"| {layer} | {len(load)} | 0 | - | - |")
    if train.expert_imbalance:
        lines += ["", f"Per step, the layers' mean busiest-over-mean: {min(train.expert_imbalance):.3f} to "
                      f"{max(train.expert_imbalance):.3f}, mean {sum(train.expert_imbalance) / len(train.expert_imbalance):.3f}."]
    if train.expert_rank_imbalance:
        by_ep = ", ".join(f"ep={ep}: {x:.3f}" for ep, x in sorted(train.expert_rank_imbalance.items(), key=lambda kv: int(kv[0])))
        lines += ["", f"The busiest rank over the mean, had the experts been split over ep ranks (a later plan "
                      f"stretches the experts' compute by it): {by_ep}."]
    return lines


def run(cfg: ReportInputs, *, env: EnvResult, bandwidth: BandwidthResult, lr_find: LrFindResult,
        plan: PlanResult, train: TrainResult, artifacts: Path) -> ReportResult:
    drawn = [plots.lr_find(lr_find, [train], artifacts / "lr_find.png"),
             plots.busbw([bandwidth], artifacts / "busbw.png"),
             plots.loss([train], artifacts / "loss.png"),
             plots.expert_load(train, artifacts / "expert_load.png")]
    pngs = [name for name in drawn if name]
    (artifacts / "report.md").write_text(markdown(env, bandwidth, lr_find, plan, train, pngs))
    tables = []
    if train.time_split:
        (artifacts / "time_split.md").write_text(split_table(train.time_split))
        tables.append("time_split.md")
    if plan.memory_audit:
        (artifacts / "memory_audit.md").write_text(audit_table(plan.memory_audit))
        tables.append("memory_audit.md")
    return ReportResult(
        files=["report.md", *pngs, *tables],
        scaling_efficiency=train.scaling_efficiency,
        samples_per_s=train.samples_per_s,
    )
