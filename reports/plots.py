"""Every plot of the run report (stages/report.py) and the study report (reports/study.py).

One function per plot, each drawn from the stages' typed results: the curves both reports show
(the loss, the LR range test, the bus bandwidth) are one function each, given one run's results
or a study's. Each writes the PNG at `path` and returns its file name, or None when there is
nothing to draw. Adding a plot to a report is a function here and a line in that report.

It sits beside the study report, which the sweep callback (reports/sweep.py) writes; the run
report, a stage, imports it too. It reads results by
attribute: the stages' types are imported for checking only.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.units import GIB

if TYPE_CHECKING:
    from stages.bandwidth import BandwidthResult
    from stages.lr_find import LrFindResult
    from stages.train_result import TrainResult


def _axes() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a login node, a worker or CI
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, 4))


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def loss(trains: list[TrainResult], path: Path) -> str | None:
    """Training loss against samples seen, not steps: runs of different world sizes and global
    batches line up."""
    trains = [t for t in trains if t.losses]
    if not trains:
        return None
    fig, ax = _axes()
    for t in trains:
        ax.plot([t.global_batch * (i + 1) for i in range(len(t.losses))], t.losses,
                label=f"{t.strategy} x{t.world_size}, global batch {t.global_batch}")
    ax.set(xlabel="samples seen", ylabel="training loss", title="Loss vs samples seen")
    ax.legend(fontsize=8)
    return _save(fig, path)


def lr_find(lr: LrFindResult, trains: list[TrainResult], path: Path) -> str:
    """The LR range test: loss against learning rate (raw and smoothed), the finder's suggestion
    at its own batch, and the LR each run trained with at its global batch."""
    fig, ax = _axes()
    ax.plot([p.lr for p in lr.curve], [p.loss for p in lr.curve], alpha=0.3, label="loss")
    ax.plot([p.lr for p in lr.curve], [p.smoothed for p in lr.curve], label="smoothed loss")
    ax.axvline(lr.suggested_lr, color="C2", ls="--",
               label=f"suggested {lr.suggested_lr:.1e} at batch {lr.finder_batch} ({lr.rule})")
    for i, (batch, value) in enumerate(sorted({(t.global_batch, t.lr) for t in trains})):
        ax.axvline(value, color=f"C{3 + i}", ls=":", label=f"trained with {value:.1e} at batch {batch}")
    # The divergent tail would squash the informative part of the curve: cap the axis above the start.
    top = 1.3 * max(lr.curve[0].smoothed, min(p.loss for p in lr.curve))
    ax.set(xscale="log", xlabel="learning rate", ylabel="loss", title="LR range test", ylim=(None, top))
    ax.legend(fontsize=7)
    return _save(fig, path)


def busbw(probes: list[BandwidthResult], path: Path, collective: str | None = None) -> str | None:
    """Bus bandwidth against message size: a curve per probe (one per world size) and collective
    (only `collective` when given), and each cluster's ruler."""
    curves = [(bw, name, [m for m in bw.results if m.collective == name])
              for bw in probes for name in sorted({m.collective for m in bw.results}) if collective in (None, name)]
    if not curves:
        return None
    fig, ax = _axes()
    for bw, name, points in curves:
        label = ", ".join(([] if collective else [name]) + ([f"world {bw.world_size}"] if len(probes) > 1 else []))
        ax.plot([m.bytes for m in points], [m.busbw_gbps for m in points], marker="o", ms=3, label=label or name)
    for ruler in sorted({bw.ruler_gbps for bw in probes}):
        ax.axhline(ruler, color="grey", ls="--", lw=0.8, label=f"ruler {ruler:g} GB/s")
    title = f"{collective or 'Collective'} bus bandwidth vs message size"
    if len(probes) == 1:
        title += f"\nworld {probes[0].world_size} ({probes[0].backend})"
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s)", title=title)
    ax.legend(fontsize=8)
    return _save(fig, path)


# --- a study's runs against their number of devices, one line per strategy ---------------------

def _by_strategy(trains: list[TrainResult]) -> dict[str, list[TrainResult]]:
    groups: dict[str, list[TrainResult]] = {}
    for t in trains:
        groups.setdefault(t.strategy, []).append(t)
    return {s: sorted(g, key=lambda t: t.world_size) for s, g in sorted(groups.items())}


