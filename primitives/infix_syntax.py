"""What an archived expression's text may hold, checked without sympy (``archive.entry``
reads every stored entry with it, and must stay quick to import).

sympy's parser evaluates its text as Python, so an archive from elsewhere must not reach
it with anything but arithmetic and the functions and conditions sympy prints and the Go
printer reads (Piecewise of comparisons, for one).
"""

from __future__ import annotations

import ast

# the language's functions (``primitives.language.INFIX_FUNCTIONS``), the builtins sympy's
# parser reads as Max, Min and Abs, and what sympy's printer writes
INFIX_CALLS = frozenset(
    {"pdiv", "Max", "Min", "sqrt", "Abs", "log", "max", "min", "abs"}
    | {"exp", "floor", "ceiling", "Piecewise", "ITE", "Not", "And", "Or"}
)
_INFIX_NODES = (
    ast.Expression, ast.BinOp, ast.UnaryOp, ast.Call, ast.Name, ast.Constant, ast.Load, ast.Tuple,
    ast.Compare, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.USub, ast.UAdd, ast.BitAnd,
    ast.BitOr, ast.Invert, ast.Gt, ast.GtE, ast.Lt, ast.LtE, ast.Eq, ast.NotEq,
)  # fmt: skip


def check_infix(text: str) -> None:
    """ValueError unless TEXT is arithmetic (+ - * / **) on names and numbers, comparisons
    and calls of ``INFIX_CALLS``: the only text ``primitives.language.parse_infix`` may evaluate."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression ({exc.msg})") from None
    for node in ast.walk(tree):
        if not isinstance(node, _INFIX_NODES):
            raise ValueError(f"not a step-time expression ({type(node).__name__} is not arithmetic)")
        if isinstance(node, ast.Call) and (
            not isinstance(node.func, ast.Name) or node.func.id not in INFIX_CALLS or node.keywords
        ):
            raise ValueError(f"not a step-time expression (calls {ast.unparse(node.func)!r})")
        if isinstance(node, ast.Name) and node.id.startswith("_"):
            raise ValueError(f"not a step-time expression (the name {node.id!r})")
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float)):  # a bool is an int
            raise ValueError(f"not a step-time expression (the constant {node.value!r})")


__all__ = ["INFIX_CALLS", "check_infix"]
