"""The shape of the code: small modules, short functions, no import cycle, and pipelines
that never reach back into the facade. (The public names are tested beside what they
name: tests/test_state.py and tests/test_launcher.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _python_files() -> list[Path]:
    return sorted(p for d in ("src", "bench", "tests") for p in (ROOT / d).rglob("*.py"))


def test_no_module_or_function_is_too_long():
    too_long = []
    for path in _python_files():
        text = path.read_text()
        where = path.relative_to(ROOT)
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{where}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{where}:{node.lineno} {node.name}(): {lines} lines")
    assert not too_long, "split these:\n" + "\n".join(too_long)


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Which unbroken modules each one imports, anywhere in it (inside functions and
    under TYPE_CHECKING too: a cycle there is still two rooms that need each other)."""
    paths = sorted(SRC.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                subs = {f"{node.module}.{a.name}" for a in node.names}
                deps.update(subs & modules)
                if subs - modules:  # names defined in the module itself
                    deps.add(node.module)
        me = _module_name(path)
        graph[me] = deps - {me}
    return graph


def test_no_import_cycle():
    graph = _import_graph()
    cycles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for dep in sorted(graph[node]):
                if dep == start:
                    cycles.append(" -> ".join([*path, dep]))
                elif dep not in seen and dep.startswith("unbroken"):
                    seen.add(dep)
                    stack.append((dep, [*path, dep]))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_library_pipelines_never_import_the_facade():
    graph = _import_graph()
    users = {m for m, deps in graph.items() if "unbroken.checkpointer" in deps}
    assert users <= {"unbroken", "unbroken.offline", "unbroken.cli"}, users
