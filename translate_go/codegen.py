"""Go source for the registry (features, primitives, deployment constants) and for
step-time expressions over primitives.

Nothing here is written by hand per primitive: every per-request quantity, phase test,
reduction and primitive formula is printed from ``primitives.registry`` with the same
``GoCodePrinter``, so the Go code can not drift from the Python evaluator
(``primitives.compute`` lambdifies the very same sympy expressions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy as sp

from primitives.deployment import Deployment
from primitives.language import OPERATORS
from primitives.registry import (
    CONSTANT_UNITS,
    FEATURE_BY_NAME,
    FEATURES,
    PHASES,
    PRIMITIVE_BY_NAME,
    PRIMITIVES,
    REQUEST_FIELDS,
    REQUEST_GO_FIELDS,
)
from translate_go.goformat import format_go_expr
from translate_go.kernels import kernels_source
from translate_go.printer import (
    RESERVED,
    GoCodePrinter,
    GoPrintError,
    NameAllocator,
    go_camel,
    go_float_literal,
    lower_statements,
)

# --- Go names of registry things (stable: derived from the registry alone) ------------
PRIMITIVE_GO_NAMES: dict[str, str] = {}
for _p in PRIMITIVES:
    PRIMITIVE_GO_NAMES[_p.name] = go_camel(_p.name)
    while PRIMITIVE_GO_NAMES[_p.name] in RESERVED:
        PRIMITIVE_GO_NAMES[_p.name] += "V"

# Deployment constants are package-level; where a primitive local would shadow one
# (the primitives n_layers, tp, moe_topk_ratio are the constants themselves) the
# constant takes a "Const" suffix.
CONSTANT_GO_NAMES: dict[str, str] = {}
for _c in CONSTANT_UNITS:
    _n = go_camel(_c)
    if _n in set(PRIMITIVE_GO_NAMES.values()) or _n in RESERVED:
        _n += "Const"
    CONSTANT_GO_NAMES[_c] = _n

FEATURE_GO_FIELDS = {f.name: go_camel(f.name) for f in FEATURES}
REQUEST_GO_LOCALS = {s.name: go_camel(s.name) for s in REQUEST_FIELDS}
PHASE_GO_LOCALS = {ph: "in" + go_camel(ph)[:1].upper() + go_camel(ph)[1:] for ph in PHASES}


@dataclass
class GoSnippet:
    """Go source text and what it needs from the file (imports, helpers)."""

    text: str
    uses_math: bool = False
    uses_pdiv: bool = False
    extra: dict = field(default_factory=dict)


def format_statement(line: str) -> str:
    """gofmt layout of one generated statement line (``name := expr``, ``if cond {`` ...)."""
    indent = len(line) - len(line.lstrip("\t"))
    body = line[indent:]
    tabs = "\t" * indent
    for head, tail in (("} else if ", " {"), ("if ", " {")):
        if body.startswith(head) and body.endswith(tail):
            return f"{tabs}{head}{format_go_expr(body[len(head) : -len(tail)])}{tail}"
    for op in (" := ", " += ", " = "):
        if op in body and not body.startswith("var "):
            lhs, rhs = body.split(op, 1)
            return f"{tabs}{lhs}{op}{format_go_expr(rhs)}"
    if body.startswith("return "):
        return f"{tabs}return {format_go_expr(body[len('return ') :])}"
    return line


def expression_primitives(expr: sp.Expr) -> list[str]:
    """Primitives EXPR uses, in registry order; unknown symbols are an error."""
    names = {s.name for s in sp.sympify(expr).free_symbols}
    unknown = sorted(names - set(PRIMITIVE_BY_NAME))
    if unknown:
        raise GoPrintError(f"expression uses {unknown}, which are not primitives; known: {sorted(PRIMITIVE_BY_NAME)}")
    return [p.name for p in PRIMITIVES if p.name in names]


def required_features(primitives: list[str]) -> list[str]:
    needed = set().union(*(PRIMITIVE_BY_NAME[p].features for p in primitives)) if primitives else set()
    return [f.name for f in FEATURES if f.name in needed]


def required_constants(primitives: list[str]) -> list[str]:
    needed = set().union(*(PRIMITIVE_BY_NAME[p].constants for p in primitives)) if primitives else set()
    return [c for c in CONSTANT_UNITS if c in needed]


def _feature_doc(name: str) -> str:
    f = FEATURE_BY_NAME[name]
    where = "every request" if f.phase is None else f"{f.phase} requests ({PHASES[f.phase]})"
    return f"{f.name} [{f.unit}]: {f.doc}; {f.reduce} of {f.per_request} over {where}"


def features_source(feature_names: list[str]) -> GoSnippet:
    """``batchFeatures`` and ``reduceBatch``: one pass over the requests (empty if none needed)."""
    if not feature_names:
        return GoSnippet("")
    feats = [FEATURE_BY_NAME[n] for n in feature_names]
    printer = GoCodePrinter(names=dict(REQUEST_GO_LOCALS))
    body: list[str] = []
    by_phase: dict[str | None, list[str]] = {}
    for f in feats:
        value = format_go_expr(printer.doprint_expr(f.per_request))
        target = f"f.{FEATURE_GO_FIELDS[f.name]}"
        if f.reduce == "sum":
            stmts = [f"{target} += {value}"]
        elif f.reduce == "max":
            # Request fields are whole numbers (never NaN), so a comparison is exactly
            # numpy's maximum, and cheaper than math.Max. The maximum starts at 0 as in
            # primitives.compute.
            stmts = [f"if v := {value}; v > {target} {{", f"\t{target} = v", "}"]
        else:  # pragma: no cover - registry invariant
            raise GoPrintError(f"unknown reduction {f.reduce!r}")
        by_phase.setdefault(f.phase, []).extend(stmts)
    body += by_phase.pop(None, [])
    for ph, stmts in by_phase.items():  # one if per phase
        body += [f"if {PHASE_GO_LOCALS[ph]} {{"] + ["\t" + s for s in stmts] + ["}"]
    phases = [ph for ph in PHASES if any(f.phase == ph for f in feats)]
    phase_lines = [f"{PHASE_GO_LOCALS[ph]} := {format_go_expr(printer.doprint_expr(PHASES[ph]))}" for ph in phases]
    # Declare only the request fields used (unused locals do not compile).
    used = " ".join(body + phase_lines)
    request_lines = [
        f"{REQUEST_GO_LOCALS[s.name]} := {REQUEST_GO_FIELDS[s.name]}"
        for s in REQUEST_FIELDS
        if _mentions(used, REQUEST_GO_LOCALS[s.name])
    ]
    loop = request_lines + phase_lines + body
    lines = ["// batchFeatures are the batch reductions (primitives/registry.py FEATURES) the primitives need."]
    lines.append("type batchFeatures struct {")
    for f in feats:
        lines.append(f"\t// {_feature_doc(f.name)}")
        lines.append(f"\t{FEATURE_GO_FIELDS[f.name]} float64")
    lines.append("}")
    lines.append("")
    lines.append("// reduceBatch computes the batch features in one pass over the requests.")
    lines.append("func reduceBatch(batch []*Request) batchFeatures {")
    lines.append("\tvar f batchFeatures")
    lines.append("\tfor _, r := range batch {")
    lines += ["\t\t" + line for line in loop]  # formatted as built
    lines.append("\t}")
    lines.append("\treturn f")
    lines.append("}")
    return GoSnippet("\n".join(lines) + "\n", uses_math=printer.uses_math)


def _mentions(text: str, ident: str) -> bool:
    import re

    return re.search(rf"(?<![\w.]){re.escape(ident)}(?!\w)", text) is not None


def constants_source(deployment: Deployment, constant_names: list[str]) -> GoSnippet:
    """A const block of the deployment constants, aligned as gofmt aligns it."""
    if not constant_names:
        return GoSnippet("")
    values = deployment.constants
    rows = []
    uses_math = False
    for name in constant_names:
        literal = go_float_literal(values[name])
        if literal.startswith("math."):
            raise GoPrintError(f"deployment constant {name} = {values[name]} is not finite")
        rows.append((CONSTANT_GO_NAMES[name], f"= {literal}", f"// {CONSTANT_UNITS[name]} ({name})"))
    w_name = max(len(r[0]) for r in rows)
    w_val = max(len(r[1]) for r in rows)
    m = deployment.model
    lines = [
        f"// Deployment constants of {m.name} at TP{deployment.tp} on {deployment.gpu.name}",
        "// (primitives.deployment.Deployment.constants). Typed float64 so that Go folds",
        "// them with float64 rounding, as Python computes them.",
        "const (",
    ]
    for name, val, comment in rows:
        lines.append(f"\t{name.ljust(w_name)} float64 {val.ljust(w_val)} {comment}")
    lines.append(")")
    return GoSnippet("\n".join(lines) + "\n", uses_math=uses_math)


def step_function_source(
    func_name: str,
    expr: sp.Expr,
    doc: list[str] | None = None,
    *,
    constants: dict[str, str] | None = None,
    receiver: str = "",
    kernel_prefix: str = "",
) -> GoSnippet:
    """``func NAME(batch []*Request) float64``: features -> primitives -> EXPR (µs).

    CONSTANTS maps deployment constants to Go (default: the package-level consts);
    RECEIVER (``(m *Model)``) makes it a method, KERNEL_PREFIX (``m.``) prefixes the
    measured-kernel lookups.
    """
    expr = sp.sympify(expr)
    constants = CONSTANT_GO_NAMES if constants is None else constants
    prims = expression_primitives(expr)
    feats = required_features(prims)
    alloc = NameAllocator()
    alloc.taken |= set(CONSTANT_GO_NAMES.values()) | {"f", "batch", "m"}
    prim_names = {p: alloc.claim(PRIMITIVE_GO_NAMES[p]) for p in prims}
    body: list[str] = []
    if feats:
        body.append("f := reduceBatch(batch)")
    # Primitives, printed from the registry with features as f.<field> and constants by name.
    reg_printer = GoCodePrinter(names={**{k: f"f.{v}" for k, v in FEATURE_GO_FIELDS.items()}, **constants})
    reg_printer.kernel_prefix = kernel_prefix
    for p in prims:
        prim = PRIMITIVE_BY_NAME[p]
        body.append(f"// {p} [{prim.unit}]: {prim.doc}")
        stmts, value = lower_statements(prim.expr, reg_printer, alloc, use_cse=False)
        body += stmts
        body.append(f"{prim_names[p]} := {value}")
    # The step-time expression, with common subexpressions named by sympy.cse.
    printer = GoCodePrinter(names=prim_names)
    printer.kernel_prefix = kernel_prefix
    stmts, value = lower_statements(expr, printer, alloc, use_cse=True)
    if stmts:
        body.append("// Step-time expression (common subexpressions as cseN, Piecewise as pwN).")
    body += stmts
    body.append(f"return {value}")
    lines = [f"// {line}" if line else "//" for line in (doc or [])]
    lines.append(f"func {receiver + ' ' if receiver else ''}{func_name}(batch []*Request) float64 {{")
    lines += [_indent_statement(line) for line in body]
    lines.append("}")
    return GoSnippet(
        "\n".join(lines) + "\n",
        uses_math=printer.uses_math or reg_printer.uses_math,
        uses_pdiv=printer.uses_pdiv or reg_printer.uses_pdiv,
        extra={
            "primitives": prims,
            "features": feats,
            "constants": required_constants(prims),
            "kernels": sorted(reg_printer.kernels | printer.kernels),
        },
    )


def _indent_statement(line: str) -> str:
    if line.startswith("//"):
        return "\t" + line
    return "\t" + format_statement(line)


def program_sources(
    exprs: list[sp.Expr],
    deployment: Deployment,
    func_names: list[str],
    docs: list[list[str]] | None = None,
    *,
    method_of: str = "",
) -> tuple[str, GoSnippet]:
    """The shared part (constants, features, pdiv) and the expression functions, for one file.

    Returns (declarations, functions); ``functions.uses_math`` covers both. With
    METHOD_OF (a type name, e.g. ``Model``) the functions are methods reading the
    constants from ``m.c`` and the kernels from ``m.k``, both set at construction
    (``translate_go.blis_deployment``): no constants or tables are baked in.
    """
    docs = docs or [None] * len(exprs)
    options = {}
    if method_of:
        options = {
            "constants": {c: f"m.c.{CONSTANT_GO_NAMES[c]}" for c in CONSTANT_UNITS},
            "receiver": f"(m *{method_of})",
            "kernel_prefix": "m.k.",
        }
    funcs = [
        step_function_source(n, e, docs[i], **options) for i, (n, e) in enumerate(zip(func_names, exprs, strict=False))
    ]
    prims = sorted({p for f in funcs for p in f.extra["primitives"]}, key=[p.name for p in PRIMITIVES].index)
    feats = required_features(prims)
    consts = required_constants(prims)
    feat_src = features_source(feats)
    const_src = constants_source(deployment, consts) if not method_of else GoSnippet("")
    uses_pdiv = any(f.uses_pdiv for f in funcs)
    kernels = sorted({k for f in funcs for k in f.extra["kernels"]})
    kernel_src = kernels_source(deployment, kernels) if not method_of else ""
    pdiv_src = OPERATORS["pdiv"].go_helper if uses_pdiv else ""
    parts = [s for s in (const_src.text, feat_src.text, kernel_src, pdiv_src) if s]
    functions = GoSnippet(
        "\n".join(f.text for f in funcs),
        uses_math=any(f.uses_math for f in funcs) or feat_src.uses_math or uses_pdiv or bool(kernels),
        uses_pdiv=uses_pdiv,
        extra={"primitives": prims, "features": feats, "constants": consts, "kernels": kernels},
    )
    return "\n".join(parts), functions


__all__ = [
    "CONSTANT_GO_NAMES",
    "FEATURE_GO_FIELDS",
    "PRIMITIVE_GO_NAMES",
    "GoSnippet",
    "constants_source",
    "expression_primitives",
    "features_source",
    "format_statement",
    "program_sources",
    "required_constants",
    "required_features",
    "step_function_source",
]
