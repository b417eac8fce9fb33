"""The advisor against published large-scale training runs.

Each row is a published configuration: the model's shape, the cluster, the layout and batch that
ran, and the throughput its authors report. The what-if plan (`pipeline=plan`, the model built at
that shape on the meta device) predicts the published layout as its `requested` candidate, and its
own recommendation beside it. `write_table` puts the comparison, with every source, in
docs/published.md; `make bench` prints the same rows.

What the model does not know, and which rows therefore lean on it: communication overlapped
inside tensor parallelism (AsyncTP), fused kernels and torch.compile, Float8 linears, the
implementation's own activations (the plan measures Hugging Face's Llama, which saves more per
layer than Meta's fused code: rows whose authors ran without recomputation run here with full
recomputation where HF's activations need it), and Meta's own pipeline schedule (torch's
Interleaved1F1B here). And its compute term is one number per cluster, `achievable_mfu` (0.4 in
every preset): a run that reached a higher or lower fraction of the peak is off by that ratio before
anything else. Hence the anchored prediction: each stack's first row sets the fraction its software
reached, and its other rows are held out.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.published_runs import HAPPENED, OUT_OF_REACH, ROWS, Published  # noqa: F401 - ROWS: the bench's and tests' table
from stages.plan import PlanResult
from training.planner.advice import PlanInputs
from training.planner.ranking import TIE, Candidate, setting_label

ROOT = Path(__file__).resolve().parents[1]
@dataclass(frozen=True)
class Checked:
    row: Published
    published: float
    """The published tokens/s per GPU (reported, or derived from the reported TFLOP/s)."""
    predicted: float
    """The requested layout's predicted tokens/s per GPU."""
    fits: bool
    recommended: float
    """The recommendation's predicted tokens/s per GPU."""
    recommended_fits: bool
    recommendation: str
    memory_gib: float
    """The requested layout's predicted memory per device."""
    published_mfu_pct: float | None
    """The published throughput as a fraction of the peak, by this project's FLOP count: the rows far
    off are those whose authors reached well above the presets' achievable_mfu."""
    achievable_mfu: float
    """The cluster's achievable fraction of peak the prediction was made with."""
    anchored: Checked | None = None
    """The same row predicted with its stack's achievable fraction, taken from the stack's anchor
    (anchored()); None for an anchor and for a stack of one row."""

    @property
    def ratio(self) -> float:
        return self.predicted / self.published

    @property
    def within_20_pct(self) -> bool:
        """The issue's goal for a published layout's predicted throughput."""
        return 0.8 <= self.ratio <= 1.2

    @property
    def advice_holds(self) -> bool:
        """The recommendation fits and is predicted at least as fast as the published layout, as the
        ranking counts speed: within its tie (TIE, 1 %) it recommends the layout of fewer degrees."""
        return self.recommended_fits and self.recommended >= self.predicted * (1 - TIE)


