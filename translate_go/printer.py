"""Printing sympy expressions as Go: ``GoCodePrinter`` and statement lowering.

Go is not C: there is no ternary operator, ``1/3`` is integer division (0) when both
operands are untyped integer constants, integers never convert to float64 implicitly,
unused imports and unused variables are compile errors, ``max``/``min``/``len`` are
predeclared names. The printer therefore

* prints every number as a float64 literal with Python's shortest round-trip repr
  (``0.3333333333333333``, never ``1/3``), so Go parses the very same double;
* prints ``Max``/``Min`` as nested ``math.Max``/``math.Min``, ``sqrt`` as ``math.Sqrt``,
  ``Abs`` as ``math.Abs``, ``log`` as ``math.Log``, small integer powers as products
  and other powers as ``math.Pow``; records whether ``math`` and ``pdiv`` were used;
* refuses ``Piecewise`` inside an expression: ``lower_statements`` hoists each one into
  an ``if``/``else`` that assigns a temporary, after ``sympy.cse`` has named the common
  subexpressions (``cse0``, ``cse1``, ...).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import sympy as sp
from sympy.printing.c import C99CodePrinter
from sympy.printing.precedence import PRECEDENCE, precedence

from primitives.language import OPERATORS
from primitives.registry import KERNEL_ARITY

GO_KEYWORDS = frozenset(
    "break case chan const continue default defer else fallthrough for func go goto if import "
    "interface map package range return select struct switch type var".split()
)
GO_PREDECLARED = frozenset(
    "any append bool byte cap clear close complex complex64 complex128 copy delete error false "
    "float32 float64 imag int int8 int16 int32 int64 iota len make max min new nil panic print "
    "println real recover rune string true uint uint8 uint16 uint32 uint64 uintptr".split()
)
# Names the generated code itself uses at package or function level.
GENERATED_NAMES = frozenset(
    "math strconv testing flate base64 binary strings bufio os io fmt pdiv batch f r Request Model "
    "LatencyModel NewModel reduceBatch batchFeatures stepTimeUs kernelLerp kernelLookup1D kernelLookup2D "
    "kernelGemmUs kernelDecodeAttentionUs kernelPrefillAttentionUs".split()
)
RESERVED = GO_KEYWORDS | GO_PREDECLARED | GENERATED_NAMES

# Word spellings in camelCase identifiers (Go style keeps initialisms upper case).
_INITIALISMS = {"gpu": "GPU", "gpus": "GPUs", "kv": "KV", "hbm": "HBM", "io": "IO", "tp": "TP", "id": "ID"}

# Integer exponents printed as repeated multiplication instead of math.Pow.
MAX_PRODUCT_POWER = 4


def go_camel(name: str) -> str:
    """``kv_bytes_per_token_per_gpu`` -> ``kvBytesPerTokenPerGPU`` (first word lower case)."""
    words = [w for w in re.split(r"[^0-9A-Za-z]+", name) if w]
    if not words:
        return "v"
    first = words[0]
    out = [first.lower() if first.isupper() or first.lower() in _INITIALISMS else first[:1].lower() + first[1:]]
    for w in words[1:]:
        out.append(_INITIALISMS.get(w.lower(), w[:1].upper() + w[1:]))
    ident = "".join(out)
    if ident[0].isdigit():
        ident = "v" + ident
    return ident


def go_identifier(name: str, taken: frozenset[str] | set[str] = RESERVED) -> str:
    """A valid, non-reserved Go identifier for NAME (camelCase, ``V`` appended on clashes)."""
    ident = go_camel(name)
    while ident in taken:
        ident += "V"
    return ident


def go_float_literal(value: float) -> str:
    """A Go float64 literal that parses to exactly VALUE (non-finite values need math)."""
    value = float(value)
    if math.isnan(value):
        return "math.NaN()"
    if math.isinf(value):
        return "math.Inf(1)" if value > 0 else "math.Inf(-1)"
    text = repr(value)  # shortest repr that round-trips; Go parses decimals correctly rounded
    if "." not in text and "e" not in text:
        text += ".0"
    return text


class GoPrintError(ValueError):
    """The expression uses something the Go printer does not support."""


class GoCodePrinter(C99CodePrinter):
    """sympy -> Go float64 expressions. ``names`` maps sympy symbol names to Go code."""

    language = "Go"
    printmethod = "_gocode"

    def __init__(self, names: dict[str, str] | None = None, settings: dict | None = None):
        super().__init__({"strict": True, **(settings or {})})
        self.names = dict(names or {})
        self.uses_math = False
        self.uses_pdiv = False
        self.kernels: set[str] = set()  # measured-kernel lookups called (translate_go.kernels)
        self.kernel_prefix = ""  # e.g. "m.k." when the lookups are methods of the model's tables

    def parenthesize(self, item, level, strict=False):
        # Non-negative numbers print as one float literal: never wrap them ("(0.5)*x").
        if isinstance(item, sp.Number) and item.is_finite and item.is_nonnegative:
            return self._print(item)
        return super().parenthesize(item, level, strict)

    # --- atoms ------------------------------------------------------------------
    def _print_Symbol(self, expr):
        if expr.name in self.names:
            return self.names[expr.name]
        return go_identifier(expr.name)

    def _number(self, value: float) -> str:
        text = go_float_literal(value)
        if text.startswith("math."):
            self.uses_math = True
        return text

    def _print_Integer(self, expr):
        return self._number(float(expr))

    def _print_Rational(self, expr):
        return self._number(float(expr))

    def _print_Float(self, expr):
        return self._number(float(expr))

    def _print_NumberSymbol(self, expr):
        return self._number(float(expr))

    _print_Pi = _print_Exp1 = _print_GoldenRatio = _print_EulerGamma = _print_Catalan = _print_NumberSymbol

    def _print_Zero(self, expr):
        return "0.0"

    def _print_One(self, expr):
        return "1.0"

    def _print_NegativeOne(self, expr):
        return "-1.0"

    def _print_Half(self, expr):
        return "0.5"

    def _print_Infinity(self, expr):
        self.uses_math = True
        return "math.Inf(1)"

    def _print_NegativeInfinity(self, expr):
        self.uses_math = True
        return "math.Inf(-1)"

    def _print_ComplexInfinity(self, expr):  # x/0 in sympy; numpy gives inf
        self.uses_math = True
        return "math.Inf(1)"

    def _print_NaN(self, expr):
        self.uses_math = True
        return "math.NaN()"

    def _print_BooleanTrue(self, expr):
        return "true"

    def _print_BooleanFalse(self, expr):
        return "false"

    # --- operators ----------------------------------------------------------------
    def _print_Pow(self, expr):
        base, exp = expr.base, expr.exp
        if base == sp.E:
            self.uses_math = True
            return f"math.Exp({self._print(exp)})"
        if exp == sp.Rational(1, 2):
            self.uses_math = True
            return f"math.Sqrt({self._print(base)})"
        if exp == sp.Rational(-1, 2):
            self.uses_math = True
            return f"(1.0/math.Sqrt({self._print(base)}))"
        if exp.is_Integer and 1 <= abs(int(exp)) <= MAX_PRODUCT_POWER:
            # Always parenthesised: sympy ranks Pow above Mul, Go sees a product.
            b = self.parenthesize(base, PRECEDENCE["Pow"])
            product = "*".join([b] * abs(int(exp)))
            return f"({product})" if exp > 0 else f"(1.0/({product}))" if abs(int(exp)) > 1 else f"(1.0/{b})"
        self.uses_math = True
        return f"math.Pow({self._print(base)}, {self._print(exp)})"

    def _operator(self, name: str, *go_args: str) -> str:
        """Operator NAME of the candidate language in its Go form (primitives.language)."""
        op = OPERATORS[name]
        if "math." in op.go:
            self.uses_math = True
        if op.go_helper:
            self.uses_pdiv = True  # pdiv is the only operator with a helper function
        return op.go.format(*go_args)

    def _nested(self, name: str, args) -> str:
        """A binary operator over sympy's n-ary Max/Min: op(a, op(b, c))."""
        printed = [self._print(a) for a in args]
        out = printed[-1]
        for a in reversed(printed[:-1]):
            out = self._operator(name, a, out)
        return out

    def _print_Max(self, expr):
        return self._nested("max", expr.args)

    def _print_Min(self, expr):
        return self._nested("min", expr.args)

    def _unary_math(self, fn: str, expr) -> str:
        self.uses_math = True
        return f"math.{fn}({self._print(expr.args[0])})"

    def _print_Abs(self, expr):
        return self._unary_math("Abs", expr)

    def _print_log(self, expr):
        return self._unary_math("Log", expr)

    def _print_exp(self, expr):
        return self._unary_math("Exp", expr)

    def _print_floor(self, expr):
        return self._unary_math("Floor", expr)

    def _print_ceiling(self, expr):
        return self._unary_math("Ceil", expr)

    def _print_sqrt(self, expr):  # pragma: no cover - sympy builds Pow(x, 1/2)
        return self._unary_math("Sqrt", expr)

    # The GP operators (primitives.language); psqrt/plog only if kept as opaque functions.
    def _print_pdiv(self, expr):
        return self._operator("pdiv", *(self._print(a) for a in expr.args))

    def _print_psqrt(self, expr):
        return self._operator("psqrt", self._print(expr.args[0]))

    def _print_plog(self, expr):
        return self._operator("plog", self._print(expr.args[0]))

    def _print_Relational(self, expr):
        ops = {"==": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}
        if expr.rel_op not in ops:
            raise GoPrintError(f"relational {expr.rel_op!r} has no Go form")
        prec = precedence(expr)
        return f"{self.parenthesize(expr.lhs, prec)} {ops[expr.rel_op]} {self.parenthesize(expr.rhs, prec)}"

    def _print_Not(self, expr):
        return "!" + self.parenthesize(expr.args[0], PRECEDENCE["Not"] + 1)

    def _print_And(self, expr):
        return " && ".join(self.parenthesize(a, PRECEDENCE["And"]) for a in expr.args)

    def _print_Or(self, expr):
        return " || ".join(self.parenthesize(a, PRECEDENCE["Or"]) for a in expr.args)

    def _print_Piecewise(self, expr):
        raise GoPrintError("Piecewise must be lowered to if/else first (use lower_statements)")

    def _print_ITE(self, expr):
        raise GoPrintError("ITE must be lowered to if/else first (use lower_statements)")

    def _print_Function(self, expr):
        name = expr.func.__name__
        if name in KERNEL_ARITY:
            self.kernels.add(name)
            self.uses_math = True
            return f"{self.kernel_prefix}{go_camel(name)}({', '.join(self._print(a) for a in expr.args)})"
        raise GoPrintError(f"function {expr.func.__name__}() has no Go translation")

    def _print_not_supported(self, expr):
        raise GoPrintError(f"{type(expr).__name__} has no Go translation: {expr}")

    def doprint_expr(self, expr) -> str:
        """One Go expression (no statements, no assignment)."""
        return self._print(sp.sympify(expr))


