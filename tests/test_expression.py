"""The vectorised interpreter agrees with sympy; protected operators never emit NaN/inf."""

import numpy as np
import pytest

from primitives.infix_syntax import check_infix
from primitives.language import (
    additive_terms,
    canonical,
    evaluate_expr,
    evaluate_program,
    parse_infix,
    program_to_sympy,
    simplify_expression,
    to_infix,
)

V = lambda n: ("var", n)  # noqa: E731
O = lambda n: ("op", n)  # noqa: E731, E741 - reads like the token it builds
C = lambda v: ("const", v)  # noqa: E731

PROGRAMS = [
    (O("add"), O("mul"), C(1.5), V("weight_time_us"), O("pdiv"), V("kv_tokens"), V("decode_tokens")),
    (O("max"), V("matmul_time_us"), O("add"), V("weight_time_us"), V("kv_io_time_us")),
    (O("sub"), O("psqrt"), V("kv_tokens"), O("plog"), O("min"), V("prefill_tokens"), C(0.333)),
    (O("mul"), O("mul"), V("batch_size"), V("batch_size"), O("pdiv"), C(1.0), C(3.0)),
]


@pytest.fixture
def columns():
    rng = np.random.default_rng(0)
    n = 500
    cols = {
        name: rng.uniform(0, 1e4, n)
        for name in [
            "weight_time_us",
            "kv_tokens",
            "decode_tokens",
            "matmul_time_us",
            "kv_io_time_us",
            "prefill_tokens",
            "batch_size",
        ]
    }
    cols["decode_tokens"][:50] = 0.0  # protected division by zero
    return cols


@pytest.mark.parametrize("program", PROGRAMS)
def test_interpreter_matches_sympy(program, columns):
    fast = evaluate_program(program, columns)
    expr = program_to_sympy(program)
    ref = evaluate_expr(parse_infix(to_infix(expr)), columns)
    assert np.allclose(fast, ref, rtol=1e-12, atol=1e-9)
    assert np.isfinite(fast).all()
    simple = simplify_expression(expr)
    assert np.allclose(evaluate_expr(simple, columns), ref, rtol=1e-9, atol=1e-6)


def test_pdiv_by_zero_is_zero(columns):
    out = evaluate_program((O("pdiv"), V("kv_tokens"), V("decode_tokens")), columns)
    assert (out[:50] == 0).all()


def test_canonical_form_ignores_commutative_order_and_terms_split_at_root():
    a = (O("add"), V("kv_tokens"), O("mul"), V("tp"), V("n_layers"))
    b = (O("add"), O("mul"), V("n_layers"), V("tp"), V("kv_tokens"))
    assert canonical(a) == canonical(b)
    assert canonical((O("sub"), V("tp"), V("n_layers"))) != canonical((O("sub"), V("n_layers"), V("tp")))
    assert additive_terms(a) == [(V("kv_tokens"),), (O("mul"), V("tp"), V("n_layers"))]


def test_infix_round_trip_keeps_full_precision():
    expr = program_to_sympy((O("mul"), C(0.1 + 0.2), V("tp")))
    back = parse_infix(to_infix(expr))
    assert float(back.subs({s: 1 for s in back.free_symbols})) == 0.1 + 0.2


@pytest.mark.parametrize(
    "text,values,expected",
    [
        ("11.837 + 4*allreduce_time_us + 1601.92*tp", {"allreduce_time_us": [10.0], "tp": [2.0]}, [3255.677]),
        (
            "pdiv(a, b)*Max(1, c) - sqrt(Abs(x))**2 + log(1 + y)/1e-3",
            {"a": [6.0, 6.0], "b": [3.0, 0.0], "c": [4.0, 4.0], "x": [-9.0, 4.0], "y": [0.0, 0.0]},
            [-1.0, -4.0],  # pdiv by zero is 0
        ),
        (  # sympy's parser reads these as Max, Min, Abs
            "max(20*num_decode_reqs, 0.01*kv_tokens) + min(a, abs(b))",
            {"num_decode_reqs": [3.0, 10.0], "kv_tokens": [1e4, 1e4], "a": [5.0, 1.0], "b": [-2.0, -2.0]},
            [102.0, 201.0],
        ),
        (
            "Piecewise((x, batch_size > 64), (x**2/1000, (tp > 1) & (prefill_tokens < 100)), (y/3, True))",
            {"x": [7.0, 100.0, 100.0], "y": [9.0] * 3, "batch_size": [100.0, 10.0, 10.0], "tp": [1.0, 2.0, 1.0]}
            | {"prefill_tokens": [50.0] * 3},
            [7.0, 10.0, 3.0],
        ),
    ],
)
def test_archived_arithmetic_parses_to_what_it_says(text, values, expected):
    check_infix(text)
    got = evaluate_expr(parse_infix(text), {k: np.asarray(v) for k, v in values.items()})
    assert np.allclose(got, expected, rtol=1e-12), got


@pytest.mark.parametrize(
    "text",
    [
        "open('f', 'w').write('1')",  # sympy's parser runs its text as Python
        "__import__('os').system('true')",
        "x.real",
        "lambda: 1",
        "x[0]",
        "Max(a, b, evaluate=False)",
        "getattr(x, 'y')",
        "'text'",
        "_private + 1",
        "x if y else z",
        "1 +",
    ],
)
def test_anything_but_arithmetic_is_refused_before_sympy_sees_it(text):
    with pytest.raises(ValueError, match="not (a step-time expression|an expression)"):
        parse_infix(text)
