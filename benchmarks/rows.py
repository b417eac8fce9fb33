"""One comparison of `make bench`: ours against a reference, measured side by side."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    name: str
    ours: float
    theirs: float
    unit: str
    goal: str

    @property
    def ratio(self) -> float:
        return self.ours / self.theirs if self.theirs else float("nan")

    def line(self) -> str:
        return f"| {self.name} | {self.ours:.4g} {self.unit} | {self.theirs:.4g} {self.unit} | {self.ratio:.3f} | {self.goal} |"
