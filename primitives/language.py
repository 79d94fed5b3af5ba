"""The candidate language: operators, programs, vectorised evaluation and sympy.

A *program* is a tuple of tokens in prefix order, the picklable form of a DEAP tree:
``("op", name)`` for an operator, ``("var", primitive_name)`` for a terminal and
``("const", value)`` for a constant. Each operator is defined once here, with its
numpy implementation (protected, so NaN and inf never escape from bad inputs), its
scalar form (compiled by ``fitness.fused`` into the fused evaluator; same values as the
numpy form, NaN included), its sympy form (read by the archive, the simplifier and the
Go printer) and its Go form (printed by ``translate_go``).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import sympy as sp
from sympy.printing.str import StrPrinter

from primitives.infix_syntax import INFIX_CALLS, check_infix
from primitives.registry import CONSTANT_UNITS, PRIMITIVE_BY_NAME

PDIV_EPS = 1e-9
Token = tuple  # ("op", name) | ("var", name) | ("const", float)
Program = tuple  # tuple[Token, ...] in prefix order


# --- protected numpy kernels (module-level so that they pickle) -----------------
def np_pdiv(x, y):
    """x / y where |y| > 1e-9, else 0: a step with no work to divide by adds nothing."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    ok = np.abs(y) > PDIV_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.where(ok, x / np.where(ok, y, 1.0), 0.0)


def add(a, b):  # floats (the scalar form) and sympy expressions (the sympy form) alike
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return a * b


def scalar_pdiv(x: float, y: float) -> float:
    return x / y if abs(y) > PDIV_EPS else 0.0


def scalar_max(a, b):
    return a if (a >= b or a != a) else b  # a NaN wins, as in np.maximum


def scalar_min(a, b):
    return a if (a <= b or a != a) else b


def scalar_psqrt(x):
    return math.sqrt(abs(x))


