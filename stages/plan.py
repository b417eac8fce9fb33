"""plan: the three rulers, measured, turned into predictions and advice with reasons.

Ruler 1, memory: the peak of one forward + backward + optimizer step on one device, against
`plan.memory_fraction` of the device. Ruler 2, bandwidth: the busbw the probe measured, fitted
to an α–β model per collective. Ruler 3, compute density: FLOPs per sample and per byte moved,
and the measured compute time of a step. This stage measures them (on one device, a slice of the
model when it exceeds one) and hands them to the planner (training/planner/): predictions of
memory, step time, throughput and scaling efficiency, the search over every layout of the
requested world and the knobs that make it fit for the highest predicted tokens/s, and the
reasons (which ruler decided against each strategy). A what-if plan (`whatif`) measures nothing:
the model is counted on the meta device and the cluster is a preset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from stages.bandwidth import BandwidthResult
from stages.common import log
from stages.lr_find import LrFindResult
from stages.rulers import Rulers, hardware, measure, meta_sample, ruler_reasons
from training import strategies
from training.memory import AuditRow
from training.planner.advice import (
    PlanInputs,
    advise_plan,
    data_parallel_size,
    own_setting,
    searched_variants,
    workload,
)
from training.planner.calibration import (
    Calibration,
    MeasuredStep,
    fit_calibration,
    measured_held_imbalance,
    measured_imbalance,
)
from training.planner.predict import Prediction
from training.planner.ranking import Candidate, describe
from training.planner.shape import Activations, Anatomy
from training.planner.space import Variant
from training.units import GIB

# Goyal et al. (2017) saw the linear rule hold to 8k-sample ImageNet batches, ~32x their base.
LINEAR_RULE_LIMIT = 32


@dataclass(frozen=True)
class PlanResult:
    recommended_strategy: str
    reasons: list[str]
    peak_memory_bytes: int
    flops_per_sample: float
    rulers: Rulers | None
    """The measurements (None for a what-if plan of hardware that isn't here)."""
    anatomy: Anatomy
    """The model as measured from its module (on the meta device for a what-if plan)."""
    world_size: int
    micro_batch: int
    recommended: Candidate | None
    """The search's winner: the fastest predicted layout and knobs that fit (None: nothing fits)."""
    requested: Candidate | None
    """What this invocation asked for, predicted the same way (None for strategy=auto)."""
    candidates: list[Candidate]
    """The best candidates, best first (at most ten, the fitting ones first)."""
    evaluated: int
    """How many settings the search held against the memory ruler (those that fit, and each layout's
    least-memory miss, also predicted in time)."""
    variants: list[Variant]
    """Each precision and checkpointing setting searched, with its compute and activations per sample."""
    predictions: list[Prediction]
    """The pure strategies at 1, 2, 4 ... plan.max_devices devices (the scaling curves)."""
    lr: float | None
    lr_rule: str | None
    calibration: Calibration | None
    """plan.calibrate=true with earlier runs found: the scales applied to every prediction."""
    layouts: list[Candidate] = dataclasses.field(default_factory=list)
    """The fastest fitting setting of each layout, best first (at most ten): what plan.trials measures."""
    flops_convention: str = "full"
    """How `flops_per_sample` counts attention: `causal_half` (causal attention's score and value
    products as half of the full s x s matrix, as NVIDIA NeMo's MFU counts it) or `full` (nothing
    halved: no causal attention, or a plan from before the convention was recorded)."""

    def metrics(self) -> list[tuple[str, float, int]]:
        out = [("memory/peak_gib", self.peak_memory_bytes / GIB, 0), ("plan/flops_per_sample", self.flops_per_sample, 0)]
        if self.rulers is not None:
            r = self.rulers
            out += [
                ("memory/param_bytes", float(r.param_bytes), 0),
                ("memory/grad_bytes", float(r.grad_bytes), 0),
                ("memory/optim_bytes", float(r.optim_bytes), 0),
                ("memory/activation_bytes", float(r.activation_bytes), 0),
                ("memory/device_gib", r.device_memory_bytes / GIB, 0),
                ("plan/step_compute_ms", r.step_compute_s * 1e3, 0),
            ]
            if r.passes is not None:
                out += [("plan/pass_share", r.passes.pass_share, 0), ("plan/optimizer_share", r.passes.step_share, 0)]
            out += [(f"plan/overhead_ms/{k}", v * 1e3, 0) for k, v in sorted(r.strategy_overhead_s.items())]
        for p in self.predictions:
            out += [(f"plan/{p.strategy}/predicted_efficiency", p.scaling_efficiency, p.devices),
                    (f"plan/{p.strategy}/predicted_tokens_per_s", p.tokens_per_s, p.devices)]
        for label, c in (("recommended", self.recommended), ("requested", self.requested)):
            if c is not None:
                out += [(f"plan/{label}/tokens_per_s", c.tokens_per_s, 0), (f"plan/{label}/step_time_ms", c.step_time_s * 1e3, 0),
                        (f"plan/{label}/memory_gib", c.memory_per_device_bytes / GIB, 0)]
        out.append(("plan/search_predictions", float(self.evaluated), 0))
        if self.calibration is not None:
            c = self.calibration
            out += [("plan/calibration_points", float(c.points), 0), ("plan/calibration_compute_scale", c.compute_scale, 0),
                    ("plan/calibration_error_before_pct", c.error_before_pct, 0),
                    ("plan/calibration_error_after_pct", c.error_after_pct, 0)]
            out += [(f"plan/calibration_comm_scale/{k}", v, 0) for k, v in c.comm_scale.items()]
        return out

    def headline(self) -> str:
        chosen = self.recommended
        if chosen is None or not chosen.fits:
            return f"{self.recommended_strategy}: {self.reasons[0]}{self._sliced()}"
        dims = " x ".join(f"{k}={v}" for k, v in chosen.dims.items() if v > 1)
        return (f"{chosen.strategy}{f' ({dims})' if strategies.get(chosen.strategy).any_layout else ''} at {self.world_size}, "
                f"micro-batch {chosen.micro_batch} x {chosen.grad_accum}, {chosen.precision}: predicted "
                f"{chosen.tokens_per_s:.0f} tokens/s, efficiency {chosen.scaling_efficiency:.2f}, "
                f"{chosen.memory_per_device_bytes / GIB:.3f} GiB per device{self._sliced()}")

    def _sliced(self) -> str:
        r = self.rulers
        if r is None or r.sliced_blocks is None:
            return ""
        return f" (timed on a slice of {r.sliced_blocks} of {r.anatomy.shape.layers} blocks: the model exceeds one device)"

    @property
    def memory_audit(self) -> list[AuditRow]:
        return self.rulers.memory_audit if self.rulers is not None else []

    def prediction(self, strategy: str, devices: int) -> Prediction | None:
        """A pure strategy's point of the scaling curves."""
        return next((p for p in self.predictions if p.strategy == strategy and p.devices == devices), None)

    def prediction_for_run(self, strategy: str, devices: int) -> Prediction | None:
        """What the plan predicted for a run of the configured `strategy` on `devices`: at the
        planned world, the requested layout; elsewhere (the 1-device baseline) the scaling curve's
        point. (Under strategy=auto the train stage holds the run against the candidate it chose.)"""
        if devices == self.world_size:
            return self.requested.prediction if self.requested is not None else None
        return self.prediction(strategy if strategy in strategies.pure() else strategies.flavours()[0].name, devices)

    def table(self) -> str:
        """The best candidates at the requested world size, and the requested layout."""
        rows = [f"the best {len(self.candidates)} of {self.evaluated} predictions at {self.world_size} devices:"]
        rows += [f"  {i}. {describe(c)}" for i, c in enumerate(self.candidates, 1)]
        if self.requested is not None:
            rows.append(f"  requested: {describe(self.requested)}")
        if self.recommended is not None:
            rows.append(f"  run it: {self.recommended.command}")
        return "\n".join(rows)


_COUNTED: dict[str, Any] = {}


def counted_on_meta(cfg: PlanInputs):  # noqa: ANN201 - a training.planner.anatomy.Counted
    """The model at its real shape and micro-batch on the meta device (no memory, no compute, so
    any sequence length): its shape, FLOPs and positions from a plain pass, and the FLOPs'
    convention; the run's activations come from its variant (variant_costs) or its measured step.
    Once per process for the same model, data and micro-batch (as measure_variant)."""
    from training.planner.anatomy import count_on_meta

    micro_batch = cfg.train.micro_batch_for(data_parallel_size(cfg))
    key = repr((cfg.model, cfg.data, cfg.seed, micro_batch))
    if key not in _COUNTED:
        _COUNTED[key] = count_on_meta(cfg.model, cfg.seed, meta_sample(cfg, micro_batch))
    return _COUNTED[key]


def variant_costs(cfg: PlanInputs, anatomy: Anatomy, measured_activations: float | None) -> list:
    """Each precision and checkpointing setting the search considers, measured on the meta device
    (the fused attention a GPU runs, training/planner/anatomy.py). On a measured cluster the run's own
    setting takes the activations its real step saved."""
    from training.planner.anatomy import measure_variant

    sample = meta_sample(cfg)
    costs = [measure_variant(cfg.model, cfg.seed, sample, precision, checkpointing)
             for precision, checkpointing in searched_variants(cfg, anatomy.shape.layers)]
    if measured_activations is not None:
        own = (cfg.strategy.precision, cfg.strategy.activation_checkpointing)
        # The measured step's saved bytes, split as the meta count split them, and its loss temporaries.
        costs = [dataclasses.replace(c, activations=measured_split(c.activations, measured_activations))
                 if (c.precision, c.activation_checkpointing) == own else c for c in costs]
    return costs


def measured_split(counted: Activations, measured: float) -> Activations:
    """The `measured` saved bytes per sample split as the `counted` ones split: what TP leaves whole
    the same share of them; the loss's temporaries (not saved tensors) as counted."""
    saved = counted.saved - counted.loss_temp
    share = (counted.tp_replicated - counted.loss_temp) / saved if saved else 0.0
    return dataclasses.replace(counted, saved=measured + counted.loss_temp,
                               tp_replicated=counted.loss_temp + measured * share)


def lr_reason(lr: LrFindResult, target_batch: int, warmup_steps: int) -> str:
    text = (f"lr: {lr.scaled(target_batch):.2e} ({lr.lr_scaling} rule from {lr.suggested_lr:.2e} at batch "
            f"{lr.finder_batch} to {target_batch}), {warmup_steps} warm-up steps")
    if lr.lr_scaling == "linear" and target_batch > LINEAR_RULE_LIMIT * lr.finder_batch:
        text += (f"; warning: the batch grows {target_batch // lr.finder_batch}x, past the ~{LINEAR_RULE_LIMIT}x "
                 "where the linear rule was seen to hold: consider lr_scaling=sqrt or a longer warm-up")
    return text


def run(cfg: PlanInputs, *, bandwidth: BandwidthResult, lr_find: LrFindResult,
        history: list[MeasuredStep]) -> PlanResult:
    """`history`: earlier runs' measured steps (the engine fills it from MLflow when
    plan.calibrate=true; empty otherwise)."""
    world = cfg.nodes * cfg.procs_per_node
    counted = counted_on_meta(cfg)
    rulers = measure(cfg, bandwidth, counted.anatomy)
    micro = cfg.train.micro_batch_for(data_parallel_size(cfg))
    anatomy = counted.anatomy
    # A slice's activations are not the model's: the meta count stands for a sliced plan.
    measured = rulers.activation_bytes / micro if cfg.cluster.measured and rulers.sliced_blocks is None else None
    costs = variant_costs(cfg, anatomy, measured)
    own = own_setting(cfg, costs)
    anatomy = dataclasses.replace(anatomy, activations=own.activations)
    w = dataclasses.replace(workload(cfg, anatomy), expert_imbalance=measured_imbalance(history),
                            expert_held_imbalance=measured_held_imbalance(history))
    hw = hardware(cfg, own.executed_flops_per_sample, rulers, bandwidth, micro)
    calibration = fit_calibration(history) if cfg.plan.calibrate else None
    if calibration is not None:
        hw = calibration.on_basis(hw)  # this plan's own timing stays in its rulers
    fields, reasons = advise_plan(cfg, anatomy, costs, hw, w, calibration)
    target = cfg.train.global_batch_for(data_parallel_size(cfg))
    reasons += ruler_reasons(rulers, cfg, world) + [lr_reason(lr_find, target, cfg.train.warmup_steps)]
    if hw.shared is not None:
        reasons.append(hw.shared.describe())
    if cfg.plan.calibrate:
        reasons.append(calibration.describe() if calibration is not None else
                       "calibration: no earlier run of this model, batch, cluster and launcher in MLflow yet; "
                       "the uncalibrated model")
    choice = fields["recommended"].strategy if fields["recommended"] is not None else cfg.strategy.name
    result = PlanResult(choice, reasons, rulers.peak_memory_bytes, anatomy.flops_per_sample, rulers, anatomy, world,
                        micro, lr=lr_find.scaled(target), lr_rule=lr_find.lr_scaling, calibration=calibration,
                        flops_convention=counted.flops_convention, **fields)
    for line in [*reasons, result.table()]:
        log("plan", line)
    return result


def whatif(cfg: PlanInputs) -> PlanResult:
    """pipeline=plan: the same advice for hardware described by a cluster preset, from the model
    built on the meta device at its real shape: its parameters, FLOPs and activations are measured
    there with no memory and no compute, so it answers in seconds for any size."""
    if cfg.cluster.measured:
        raise ValueError(f"cluster={cfg.cluster.name} is measured by running: use pipeline=full, or a described "
                         "cluster such as cluster=h100-80g-ndr for a what-if plan")
    world = cfg.nodes * cfg.procs_per_node
    counted = counted_on_meta(cfg)
    anatomy = counted.anatomy
    costs = variant_costs(cfg, anatomy, None)
    own = own_setting(cfg, costs)
    anatomy = dataclasses.replace(anatomy, activations=own.activations)
    w = workload(cfg, anatomy)
    hw = hardware(cfg, own.executed_flops_per_sample, None, None, w.micro_batch)
    fields, reasons = advise_plan(cfg, anatomy, costs, hw, w, None)
    if anatomy.shape.experts:
        reasons.append(f"experts' GEMMs: not timed in a what-if (no device to time them on): the experts run at "
                       f"cluster.achievable_mfu={cfg.cluster.achievable_mfu:g} like the rest, whatever rows each gets")
    best = fields["recommended"]
    result = PlanResult(best.strategy if best is not None else cfg.strategy.name, reasons,
                        int(best.memory_per_device_bytes) if best is not None else 0, anatomy.flops_per_sample, None,
                        anatomy, world, w.micro_batch, lr=None, lr_rule=None, calibration=None,
                        flops_convention=counted.flops_convention, **fields)
    print(f"what-if: model={cfg.model.name} ({w.shape.params / 1e9:.2f} B parameters) on cluster={cfg.cluster.name}, "
          f"{cfg.nodes} nodes x {cfg.procs_per_node} = {world} devices")
    print(result.table())
    for reason in reasons:
        print(f"  {reason}")
    return result