# --- statements ------------------------------------------------------------------
@dataclass
class NameAllocator:
    """Unique local names within one Go function."""

    taken: set[str] = field(default_factory=lambda: set(RESERVED))

    def claim(self, name: str) -> str:
        ident = go_identifier(name, self.taken)
        self.taken.add(ident)
        return ident

    def fresh(self, prefix: str) -> str:
        i = 0
        while f"{prefix}{i}" in self.taken:
            i += 1
        self.taken.add(f"{prefix}{i}")
        return f"{prefix}{i}"


def _innermost_conditional(expr: sp.Basic) -> sp.Basic | None:
    for node in sp.postorder_traversal(expr):
        if isinstance(node, (sp.Piecewise, sp.ITE)):
            return node
    return None


def _as_boolean_formula(node: sp.Basic) -> sp.Basic:
    """A boolean ITE/Piecewise as And/Or/Not, which Go writes directly."""
    if isinstance(node, sp.ITE):
        c, a, b = node.args
        return sp.Or(sp.And(c, a), sp.And(sp.Not(c), b))
    terms, earlier = [], []
    for value, cond in node.args:
        terms.append(sp.And(*[sp.Not(e) for e in earlier], cond, value))
        earlier.append(cond)
    return sp.Or(*terms)


_MAX_LOWERING_STEPS = 10_000


