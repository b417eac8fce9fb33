"""What a stage's run came to (Outcome: ran, cached, failed or skipped, with its result and where it
was measured), the invocation's Summary of them, and the closing table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.cache import Entry
from pipelines.configtools import to_jsonable
from pipelines.redact import redact_text
from pipelines.summary import SkipReason
from pipelines.tracking import HasHeadline


@dataclass
class Outcome:
    status: str
    """ran | cached | failed | skipped"""
    seconds: float = 0.0
    key: str | None = None
    error: str | None = None
    result: Any = None
    baseline: dict[str, Any] | None = None
    entry: Entry | None = field(default=None, repr=False)
    """The cache entry behind a ran or cached outcome (its metrics and artifacts are logged)."""
    placement: dict[str, Any] | None = None
    """Where a worker stage's result was measured (Placement.describe); None for driver stages."""
    reason: SkipReason | None = None
    """Why a skipped stage was skipped by choice (only=[...], its `when` key); None otherwise."""
    peak_memory_bytes: int | None = None
    """The highest peak device memory of its ranks (pipelines.summary.StageRecord)."""

    @property
    def measured_by(self) -> dict[str, Any] | None:
        """For a cached outcome: the invocation that measured it (run dir, MLflow run, placement)."""
        if self.status != "cached" or self.entry is None:
            return None
        return self.entry.origin

    @property
    def not_asked(self) -> bool:
        """Skipped because its `when` key turned it off: no failure, no reason to skip what needs it."""
        return self.reason is SkipReason.NOT_ASKED

    def describe(self) -> str:
        """Its progress line: status, seconds, the baseline's status and the error."""
        text = f"{self.status} in {self.seconds:.1f} s"
        if self.baseline:
            text += f" (1-device baseline {self.baseline['status']})"
        if self.error:
            text += f": {self.error}"
        return text

    def as_json(self, fn: str) -> dict[str, Any]:
        """Its entry in summary.json (pipelines.summary.StageRecord); `fn` types its result."""
        data = {
            "status": self.status,
            "reason": self.reason,
            "seconds": round(self.seconds, 3),
            "key": self.key,
            "error": redact_text(self.error) if self.error else None,
            "fn": fn,
            "result": to_jsonable(self.result) if self.result is not None else None,
            "peak_memory_bytes": self.peak_memory_bytes,
        }
        if self.baseline is not None:
            data["baseline"] = self.baseline
        if self.placement is not None:
            data["placement"] = self.placement
        if self.measured_by is not None:
            data["measured_by"] = self.measured_by
        return data


@dataclass
class Summary:
    stages: dict[str, Outcome] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    path: Path | None = None

    @property
    def ok(self) -> bool:
        return all(o.status in ("ran", "cached") or o.reason is not None for o in self.stages.values())


def summary_table(summary: Summary) -> str:
    """The closing table: one row per stage with its status, time and headline numbers."""
    rows = [("stage", "status", "seconds", "result")]
    for name, outcome in summary.stages.items():
        if isinstance(outcome.result, HasHeadline):
            text = outcome.result.headline()
        else:
            # The full error (a job's stderr tail, say) was printed when the stage failed;
            # a table row holds its first line.
            text = (outcome.error or "").strip().split("\n", 1)[0]
        rows.append((name, outcome.status, f"{outcome.seconds:.1f}", text))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}" for r in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)
