"""Degrees -> DeviceMesh (torchtitan's ParallelDims).

A strategy is four degrees: pp x dp_replicate x dp_shard x tp = world size. One degree may be
-1, meaning "the ranks left over". The mesh is laid out outermost-first as (pp, dp_replicate,
dp_shard, tp), so that tp, the most communication-hungry, spans neighbouring ranks (the same
node), and pp, the least, spans the farthest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from training.config import StrategyConfig

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """The four degrees of a layout. The cost model predicts with them, the parallel code builds
    its mesh from them: one class for both."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, tp: int, pp: int, world_size: int) -> ParallelDims:
        """Fill in the one -1 degree; ValueError when the degrees can't make `world_size`."""
        degrees = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp}
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
            raise ValueError(
                f"strategy degrees pp x dp_replicate x dp_shard x tp = {degrees['pp']} x {degrees['dp_replicate']} x "
                f"{degrees['dp_shard']} x {degrees['tp']} = {product}, but the world size is {world_size}"
            )
        return cls(**degrees)

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp * self.pp

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
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def uses_fsdp(self) -> bool:
        """Whether the trainer wraps this layout in FSDP2: to shard (dp_shard), and to replicate a
        tensor-parallel model (DDP cannot replicate DTensor parameters: HSDP does)."""
        return self.fsdp_enabled or (self.dp_replicate_enabled and self.tp_enabled)

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The 4-D mesh over the default process group, and its flattened data-parallel mesh
        (dp_replicate x dp_shard: every rank that sees different data)."""
        from torch.distributed.device_mesh import init_device_mesh  # torch is imported only when used

        shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIM_NAMES)
        return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension, and along the flattened dp."""
        out = {}
        rest = rank
        for name, size in reversed(list(zip(DIM_NAMES, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
                                            strict=True))):
            out[name] = rest % size
            rest //= size
        out["dp"] = out["dp_replicate"] * self.dp_shard + out["dp_shard"]
        return out


def resolve_dims(strategy: StrategyConfig, world: int) -> ParallelDims:
    """A strategy's degrees on `world` ranks (shapes only: no process group, no torch)."""
    d = strategy.degrees()
    return ParallelDims.resolve(d["dp_replicate"], d["dp_shard"], d["tp"], d["pp"], world)