def _is_boolean(value: sp.Basic, bool_names: set[str]) -> bool:
    """Relationals, And/Or/Not, true/false, or a temporary that holds a bool."""
    if isinstance(value, sp.Symbol):
        return value.name in bool_names
    return isinstance(value, sp.logic.boolalg.Boolean) and not isinstance(value, sp.Expr)


def _lower_piecewise(
    expr: sp.Basic, printer: GoCodePrinter, alloc: NameAllocator, lines: list[str], bool_names: set[str] | None = None
) -> sp.Basic:
    """Replace each Piecewise (innermost first) by a temporary set in an if/else chain.

    Boolean-valued conditionals (an ITE, or a Piecewise of conditions, which sympy makes
    of relationals over Piecewise values) become And/Or formulas instead.
    """
    for _ in range(_MAX_LOWERING_STEPS):
        node = _innermost_conditional(expr)
        if node is None:
            return expr
        if isinstance(node, sp.ITE) or any(_is_boolean(v, bool_names or set()) for v, _ in node.args):
            expr = expr.xreplace({node: _as_boolean_formula(node)})
            continue
        pw = node
        name = alloc.fresh("pw")
        branches = [(v, c) for v, c in pw.args if c != sp.false]
        conditional = []
        default = sp.nan  # sympy's Piecewise is nan when no branch holds
        for value, cond in branches:
            if cond == sp.true:
                default = value
                break
            conditional.append((value, cond))
        if not conditional:
            lines.append(f"{name} := {printer.doprint_expr(default)}")
        else:
            lines.append(f"var {name} float64")
            for i, (value, cond) in enumerate(conditional):
                opener = "if" if i == 0 else "} else if"
                lines.append(f"{opener} {printer.doprint_expr(cond)} {{")
                lines.append(f"\t{name} = {printer.doprint_expr(value)}")
            lines.append("} else {")
            lines.append(f"\t{name} = {printer.doprint_expr(default)}")
            lines.append("}")
        printer.names[name] = name
        expr = expr.xreplace({pw: sp.Symbol(name)})
    raise GoPrintError("could not lower the expression's Piecewise/ITE nodes to if/else")


