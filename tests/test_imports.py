"""No import cycle in src/leanserve: a newcomer can read the package bottom-up, and no module depends on being
imported half-initialised.

The graph has an edge from a module to every leanserve module it imports, at module level or inside a function
(a lazy import is still a dependency); only imports under `if TYPE_CHECKING:` (annotations) are left out.
`from leanserve.x import y` where y is a submodule imports leanserve.x.y; a package's `__init__` is a module
like any other. Importing leanserve.a.b.c from outside leanserve.a also runs leanserve.a's `__init__` (and
leanserve.a.b's) first, so that is an edge too; a module inside a package importing its siblings is not (the
package is already being imported)."""

import ast
import subprocess
import sys
from pathlib import Path

import leanserve

SRC = Path(leanserve.__file__).parent
PACKAGE = "leanserve"


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, name: str, is_package: bool) -> list[str]:
    """The absolute module names `tree` imports (submodules named by `from x import y` as x.y candidates too)."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            found.append(base)
            found.extend(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for target in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            if target not in modules or target == name or name.startswith(target + "."):
                continue  # (a package this module is inside is being imported already)
            edges.add(target)
            # the packages above `target` that `name` is not inside: importing target runs their __init__ first
            parts = target.split(".")
            for i in range(2, len(parts)):
                package = ".".join(parts[:i])
                if not (name == package or name.startswith(package + ".")):
                    edges.add(package)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_lazy_and_from_imports():
    graph = import_graph()
    assert "leanserve.model.weights" in graph["leanserve.model.backends.torch"]
    # (from leanserve.model.backends.cpu import kernels: a submodule)
    assert "leanserve.model.backends.cpu.kernels" in graph["leanserve.model.batch"]
    assert "leanserve.model.backends" in graph["leanserve.model.batch"]  # (its __init__ runs first)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_serving_never_imports_training():
    """Training (the repo's train/ package) is not installed: no leanserve module imports it, and importing
    leanserve and its CLI loads none of it."""
    importers = sorted(
        name
        for name, path in _modules().items()
        if any(t == "train" or t.startswith("train.") for t in _imports(ast.parse(path.read_text()), name, False))
    )
    assert importers == []
    code = "import sys, leanserve, leanserve.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'train'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=SRC.parents[1])
    assert out.stdout.strip() == "[]"
