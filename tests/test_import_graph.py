"""No import cycle inside engine/: every module's imports of other engine modules (at any depth in
the file, function-level imports included) form a graph without cycles. Parts are built before the
object that uses them, so nothing needs to import back."""
from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "engine"


def module_name(path: Path) -> str:
    parts = path.relative_to(ENGINE.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def engine_imports(path: Path) -> set[str]:
    """The engine modules a file imports (`from engine.x import y` names engine.x, or engine.x.y
    when y is itself a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "engine":
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "engine")
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(f): f for f in ENGINE.rglob("*.py")}
    return {name: {d for d in engine_imports(f) if d in files and d != name} for name, f in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_engine_has_no_import_cycle():
    graph = import_graph()
    assert "engine.llm_engine" in graph and "engine.engine_builder" in graph["engine.llm_engine"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in engine/: " + " -> ".join(cycle)
