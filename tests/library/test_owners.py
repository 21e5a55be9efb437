"""One owner per concept: bucket keys in ``rlsync.layout``, errors under one root in ``rlsync.errors``,
size limits in ``rlsync.limits``.

The checks read the code with ``ast`` (nothing is imported to check it), and each is shown to catch
what it looks for on a planted module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rlsync import errors, layout, limits
from tests.helpers import parse_module

ROOT = Path(__file__).resolve().parents[2]
#: Shipped code: the library, Space support, the three Spaces and the combined app.
SHIPPED = ("shared/rlsync", "env_space", "rollout_space", "trainer_space")
#: Every bucket prefix and key the layout owns (a string constant starting with one of them spells it).
KEY_SPELLINGS = tuple(
    value for name, value in vars(layout).items() if name.isupper() and isinstance(value, str) and name != "MAX_BATCH"
)


def shipped_files() -> list[Path]:
    files = [p for pkg in SHIPPED for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts]
    return [*files, ROOT / "app.py"]


def parse(path: Path) -> ast.Module:
    """The module at ``path``; the shipped ones were parsed at collection (:data:`TREES`), before any test
    starts threads (see :func:`tests.helpers.parse_module`)."""
    return TREES[path] if path in TREES else parse_module(path)


TREES = {path: parse_module(path) for path in shipped_files()}


def docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (modules, classes, functions)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def spells_key(text: str, key: str) -> bool:
    """``text`` is ``key``, or ``key`` followed by more of a key (a digit, a dot or a slash: not ``tasks/s``)."""
    rest = text[len(key):] if text.startswith(key) else None
    return rest is not None and (rest == "" or any(c.isdigit() or c in "./" for c in rest))


def key_spellings(path: Path) -> list[str]:
    """String constants in the module at ``path`` (docstrings aside) that spell a bucket key or prefix."""
    tree = parse(path)
    docs = docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if any(spells_key(node.value, key) for key in KEY_SPELLINGS):
                found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{node.lineno} {node.value!r}")
    return found


def defined_exceptions(path: Path) -> list[tuple[str, list[str]]]:
    """``(class name, base names)`` of the classes in ``path`` whose names say they are errors."""
    tree = parse(path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
            if any(b.endswith(("Error", "Exception")) or b in ("StopRequested", "EvaluatorRefused") for b in bases):
                out.append((node.name, bases))
    return out


def test_every_bucket_key_is_spelled_in_the_layout_module_only():
    offenders = [hit for p in shipped_files() if p.name != "layout.py" for hit in key_spellings(p)]
    assert offenders == []


def test_key_check_catches_a_spelled_prefix(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""A docstring may say tasks/."""\nKEY = "tasks/" + "x"\nOTHER = "deltas/0001.safetensors"\n')
    planted.write_text(planted.read_text() + 'LABEL = "tasks/s"\n')
    assert sorted(hit.split(" ", 1)[1] for hit in key_spellings(planted)) == ["'deltas/0001.safetensors'", "'tasks/'"]


def test_library_exceptions_are_defined_in_the_errors_module_only():
    library = [p for p in (ROOT / "shared/rlsync").rglob("*.py") if "spaces" not in p.parts and p.name != "errors.py"]
    assert [(p.name, cls) for p in library for cls, _ in defined_exceptions(p)] == []


def test_every_shipped_exception_has_the_one_root():
    public = {name: cls for name, cls in vars(errors).items() if isinstance(cls, type) and issubclass(cls, Exception)}
    assert all(issubclass(cls, errors.RlsyncError) for cls in public.values()), public
    # outside the library (Space support, the Spaces), exceptions derive from a class of rlsync.errors
    for path in shipped_files():
        if path.name == "errors.py":
            continue
        for name, bases in defined_exceptions(path):
            assert any(b in public for b in bases), f"{path.relative_to(ROOT)}: {name}{tuple(bases)} is not an RlsyncError"


