"""Keeping completion text from running as code in the evaluators that scorers call.

Some reasoning-gym verifiers hand the model's answer to an evaluator: sympy's
``parse_expr`` (countdown, puzzle24, polynomial_multiplication, simple_integration,
intermediate_integration; math-verify and ``sympify`` of a string too), whose last step
is Python's ``eval``, or Python's ``eval`` itself (string_insertion, spiral_matrix,
binary_matrix, n_queens, which try the answer as a Python list). Either runs
``__import__('os').system(...)``. :func:`guard_evaluators` puts a check in front of both:

- ``parse_expr`` (every caller, through ``sympy.parsing.sympy_parser.stringify_expr``):
  ASCII text of numbers, operators, brackets and names only; a name must be the
  caller's own (``local_dict``), unknown to sympy (it becomes a ``Symbol``), or a
  mathematical function or constant of sympy's namespace; no strings, attribute
  access, keywords, underscores, assignments or subscripts;
- ``eval`` as reasoning-gym's modules see it: a Python literal or arithmetic on literals
  (what those verifiers expect: lists of numbers or strings), evaluated without builtins.

Refused text raises ``ValueError`` (``EvaluatorRefused``), which the verifiers already
treat as a wrong answer. The check bounds *what* runs, not how long: ``9**9**9**9`` is
arithmetic; the simulator's confined child (:mod:`env_space.isolation`) bounds time and memory.
"""

from __future__ import annotations

import ast
import builtins
import io
import keyword
import sys
import tokenize
from typing import Any

from sympy.core.function import FunctionClass
from sympy.parsing import sympy_parser

from rlsync.errors import RefusedObjectError

__all__ = ["EvaluatorRefused", "check_literal", "check_sympy_text", "guard_evaluators"]

#: sympy names that are values, plain functions or unevaluated operators rather than ``Function`` classes.
_SYMPY_VALUES = frozenset({
    "pi", "E", "I", "oo", "zoo", "nan", "sqrt", "cbrt", "root", "Rational", "Integer", "Float",
    "Integral", "Derivative", "Sum", "Product", "Limit",
})  # fmt: skip
_FORBIDDEN_OPS = frozenset({".", "=", ":", ":=", ";", "@", "[", "]", "{", "}", "->", "...", "`"}) | {
    op + "=" for op in ("+", "-", "*", "/", "//", "%", "**", "&", "|", "^", "<<", ">>", "@")
}
_LITERAL_NODES = (
    ast.Expression, ast.Constant, ast.List, ast.Tuple, ast.Set, ast.UnaryOp, ast.BinOp, ast.Load,
    ast.operator, ast.unaryop,
)  # fmt: skip
_original_eval = builtins.eval


class EvaluatorRefused(RefusedObjectError, ValueError):
    """Text that would run as code, refused before it reaches an evaluator."""


def check_sympy_text(text: str, local_dict: dict[str, Any], global_dict: dict[str, Any]) -> None:
    """Check what ``parse_expr`` is about to evaluate (see the module docstring).

    Raises:
        EvaluatorRefused: Anything but a mathematical expression.
    """
    if not text.isascii():
        raise EvaluatorRefused("non-ASCII text")
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text.strip()).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError) as exc:
        raise EvaluatorRefused(f"does not tokenize: {exc}") from None
    for tok in tokens:
        if tok.type == tokenize.STRING or (tok.type == tokenize.OP and tok.string in _FORBIDDEN_OPS):
            raise EvaluatorRefused(f"{tok.string[:20]!r} is not part of an expression")
        if tok.type == tokenize.NAME and not _sympy_name_ok(tok.string, local_dict, global_dict):
            raise EvaluatorRefused(f"name {tok.string[:20]!r} is not allowed in an expression")
        if tok.type == tokenize.ERRORTOKEN and not tok.string.isspace() and tok.string != "!":
            raise EvaluatorRefused(f"{tok.string[:20]!r} is not part of an expression")


def _sympy_name_ok(name: str, local_dict: dict[str, Any], global_dict: dict[str, Any]) -> bool:
    if name.startswith("_") or (keyword.iskeyword(name) and name not in ("True", "False", "None")):
        return False
    if name in local_dict or name not in global_dict:
        return True  # the caller's own, or a new Symbol
    value = global_dict[name]
    return isinstance(value, FunctionClass) or name in _SYMPY_VALUES or name in ("True", "False", "None")


def check_literal(text: str) -> ast.Expression:
    """Check what a verifier hands ``eval``: a Python literal, or arithmetic on literals.

    Returns:
        The parsed expression.

    Raises:
        EvaluatorRefused: Names, calls, attributes, subscripts, comprehensions, f-strings, ...
    """
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise EvaluatorRefused(f"not a Python literal: {type(exc).__name__}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _LITERAL_NODES):
            raise EvaluatorRefused(f"{type(node).__name__} is not part of a literal")
    return tree


def guarded_eval(source: Any, globals: Any = None, locals: Any = None) -> Any:  # noqa: A002 - eval's own names
    """``eval`` for reasoning-gym's modules: text must pass :func:`check_literal`; it runs without builtins."""
    if isinstance(source, (str, bytes)):
        text = source.decode() if isinstance(source, bytes) else source
        return _original_eval(compile(check_literal(text), "<answer>", "eval"), {"__builtins__": {}}, {})
    return _original_eval(source, globals, locals)


_original_stringify = sympy_parser.stringify_expr


def _guarded_stringify(s: str, local_dict: Any, global_dict: Any, transformations: Any) -> str:
    check_sympy_text(s, local_dict or {}, global_dict or {})
    return _original_stringify(s, local_dict, global_dict, transformations)


def guard_evaluators() -> None:
    """Install both checks in this process (idempotent): sympy's ``parse_expr``, and ``eval`` in every
    loaded ``reasoning_gym`` module. Call it after importing reasoning-gym."""
    sympy_parser.stringify_expr = _guarded_stringify
    for name, module in list(sys.modules.items()):
        if (name == "reasoning_gym" or name.startswith("reasoning_gym.")) and module is not None:
            module.eval = guarded_eval  # a module global shadows the builtin for that module's code