def _device_axis(ax: Any, trains: list[TrainResult]) -> None:
    ticks = sorted({t.world_size for t in trains})
    ax.set(xscale="log", xlabel="devices")
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def efficiency(trains: list[TrainResult], path: Path) -> str | None:
    """Scaling efficiency against devices, measured (solid) and as the plan predicted (dashed)."""
    if not trains:
        return None
    fig, ax = _axes()
    for i, (strategy, group) in enumerate(_by_strategy(trains).items()):
        ax.plot([t.world_size for t in group], [t.scaling_efficiency for t in group],
                marker="o", color=f"C{i}", label=f"{strategy} measured")
        predicted = [(t.world_size, t.prediction.scaling_efficiency) for t in group if t.prediction]
        if predicted:
            ax.plot(*zip(*predicted, strict=True), ls="--", marker="x", color=f"C{i}",
                    label=f"{strategy} predicted (plan)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(ylabel="scaling efficiency", title="Scaling efficiency vs devices")
    _device_axis(ax, trains)
    ax.legend(fontsize=8)
    return _save(fig, path)


def throughput(trains: list[TrainResult], path: Path) -> str | None:
    """Samples/s per device against devices."""
    if not trains:
        return None
    fig, ax = _axes()
    for strategy, group in _by_strategy(trains).items():
        ax.plot([t.world_size for t in group], [t.samples_per_s_per_device for t in group], marker="o", label=strategy)
    ax.set(ylabel="samples/s per device", title="Throughput per device vs devices")
    _device_axis(ax, trains)
    ax.legend(fontsize=8)
    return _save(fig, path)


def mfu(trains: list[TrainResult], path: Path) -> str | None:
    """MFU where every device's peak FLOP/s is known; otherwise the achieved model FLOP/s per
    device, which is what MFU divides (CPUs have no listed peak)."""
    if not trains:
        return None
    known = all(t.mfu_pct is not None for t in trains)
    fig, ax = _axes()
    for strategy, group in _by_strategy(trains).items():
        values = [t.mfu_pct if known else t.flops_per_sample * t.samples_per_s_per_device / 1e9 for t in group]
        ax.plot([t.world_size for t in group], values, marker="o", label=strategy)
    if known:
        ax.set(ylabel="MFU (%)", title="Model FLOPs utilisation vs devices")
    else:
        ax.set(ylabel="model GFLOP/s per device",
               title="Achieved model FLOP/s per device\n(MFU needs a peak FLOP/s; none is listed for this device)")
    _device_axis(ax, trains)
    ax.legend(fontsize=8)
    return _save(fig, path)


def memory(trains: list[TrainResult], path: Path) -> str | None:
    """Peak memory per device: a bar per strategy and world size, the plan's prediction as a tick."""
    if not trains:
        return None
    groups = _by_strategy(trains)
    worlds = sorted({t.world_size for t in trains})
    width = 0.8 / len(worlds)
    fig, ax = _axes()
    for j, world in enumerate(worlds):
        xs, heights, predicted = [], [], []
        for i, group in enumerate(groups.values()):
            t = next((t for t in group if t.world_size == world), None)
            if t is None:
                continue
            x = i - 0.4 + width * (j + 0.5)
            xs.append(x)
            heights.append(t.peak_memory_bytes / GIB)
            if t.prediction:
                predicted.append((x, t.prediction.memory_bytes / GIB))
        ax.bar(xs, heights, width=width * 0.9, label=f"{world} devices", color=f"C{j}")
        if predicted:
            ax.plot(*zip(*predicted, strict=True), ls="none", marker="_", ms=14, mew=2, color="black")
    ax.plot([], [], ls="none", marker="_", ms=14, mew=2, color="black", label="predicted (plan)")
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set(ylabel="peak memory per device (GiB)", title="Peak memory per device")
    ax.legend(fontsize=8)
    return _save(fig, path)


# --- a mixture of experts' routing --------------------------------------------------------------

def expert_load(train: TrainResult, path: Path) -> str | None:
    """Where a mixture of experts sent its tokens: each MoE layer's routed slots per expert over the
    run, as a share of that layer's mean (1.0: balanced; the busiest expert bounds an
    expert-parallel step), and per step the layers' mean busiest-over-mean. None for a dense model."""
    if not train.expert_load:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(train.expert_load)
    share = [[n * len(load) / max(sum(load), 1) for n in load] for load in train.expert_load.values()]
    experts = max(len(s) for s in share)
    fig, (heat, line) = plt.subplots(1, 2, figsize=(11, max(3.5, 0.3 * len(layers) + 1.5)),
                                     gridspec_kw={"width_ratios": [3, 2]})
    image = heat.imshow(share, aspect="auto", cmap="viridis", vmin=0)
    fig.colorbar(image, ax=heat, label="slots / layer mean")
    if experts <= 16:  # small enough to read each cell
        heat.set_xticks(range(experts))
        for i, row in enumerate(share):
            for e, x in enumerate(row):
                heat.text(e, i, f"{x:.2f}", ha="center", va="center", fontsize=7, color="white" if x < 1 else "black")
    heat.set_yticks(range(len(layers)), [f"{name} (max {max(s):.2f})" for name, s in zip(layers, share, strict=True)],
                    fontsize=7)
    heat.set(xlabel="expert", title=f"Routed slots per expert over {train.steps} steps")
    steps = range(train.expert_first_step, train.expert_first_step + len(train.expert_imbalance))
    line.plot(list(steps), train.expert_imbalance, marker="o", ms=3, label="busiest expert / mean")
    for i, (ep, x) in enumerate(sorted(train.expert_rank_imbalance.items(), key=lambda kv: int(kv[0]))):
        line.axhline(x, color=f"C{i + 1}", ls="--", lw=0.8, label=f"busiest of ep={ep} ranks / mean (run mean)")
    line.axhline(1.0, color="grey", lw=0.8)
    line.set(xlabel="step", ylabel="max / mean", title="Imbalance per step, layers' mean")
    line.legend(fontsize=7)
    return _save(fig, path)
