"""One-line mutations of the planner (and the three the issue #28 read found), each applied in turn
to the working tree, the unit tests run against it, and the file restored: every mutation must be
caught by a failing test. Not part of `make test` (minutes, and it edits sources while it runs):

    .venv/bin/python scripts/mutations.py [test paths ...]   # default: tests/unit

Prints CAUGHT or SURVIVED per mutation, with the first failing test.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
MUTATIONS = [  # (what, file, the line as it is, the line mutated)
 ("old: one bus-factor table, reduce_scatter's changed", "training/collectives.py",
  '    "reduce_scatter": lambda n: (n - 1) / n,', '    "reduce_scatter": lambda n: 1.0,'),
 ("old: 1F1B's in-flight activations removed", "training/planner/pipeline.py",
  '    return min(m, pp), 1\n', '    return 1, 1\n'),
 ("old: the advisor's tie-break on micro-batch reversed", "training/planner/ranking.py",
  'c.activation_checkpointing != "none", -c.micro_batch,', 'c.activation_checkpointing != "none", c.micro_batch,'),
 ("new 1 (memory): FSDP's optimizer moments not sharded", "training/planner/memory.py",
  'return MASTER_BYTES / n + gathered, MASTER_BYTES / n, MOMENT_BYTES / n', 'return MASTER_BYTES / n + gathered, MASTER_BYTES / n, MOMENT_BYTES'),
 ("new 2 (comm): ZeRO-3's re-gather before backward dropped", "training/planner/comm.py",
  'regathered = shape.params - shape.first_stage_params - shape.last_stage_params if resharded else 0', 'regathered = 0'),
 ("new 3 (step): overlap hides all of compute, not two thirds", "training/planner/step.py",
  'hidden = overlap * compute_s * 2 / 3', 'hidden = overlap * compute_s'),
 ("new 4 (workload): loss-parallel temporaries as the fused kernels' two copies", "training/planner/workload.py",
  'LOSS_PARALLEL_TEMPS = 1.5', 'LOSS_PARALLEL_TEMPS = 1.0'),
 ("new 5 (calibration): no prior toward the model", "training/planner/calibration.py",
  'PRIOR_WEIGHT = 0.2', 'PRIOR_WEIGHT = 0.0'),
 ("new 6 (ranking): no tie, the fastest always wins", "training/planner/ranking.py",
  'TIE = 0.01', 'TIE = 0.0'),
 ("new 7 (shape): alike layers extended from one layer as if two were the outside", "training/planner/shape.py",
  '    return one + (layers - 1) * (two - one)', '    return one + layers * (two - one)'),
 ("new 8 (ranking): no preference for node-local TP", "training/planner/ranking.py",
  'NODE_LOCAL = 0.05', 'NODE_LOCAL = 0.0'),
]


def main(tests: list[str]) -> int:
    survived = 0
    for name, rel, old, new in MUTATIONS:
        p = ROOT / rel
        src = p.read_text()
        assert src.count(old) == 1, (name, src.count(old))
        p.write_text(src.replace(old, new))
        try:
            start = time.time()
            r = subprocess.run([str(ROOT / '.venv/bin/python'), '-m', 'pytest', *tests, '-q', '-x', '-m', 'not slow',
                                '-p', 'no:cacheprovider', '-p', 'no:randomly'], cwd=ROOT, capture_output=True, text=True)
            failed = [line for line in r.stdout.splitlines() if line.startswith('FAILED')]
            survived += r.returncode == 0
            print(f"{'CAUGHT' if r.returncode else 'SURVIVED'} {name}: {failed[:2]} ({time.time() - start:.0f} s)", flush=True)
        finally:
            p.write_text(src)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["tests/unit"]))
