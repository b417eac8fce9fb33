"""`make bench`'s what-if benches: the advisor against published runs, and its search at
16,384 devices (no processes: the models are built on the meta device)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.rows import Row

ROOT = Path(__file__).resolve().parents[1]


def bench_published() -> list[Row]:
    """8. The advisor's prediction of published large-scale runs (their layout, shape and cluster) vs the
    throughput their authors report; the table with sources goes to docs/published.md."""
    from benchmarks.published import ROWS, anchored, check, write_table

    checked, anchors = anchored([check(row) for row in ROWS])
    write_table(checked, anchors, ROOT / "docs" / "published.md")
    rows = [Row(f"advisor vs published: {c.row.label} (tokens/s per GPU: predicted with the preset vs published)",
                c.predicted, c.published, "tokens/s", "within 20 %") for c in checked]
    held = [c.anchored for c in checked if c.anchored is not None]
    rows += [Row("advisor vs published: layouts predicted within 20 % with the preset, of all", sum(
                 c.within_20_pct for c in checked), len(checked), "rows", "all"),
             Row("advisor vs published: held-out layouts within 20 % anchored, of all held out", sum(
                 c.within_20_pct for c in held), len(held), "rows", "all"),
             Row("advisor vs published: published layouts predicted to fit, of all", sum(c.fits for c in checked),
                 len(checked), "rows", "all"),
             Row("advisor vs published: recommendation fitting and at least as fast as the published layout, of all",
                 sum(c.advice_holds for c in checked), len(checked), "rows", "all")]
    return rows + [Row(f"advisor vs published, held out, {c.row.stack} anchored on its first row (fraction of peak "
                       f"{anchors[c.row.stack].achievable_mfu:.2f}): {c.row.label}", c.anchored.predicted,
                       c.published, "tokens/s", "within 20 %") for c in checked if c.anchored is not None]


def bench_search() -> list[Row]:
    """9. The advisor's search at Llama 3 405B's scale: 16,384 H100s, every layout, schedule,
    checkpointing mode and batch split (the model measured once on the meta device, then searched)."""
    from benchmarks.published import SEARCH_405B, plan_inputs, timed_whatif

    result, seconds = timed_whatif(plan_inputs(SEARCH_405B))
    return [Row(f"search time, Llama 3 405B on {result.world_size:,} devices vs the 10 s goal", seconds, 10.0, "s",
                "ratio < 1")]
