"""The advice's reasons, in the seeds' terms: which ruler (memory, bandwidth, compute) decided
against each strategy, why a recommendation whose group crosses nodes was kept, what decided a
mixture of experts' expert degree, and the headline."""

from __future__ import annotations

from typing import TYPE_CHECKING

from training import strategies
from training.planner.comm import Group, all_to_all_bytes, group_of
from training.planner.hardware import Hardware
from training.planner.memory import state_memory
from training.planner.ranking import NODE_LOCAL, Candidate, Searched, closest_miss, crosses_nodes
from training.planner.shape import Anatomy, Shape
from training.units import GIB

if TYPE_CHECKING:
    from training.planner.advice import PlanInputs


def rejection_reasons(searched: Searched, best: Candidate | None, memory_limit: float, hw: Hardware,
                      cfg: PlanInputs, anatomy: Anatomy) -> list[str]:
    """For each pure strategy, the ruler that decided against it (or that it is the choice)."""
    reasons = []
    pct = f"{cfg.plan.memory_fraction:.0%} of {hw.device_memory_bytes / GIB:.1f} GiB"
    for name in strategies.pure():
        own = [c for c in searched.ranked if c.strategy == name]
        if not own:
            reasons.append(f"{name}: {_why_absent(name, anatomy, cfg)}")
            continue
        top = own[0]
        if best is not None and top is best:
            continue
        if not top.fits:
            states = state_memory(anatomy.shape, top.flavour, top.degrees, top.precision).total
            rest = top.memory_per_device_bytes - states
            reasons.append(f"{name}: states {states / GIB:.1f} GiB + activations {rest / GIB:.1f} GiB per device "
                           f"> {memory_limit / GIB:.1f} GiB ({pct}), even at micro-batch {top.micro_batch} in "
                           f"{top.precision} with {top.activation_checkpointing} checkpointing: the memory ruler")
            continue
        if crosses_nodes(top, hw.devices_per_node):
            reasons.append(f"{name}: {tier(top, hw)}: the bandwidth ruler ({top.tokens_per_s:.0f} tokens/s)")
            continue
        if best is not None:
            reasons.append(f"{name}: fits ({top.memory_per_device_bytes / GIB:.1f} GiB) but predicted "
                           f"{top.tokens_per_s:.0f} tokens/s, {top.tokens_per_s / best.tokens_per_s:.2f}x the "
                           f"recommendation: {_what_costs(top, best)}")
    return reasons


def _what_costs(c: Candidate, best: Candidate) -> str:
    """Which ruler a slower candidate loses by: exposed communication (bandwidth), the pipeline's
    bubble, or compute (recomputation it needs to fit, or its overhead)."""
    step, p = c.step_time_s, c.prediction
    if p.bubble_s > 0.2 * step:
        return f"the pipeline bubble ({100 * p.bubble_s / step:.0f} % of its step)"
    if p.exposed_comm_s > 0.2 * step:
        return f"the bandwidth ruler ({100 * p.exposed_comm_s / step:.0f} % of its step is exposed communication)"
    if c.activation_checkpointing == "full" and best.activation_checkpointing == "none":
        return "the memory ruler: it fits only with full checkpointing, whose recomputation costs compute"
    return f"the compute ruler ({100 * (p.compute_s + p.overhead_s) / step:.0f} % of its step is compute and overhead)"


def _why_absent(name: str, anatomy: Anatomy, cfg: PlanInputs) -> str:
    shape, degrees = anatomy.shape, strategies.get(name).degrees
    if degrees["tp"] == -1:
        if shape.block_linear_params == 0:
            return "the model declares no tensor-parallel plan"
        return f"tp={cfg.nodes * cfg.procs_per_node} does not divide its widths and heads {list(shape.tp_sizes)}"
    if degrees["pp"] == -1:
        if not shape.pipeline:
            return "the model declares no pipeline layout"
        return f"pp={cfg.nodes * cfg.procs_per_node} stages would exceed its {shape.layers} blocks"
    if cfg.plan.strategies and name not in cfg.plan.strategies:
        return "left out by plan.strategies"
    return "no batch split of this world keeps the batch"


TIER_TRAFFIC = {"tp": ("all_reduce", "4 all-reduces per layer"), "cp": ("all_gather", "K/V all-gathered per layer"),
                "ep": ("all_to_all", "4 all-to-alls per MoE layer")}
"""What each node-local degree sends per layer (training/planner/comm.py's comm_time), and its collective."""