def test_exception_check_catches_a_class_defined_elsewhere(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("class LooseError(ValueError):\n    pass\n\nclass _Private(Exception):\n    pass\n")
    assert defined_exceptions(planted) == [("LooseError", ["ValueError"])]


@pytest.mark.parametrize(
    ("error", "group", "builtin"),
    [
        (errors.FormatError("x"), errors.RefusedObjectError, ValueError),
        (errors.HashMismatchError("x"), errors.RefusedObjectError, None),
        (errors.ChainError("x"), errors.RefusedObjectError, None),
        (errors.ObjectTooLargeError("x"), errors.RefusedObjectError, None),
        (errors.InvalidKeyError("x"), errors.RefusedObjectError, ValueError),
        (errors.CheckpointError("x"), errors.RefusedObjectError, ValueError),
        (errors.FileTooLargeError("x"), errors.RefusedObjectError, OSError),
        (errors.NotRegularFileError("x"), errors.RefusedObjectError, OSError),
        (errors.TransientBucketError("x", retry_after=2.0), errors.RetryableError, None),
        (errors.RetryableHttpError("x", status=503), errors.RetryableError, None),
        (errors.FencedError("x"), errors.StopRoleError, None),
        (errors.RunLockedError("x"), errors.StopRoleError, None),
        (errors.RunExistsError("x"), errors.StopRoleError, None),
        (errors.StopRequested("x"), errors.StopRoleError, RuntimeError),
        (errors.ObjectNotFoundError("x"), errors.BucketError, KeyError),
    ],
)
def test_errors_are_grouped_by_what_the_caller_does(error, group, builtin):
    """A role catches a group; the names users caught before (and the builtins) still catch the same errors."""
    assert isinstance(error, group) and isinstance(error, errors.RlsyncError)
    assert builtin is None or isinstance(error, builtin)
    with pytest.raises(group):
        raise error


def test_the_groups_do_not_overlap_where_the_caller_would_act_twice():
    for refused in (errors.FormatError, errors.ChainError, errors.ObjectTooLargeError):
        assert not issubclass(refused, (errors.RetryableError, errors.StopRoleError))
    assert not issubclass(errors.TransientBucketError, errors.RefusedObjectError)
    assert str(errors.ObjectNotFoundError("k missing")) == "k missing"  # not KeyError's quoted form


def test_byte_limits_are_defined_in_the_limits_module_only():
    offenders = []
    for path in shipped_files():
        if path.name == "limits.py":
            continue
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.startswith("MAX_") and target.id.endswith("_BYTES"):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {target.id}")
    assert offenders == []
    assert limits.MAX_POINTER_BYTES >= limits.MAX_CONTROL_BYTES > 0


@pytest.mark.parametrize(("step", "epoch"), [(0, 0), (11, 3), (10**12 - 1, 9999)])
def test_layout_builders_and_patterns_agree(step, epoch):
    anchor = layout.ANCHOR_FILE.fullmatch(f"{layout.anchor_folder(step, epoch)}/model.safetensors")
    assert anchor is not None and (int(anchor.group(1)), int(anchor.group(2))) == (step, epoch)
    delta = layout.DELTA_FILE.fullmatch(layout.delta_key(step, epoch))
    assert delta is not None and (int(delta.group(1)), int(delta.group(2))) == (step, epoch)
    part = layout.DELTA_FILE.fullmatch(layout.delta_part_key(step, epoch, 2, 4))
    assert part is not None and part.group(3, 4) == ("00003", "00004")


def test_exchange_keys_round_trip_and_refuse_bad_ids():
    assert layout.batch_of(layout.task_key(5)) == 5
    assert layout.batch_of(layout.score_key(7, "r-1")) == 7 and layout.replica_of(layout.score_key(7, "r-1")) == "r-1"
    assert layout.batch_of("tasks/5.json") is None and layout.batch_of("tasks/0000000005.x.json") is None
    assert layout.replica_of("rollouts/0000000001/...json") is None
    for bad in ("", ".", "..", "a/b", "x" * 65, 5):
        assert not layout.is_id(bad)
        with pytest.raises(ValueError):
            layout.check_id(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        layout.task_key(layout.MAX_BATCH + 1)
