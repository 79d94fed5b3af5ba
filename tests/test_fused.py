"""The fused evaluator gives the plain interpreter's values and the plain scoring's errors."""

import math
import random

import numpy as np
import pytest
from deap import gp
from test_search import planted_table

from evolve.toolbox import build_pset, tree_to_program
from fitness.fused import CHUNK_ROWS, FusedTerms, column_matrix
from fitness.scoring import FitnessContext, score_program
from primitives.language import OPERATORS, additive_terms, evaluate_program

SPECIAL = [0.0, -0.0, 1e-300, -1e-12, 1e-9, 2e-9, 0.5, 1.0, -3.0, 1e300, -1e300, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_scalar_form_of_each_operator_matches_its_numpy_form(name):
    """Special values included: a NaN or inf must come out where numpy's form gives one."""
    op = OPERATORS[name]
    rng = np.random.default_rng(1)
    values = np.concatenate([SPECIAL, rng.uniform(-5, 5, 200), 10 ** rng.uniform(-12, 12, 200)])
    pairs = [(x, y) for x in values[:40] for y in values[:40]] + list(zip(values, values[::-1], strict=True))
    xs = np.array([p[0] for p in pairs])
    ys = np.array([p[1] for p in pairs])
    with np.errstate(all="ignore"):
        ref = op.numpy_fn(xs, ys) if op.arity == 2 else op.numpy_fn(xs)
    with np.errstate(all="ignore"):
        got = np.array([op.scalar_fn(x, y) if op.arity == 2 else op.scalar_fn(x) for x, y in pairs])
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    fin = np.isfinite(ref)
    assert np.array_equal(got[~fin & ~np.isnan(ref)], ref[~fin & ~np.isnan(ref)])
    assert np.allclose(got[fin], ref[fin], rtol=4e-16, atol=0)  # plog: within 2 ulps of numpy's log1p


def _random_programs(names, n, seed):
    pset = build_pset(names)
    random.seed(seed)
    return [tree_to_program(gp.PrimitiveTree(gp.genHalfAndHalf(pset, 1, 5))) for _ in range(n)]


def test_fused_terms_equal_the_interpreter_across_chunks():
    table = planted_table(n=2 * CHUNK_ROWS + 37)  # a partial last chunk
    cols = dict(table.columns)
    cols["decode_tokens"] = cols["decode_tokens"].copy()
    cols["decode_tokens"][:40] = 0.0  # protected division by zero
    mat = column_matrix(cols, table.n)
    for program in _random_programs(table.primitive_names, 150, seed=5):
        terms = additive_terms(program)
        X = FusedTerms(terms).terms_into(mat, np.empty((len(terms), table.n)))
        with np.errstate(all="ignore"):
            ref = np.array([evaluate_program(t, cols, table.n) for t in terms])
        assert np.array_equal(np.isnan(X), np.isnan(ref)), program
        fin = np.isfinite(ref)
        assert np.array_equal(X[~fin & ~np.isnan(ref)], ref[~fin & ~np.isnan(ref)]), program
        assert np.allclose(X[fin], ref[fin], rtol=1e-13, atol=0), program


def test_fused_scores_equal_the_plain_scores():
    table = planted_table(n=3000)
    table.is_train[table.experiment == 1] = True  # an experiment without a holdout is judged on its training rows
    ctx = FitnessContext(table)
    programs = _random_programs(table.primitive_names, 300, seed=11)  # many mix times with counts: worst
    scored = 0
    for program in programs:
        plain, fused = score_program(program, ctx, fused=False), score_program(program, ctx)
        assert plain.ok == fused.ok, program
        if plain.ok:
            scored += 1
            assert fused.train_error == pytest.approx(plain.train_error, rel=1e-9)
            assert fused.objectives["step_mape"] == pytest.approx(plain.objectives["step_mape"], rel=1e-9)
            assert fused.complexity == plain.complexity
    assert scored > 60
    detailed = [score_program(p, ctx, detail=True, fused=f) for f in (False, True) for p in programs[:5]]
    for plain, fused in zip(detailed[:5], detailed[5:], strict=True):
        for name, row in plain.per_experiment.items():
            assert fused.per_experiment[name] == pytest.approx(row, rel=1e-9)


def test_overflow_to_inf_scores_worst():
    table = planted_table()
    huge = (("op", "mul"), ("const", 1e300), ("op", "mul"), ("const", 1e300), ("var", "kv_tokens"))
    assert not score_program(huge, FitnessContext(table)).ok
