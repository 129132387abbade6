"""The packages' import rules, read from the source (an AST walk; imports inside functions count for the
layers too):

- packages stand in floors, each importing only from the floors below it: ``checkpoint_store`` (bytes in,
  bytes out) < ``engine`` < ``gateway`` < ``adapters`` < ``peer``, ``traces`` < ``ft``; ``checkpoint_store``
  imports nothing of the project;
- a few leaf modules that import nothing of the project but each other (``ft.env``, the environment
  variables read in one place; ``ft.servers``, the running servers' files; ``ft.hub``, model names) may be
  imported from any floor;
- the kernels (``engine/ops``) import no engine module outside ``engine.ops`` but the weight formats
  (``engine.quant``);
- the modules' import graph has no cycles, neither among the imports run at import time nor through an
  import deferred into a function; imports under ``if TYPE_CHECKING:`` count (a cycle of types only is
  still two modules that need each other);
- the gateway does not import ``adapters``, and its error types live in ``gateway/errors.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"checkpoint_store": 0, "engine": 1, "gateway": 2, "adapters": 3, "peer": 4, "traces": 4, "ft": 5}
LEAVES = {"ft.env", "ft.servers", "ft.hub"}
KERNELS_MAY_IMPORT = ("engine.ops", "engine.quant")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. "gateway.plan"
    target: str  # the project module imported, e.g. "engine.sampling"
    in_function: bool  # run when the function is called, not at import time


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in FLOORS for p in sorted((ROOT / package).rglob("*.py"))}


def is_project(name: str) -> bool:
    return name.split(".")[0] in FLOORS


def targets(node: ast.Import | ast.ImportFrom, source: str, is_package: bool, known: set[str]) -> list[str]:
    """The project modules one import statement names: `from X import a` names X.a where that is a module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if is_project(alias.name)]
    base = node.module or ""
    if node.level:
        package = source.split(".") if is_package else source.split(".")[:-1]
        anchor = package[: len(package) - node.level + 1]
        base = ".".join([*anchor, *([base] if base else [])])
    if not is_project(base):
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def walk(node: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        yield child, in_function
        nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from walk(child, nested)


def all_imports() -> list[Import]:
    modules = project_modules()
    known = set(modules)
    found = []
    for source, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, in_function in walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = targets(node, source, path.name == "__init__.py", known)
                found += [Import(source, t, in_function) for t in names if t != source]
    return found


IMPORTS = all_imports()


def package(module: str) -> str:
    return module.split(".")[0]


def test_the_walk_sees_every_package():
    assert {package(i.source) for i in IMPORTS} == set(FLOORS)


def test_the_store_imports_nothing_of_the_project():
    assert [i for i in IMPORTS if package(i.source) == "checkpoint_store" and package(i.target) != package(i.source)] == []


def test_importing_the_store_loads_no_engine_module():
    code = "import checkpoint_store, sys; print([m for m in sys.modules if m.split('.')[0] in ('engine', 'gateway')])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_each_package_imports_only_the_floors_below():
    upward = [
        f"{i.source} -> {i.target}"
        for i in IMPORTS
        if package(i.source) != package(i.target)
        and i.target not in LEAVES
        and FLOORS[package(i.target)] >= FLOORS[package(i.source)]
    ]
    assert not upward, "imports of an equal or higher floor:\n" + "\n".join(upward)


def test_the_leaves_import_only_leaves():
    assert [f"{i.source} -> {i.target}" for i in IMPORTS if i.source in LEAVES and i.target not in LEAVES] == []


def test_the_kernels_import_no_engine_module_outside_the_kernels():
    outside = [
        f"{i.source} -> {i.target}"
        for i in IMPORTS
        if i.source.startswith("engine.ops")
        and package(i.target) == "engine"
        and not i.target.startswith(KERNELS_MAY_IMPORT)
    ]
    assert not outside, "kernels importing the engine:\n" + "\n".join(outside)


def test_the_gateway_does_not_import_adapters():
    assert [f"{i.source} -> {i.target}" for i in IMPORTS if package(i.source) == "gateway" and package(i.target) == "adapters"] == []


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its first module) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return [shortest_cycle(c[0], set(c), edges) for c in sorted(components)]


def shortest_cycle(start: str, members: set[str], edges: dict[str, set[str]]) -> list[str]:
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, set()) & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in no cycle")


def graph(deferred: bool) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for i in IMPORTS:
        if deferred or not i.in_function:
            edges.setdefault(i.source, set()).add(i.target)
    return edges


def test_the_import_graph_has_no_cycles():
    found = [" -> ".join(c) for c in cycles(graph(deferred=False))]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_no_cycle_hides_behind_an_import_inside_a_function():
    found = [" -> ".join(c) for c in cycles(graph(deferred=True))]
    assert not found, "import cycles through imports inside functions:\n" + "\n".join(found)


def test_the_cycle_finder_reports_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(edges) == [["a", "b", "c", "a"]]


def test_the_gateways_error_types_live_in_one_module():
    """Every exception class of the gateway is in gateway/errors.py (where the app's handlers are), but the
    renderer's private signal from a template's `raise_exception`, which it turns into a `RenderError`."""
    private = {"TemplateRaised"}
    outside = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            bases = [
                b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                for b in getattr(node, "bases", [])
            ]
            if isinstance(node, ast.ClassDef) and any(
                b.endswith(("Error", "Exception", "BadRequest")) for b in bases
            ):
                outside += (
                    [] if path.name == "errors.py" or node.name in private else [f"{path.name}:{node.name}"]
                )
    assert outside == []
