"""One setting of a run as the planner predicts it: the model, the batch, the precision, the
checkpointing, the schedule and what a sample saves; built the one way for a run of a strategy
(strategy_workload) or for a point of the search (search.Variant.workload).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from training.parallel.dims import ParallelDims, expert_parallel_problem
from training.parallel.schedules import V_SHAPED
from training.planner.shape import Activations, Shape, kept_share

if TYPE_CHECKING:
    from training.config import StrategyConfig

LOSS_PARALLEL_TEMPS = 1.5
"""The loss's temporaries under loss parallelism, in units of the fused kernels' two copies of the
logits: three copies of the rank's share (Workload.loss_temps)."""


@dataclass(frozen=True)
class Workload:
    shape: Shape
    micro_batch: int
    grad_accum: int
    microbatches: int
    precision: str
    """`fp32`, `bf16`, `fp16` or `fp8`: what the states and activations are held in (states_per_param;
    fp8's in bf16)."""
    checkpointing: str
    """strategy.activation_checkpointing: `none`, `selective` or `full` (what the forward's
    collectives repeat in backward)."""
    tokens_per_sample: int
    activations: Activations
    """What a sample saves for backward in this precision and checkpointing."""
    bucket_cap_bytes: float = 25 * 1024**2
    """DDP's gradient bucket size (strategy.bucket_cap_mb)."""
    seconds_per_sample: float | None = None
    """This workload's compute per sample on one device when it differs from the hardware's
    measured one (another precision or activation checkpointing); None: the hardware's."""
    clip: bool = False
    """Gradient clipping (train.grad_clip): sharded gradients need one more all-reduce for the norm."""
    pp_schedule: str = "1f1b"
    """GPipe keeps every microbatch's activations until the backward; 1F1B at most one per stage."""
    sequence_parallel: bool = False
    """strategy.sequence_parallel: TP's activations sharded but `Activations.sp_replicated`,
    its all-reduces all-gathers and reduce-scatters."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank (interleaved and V-shaped schedules)."""
    expert_imbalance: tuple[tuple[int, float], ...] = ()
    """(ep, measured imbalance) pairs: the busiest expert-parallel rank's routed tokens over the
    mean rank's, per step, averaged (stages/train.py's TrainResult.expert_rank_imbalance); an ep
    not in it is predicted balanced (1.0)."""

    expert_held_imbalance: tuple[tuple[int, float], ...] = ()
    """(ep, measured imbalance) pairs of what the ranks hold: the busiest rank's slots summed over the
    layers over the mean rank's at the worst step (TrainResult.expert_rank_held_imbalance): the
    memory ruler's; an ep not in it is predicted balanced."""

    @property
    def v_shaped(self) -> bool:
        """A V-shaped schedule (zbv, dualpipev): rank r holds stages r and 2p − 1 − r, rank 0 both ends."""
        return self.pp_schedule in V_SHAPED

    def imbalance_at(self, ep: int) -> float:
        """The busiest expert-parallel rank's slots over what the meta count gives a rank (balanced
        routing, a capacity factor's drops included): the measured figure, bounded by the capacity
        factor. 1.0 unmeasured or without expert parallelism."""
        return self._over_counted(dict(self.expert_imbalance).get(ep)) if ep > 1 else 1.0

    def held_imbalance_at(self, ep: int) -> float:
        """imbalance_at's figure for what the busiest rank holds at the worst step (memory)."""
        return self._over_counted(dict(self.expert_held_imbalance).get(ep)) if ep > 1 else 1.0

    def _over_counted(self, measured: float | None) -> float:
        """A measured imbalance (the busiest rank's kept slots over a balanced share of those
        routed: training/contract/experts.py load_imbalance) over the share the meta count kept. No
        expert keeps more than c times a balanced one's slots, so a rank's figure is at most c."""
        if measured is None:
            return 1.0
        c = self.shape.capacity_factor
        return min(measured, c) / kept_share(c) if c is not None else measured

    def expert_straggler(self, d: ParallelDims) -> float:
        """How much longer the busiest expert-parallel rank computes than the mean: its experts'
        share of the FLOPs times the excess of tokens it got (the all-to-alls make every rank wait
        for it). 1 without expert parallelism: one rank runs every expert, whatever the routing."""
        return 1.0 + self.shape.expert_flops_share * (self.imbalance_at(d.ep) - 1.0)

    def tp_unsplit(self, d: ParallelDims) -> float:
        """How much more than 1/tp of a sample's compute each tensor-parallel rank runs: the routed
        experts are in no tensor-parallel plan, so without expert parallelism every rank of a TP
        group runs them whole on the same tokens (1 + share x (tp - 1)); with it the TP ranks split
        the tokens between them (training/parallel/ep.py), as the plan splits the rest. 1 for a
        dense model or tp = 1."""
        return 1.0 if d.ep > 1 else 1.0 + self.shape.expert_flops_share * (d.tp - 1)

    def head_split(self, d: ParallelDims) -> int:
        """Over how many ranks the head's logits and the loss's temporaries are split."""
        return d.tp if self.shape.head_params else 1

    def loss_temps(self, d: ParallelDims) -> float:
        """The loss's temporaries per sample on one rank at the start of backward: two fp32 copies of
        the whole logits (the fused kernels'), or where the head is split, three of this rank's
        share (torch's loss-parallel backward holds the one-hot zeros, the softmax, their sum and
        then the product beside the saved log-softmax; measured at tp=2: tests/dist/test_memory_budget.py)."""
        split = self.head_split(d)
        return self.activations.loss_temp * (LOSS_PARALLEL_TEMPS / split if split > 1 else 1)


