"""One way to set a step up: every stage that steps a model (train and trials through
stages/setting.py, lr_find, plan's rulers) and the overhead probe make it trainable with
`compose.trainable` (parallelized, its optimizer built), and step it with training/step.py's
`optimizer_step`. Only the dry run, which counts a layout on a fake process group and never steps
it, calls `parallelize` and `build_optimizer` itself."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUP = {"parallelize", "build_optimizer"}
COUNTS_ONLY = {"training/parallel/compose.py", "training/planner/dryrun.py"}


def calls(path: Path, names: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name in names:
                found.add(name)
    return found


def test_no_stage_or_probe_sets_a_step_up_its_own_way():
    own_way = {str(p.relative_to(ROOT)): sorted(found)
               for folder in ("stages", "training", "pipelines", "reports")
               for p in (ROOT / folder).rglob("*.py")
               if str(p.relative_to(ROOT)) not in COUNTS_ONLY and (found := calls(p, SETUP))}
    assert own_way == {}


def test_every_stage_that_steps_a_model_uses_trainable_and_the_one_step():
    steppers = ["stages/setting.py", "stages/lr_find.py", "stages/rulers.py", "training/overhead.py"]
    for name in steppers:
        assert calls(ROOT / name, {"trainable"}) == {"trainable"}, name
    for name in ["training/loop.py", "stages/lr_find.py", "stages/rulers.py", "training/overhead.py"]:
        assert calls(ROOT / name, {"optimizer_step"}) == {"optimizer_step"}, name


def test_the_compute_ruler_times_the_trainers_loop():
    """plan's step time is the train stage's loop (fresh batches, the schedule, the window's mean),
    not a step of its own: what it predicts is what train measures."""
    for name in ["stages/setting.py", "stages/rulers.py"]:
        assert calls(ROOT / name, {"train_loop"}) == {"train_loop"}, name
