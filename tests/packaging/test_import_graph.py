"""The integrations' import graph: no cycles between modules (over all of them, and within
tokencache_routing and tokencache_models each), and the layers point one way
(tokencache_models never imports the routing engine, the server or the SGLang backend; the
routing engine never imports the server). And no module but engine.py reaches into
RoutedEngine's underscore members: the others use its public API and the typed interfaces in
tokencache_routing/core/state.py and core/driver_api.py (RequestDriver, DriverEngine). The
shared types (core/state.py) name no part of the scheduler, not even for annotations: the
scheduler imports them. Within tokencache_routing the
subpackages are layered: core/ imports none of the others, sim/, baselines/ and drivers/ only
core/, nothing but tools/ (and __main__.py, which runs its commands) imports tools/.
Within tokencache_models the foundations (shared_prefix/, forward/, kv/, kernels/, executor/)
never import the network, its loaders, parallel/ or testing/, and only the package's __init__
imports testing/ (it re-exports GreedyRunner).

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


@pytest.mark.parametrize(
    ("package", "least"), [("tokencache_routing", 20), ("tokencache_models", 20)]
)
def test_package_has_no_cycles(package: str, least: int) -> None:
    """Within one package, its __init__ (re-exports) left out: no module leads back to itself."""
    graph = {
        m: {d for d in deps if d.startswith(package + ".")}
        for m, deps in _graph().items()
        if m.startswith(package + ".")
    }
    assert len(graph) >= least  # the walk found the modules
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


RT = "tokencache_routing"
SUBPACKAGES = ("core", "drivers", "sim", "baselines", "tools")
# What each subpackage may import of tokencache_routing (its own modules always): the
# package's __init__ only re-exports, so importing it counts as importing the engine.
MAY_IMPORT = {
    "core": set(),
    "sim": {"core"},
    "baselines": {"core"},
    "drivers": {"core"},
    "tools": {"core", "drivers", "sim", "baselines", "engine", "tp_launch", "__init__"},
}


def _layer(module: str) -> str:
    """tokencache_routing.core.kv -> core; tokencache_routing.engine -> engine;
    tokencache_routing -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_routing_subpackages_are_layered() -> None:
    graph = {m: deps for m, deps in _graph().items() if m.split(".")[0] == RT}
    layers = {_layer(m) for m in graph}
    assert set(SUBPACKAGES) <= layers  # the walk found the subpackages
    wrong = []
    for m, deps in graph.items():
        layer = _layer(m)
        for d in deps:
            if d.split(".")[0] != RT or _layer(d) == layer:
                continue
            target = _layer(d)
            if layer in MAY_IMPORT:
                ok = target in MAY_IMPORT[layer]
            else:  # engine, tp_launch, __init__: anything but tools/; __main__ runs tools/
                ok = target != "tools" or layer == "__main__"
            if not ok:
                wrong.append(f"{m} -> {d}")
    assert not sorted(wrong)


def test_the_layer_check_sees_the_layers() -> None:
    assert _layer("tokencache_routing.core.kv") == "core"
    assert _layer("tokencache_routing.engine") == "engine"
    assert _layer("tokencache_routing") == "__init__"
    graph = _graph()
    assert "tokencache_routing.core.batch" in graph["tokencache_routing.drivers.threaded"]
    assert "tokencache_routing.drivers.events" in graph["tokencache_routing.engine"]


def _reaches(graph: dict[str, set[str]], start: str, target: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        for d in graph.get(todo.pop(), set()):
            if d == target:
                return True
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return False


def test_shared_types_import_no_scheduler_part() -> None:
    """core/state.py's imports, those under TYPE_CHECKING included, reach no module that
    imports it back: the driver interfaces that name the Scheduler live in driver_api.py."""
    tree = ast.parse((ROOT / RT / "core" / "state.py").read_text())
    named = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    graph, state = _graph(), f"{RT}.core.state"
    assert not sorted(m for m in named if m and _reaches(graph, f"{RT}.core.{m}", state))
    assert _reaches(graph, f"{RT}.core.scheduler", state)  # the check can see one


def test_the_engine_parts_name_no_engine() -> None:
    """What engine.py imports of its own level (tp_launch.py, config.py, warm_up.py) names no
    module that imports it back, not even under TYPE_CHECKING: tp_launch.py sees the engine
    through a Protocol of its own (FailsRequests)."""
    graph, engine = _graph(), f"{RT}.engine"
    assert {f"{RT}.tp_launch", f"{RT}.config", f"{RT}.warm_up"} <= graph[engine]
    for name in ("tp_launch", "config", "warm_up"):
        tree = ast.parse((ROOT / RT / f"{name}.py").read_text())
        named = {
            f"{RT}.{n.module}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module
        }
        assert engine not in named, name
        assert not sorted(m for m in named if _reaches(graph, m, engine)), name


MODELS = "tokencache_models"
# What each foundation subpackage of tokencache_models may import of it (its own modules
# always); the network (model, layers, attention), the loaders, parallel/ and testing/ sit above.
MODELS_MAY_IMPORT = {
    "shared_prefix": {"arrays"},
    "forward": {"arrays", "shared_prefix"},
    "kv": {"arrays", "config", "shared_prefix"},
    "kernels": {"forward", "shared_prefix"},
    "executor": {"forward", "kernels", "kv", "shared_prefix"},
}


def test_models_subpackages_are_layered() -> None:
    graph = {m: deps for m, deps in _graph().items() if m.split(".")[0] == MODELS}
    assert set(MODELS_MAY_IMPORT) | {"testing", "parallel"} <= {_layer(m) for m in graph}
    wrong = []
    for m, deps in graph.items():
        layer = _layer(m)
        for d in deps:
            target = _layer(d)
            if d.split(".")[0] != MODELS or target == layer:
                continue
            if layer in MODELS_MAY_IMPORT:
                ok = target in MODELS_MAY_IMPORT[layer]
            else:
                ok = target != "testing" or layer == "__init__"
            if not ok:
                wrong.append(f"{m} -> {d}")
    assert not sorted(wrong)


ENGINE = ROOT / "tokencache_routing" / "engine.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _engine_private_members(source: str) -> set[str]:
    """RoutedEngine's underscore methods and the underscore attributes it sets on self."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RoutedEngine")
    names = {
        n.name
        for n in cls.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(n.name)
    }
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and _private(node.attr)
        ):
            names.add(node.attr)
    return names


def _private_reaches(source: str, private: set[str]) -> list[tuple[int, str]]:
    """(line, name) for each use of one of `private` on anything but self: an attribute
    (x._name) or a name given to getattr / setattr / hasattr / delattr."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in private:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in private
        ):
            found.append((node.lineno, str(node.args[1].value)))
    return sorted(found)


def test_no_module_reaches_into_the_engine() -> None:
    private = _engine_private_members(ENGINE.read_text())
    assert {"_drive_lock", "_inbox", "_flush_aborts", "_events"} <= private  # the walk works
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted(ROOT.rglob("*.py"))
        if path != ENGINE
        for line, name in _private_reaches(path.read_text(), private)
    ]
    assert not wrong, "RoutedEngine's private members used outside engine.py: " + ", ".join(wrong)


def test_the_check_sees_a_planted_reach() -> None:
    private = {"_wait", "_cost"}
    planted = "h._engine._wait(r)\nself._wait()\nsetattr(eng, '_cost', f)\n"
    assert _private_reaches(planted, private) == [(1, "_wait"), (3, "_cost")]
