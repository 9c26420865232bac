"""No import cycle between modules inside engine/ or inside tui/, counting every import statement.

import-linter sees module-level imports only; a circle held together by an import under ``if TYPE_CHECKING``
or inside a function is still a circle to a reader. This test parses each file of engine/ and tui/ with ast
and follows every import statement wherever it sits.
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "engine"
TUI = REPO / "tui"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path) -> dict[str, Path]:
    return {module_name(p): p for p in sorted(root.rglob("*.py"))}


def engine_modules() -> dict[str, Path]:
    return package_modules(ENGINE)


def imported_modules(name: str, source: str, known: set[str], is_package: bool = False) -> set[str]:
    """The modules of ``known`` one file imports, at any depth of its syntax tree."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]  # `import engine.x.y` binds engine; name what exists
            if target and target != name:
                out.add(target)
    return out


def import_graph(root: Path = ENGINE) -> dict[str, set[str]]:
    """Every module's imports. The parse runs with the collector paused, after a full collection: on CPython
    before 3.11.8 (gh-106905) a finalizer that a GC pass runs in the middle of ast.parse and that raises (an
    earlier test's asyncio transport, closing after its loop) fails the parse with "AST constructor recursion
    depth mismatch"."""
    modules = package_modules(root)
    known = set(modules)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return {
            name: imported_modules(name, path.read_text(encoding="utf-8"), known, path.name == "__init__.py")
            for name, path in modules.items()
        }
    finally:
        if was_enabled:
            gc.enable()


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_graph_sees_imports_inside_functions_and_type_checking_blocks() -> None:
    known = set(engine_modules())
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from engine.host import procs\n"
        "def f():\n    import engine.protocol\n"
        "def g():\n    from ..supervisor.records import read_run\n"
    )
    edges = imported_modules("engine.agent.probe", source, known)
    assert edges == {"engine.host.procs", "engine.protocol", "engine.supervisor.records"}


def test_a_circle_is_found_whatever_its_length() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]


def test_no_import_cycle_inside_engine() -> None:
    found = sorted(sorted(c) for c in cycles(import_graph()))
    assert found == [], f"import cycles inside engine/: {found}"


def test_the_tui_graph_sees_the_dashboard_imported_inside_a_function() -> None:
    """``connect`` imports the dashboard inside its function (textual stays out of headless commands)."""
    graph = import_graph(TUI)
    assert "tui.dashboard.app" in graph["tui.__main__"]
    assert {"tui.cli.run", "tui.cli.monitor"} <= graph["tui.__main__"]


def test_no_import_cycle_inside_tui() -> None:
    found = sorted(sorted(c) for c in cycles(import_graph(TUI)))
    assert found == [], f"import cycles inside tui/: {found}"
