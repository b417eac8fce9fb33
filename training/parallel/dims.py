"""Degrees -> DeviceMesh (torchtitan's ParallelDims).

A strategy is five degrees: pp x dp_replicate x dp_shard x cp x tp = world size. One degree may be
-1, meaning "the ranks left over". The mesh is laid out outermost-first as (pp, dp_replicate,
dp_shard, cp, tp), as torchtitan lays it out, so that tp, the most communication-hungry, spans
neighbouring ranks (the same node), cp (K/V exchanged every layer) comes next, and pp, the least,
spans the farthest.

Context-parallel ranks see the same samples (a different part of each sequence) and hold the same
parameters: they are not data-parallel ranks (dp_size excludes cp), but their gradients must be
reduced together, so the gradient wrappers treat cp as one more data-parallel dimension
(torchtitan's `dp_shard_cp`: FSDP shards over dp_shard x cp).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from training.config import StrategyConfig

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a layout. The cost model predicts with them, the parallel code builds its
    mesh from them: one class for both. `cp` comes last so that positional constructions of the
    four older degrees keep their meaning."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    """Context-parallel degree: the ranks each sequence is split over (load-balanced for causal
    attention; training/parallel/cp.py)."""
    ep: int = 1
    """Expert-parallel degree: carved out of the data-, context- and tensor-parallel ranks, which all
    route tokens of their own (dp_size x cp x tp / ep expert groups of ep neighbouring ranks, each
    splitting every MoE layer's experts: training/parallel/ep.py), so it is no mesh dimension of its
    own and leaves the world size as it is."""

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, tp: int, pp: int, world_size: int, cp: int = 1) -> ParallelDims:
        """Fill in the one -1 degree; ValueError when the degrees can't make `world_size`."""
        degrees = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp, "cp": cp}
        for name, value in degrees.items():
            if value == 0 or value < -1:
                raise ValueError(f"strategy.{name}={value}: a degree must be >= 1, or -1 for the leftover ranks")
        free = [name for name, value in degrees.items() if value == -1]
        if len(free) > 1:
            raise ValueError(f"strategy degrees {', '.join(free)} are all -1: at most one may take the leftover ranks")
        fixed = math.prod(v for v in degrees.values() if v != -1)
        if free:
            if world_size % fixed:
                raise ValueError(
                    f"strategy degrees multiply to {fixed}, which does not divide the world size {world_size} "
                    f"(so strategy.{free[0]}=-1 has no whole value)"
                )
            degrees[free[0]] = world_size // fixed
        product = math.prod(degrees.values())
        if product != world_size:
            # cp is named only when set: the four-degree sentence stays what layouts without it read.
            names = [n for n in DIM_NAMES if n != "cp" or degrees["cp"] != 1]
            raise ValueError(
                f"strategy degrees {' x '.join(names)} = {' x '.join(str(degrees[n]) for n in names)} = {product}, "
                f"but the world size is {world_size}"
            )
        return cls(**degrees)

    @property
    def world_size(self) -> int:
        return self.dp_size * self.cp * self.tp * self.pp

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: replicas times shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    def gradient_ranks(self, wrapper: str | None) -> tuple[int, int]:
        """(replicas, shards): the ranks a strategy's gradient wrapper (`Strategy.wrapper`) replicates
        and shards the parameters over. CP ranks hold the same parameters, so they join the shards
        (FSDP over dp_shard x cp, torchtitan's `dp_shard_cp`), except under a DDP strategy (ddp,
        zero1), whose promise is a whole replica per rank: there they are more replicas."""
        if self.cp_enabled and wrapper == "ddp":
            return self.dp_replicate * self.cp, self.dp_shard
        return self.dp_replicate, self.dp_shard * self.cp

    def uses_fsdp(self, wrapper: str | None) -> bool:
        """Whether the trainer wraps this layout in FSDP2 under a strategy of `wrapper`: to shard,
        and to replicate a tensor-parallel model (DDP cannot replicate DTensor parameters: HSDP
        does). The one rule the trainer (training/parallel/compose.py) and the planner read."""
        replicas, shards = self.gradient_ranks(wrapper)
        return shards > 1 or (replicas > 1 and self.tp_enabled)

    @property
    def shape(self) -> tuple[int, ...]:
        """The degrees in DIM_NAMES order (outermost first)."""
        return tuple(getattr(self, name) for name in DIM_NAMES)

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The 5-D mesh over the default process group, and its flattened data-parallel mesh
        (dp_replicate x dp_shard: every rank that sees different data)."""
        from torch.distributed.device_mesh import init_device_mesh  # torch is imported only when used

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=DIM_NAMES)
        return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension, and along the flattened dp."""
        out = {}
        rest = rank
        for name, size in reversed(list(zip(DIM_NAMES, self.shape, strict=True))):
            out[name] = rest % size
            rest //= size
        out["dp"] = out["dp_replicate"] * self.dp_shard + out["dp_shard"]
        return out


