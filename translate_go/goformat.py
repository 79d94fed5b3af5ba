"""gofmt's layout of a single-line Go expression, without running gofmt.

gofmt spaces binary operators depending on the precedences mixed in an expression and
on its nesting depth (``a + b*c``, but ``math.Max(a, b+c)``), and drops doubled
parentheses. The generated code must be gofmt-clean even where no Go toolchain is
installed, so this module parses the small expression language the printer emits
(identifiers, selectors, calls, float literals, unary ``- + !``, binary operators,
parentheses) and re-prints it with the rules of ``go/printer`` (nodes.go:
``binaryExpr``, ``cutoff``, ``walkBinary``, ``diffPrec``, ``reduceDepth``).
Tests compare its output with real gofmt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREC = {
    "||": 1, "&&": 2,
    "==": 3, "!=": 3, "<": 3, "<=": 3, ">": 3, ">=": 3,
    "+": 4, "-": 4, "|": 4, "^": 4,
    "*": 5, "/": 5, "%": 5, "<<": 5, ">>": 5, "&": 5, "&^": 5,
}  # fmt: skip
UNARY_PREC = 6
LOWEST_PREC = 0

_TOKEN = re.compile(
    r"\s*(?:(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)"
    r"|(?P<op>&&|\|\||==|!=|<=|>=|<<|>>|&\^|[-+*/%<>!()&|^,]))"
)


@dataclass
class _Leaf:
    text: str


@dataclass
class _Unary:
    op: str
    x: object


@dataclass
class _Binary:
    op: str
    x: object
    y: object


@dataclass
class _Paren:
    x: object


@dataclass
class _Call:
    fun: str
    args: list


def _tokenize(text: str) -> list[str]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"cannot tokenize Go expression at {text[pos:]!r}")
        out.append(m.group(m.lastgroup))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, tokens: list[str]):
        self.toks = tokens
        self.i = 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise ValueError(f"expected {expected!r}, got {tok!r}")
        self.i += 1
        return tok

    def expr(self, min_prec: int = 1):
        left = self.unary()
        while (tok := self.peek()) in PREC and PREC[tok] >= min_prec:
            self.take()
            left = _Binary(tok, left, self.expr(PREC[tok] + 1))
        return left

    def unary(self):
        if self.peek() in ("-", "+", "!", "^"):
            return _Unary(self.take(), self.unary())
        return self.primary()

    def primary(self):
        tok = self.take()
        if tok == "(":
            inner = self.expr()
            self.take(")")
            node = _Paren(inner)
        elif tok[0].isalpha() or tok[0] == "_":
            node = _Leaf(tok)
        elif tok[0].isdigit() or tok[0] == ".":
            return _Leaf(tok)
        else:
            raise ValueError(f"unexpected {tok!r}")
        while self.peek() == "(":  # calls, possibly chained: float64(len(x))
            self.take("(")
            args = []
            if self.peek() != ")":
                args.append(self.expr())
                while self.peek() == ",":
                    self.take(",")
                    args.append(self.expr())
            self.take(")")
            node = _Call(_render(node), args)
        return node


def _walk_binary(e: _Binary) -> tuple[bool, bool, int]:
    has4 = PREC[e.op] == 4
    has5 = PREC[e.op] == 5
    max_problem = 0
    if isinstance(e.x, _Binary) and not PREC[e.x.op] < PREC[e.op]:
        h4, h5, mp = _walk_binary(e.x)
        has4, has5, max_problem = has4 or h4, has5 or h5, max(max_problem, mp)
    if isinstance(e.y, _Binary):
        if not PREC[e.y.op] <= PREC[e.op]:
            h4, h5, mp = _walk_binary(e.y)
            has4, has5, max_problem = has4 or h4, has5 or h5, max(max_problem, mp)
    elif isinstance(e.y, _Unary):
        pair = e.op + e.y.op
        if pair in ("/*", "&&", "&^"):
            max_problem = 5
        elif pair in ("++", "--"):
            max_problem = max(max_problem, 4)
    return has4, has5, max_problem


def _cutoff(e: _Binary, depth: int) -> int:
    has4, has5, max_problem = _walk_binary(e)
    if max_problem > 0:
        return max_problem + 1
    if has4 and has5:
        return 5 if depth == 1 else 4
    return 6 if depth == 1 else 4


def _diff_prec(x, prec: int) -> int:
    return 0 if isinstance(x, _Binary) and PREC[x.op] == prec else 1


def _reduce_depth(depth: int) -> int:
    return max(depth - 1, 1)


def _join(a: str, b: str) -> str:
    # go/printer separates tokens that would otherwise combine (x - -y, a / *p).
    if a and b and (a[-1] + b[0]) in ("--", "++", "/*", "<-", "<<", "&&", "&^"):
        return a + " " + b
    return a + b


def _expr1(node, prec1: int, depth: int) -> str:
    if isinstance(node, _Leaf):
        return node.text
    if isinstance(node, _Binary):
        return _binary(node, prec1, _cutoff(node, depth), depth)
    if isinstance(node, _Unary):
        if UNARY_PREC < prec1:
            return "(" + _expr1(node, LOWEST_PREC, depth) + ")"
        return _join(node.op, _expr1(node.x, UNARY_PREC, depth))
    if isinstance(node, _Paren):
        if isinstance(node.x, _Paren):  # gofmt drops doubled parentheses
            return _expr1(node.x, LOWEST_PREC, depth)
        return "(" + _expr1(node.x, LOWEST_PREC, _reduce_depth(depth)) + ")"
    if isinstance(node, _Call):
        d = depth + 1 if len(node.args) > 1 else depth
        return node.fun + "(" + ", ".join(_expr1(a, LOWEST_PREC, d) for a in node.args) + ")"
    raise TypeError(node)  # pragma: no cover


def _binary(x: _Binary, prec1: int, cutoff: int, depth: int) -> str:
    prec = PREC[x.op]
    if prec < prec1:  # pragma: no cover - parsed source always has ParenExpr here
        return "(" + _expr1(x, LOWEST_PREC, _reduce_depth(depth)) + ")"
    blank = prec < cutoff
    left = _expr1(x.x, prec, depth + _diff_prec(x.x, prec))
    right = _expr1(x.y, prec + 1, depth + 1)
    if blank:
        return f"{left} {x.op} {right}"
    return _join(_join(left, x.op), right)


def _render(node) -> str:
    return _expr1(node, LOWEST_PREC, 1)


def format_go_expr(text: str, depth: int = 1) -> str:
    """TEXT laid out as gofmt prints it in a statement (depth 1: assignment, return, if)."""
    parser = _Parser(_tokenize(text))
    node = parser.expr()
    if parser.peek() is not None:
        raise ValueError(f"trailing tokens in Go expression {text!r}")
    return _expr1(node, LOWEST_PREC, depth)


__all__ = ["format_go_expr"]
