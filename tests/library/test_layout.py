"""The project's layout: the sync library never imports the Space layer, nothing shipped imports the test
tooling, no import cycles, no long files.

Imports are read with ``ast`` from every module of the project (function-local and
``TYPE_CHECKING`` imports included, relative imports resolved), so nothing is imported
to check them.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

from tests.helpers import parse_module

ROOT = Path(__file__).resolve().parents[2]
#: Top-level packages of the project (tests/ is checked for cycles too, but may import anything).
PACKAGES = ("shared/rlsync", "env_space", "rollout_space", "trainer_space", "benchmarks", "testing", "tests")
#: The Space layer: what the sync library (``rlsync`` minus ``rlsync.spaces``) must not import.
SPACE_LAYER = ("rlsync.spaces", "env_space", "rollout_space", "trainer_space")
#: Test tooling (stand-ins, fault injectors, the soak): what neither the library nor a Space may import.
TEST_TOOLING = ("testing",)
MAX_LINES = 600


def module_name(path: Path) -> str:
    """``shared/rlsync/protocol/__init__.py`` -> ``rlsync.protocol``, ``shared/rlsync/format.py`` -> ``rlsync.format``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "shared":  # the library's distribution folder: shared/rlsync/... is rlsync...
        parts.pop(0)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every Python module of the project packages plus the top-level ``app.py``."""
    found = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts}
    found["app"] = ROOT / "app.py"
    return found


def imported_names(path: Path, name: str) -> set[str]:
    """Absolute names of every import in the module at ``path`` (any depth, relative ones resolved).

    ``from pkg import x`` yields both ``pkg`` and ``pkg.x`` (``x`` may be a submodule).
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(parse_module(path)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (each import resolved to the deepest project module)."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for target in imported_names(path, name):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def in_layer(module: str, layer: tuple[str, ...]) -> bool:
    return any(module == top or module.startswith(top + ".") for top in layer)


def test_sync_library_never_imports_the_space_layer():
    graph = import_graph()
    library = [m for m in graph if in_layer(m, ("rlsync",)) and not in_layer(m, ("rlsync.spaces",))]
    assert "rlsync.format" in library and "rlsync.protocol.publisher" in library  # the walk found the library
    bad = {m: sorted(t for t in graph[m] if in_layer(t, SPACE_LAYER)) for m in library}
    assert not {m: t for m, t in bad.items() if t}, "the sync library imports the Space layer"


def test_space_support_layer_knows_no_space_folder():
    graph = import_graph()
    support = [m for m in graph if in_layer(m, ("rlsync.spaces",))]
    assert "rlsync.spaces.tiny_model" in support
    spaces = ("env_space", "rollout_space", "trainer_space")
    bad = {m: sorted(t for t in graph[m] if in_layer(t, spaces)) for m in support}
    assert not {m: t for m, t in bad.items() if t}, "shared/rlsync/spaces/ imports a Space folder"


def test_nothing_shipped_imports_the_test_tooling():
    """The library (Space support included), the Space folders and the combined app never import ``testing``."""
    graph = import_graph()
    shipped = [m for m in graph if in_layer(m, ("rlsync", *SPACE_LAYER, "app"))]
    assert "rlsync.bucket" in shipped and "trainer_space.app" in shipped and "app" in shipped
    assert "testing.faulty" in graph["testing.soak.kinds.flaky_storage"]  # the walk sees the tooling's imports
    bad = {m: sorted(t for t in graph[m] if in_layer(t, TEST_TOOLING)) for m in shipped}
    assert not {m: t for m, t in bad.items() if t}, "shipped code imports the test tooling (testing/)"


def test_no_import_cycles():
    graph = import_graph()
    assert "rlsync.vllm.target" in graph["rlsync.vllm.transfer"]
    assert not cycles(graph)


def test_checks_catch_what_they_look_for(tmp_path):
    """The import reader sees function-local and relative imports, and the cycle finder finds a cycle."""
    pkg = tmp_path / "shared"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    module = pkg / "format.py"
    module.write_text("def f():\n    from .spaces import ui\n    import env_space.environments\n")
    names = imported_names(module, "rlsync.format")
    assert {"rlsync.spaces", "rlsync.spaces.ui", "env_space.environments"} <= names
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def source_files(suffixes: tuple[str, ...]) -> list[Path]:
    """Files with these suffixes outside tests/, hidden folders (.venv, .git), caches and mutmut's copy (mutants/)."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "__pycache__", "node_modules", "mutants")]
        found += [Path(folder) / f for f in files if f.endswith(suffixes)]
    return found


def test_no_source_file_over_600_lines_outside_tests():
    sources = source_files((".py", ".sh"))
    assert ROOT / "shared" / "rlsync" / "format.py" in sources and ROOT / "scripts" / "setup.sh" in sources
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"source files over {MAX_LINES} lines: {long}"
