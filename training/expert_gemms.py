"""How efficiently this device runs a mixture of experts' GEMMs: each expert on its own few rows,
against one GEMM of the same FLOPs. Small experts waste a device (InternEvo: "MoE MFU is about
half of dense"; MegaBlocks' and Megatron-Core's grouped GEMMs exist for it): the rows an expert
gets are the routed tokens over the experts, and a matmul of few rows is bound by reading its
weights, not by its FLOPs.

Expert parallelism changes the rows: a rank holding E/ep experts receives every rank of its
expert group's tokens for them, so each expert runs ep times the rows (the same FLOPs a rank,
in ep times fewer, larger GEMMs). Measured per degree here, so the plan can say what the one-device
step it timed (ep=1's small GEMMs) leaves on the table at each ep.

An expert's forward is taken as one (rows x hidden) @ (hidden x width) GEMM, width = its
parameters / hidden (two linears of hidden x ffn, or three for a gated one, are 2 or 3 x ffn): the
same FLOPs and weight bytes as the expert's matmuls.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TIMED_REPEATS = 5
MIN_TIMED_S = 0.002
MAX_WEIGHT_BYTES = 512 * 1024**2
"""The most bytes of expert weights the measurement allocates (one layer's local experts, and the
one GEMM's weight of the same size); above it the plan says it did not measure."""


@dataclass(frozen=True)
class ExpertGemms:
    """Per expert-parallel degree (`degrees`, 1 first): the rows each local expert runs in one
    micro-batch, and the time of one GEMM of all a rank's rows over the time of its experts' GEMMs
    one by one (1: nothing lost; above 1 on a host where one large GEMM runs out of cache)."""

    degrees: list[int]
    """Expert-parallel degrees timed: those dividing the experts and the world."""
    rows: list[int]
    """Rows each local expert runs at that degree (routed_rows)."""
    efficiency: list[float]
    """One GEMM's time over the experts' GEMMs' time, at that degree."""
    width: int
    """The GEMM's width an expert is taken as (expert_width)."""
    hidden: int

    def describe(self) -> str:
        measured = ", ".join(f"ep={ep} {r} rows {e:.2f}"
                             for ep, r, e in zip(self.degrees, self.rows, self.efficiency, strict=True))
        top, base = self.efficiency[-1], self.efficiency[0]
        gain = (f": at ep={self.degrees[-1]} the experts may run {top / base:.2f}x as fast as the prediction says "
                "(noted, not added to it)" if top > 1.05 * base else "")
        return (f"experts' GEMMs: each expert on its routed rows against one GEMM of the same FLOPs on this device "
                f"(hidden {self.hidden} x width {self.width}): {measured}; the timed step runs ep=1's{gain}")


def expert_width(expert_params: int, moe_layers: int, experts: int, hidden: int) -> int:
    """The width of the one GEMM an expert's forward is taken as: its parameters over `hidden`."""
    return max(1, round(expert_params / max(moe_layers, 1) / max(experts, 1) / max(hidden, 1)))


def routed_rows(tokens: int, top_k: int, experts: int, ep: int) -> int:
    """Rows each of a rank's E/ep experts runs when `tokens` routed tokens a rank spread evenly:
    tokens x top_k slots over E experts, from each of the ep ranks of its group."""
    return max(1, math.ceil(tokens * top_k * ep / experts))


def measure_expert_gemms(hidden: int, width: int, experts: int, top_k: int, tokens: int, degrees: list[int],
                         dtype: torch.dtype, device: torch.device) -> ExpertGemms | None:
    """ExpertGemms at each of `degrees` (1 first, each dividing `experts`), timed with `dtype` on
    `device`; None when one layer's experts outweigh MAX_WEIGHT_BYTES."""
    import torch  # the plan's record of these needs no torch: only measuring does

    size = torch.tensor([], dtype=dtype).element_size()
    if experts * hidden * width * size > MAX_WEIGHT_BYTES:
        return None
    rows, efficiency = [], []
    for ep in degrees:
        r = routed_rows(tokens, top_k, experts, ep)
        rows.append(r)
        efficiency.append(_efficiency(experts // ep, r, hidden, width, dtype, device))
    return ExpertGemms(list(degrees), rows, efficiency, width, hidden)


def _efficiency(local: int, r: int, hidden: int, width: int, dtype: torch.dtype, device: torch.device) -> float:
    """One GEMM of `local` x `r` rows over `local` GEMMs of `r` rows, each through its own weight."""
    import torch

    from training.dist import synchronize

    weights = torch.randn(local, hidden, width, dtype=dtype, device=device)
    x = torch.randn(local * r, hidden, dtype=dtype, device=device)

    def grouped() -> None:
        for i in range(local):
            torch.mm(x[i * r:(i + 1) * r], weights[i])

    def one() -> None:
        torch.mm(x, weights[0])  # every row through one weight, read once

    one_s, grouped_s = _median_times([one, grouped], device, synchronize)
    return one_s / grouped_s


def _median_times(fns: list, device: torch.device, synchronize) -> list[float]:  # noqa: ANN001 - callables
    """Each of `fns`' median seconds a call over TIMED_REPEATS rounds, the fns alternating within
    a round (a noisy host slows both alike), each timing of enough calls to last MIN_TIMED_S (a
    small GEMM takes microseconds, below the timer's noise)."""
    calls = []
    for fn in fns:
        for _ in range(2):  # warm-up: threads started, kernels chosen, caches filled
            start = time.perf_counter()
            fn()
            synchronize(device)
        calls.append(max(1, math.ceil(MIN_TIMED_S / max(time.perf_counter() - start, 1e-7))))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(TIMED_REPEATS):
        for fn, n, out in zip(fns, calls, times, strict=True):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            synchronize(device)
            out.append((time.perf_counter() - start) / n)
    return [statistics.median(t) for t in times]
