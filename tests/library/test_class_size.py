"""One job per class: no class outside ``tests/`` is longer than :data:`MAX_CLASS_LINES` lines.

The check reads the code with ``ast`` (nothing is imported), from the ``class`` line to the class's last line,
docstrings and blank lines included. There is no allowlist: the sync chain's classes (``Publisher``,
``Subscriber``, ``ShardedPublisher``, ``Replica``), the last ones over the bound, were split by job.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

from tests.helpers import parse_module

ROOT = Path(__file__).resolve().parents[2]
MAX_CLASS_LINES = 250


def python_files() -> list[Path]:
    """``.py`` files outside tests/, hidden folders (.venv, .git), caches and mutmut's copy (mutants/)."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "__pycache__", "node_modules", "mutants")]
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return found


def class_lengths(tree: ast.Module) -> dict[str, int]:
    """Every class in ``tree`` (nested ones as ``Outer.Inner``) with its length in lines."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, outer: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = f"{outer}{child.name}"
                out[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, outer)

    visit(tree, "")
    return out


#: Parsed at collection, before any test starts threads (see :func:`tests.helpers.parse_module`).
LENGTHS = {
    (path.relative_to(ROOT).as_posix(), name): lines
    for path in python_files()
    for name, lines in class_lengths(parse_module(path)).items()
}


def test_no_class_over_250_lines_outside_tests():
    assert ("shared/rlsync/bucket/hf.py", "HfBucket") in LENGTHS and ("env_space/simulator.py", "EnvSimulator") in LENGTHS
    long = {
        f"{path}::{name}": lines
        for (path, name), lines in LENGTHS.items()
        if lines > MAX_CLASS_LINES
    }
    assert not long, f"classes over {MAX_CLASS_LINES} lines: {long}; split them by job"


def test_the_check_counts_classes_and_nested_classes(tmp_path):
    planted = tmp_path / "planted.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    planted.write_text(f"class Long:\n{body}\n\n\ndef f():\n    class Inner:\n        pass\n    return Inner\n")
    lengths = class_lengths(parse_module(planted))
    assert lengths == {"Long": MAX_CLASS_LINES + 1, "Inner": 2}
