"""The integrations' import graph: no cycles between modules, and the layers point one way
(tokencache_models never imports the routing engine, the server or the SGLang backend; the
routing engine never imports the server).

Read with ast from the source, so it sees imports inside functions too (a deferred import is
still a dependency); imports under `if TYPE_CHECKING:` are left out (annotations only)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "integrations"
PACKAGES = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str) -> set[str]:
    """Modules of the integrations that `module` (at `path`) imports at run time."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {m: {d for d in _imports(p, m) if d in files and d != m} for m, p in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, if any (depth-first search with colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (found := dfs(d)) is not None:
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := dfs(m)) is not None:
            return found
    return None


def test_no_module_imports_itself_through_others() -> None:
    graph = _graph()
    assert len(graph) > 40  # the walk found the packages
    # A package's __init__ re-exports its modules: edges into it from its own modules are
    # the one allowed way back (they import names the package defines first, not modules).
    for pkg in PACKAGES:
        for m in graph:
            if m.startswith(pkg + "."):
                graph[m].discard(pkg)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


@pytest.mark.parametrize(
    ("lower", "upper"),
    [
        ("tokencache_models", "tokencache_routing"),
        ("tokencache_models", "tokencache_serve"),
        ("tokencache_models", "tokencache_sglang"),
        ("tokencache_routing", "tokencache_serve"),
        ("tokencache_sglang", "tokencache_routing"),
    ],
)
def test_layers_point_one_way(lower: str, upper: str) -> None:
    graph = _graph()
    wrong = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m.split(".")[0] == lower
        for d in deps
        if d.split(".")[0] == upper
    )
    assert not wrong


def test_the_check_sees_a_planted_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
