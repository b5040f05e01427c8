"""The shape of the code: small modules, short functions, no import cycle, pipelines that
never reach back into the facade, and wings whose dependencies go one way. (The public
names are tested beside what they name: tests/test_state.py and tests/test_launcher.py.)"""

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
    assert users <= {"unbroken", "unbroken.format.offline", "unbroken.cli.main"}, users


# The top level holds the public API; the wings are its subpackages. Lowest first: a part
# may import only parts before it (one way, so no two wings ever need each other).
ORDER = (
    *("errors", "access", "tree", "state", "policies", "retention", "preemption", "options"),
    *("job", "run", "storage", "format", "sdc", "memory", "restoring", "healing", "saving"),
    *("dcp", "lightning", "megatron", "checkpointer", "unbroken", "hf", "torchtitan"),
    *("goodput", "data", "demo", "cli"),
    "__main__",
)
# A warm spare imports the whole library ahead of its assignment, to be ready sooner.
PRELOADS = {("unbroken.run.spare", "unbroken")}


def _part(module: str) -> str:
    """The wing a module belongs to, or the top-level module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "unbroken"


def _crossings() -> list[tuple[str, str]]:
    graph = _import_graph()
    return [
        (m, d)
        for m, deps in graph.items()
        for d in deps
        if _part(m) != _part(d) and (m, d) not in PRELOADS
    ]


def _wings() -> list[str]:
    return sorted(p.parent.name for p in (SRC / "unbroken").glob("*/__init__.py"))


def _declared(wing: str, label: str) -> set[str]:
    doc = ast.get_docstring(ast.parse((SRC / "unbroken" / wing / "__init__.py").read_text()))
    assert doc and f"\n{label}:" in f"\n{doc}", f"unbroken.{wing}: its docstring names no {label}"
    text = f"{doc}\n".split(f"{label}:", 1)[1].split(".\n", 1)[0]
    names = (w.split("(")[0].strip() for w in text.replace("\n", " ").split(","))
    return {name for name in names if name}


def test_every_part_of_the_package_has_a_place_in_the_order():
    tops = {p.stem for p in (SRC / "unbroken").glob("*.py")} - {"__init__"}
    assert set(ORDER) == tops | set(_wings()) | {"unbroken"}


def test_dependencies_between_wings_go_one_way():
    rank = {part: i for i, part in enumerate(ORDER)}
    upward = [f"{m} -> {d}" for m, d in _crossings() if rank[_part(d)] > rank[_part(m)]]
    assert not upward, "these import a later wing (move the code down, or hand it in):\n" + (
        "\n".join(sorted(upward))
    )


def test_each_wing_imports_only_what_its_docstring_allows():
    wrong = [
        f"{m} -> {d}"
        for m, d in _crossings()
        if _part(m) in _wings() and _part(d) not in _declared(_part(m), "May import")
    ]
    assert not wrong, "not in the importing wing's 'May import':\n" + "\n".join(sorted(wrong))


def test_other_wings_enter_a_wing_through_its_entry_points():
    """Interop and the facade use a wing's named entry points, never its inner rooms."""
    wrong = []
    for m, d in _crossings():
        wing, inner = _part(d), d.split(".")[2:]
        if wing in _wings() and inner and inner[0] not in _declared(wing, "Entry points"):
            wrong.append(f"{m} -> {d}")
    assert not wrong, "not a named entry point of its wing:\n" + "\n".join(sorted(wrong))