def lower_statements(
    expr: sp.Expr,
    printer: GoCodePrinter,
    alloc: NameAllocator,
    *,
    use_cse: bool = True,
) -> tuple[list[str], str]:
    """Go statements that compute EXPR, and the Go expression of the result.

    Common subexpressions become ``cseN := ...`` (sympy.cse), each Piecewise an
    if/else chain assigning ``pwN``. All temporaries are used by construction.
    """
    lines: list[str] = []
    expr = sp.sympify(expr)
    if use_cse:
        taken = {s.name for s in expr.free_symbols}
        prefix_syms = (sp.Symbol(n) for n in _fresh_names("cse", alloc, taken))
        replacements, reduced = sp.cse(expr, symbols=prefix_syms, optimizations=None)
        result = reduced[0]
    else:
        replacements, result = [], expr
    bool_names: set[str] = set()  # cse temporaries holding a condition (Go bool)
    for sym, sub in replacements:
        sub = _lower_piecewise(sub, printer, alloc, lines, bool_names)
        if _is_boolean(sub, bool_names):
            bool_names.add(sym.name)
        printer.names[sym.name] = sym.name
        lines.append(f"{sym.name} := {printer.doprint_expr(sub)}")
    result = _lower_piecewise(result, printer, alloc, lines, bool_names)
    return lines, printer.doprint_expr(result)


def _fresh_names(prefix: str, alloc: NameAllocator, also_taken: set[str]):
    """Endless cse0, cse1, ... skipping names in use; claimed only when drawn."""
    i = 0
    while True:
        name = f"{prefix}{i}"
        i += 1
        if name in alloc.taken or name in also_taken:
            continue
        alloc.taken.add(name)
        yield name


__all__ = [
    "GoCodePrinter",
    "GoPrintError",
    "NameAllocator",
    "RESERVED",
    "go_camel",
    "go_float_literal",
    "go_identifier",
    "lower_statements",
]