def strategy_workload(shape: Shape, activations: Activations, strategy: StrategyConfig, micro_batch: int,
                      grad_accum: int, tokens_per_sample: int, clip: bool, seconds_per_sample: float | None = None,
                      expert_imbalance: tuple[tuple[int, float], ...] = (),
                      expert_held_imbalance: tuple[tuple[int, float], ...] = ()) -> Workload:
    """The Workload of a run of `strategy` (its precision, checkpointing, pipeline schedule,
    sequence parallelism and DDP buckets), built the one way for the plan's own run, the advice's
    requested layout and a fit (the search builds its points' from theirs: Variant.workload)."""
    return Workload(shape=shape, micro_batch=micro_batch, grad_accum=grad_accum, microbatches=strategy.microbatches,
                    precision=strategy.precision, checkpointing=strategy.activation_checkpointing,
                    tokens_per_sample=tokens_per_sample, activations=activations,
                    bucket_cap_bytes=strategy.bucket_cap_mb * 1024**2, seconds_per_sample=seconds_per_sample,
                    clip=clip, pp_schedule=strategy.pp_schedule, sequence_parallel=strategy.sequence_parallel,
                    pp_virtual_stages=strategy.pp_virtual_stages, expert_imbalance=expert_imbalance,
                    expert_held_imbalance=expert_held_imbalance)


def feasible(shape: Shape, d: ParallelDims, w: Workload) -> bool:
    """Whether the model can be laid out so: TP needs a plan whose widths and heads it divides; PP
    a declared layout, a block per stage and microbatches that divide the micro-batch."""
    if d.tp > 1 and (shape.block_linear_params == 0 or any(size % d.tp for size in shape.tp_sizes)):
        return False
    if d.pp > 1 and (not shape.pipeline or d.pp * w.pp_virtual_stages > shape.layers
                     or w.micro_batch % w.microbatches or pipeline_problem(w, d) is not None):
        return False
    if d.cp > 1 and shape.seq_len % (2 * d.cp):  # two load-balanced chunks per cp rank
        return False
    return expert_parallel_problem(d, shape.experts) is None


def pipeline_problem(w: Workload, d: ParallelDims) -> str | None:
    """Why the schedule can't run this pipeline (torch 2.13's rules: training/parallel/schedules.py)."""
    from training.parallel.schedules import checkpointing_problem, data_parallel_problem, microbatches_problem

    return (microbatches_problem(w.pp_schedule, d.pp, w.pp_virtual_stages, w.microbatches)
            or data_parallel_problem(w.pp_schedule, d.dp_size * d.cp)
            or checkpointing_problem(w.pp_schedule, w.checkpointing))