def float_bits(x: float) -> int:
    """The IEEE-754 bits of a float64 as int64 (``fitness.fused`` compiles it to a bitcast)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


# fdlibm's log (e_log.c): ln 2 in two parts and the minimax polynomial of log((1+s)/(1-s))
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10
_LG1, _LG2, _LG3 = 6.666666666666735130e-01, 3.999999999940941908e-01, 2.857142874366239149e-01
_LG4, _LG5, _LG6, _LG7 = (
    2.222219843214978396e-01,
    1.818357216161805012e-01,
    1.531383769920937332e-01,
    1.479819860511658591e-01,
)


def scalar_plog(x):
    """log1p(|x|) within 2 ulps of numpy's, without library calls so that a compiler
    vectorises it (numpy's own log1p is vectorised): fdlibm's log (e_log.c, < 1 ulp) of
    u = 1 + a, scaled by a / (u - 1) to cancel the rounding of 1 + a (Goldberg, "What every
    computer scientist should know about floating-point arithmetic")."""
    a = abs(x)
    u = 1.0 + a
    if not u < math.inf:  # inf and NaN
        return u
    if u == 1.0:
        return a
    b = float_bits(u)
    hx = (b >> 32) & 0x000FFFFF
    i = (hx + 0x95F64) & 0x100000  # mantissa into [sqrt(2)/2, sqrt(2))
    k = ((b >> 52) - 1023) + (i >> 20)
    f = bits_float(((hx | (i ^ 0x3FF00000)) << 32) | (b & 0xFFFFFFFF)) - 1.0
    s = f / (2.0 + f)
    dk = float(k)
    z = s * s
    w = z * z
    r = z * (_LG1 + w * (_LG3 + w * (_LG5 + w * _LG7))) + w * (_LG2 + w * (_LG4 + w * _LG6))
    hfsq = 0.5 * f * f
    if ((hx - 0x6147A) | (0x6B851 - hx)) > 0:
        log_u = dk * _LN2_HI - ((hfsq - (s * (hfsq + r) + dk * _LN2_LO)) - f)
    else:
        log_u = dk * _LN2_HI - ((s * (f - r) - dk * _LN2_LO) - f)
    return log_u * (a / (u - 1.0))


def np_psqrt(x):
    return np.sqrt(np.abs(x))


def np_plog(x):
    return np.log1p(np.abs(x))


class pdiv(sp.Function):  # noqa: N801 - printed name is the function name
    """Protected division, opaque to simplification: pdiv(x, y) = x/y if |y| > 1e-9 else 0."""

    nargs = 2

    @classmethod
    def eval(cls, x, y):
        if y.is_Number:
            return x / y if abs(float(y)) > PDIV_EPS else sp.Integer(0)
        return None  # stays opaque for symbolic y

    def _eval_evalf(self, prec):
        x, y = (a.evalf(prec) for a in self.args)
        if y.is_Number:
            return (x / y if abs(float(y)) > PDIV_EPS else sp.Integer(0)).evalf(prec)
        return None


# Go source of pdiv (the exported step_time.go carries this text verbatim).
PDIV_GO = """// pdiv is protected division, as in primitives/language.py: x/y where |y| > 1e-9, else 0.
func pdiv(x, y float64) float64 {
	if math.Abs(y) > 1e-9 {
		return x / y
	}
	return 0
}
"""


@dataclass(frozen=True)
class Operator:
    name: str
    arity: int
    numpy_fn: Callable
    scalar_fn: Callable  # one row at a time: the form the fused evaluator compiles
    sympy_fn: Callable
    commutative: bool
    # Go form: a format string over the operands' Go code ({0}, {1}). add/sub/mul are
    # Go's own infix operators, which the printer writes from sympy's Add/Mul.
    go: str
    go_helper: str = ""  # Go source of the function ``go`` calls, emitted only when used


def _sp_psqrt(x):
    return sp.sqrt(sp.Abs(x))


def _sp_plog(x):
    return sp.log(1 + sp.Abs(x))


OPERATORS: dict[str, Operator] = {
    op.name: op
    for op in (
        Operator("add", 2, np.add, add, add, True, "{0} + {1}"),
        Operator("sub", 2, np.subtract, sub, sub, False, "{0} - {1}"),
        Operator("mul", 2, np.multiply, mul, mul, True, "{0} * {1}"),
        Operator("pdiv", 2, np_pdiv, scalar_pdiv, pdiv, False, "pdiv({0}, {1})", PDIV_GO),
        Operator("max", 2, np.maximum, scalar_max, sp.Max, True, "math.Max({0}, {1})"),
        Operator("min", 2, np.minimum, scalar_min, sp.Min, True, "math.Min({0}, {1})"),
        Operator("psqrt", 1, np_psqrt, scalar_psqrt, _sp_psqrt, False, "math.Sqrt(math.Abs({0}))"),
        Operator("plog", 1, np_plog, scalar_plog, _sp_plog, False, "math.Log(1.0 + math.Abs({0}))"),
    )
}


# numpy names for lambdify of archived sympy expressions (arrays), and scalar ones
LAMBDIFY_MODULES = [{"pdiv": np_pdiv, "Max": np.maximum, "Min": np.minimum}, "numpy"]
SCALAR_MODULES = [{"pdiv": scalar_pdiv, "Max": max, "Min": min}, "math"]


# --- programs -----------------------------------------------------------------
def scaled_expression(expression: str, factor: float) -> str:
    """EXPRESSION (infix) with its value times FACTOR: a what-if of a model's step time."""
    return f"{factor!r}*({expression})"


def subtree_end(program: Program, start: int) -> int:
    """Index one past the subtree rooted at ``start``."""
    need = 1
    i = start
    while need:
        kind, value = program[i]
        need += OPERATORS[value].arity - 1 if kind == "op" else -1
        i += 1
    return i


def children(program: Program, start: int = 0) -> list[tuple[int, int]]:
    """(start, end) spans of the children of the node at ``start``."""
    kind, value = program[start]
    if kind != "op":
        return []
    spans = []
    i = start + 1
    for _ in range(OPERATORS[value].arity):
        j = subtree_end(program, i)
        spans.append((i, j))
        i = j
    return spans


def additive_terms(program: Program) -> list[Program]:
    """Flatten the root's chain of ``add`` into terms (the linear-scaling basis)."""
    kind, value = program[0]
    if kind == "op" and value == "add":
        out: list[Program] = []
        for s, e in children(program, 0):
            out.extend(additive_terms(program[s:e]))
        return out
    return [program]


def fold(program: Program, leaf: Callable, node: Callable):
    """Bottom-up over a program: ``leaf(kind, value)`` for terminals, ``node(op, args)``."""

    def rec(start: int):
        kind, value = program[start]
        if kind != "op":
            return leaf(kind, value), start + 1
        op = OPERATORS[value]
        args = []
        i = start + 1
        for _ in range(op.arity):
            a, i = rec(i)
            args.append(a)
        return node(op, args), i

    return rec(0)[0]


def _canonical_leaf(kind: str, value) -> str:
    return value if kind == "var" else repr(float(value))


def _canonical_node(op: Operator, args: list[str]) -> str:
    return f"{op.name}({','.join(sorted(args) if op.commutative else args)})"


def canonical(program: Program) -> str:
    """A string equal for programs that differ only in the order of commutative args."""
    return fold(program, _canonical_leaf, _canonical_node)


def variables(program: Program) -> list[str]:
    return sorted({v for k, v in program if k == "var"})


def evaluate_program(program: Program, columns: Mapping[str, np.ndarray], n: int | None = None) -> np.ndarray:
    """Vectorised interpreter: one numpy call per node, no compile/eval."""
    if n is None:
        n = len(next(iter(columns.values())))
    stack: list[np.ndarray] = []
    with np.errstate(all="ignore"):
        for kind, value in reversed(program):
            if kind == "var":
                stack.append(columns[value])
            elif kind == "const":
                stack.append(np.full(n, float(value)))
            else:
                op = OPERATORS[value]
                if op.arity == 1:
                    stack.append(op.numpy_fn(stack.pop()))
                else:
                    a = stack.pop()
                    b = stack.pop()
                    stack.append(op.numpy_fn(a, b))
    out = stack.pop()
    return np.broadcast_to(np.asarray(out, dtype=np.float64), (n,))


# --- sympy --------------------------------------------------------------------
def symbol(name: str) -> sp.Symbol:
    """Primitives are non-negative quantities; saying so keeps simplification honest."""
    return sp.Symbol(name, nonnegative=True)


def _sympy_leaf(kind: str, value) -> sp.Expr:
    return symbol(value) if kind == "var" else sp.Float(float(value))


def program_to_sympy(program: Program) -> sp.Expr:
    return fold(program, _sympy_leaf, lambda op, args: op.sympy_fn(*args))


def linear_model_sympy(terms: Sequence[Program], coefficients: Sequence[float], intercept: float) -> sp.Expr:
    """intercept + sum(coef * term): the fitted step-time expression in µs."""
    expr = sp.Float(float(intercept))
    for term, coef in zip(terms, coefficients, strict=False):
        if coef != 0.0:
            expr = expr + sp.Float(float(coef)) * program_to_sympy(term)
    return expr


INFIX_FUNCTIONS = {"pdiv": pdiv, "Max": sp.Max, "Min": sp.Min, "sqrt": sp.sqrt, "Abs": sp.Abs, "log": sp.log}
assert set(INFIX_FUNCTIONS) <= INFIX_CALLS, "infix_syntax must let the parser's functions through"


def parse_infix(text: str) -> sp.Expr:
    """Parse an archived infix expression (sympy syntax with pdiv) back to sympy."""
    from sympy.parsing.sympy_parser import parse_expr

    check_infix(text)
    local = {name: symbol(name) for name in PRIMITIVE_BY_NAME}
    local.update(INFIX_FUNCTIONS)
    return parse_expr(text, local_dict=local, evaluate=True)


def parse_step_formula(text: str) -> sp.Expr:
    """parse_infix, for an expression that is to be priced or exported: ValueError unless it
    is finite and every name in it is a primitive or a deployment constant (an archive's text
    may be edited or old)."""
    expr = parse_infix(text)
    unknown = sorted(s.name for s in expr.free_symbols if s.name not in PRIMITIVE_BY_NAME.keys() | CONSTANT_UNITS)
    if unknown:  # a name no evaluator can price
        raise ValueError(f"not a primitive: {', '.join(unknown)}")
    if expr.has(sp.zoo, sp.oo, -sp.oo, sp.nan):  # e.g. 1/0: no step time, nor Go to print
        raise ValueError("not finite (it divides by zero)")
    return expr


class _InfixPrinter(StrPrinter):
    """sympy's str printer, but floats print as Python's shortest exact repr."""

    def _print_Float(self, expr):
        return repr(float(expr))


def to_infix(expr: sp.Expr) -> str:
    """Readable infix that parse_infix reads back; floats keep full double precision."""
    return _InfixPrinter({"order": "none"}).doprint(expr)


def evaluate_expr(expr: sp.Expr, columns: Mapping[str, np.ndarray], n: int | None = None) -> np.ndarray:
    """Evaluate a sympy expression over primitive columns (reference path, not the hot loop):
    N values (default: as many as the columns have rows; give N where a constant expression
    may come with no columns)."""
    names = sorted(s.name for s in expr.free_symbols)
    if n is None:
        n = len(next(iter(columns.values())))
    fn = sp.lambdify([symbol(nm) for nm in names], expr, modules=LAMBDIFY_MODULES)
    with np.errstate(all="ignore"):
        out = fn(*[np.asarray(columns[nm], dtype=np.float64) for nm in names])
    return np.broadcast_to(np.asarray(out, dtype=np.float64), (n,)).copy()


def count_nodes(expr: sp.Expr) -> int:
    """Complexity of an expression: nodes of its sympy tree."""
    return sum(1 for _ in sp.preorder_traversal(expr))


SIMPLIFY_MAX_OPS = 60  # sympy.simplify is slow on large Max/Piecewise trees; larger ones only fold constants


def simplify_expression(expr: sp.Expr) -> sp.Expr:
    """Fold numeric constants and simplify, keeping physical groupings where sympy can."""
    folded = expr.evalf()
    if sp.count_ops(folded) > SIMPLIFY_MAX_OPS:
        return folded
    try:
        simple = sp.simplify(folded, ratio=1.0)
    except Exception:  # sympy can fail on exotic Piecewise/Max nests; folding is still valid
        return folded
    return simple.evalf() if sp.count_ops(simple) <= sp.count_ops(folded) else folded
