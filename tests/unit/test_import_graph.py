"""The house rules docs/architecture.md states, held: the modules import one another without a
circle, the engine imports no stage, the library nothing of the pipeline, the planner down its own
order; no private name across packages; no file over 400 lines. A circle is what ties the engine
to the application (the study reader once reached the CLI through the summary for one path); each
import a module makes, at the top or inside a function, counts. Imports only a type checker reads
(`if TYPE_CHECKING:`) do not: they never run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pipelines.cache import PACKAGES

ROOT = Path(__file__).resolve().parents[2]


def _runtime_imports(tree: ast.AST) -> set[str]:
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph() -> dict[str, set[str]]:
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            files[name] = path
    return {name: {d for d in _runtime_imports(ast.parse(path.read_text())) if d in files and d != name}
            for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_project_imports_itself_round_a_circle():
    graph = import_graph()
    assert len(graph) > 100 and "pipelines.cache" in graph["pipelines.runner"], "the graph was read"
    assert circles(graph) == []


def import_rules() -> dict[str, list[str]]:
    """docs/architecture.md's table: each package (dotted) and the prefixes its modules may import."""
    rules = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith("/`"):
            package = cells[0].strip("`/").replace("/", ".")
            allowed = [t.rstrip("/").replace("/", ".") for t in re.findall(r"`([a-z_./]+)`", cells[2])]
            rules[package] = allowed
    return rules


def test_every_import_keeps_to_the_table_of_docs_architecture_md():
    """Each module may import its own package and what the most specific row of the table its path
    falls under allows: so the engine imports no stage or report (conf/ names them), the library
    nothing of the pipeline, common/ nothing of the project, the built-in models only the contract,
    and no module a built-in model."""
    rules = import_rules()
    assert {"common", "training", "training.models", "pipelines", "stages", "reports"} <= set(rules)
    assert rules["common"] == [] and rules["training.models"] == ["training.contract"] and "stages" not in rules["pipelines"]

    def row(module: str) -> str:
        return max((p for p in rules if module == p or module.startswith(p + ".")), key=len)

    graph = import_graph()
    # A built-in model is a `_target_` like a user's: nothing imports one, everything reads the contract.
    wrong = [f"{name} imports {dep}" for name, deps in graph.items() if not name.startswith("training.models")
             for dep in sorted(deps) if dep.startswith("training.models")]
    for name, deps in graph.items():
        own = row(name)
        allowed = [own, *rules[own]]
        wrong += [f"{name} imports {dep}" for dep in sorted(deps)
                  if not any(dep == a or dep.startswith(a + ".") for a in allowed)]
    assert wrong == []


def test_no_module_imports_a_private_name_of_another_package():
    """`from training.search import _candidate` reached into another package's internals; a name
    another package needs is public."""
    private = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    top = node.module.split(".")[0]
                    if top in PACKAGES and top != package:
                        private += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                                    if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == []


def planner_order() -> list[str]:
    """The planner's modules in the order its package docstring lists them (training/planner/__init__.py)."""
    import training.planner

    return [line.split(":")[0].removeprefix("- ") for line in training.planner.__doc__.splitlines()
            if line.startswith("- ")]


def test_the_planner_imports_only_down_its_declared_order_and_nothing_of_the_pipeline():
    """One planner package whose docstring lists its modules in dependency order: each imports only
    those listed above it, and none imports the engine, a stage or a report (training/ knows
    nothing of the pipeline). Every module of the package is listed."""
    order = planner_order()
    graph = import_graph()
    modules = {name.removeprefix("training.planner.") for name in graph if name.startswith("training.planner.")}
    assert modules == set(order), "the docstring lists every module of the package, and only those"
    wrong = []
    for name in order:
        for dep in sorted(graph[f"training.planner.{name}"]):
            if dep.startswith(("pipelines", "stages", "reports")):
                wrong.append(f"{name} imports {dep}")
            elif dep.startswith("training.planner.") and order.index(dep.removeprefix("training.planner.")) >= order.index(name):
                wrong.append(f"{name} imports {dep}, listed below it")
    assert wrong == []


def test_the_rulers_and_the_search_are_arithmetic_without_torch():
    """What-if plans of a 405B model on 16,384 GPUs answer in seconds because the rulers and the
    search are arithmetic: only the modules that count a model (counting, anatomy, fit, dryrun) import
    torch."""
    counting = {"counting", "anatomy", "fit", "dryrun"}
    with_torch = []
    for name in planner_order():
        imports = _runtime_imports(ast.parse((ROOT / "training" / "planner" / f"{name}.py").read_text()))
        if any(i == "torch" or i.startswith("torch.") for i in imports) and name not in counting:
            with_torch.append(name)
    assert with_torch == []
    # And through what they import: a helper moved into a module that imports torch (a contract
    # module, say) would make every cached re-run's driver import it (tests/integration/test_moe_e2e.py).
    import subprocess
    import sys

    arithmetic = [f"training.planner.{name}" for name in planner_order() if name not in counting]
    code = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code, *arithmetic], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr


MAX_LINES = 400


def test_no_source_file_is_over_400_lines():
    """A file that outgrows 400 lines holds more than one idea (docs/architecture.md): split it by idea."""
    sources = [path for folder in (*PACKAGES, "benchmarks", "scripts", "tests") for path in (ROOT / folder).rglob("*.py")]
    long = {str(path.relative_to(ROOT)): n for path in [*sources, ROOT / "run.py"]
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert len(sources) > 150 and long == {}