def gradient_dims(dims: ParallelDims, cp_replicates: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh dimensions gradients are reduced over, as (replicate, shard). CP ranks hold the
    same parameters, so they join the shard dimensions (FSDP over dp_shard x cp, torchtitan's
    `dp_shard_cp`), or the replicate ones when `cp_replicates` (DDP strategies: every rank a whole
    replica)."""
    replicate, shard = ("dp_replicate",), ("dp_shard",)
    if dims.cp_enabled:
        replicate, shard = (replicate + ("cp",), shard) if cp_replicates else (replicate, shard + ("cp",))
    return replicate, shard


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims, cp_replicates: bool = False) -> DeviceMesh:
    """FSDP's mesh: (replicate, shard) for HSDP when anything replicates, else the shard
    dimension alone; without cp, the mesh's own dp_replicate and dp_shard dimensions."""
    replicate, shard = gradient_dims(dims, cp_replicates)
    if math.prod(getattr(dims, name) for name in replicate) > 1:
        return _slice_2d(mesh, _flatten(mesh, replicate), _flatten(mesh, shard))
    return _flatten(mesh, shard)


def ddp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """DDP's mesh: dp_replicate, and the CP ranks with it (each a whole replica)."""
    replicate, _ = gradient_dims(dims, cp_replicates=True)
    return _flatten(mesh, replicate)


def _flatten(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """`names` as one dimension: the mesh's own, or flattened (named `dp_shard_cp`; flattening the
    same dimensions under the same name again is a no-op in torch)."""
    return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))


def _slice_2d(mesh: DeviceMesh, outer: DeviceMesh, inner: DeviceMesh) -> DeviceMesh:
    """The 2-D (outer, inner) submesh of `mesh`. Sliced from the root, flattened dimensions and all,
    so that FSDP's HSDP mesh and the TP mesh share one root (FSDP2 + TP needs it); torch warns that
    slicing a flattened dimension will be deprecated, and has no other way to build it yet."""
    names = (outer.mesh_dim_names[0], inner.mesh_dim_names[0])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[names]


def resolve_dims(strategy: StrategyConfig, world: int) -> ParallelDims:
    """A strategy's degrees on `world` ranks (shapes only: no process group, no torch)."""
    d = strategy.degrees()
    dims = ParallelDims.resolve(d["dp_replicate"], d["dp_shard"], d["tp"], d["pp"], world, cp=strategy.cp_degree)
    return dataclasses.replace(dims, ep=strategy.ep)


def expert_parallel_problem(dims: ParallelDims, experts: list[int] | tuple[int, ...]) -> str | None:
    """Why `dims.ep` can't split the experts (`experts`: each MoE layer's count) on `dims`; None when
    it can. The trainer's check (pipelines/validate.py) and the search's (training/planner/memory.py)."""
    ep = dims.ep
    if ep == 1:
        return None
    if not experts:
        return ("the model declares no experts to split: name its experts modules and their stacked weights in "
                "model.ep_plan (ep_dispatch_experts, grouped_gemm), as Hugging Face's base_model_ep_plan does")
    routing = dims.dp_size * dims.cp * dims.tp
    if routing % ep:
        # Every one of those ranks routes tokens of its own (TP ranks split the ones they share).
        inside = " x ".join(n for n, size in (("dp_replicate", dims.dp_replicate), ("dp_shard", dims.dp_shard),
                                              ("cp", dims.cp), ("tp", dims.tp)) if size > 1 or n == "dp_shard")
        return f"must divide the ranks it is carved out of, {inside} = {routing}"
    if any(n % ep for n in experts):
        return f"must divide every layer's experts ({', '.join(map(str, sorted(set(experts))))})"
    return None