def tier(c: Candidate, hw: Hardware) -> str:
    """What the candidate's TP and CP collectives cost on the tier they ride, against a node's
    link: e.g. `tp=16 crosses nodes (16 ranks on 2 nodes): 4 all-reduces per layer at 61 µs and 370
    GB/s per GPU, vs 13 µs and 450 GB/s inside a node`; the degrees that cross nodes, else tp."""
    d = c.degrees
    groups = {dim: group_of(d, dim, hw.devices_per_node) for dim in TIER_TRAFFIC if c.dims.get(dim, 1) > 1}
    crossing = [dim for dim, g in groups.items() if g.nodes > 1] or ["tp"]
    parts = []
    for dim in crossing:
        group = groups.get(dim) or group_of(d, dim, hw.devices_per_node)
        collective, traffic = TIER_TRAFFIC[dim]
        local = min(group.ranks, hw.devices_per_node)
        across, inside = hw.link(collective, group), hw.link(collective, Group(local, local))
        where = "crosses nodes" if group.nodes > 1 else "stays in one node"
        parts.append(f"{dim}={c.dims.get(dim, 1)} {where} ({group.describe()}): {traffic} at "
                     f"{across.alpha_at(group.ranks) * 1e6:.0f} µs and {across.busbw_gbps:.0f} GB/s per GPU, vs "
                     f"{inside.alpha_at(inside.world) * 1e6:.0f} µs and {inside.busbw_gbps:.0f} GB/s inside a node")
    return "; ".join(parts)


def node_local_reason(best: Candidate | None, searched: Searched, hw: Hardware) -> str | None:
    """Why a recommendation whose TP or CP group crosses nodes was kept: no node-local layout within
    NODE_LOCAL of it (search.rank prefers one that is); None when it does not cross."""
    if best is None or not crosses_nodes(best, hw.devices_per_node):
        return None
    local = next((c for c in searched.ranked if c.fits and not crosses_nodes(c, hw.devices_per_node)), None)
    versus = (f"the best node-local layout, {local.strategy} {_short(local)}, is predicted "
              f"{1 - local.tokens_per_s / best.tokens_per_s:.0%} slower" if local is not None else
              "no node-local layout fits")
    return f"tiers: {tier(best, hw)}; kept because {versus} (more than {NODE_LOCAL:.0%})"


def expert_reason(best: Candidate | None, searched: Searched, hw: Hardware, shape: Shape,
                  imbalance: tuple[tuple[int, float], ...]) -> str | None:
    """For a mixture-of-experts model: the expert-parallel degree chosen and the ruler that decided,
    against the best layout of the other kind (ep > 1 vs experts whole on every rank): the
    all-to-all's bytes (balanced, 4 a layer: dispatch, combine and their gradients) and the
    prediction's all-to-all time a step (the counts, recomputation and imbalance included) on the
    tier its group rides, the experts' states per rank, and the
    routing imbalance the prediction used. None for a dense model."""
    if best is None or not shape.experts:
        return None
    ep = best.dims.get("ep", 1)
    other = next((c for c in searched.ranked if c.fits and (c.dims.get("ep", 1) > 1) != (ep > 1)), None)
    split = best if ep > 1 else other
    if split is None:
        return f"experts: ep=1, every rank holds all {max(shape.experts)} experts a layer; no expert-parallel layout fits"
    d = split.degrees
    group = group_of(d, "ep", hw.devices_per_node)
    per_layer = 4 * all_to_all_bytes(shape, split.micro_batch * shape.seq_len, split.precision)
    link = hw.link("all_to_all", group)
    a2a_s = split.prediction.expert_parallel_s
    states = state_memory(shape, split.flavour, d, split.precision).total
    measured = dict(imbalance).get(d.ep)
    skew = (f"routing imbalance {measured:.2f} measured at ep={d.ep}" if measured is not None
            else "routing taken as balanced (no measured run of this model at that ep)")
    facts = (f"ep={d.ep} ({group.describe()}): {max(shape.experts) // d.ep} of {max(shape.experts)} experts a layer "
             f"per rank, states {states / GIB:.2f} GiB per device; all-to-all {per_layer / 1e6:.2f} MB a MoE "
             f"layer per micro-batch at {link.busbw_gbps:.1f} GB/s, {a2a_s * 1e3:.2f} ms a step; {skew}")
    if ep > 1:
        versus = (f"predicted {best.tokens_per_s / other.tokens_per_s:.2f}x the best layout without it "
                  f"({other.strategy} {_short(other)})" if other is not None else "no layout without it fits")
        return f"experts: {facts}; {versus}"
    return (f"experts: ep=1 (every rank holds every expert); the best expert-parallel layout, {split.strategy} "
            f"{_short(split)}, is predicted {split.tokens_per_s / best.tokens_per_s:.2f}x: {facts}")


def headline_reason(best: Candidate | None, searched: Searched, memory_limit: float, world: int) -> str:
    if best is None or not best.fits:
        return closest_miss(searched.ranked, memory_limit)
    runner = next((c for c in searched.ranked if c is not best and c.fits), None)
    versus = f" vs {runner.strategy} {runner.tokens_per_s:.0f}" if runner else ""
    return (f"throughput: {best.strategy} {_short(best)} is the fastest that fits at {world} devices of "
            f"{searched.evaluated} predictions: {best.tokens_per_s:.0f} tokens/s{versus}, "
            f"efficiency {best.scaling_efficiency:.2f}, {best.memory_per_device_bytes / GIB:.2f} GiB per device")


def _short(c: Candidate) -> str:
    dims = " x ".join(f"{k}={v}" for k, v in c.dims.items() if v > 1)
    return (f"({dims + ', ' if dims else ''}micro-batch {c.micro_batch} x {c.grad_accum}, {c.precision}, "
            f"{c.activation_checkpointing} checkpointing)")