def plan_inputs(overrides: tuple[str, ...] | list[str]) -> PlanInputs:
    """What `python run.py pipeline=plan <overrides>` plans, composed and resolved as run.py does."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipelines.configtools import from_dict
    from pipelines.schema import Config, register
    from pipelines.validate import resolve

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        composed = compose(config_name="config", overrides=["pipeline=plan", "tracking=none", *overrides])
    cfg = resolve(from_dict(Config, OmegaConf.to_container(composed, resolve=True)), gpus_per_node=0)
    return PlanInputs(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(PlanInputs)})


def timed_whatif(inputs: PlanInputs) -> tuple[PlanResult, float]:
    """The what-if plan of `inputs`, and the seconds its search alone took (the model is measured
    once on the meta device before it)."""
    from stages import plan as plan_stage

    seen = {}
    original = plan_stage.advise_plan

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = original(*args, **kwargs)
        seen["s"] = time.perf_counter() - start
        return out

    plan_stage.advise_plan = timed
    try:
        return plan_stage.whatif(inputs), seen["s"]
    finally:
        plan_stage.advise_plan = original


SEARCH_405B = ("model=hf-llama3-405b", "data.seq_len=8192", "cluster=h100-80g-ndr", "nodes=2048", "train.global_batch=2048",
               "strategy=hybrid", "strategy.tp=8", "strategy.pp=16", "strategy.dp_shard=128", "strategy.precision=bf16",
               "strategy.sequence_parallel=true", "strategy.microbatches=16", "strategy.pp_schedule=interleaved_1f1b",
               "strategy.pp_virtual_stages=2", "strategy.activation_checkpointing=full")
"""Llama 3 405B on 16,384 H100s (Table 4's second row): the search's scale goal, under 10 s."""


def check(row: Published, achievable_mfu: float | None = None) -> Checked:
    """The what-if plan of one published run: its requested layout and the recommendation; with
    `achievable_mfu`, on the cluster preset with that fraction of peak (`cluster.achievable_mfu=`)."""
    from stages.plan import whatif

    fraction = [] if achievable_mfu is None else [f"cluster.achievable_mfu={achievable_mfu:.6f}"]
    inputs = plan_inputs([*row.overrides, HAPPENED, *fraction])
    result = whatif(inputs)
    world = result.world_size
    mine, best = result.requested, result.recommended
    predicted = mine.tokens_per_s / world
    published = row.tokens_per_s_per_gpu
    if published is None:
        published = row.tflops_per_gpu * 1e12 * result.anatomy.tokens_per_sample / result.flops_per_sample
    published_mfu = None if mine.mfu_pct is None else mine.mfu_pct * published / predicted
    return Checked(row, published, predicted, mine.fits, best.tokens_per_s / world, best.fits, describe(best),
                   mine.memory_per_device_bytes / 2**30, published_mfu, inputs.cluster.achievable_mfu)


def anchor_fraction(anchor: Checked, tolerance: float = 0.005, rounds: int = 6) -> Checked:
    """The anchor predicted with the achievable fraction of peak at which it matches what was
    published: what a user measures with one run of their stack before planning the others.
    Throughput is nearly proportional to the fraction (communication partly hides behind compute),
    so a few fixed-point steps settle it."""
    for _ in range(rounds):
        if abs(anchor.ratio - 1) <= tolerance:
            break
        anchor = check(anchor.row, min(1.0, anchor.achievable_mfu / anchor.ratio))
    return anchor


def anchored(checked: list[Checked]) -> tuple[list[Checked], dict[str, Checked]]:
    """Each row of a stack after its first predicted again with the fraction of peak the first one
    (the anchor) reached: the model's error on layouts and scale with the software's kernel
    efficiency measured, not assumed. Returns the rows and each stack's settled anchor."""
    anchors: dict[str, Checked] = {}
    out = []
    for c in checked:
        if c.row.stack not in anchors:
            anchors[c.row.stack] = anchor_fraction(c)
            out.append(c)
        else:
            out.append(dataclasses.replace(c, anchored=check(c.row, anchors[c.row.stack].achievable_mfu)))
    return out, anchors


def describe(c: Candidate) -> str:
    setting = setting_label(c.dims, c.micro_batch, c.grad_accum, c.precision, c.activation_checkpointing)
    return f"{c.strategy} ({c.flavour}) {setting}"


"""Published mixture-of-experts runs that are not rows, and why (written under the table)."""


def write_table(checked: list[Checked], anchors: dict[str, Checked], path: Path) -> None:
    lines = ["# The advisor against published runs", "",
             "Generated by `make bench` (benchmarks/published.py, the runs in benchmarks/published_runs.py); every row's layout is passed to `pipeline=plan` as the",
             "requested layout, the model built at the published shape on the meta device. `ratio` = predicted /",
             "published tokens/s per GPU. See docs/advisor.md for what the model does not know.", "",
             "Two predictions per row. *Preset*: the cluster preset as shipped, whose compute term assumes one",
             "achievable fraction of peak (`achievable_mfu`, 0.4) for any software. *Anchored*: the same model with",
             "the fraction a stack (its software and GPU) reached on its first row here, the anchor, set with",
             "`cluster.achievable_mfu=` as a user would after measuring one run of their own stack; the other",
             "rows of that stack are then held out: their error is the model's on layouts, sizes and scale.", "",
             "A published run happened, so it is held to 0.9 of its devices' memory (`plan.memory_fraction=0.9`;",
             "a new run is planned at 0.7). Float8 rows are planned with `strategy.precision=fp8`: the linears'",
             "FLOPs at the fp8 peak, the rest of the step (attention above all, at long context) at bf16's.", "",
             "| run | stack | published tok/s/GPU | published MFU | preset: predicted | ratio | anchored: predicted "
             "| ratio | memory/GPU | fits | recommended tok/s/GPU | recommendation | source |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for c in checked:
        mfu = "" if c.published_mfu_pct is None else f"{c.published_mfu_pct:.0f} %"
        if c.anchored is not None:
            anchored_cells = f"{c.anchored.predicted:,.0f} | {c.anchored.ratio:.2f}"
        else:
            anchored_cells = f"anchor (fraction {anchors[c.row.stack].achievable_mfu:.2f}) | "
        memory = f"{c.memory_gib:.1f} GiB" + (f" (published {c.row.memory_gib:.1f})" if c.row.memory_gib else "")
        lines.append(f"| {c.row.label} | {c.row.stack} | {c.published:,.0f} | {mfu} | {c.predicted:,.0f} | "
                     f"{c.ratio:.2f} | {anchored_cells} | {memory} | {'yes' if c.fits else 'no'} | "
                     f"{c.recommended:,.0f} | `{c.recommendation}` | {c.row.source}{'; ' + c.row.note if c.row.note else ''} |")
    within = sum(c.within_20_pct for c in checked)
    held = [c.anchored for c in checked if c.anchored is not None]
    held_within = sum(c.within_20_pct for c in held)
    lines += ["", f"Preset: {within} of {len(checked)} published layouts predicted within 20 %. Anchored: {held_within} "
              f"of the {len(held)} held-out layouts within 20 % (worst ratio "
              f"{max(held, key=lambda c: abs(c.ratio - 1)).ratio:.2f}). The published layout is predicted to fit in "
              f"{sum(c.fits for c in checked)} of {len(checked)}; the recommendation is predicted at least as fast "
              f"(within the ranking's {TIE:.0%} tie) and fitting in {sum(c.advice_holds for c in checked)} "
              f"of {len(checked)}."]
    lines += ["", "## Published runs not in the table", ""]
    lines += [f"- **{run}** ({source}): {why}." for run, source, why in OUT_OF_REACH]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    results, anchors = anchored([check(row) for row in ROWS])
    write_table(results, anchors, ROOT / "docs" / "published.md")
    for c in results:
        held = f", anchored {c.anchored.ratio:.2f}" if c.anchored is not None else ", anchor"
        print(f"{c.row.label}: predicted {c.predicted:.0f} vs published {c.published:.0f} "
              f"tokens/s/GPU, ratio {c.ratio:.2f}{held}", file=sys.stdout)
