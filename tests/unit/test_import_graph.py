"""The project's modules import one another without a circle, and the engine imports no stage. A
circle is what ties the engine to the application (the study reader once reached the CLI through
the summary for one path); each import a module makes, at the top or inside a function, counts. Imports only a type checker reads
(`if TYPE_CHECKING:`) do not: they never run."""

from __future__ import annotations

import ast
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


def test_the_engine_imports_no_stage_and_no_report():
    """pipelines/ runs any DAG of stages named in conf/: it names none (docs/extending.md), and the
    study report its sweeps end with is the application's, named in conf/config.yaml by _target_."""
    graph = import_graph()
    crossing = {name: sorted(d for d in deps if d.startswith(("stages", "reports")))
                for name, deps in graph.items() if name.startswith("pipelines")}
    assert {name: deps for name, deps in crossing.items() if deps} == {}


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
