"""The layout tells the architecture (docs/architecture.md): four wings around a small core, imports one way.

The import graph is read from the source (every `import` and `from ... import`, inside functions too), so a
deferred import cannot hide a circle or an arrow the wrong way."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "optimum_qnn"
BENCHMARKS = PACKAGE.parent / "benchmarks"
MAX_LINES = 500  # docs/architecture.md: a file past it is split along what it does
WINGS = ("exporter", "quantization", "artifacts", "runtime")
# What each wing may import besides the core (config, contract, errors, swap, session, native_output, ops/,
# models/, sdk/): exporter -> quantization -> core; runtime -> artifacts -> core; the exporter also writes artifacts.
MAY_IMPORT = {
    "exporter": {"quantization", "artifacts"},
    "quantization": set(),
    "artifacts": set(),
    "runtime": {"artifacts"},
}
FACES = {"cli", "__main__", "doctor", "__init__"}  # the entry points; they may import anything


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the optimum_qnn modules it imports (a package's import counts as its __init__)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                if t.startswith("optimum_qnn") and t in modules and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 40
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_imports_run_one_way():
    wrong = []
    for module, edges in import_graph().items():
        wing = _wing(module)
        last = module.split(".")[-1]
        if module == "optimum_qnn" or module.count(".") == 1 and last in FACES:
            continue
        for target in edges:
            to = _wing(target)
            if wing is None and to is not None:
                wrong.append(f"core {module} -> {target}")
            elif wing is not None and to is not None and to != wing and to not in MAY_IMPORT[wing]:
                wrong.append(f"{module} -> {target}")
            elif target.count(".") == 1 and target.split(".")[1] in FACES - {"__init__"}:
                wrong.append(f"{module} -> face {target}")
    assert not wrong, "\n".join(sorted(wrong))


def benchmarks_graph() -> dict[str, set[str]]:
    """benchmarks/ script -> the benchmarks/ scripts it imports (they import each other by bare name: the folder is on
    sys.path when one runs)."""
    scripts = {p.stem: p for p in BENCHMARKS.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in scripts.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                edges.add(node.module)
        graph[name] = {e for e in edges if e in scripts and e != name}
    return graph


def test_the_benchmarks_import_each_other_without_a_circle():
    graph = benchmarks_graph()
    assert {"run", "results", "stored", "recipe"} <= set(graph) and graph["results"], graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_file_of_the_package_or_the_benchmarks_is_over_500_lines():
    files = [*PACKAGE.rglob("*.py"), *BENCHMARKS.glob("*.py")]
    assert len(files) > 100
    long = {str(f.relative_to(PACKAGE.parent)): n for f in files if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split each along what it does): {long}"
