"""Physically bounded constants: units of terms, efficiency bounds, negative times, monotone probes,
and the KV semantics of block-counted traces."""

from __future__ import annotations

import pytest
import sympy as sp
from test_search import planted_table
from test_sim_scheduler import DEP, ConstModel, spec_

from fitness.efficiency import as_bounds, work_factors
from fitness.physics_check import bound_flag, monotone_on_probes, probe_check, term_efficiencies
from fitness.physics_probes import PhysicsProbes, monotone
from fitness.scoring import FitnessContext, score_program, sympy_term_intervals
from fitness.sim.engine import simulate
from fitness.sim.recording import kv_sharing_factor
from primitives.deployment import default_resolver
from primitives.language import linear_model_sympy, parse_infix, to_infix
from primitives.units import MICROSECONDS, is_efficiency_term, term_unit

R = default_resolver()
V = lambda name: ("var", name)  # noqa: E731
OP = lambda name: ("op", name)  # noqa: E731


@pytest.mark.parametrize(
    "text,efficiency",
    [
        ("weight_time_us", True),
        ("moe_touched_fraction*weight_time_us", True),
        ("Max(gemm_time_us, weight_time_us)", True),
        ("sqrt(Abs(kv_io_time_us*weight_time_us))", True),
        ("pdiv(num_prefill_reqs, kv_io_time_us)", False),
        ("n_layers*tp", False),
        ("kv_tokens + weight_time_us", False),  # mixed units: a count term, not an efficiency
        ("log(1 + Abs(kv_tokens))", False),
    ],
)
def test_term_units(text, efficiency):
    assert is_efficiency_term(parse_infix(text)) is efficiency
    assert (term_unit(parse_infix(text)) == MICROSECONDS) is efficiency


def test_efficiency_is_held_inside_its_bounds():
    table = planted_table(noise=0.0)  # truth: 1.3 weight + 1.5 kv_io + 40 calls + 1500
    prog = (OP("add"), OP("add"), V("weight_time_us"), V("kv_io_time_us"), V("allreduce_calls"))
    free = score_program(prog, FitnessContext(table))
    assert free.coefficients == pytest.approx([1.3, 1.5, 40.0], rel=1e-6)
    tight = score_program(prog, FitnessContext(table, efficiency_bounds=(0.5, 1.4)))
    assert tight.coefficients[1] == pytest.approx(1.4)  # kv_io capped at the upper bound
    assert 0.5 <= tight.coefficients[0] <= 1.4
    # a µs term the data does not want still gets at least the lower bound: its ideal time
    prog2 = (OP("add"), OP("add"), V("weight_time_us"), V("kv_io_time_us"), V("allreduce_time_us"))
    s = score_program(prog2, FitnessContext(table))
    assert min(s.coefficients) >= 1.0 - 1e-12


C = lambda value: ("const", value)  # noqa: E731


def test_a_literal_inside_a_term_does_not_escape_its_bounds():
    # the data wants 1.5 on kv_io; bounded to 1.4, ``2*kv_io`` may not reach it at c = 0.75
    table = planted_table(noise=0.0)
    doubled = (OP("add"), OP("add"), V("weight_time_us"), OP("mul"), C(2.0), V("kv_io_time_us"), V("allreduce_calls"))
    s = score_program(doubled, FitnessContext(table, efficiency_bounds=(0.5, 1.4)))
    assert s.ok and 2 * s.coefficients[1] == pytest.approx(1.4)
    # a literal times a work: 10*weight_time_us at the truth's 1.3 takes c = 0.13, below the run's lower bound 1
    scaled = (OP("add"), OP("add"), OP("mul"), C(10.0), V("weight_time_us"), V("kv_io_time_us"), V("allreduce_calls"))
    s = score_program(scaled, FitnessContext(table))
    assert s.ok and s.coefficients == pytest.approx([0.13, 1.5, 40.0], rel=1e-6)
    expression = to_infix(linear_model_sympy(s.terms, s.coefficients, s.intercept))
    assert not any(r["outside_bounds"] for r in term_efficiencies(expression))


def test_a_work_priced_in_two_terms_scores_worst():
    # kv_io in two terms: its efficiency would be their sum, which bounds on each do not hold
    table = planted_table(noise=0.0)
    twice = (OP("add"), OP("add"), V("weight_time_us"), V("kv_io_time_us"), OP("add"), V("kv_io_time_us"))
    twice += (V("allreduce_calls"),)
    assert not score_program(twice, FitnessContext(table)).ok
    # counts may repeat: per-call costs add up, each >= 0
    calls = (OP("add"), OP("add"), V("weight_time_us"), V("allreduce_calls"), V("allreduce_calls"))
    assert score_program(calls, FitnessContext(table)).ok
    # the same through a ratio factor: on a dense model (fraction 1) KV would be read at the sum
    ratio = (OP("mul"), V("kv_io_time_us"), V("moe_touched_fraction"))
    via_ratio = (OP("add"), OP("add"), V("weight_time_us"), V("kv_io_time_us"), OP("add"), *ratio)
    assert not score_program(via_ratio + (V("allreduce_calls"),), FitnessContext(table)).ok


def test_a_term_is_bounded_through_each_of_its_works():
    bounds = as_bounds((1.0, 4.0), {"kv_io_time_us": 1.16}, {"kv_io_time_us": 1.0549})

    def interval(text):
        return bounds.coefficient_interval(work_factors(parse_infix(text)))

    assert interval("gemm_time_us + kv_io_time_us") == (1.0549, 1.16)  # KV's measured price holds inside a sum too
    assert interval("Max(weight_time_us, kv_io_time_us)") == (1.0549, 1.16)  # and for whichever branch wins
    assert interval("Max(weight_time_us, 2*kv_io_time_us)") is None  # KV at 2c, weights at c: no c suits both
    assert interval("pdiv(weight_time_us, 0.5)") == (0.5, 2.0)
    assert interval("pdiv(2*weight_time_us, moe_touched_fraction)") == (0.5, 2.0)  # a ratio no bound sees
    assert interval("gemm_time_us + 27.7") == (1.0, 4.0)  # a µs constant is no work
    assert interval("gemm_time_us + 10*kv_io_time_us") is None
    # a literal hidden in a ratio factor or a denominator, a product or ratio of times: no factor describes them
    for hidden in (
        "pdiv(weight_time_us, 0.5*moe_touched_fraction)",
        "weight_time_us*pdiv(10.0, moe_topk_ratio)",
        "weight_time_us*(9.0 + moe_topk_ratio)",
        "pdiv(weight_time_us, moe_touched_fraction - 1)",
        "3*weight_time_us*pdiv(gemm_time_us, 2*kv_io_time_us)",
    ):
        assert work_factors(parse_infix(hidden)) is None, hidden
    # a Max inside a sum: weights at 1 (the Max picks 2*gemm) to 2 (it picks them), so c from 1 to 2
    inner_sum = work_factors(parse_infix("Max(0.5, weight_time_us + Max(weight_time_us, 2*gemm_time_us))"))
    assert inner_sum == (("gemm_time_us", 2.0, 2.0), ("weight_time_us", 1.0, 2.0))
    assert work_factors(parse_infix("weight_time_us + Max(weight_time_us, 2*gemm_time_us)")) is None  # two parts
    # before, that Max gave weights 2 to 2 and c down to 0.5: weights at 0.5 where the Max picks gemm
    assert interval("Max(kv_io_time_us, weight_time_us + Max(weight_time_us, 2*gemm_time_us))") == (1.0549, 1.16)
    assert interval("Max(0.5, weight_time_us + Max(weight_time_us, 2*gemm_time_us))") == (1.0, 2.0)
    # a literal inside Max scales the works under it: 2 and 3 on gemm and attention, so c from 0.5 to 4/3
    assert interval("Max(189.0, 2*gemm_time_us + 3*decode_attention_time_us)") == pytest.approx((0.5, 4 / 3))
    (row,) = term_efficiencies("0.72*Max(189.0, 2*gemm_time_us + 3*decode_attention_time_us)", bounds)
    assert (row["lower"], row["upper"], row["outside_bounds"]) == (pytest.approx(0.5), pytest.approx(4 / 3), False)
    # one primitive per term: in two terms, or in two parts of one (refitted apart from the archive), no interval
    terms = [parse_infix(t) for t in ("gemm_time_us", "tp", "Max(weight_time_us, kv_io_time_us)")]
    assert sympy_term_intervals(terms, bounds) == [(1.0, 4.0), None, (1.0549, 1.16)]
    for twice in (
        ["kv_io_time_us", "2*kv_io_time_us"],
        ["kv_io_time_us", "kv_io_time_us*moe_touched_fraction"],
        ["gemm_time_us", "Max(gemm_time_us, kv_io_time_us)"],
        ["1.5*gemm_time_us + 1.5*Max(gemm_time_us, kv_io_time_us)"],
    ):
        assert sympy_term_intervals([parse_infix(t) for t in twice], bounds) is None, twice
    # an archive from before: a literal no coefficient keeps inside, and a work merged from two terms
    rows = term_efficiencies("Max(gemm_time_us, 10*kv_io_time_us) + 2.1098*kv_io_time_us", bounds)
    assert {r["term"]: bound_flag(r) for r in rows} == {
        "Max(gemm_time_us, 10*kv_io_time_us)": "OUTSIDE its bounds (at any coefficient)",
        "kv_io_time_us": "OUTSIDE its bounds (1.0549-1.16)",
    }


def test_a_term_that_subtracts_time_scores_worst():
    table = planted_table(noise=0.0)
    prog = (OP("add"), V("weight_time_us"), OP("sub"), V("kv_io_time_us"), V("matmul_time_us"))
    assert not score_program(prog, FitnessContext(table)).ok
    rows = term_efficiencies("100 + 1.2*weight_time_us + 846.6*matmul_time_us - 846.8*kv_io_time_us")
    kinds = {r["term"]: r["kind"] for r in rows}
    assert kinds == {"weight_time_us": "efficiency", "matmul_time_us": "efficiency", "kv_io_time_us": "negative time"}
    rows = term_efficiencies("4.0*weight_time_us + 0.5*kv_io_time_us", (0.5, 4.0))
    bounds = {r["term"]: r["on_bound"] for r in rows}
    assert bounds == {"weight_time_us": "upper", "kv_io_time_us": "lower"}


@pytest.mark.parametrize("text", ["gemm_time_us - 27.7", "2*(kv_io_time_us + gemm_time_us - 40)"])
def test_a_time_term_with_a_negative_offset_is_a_negative_time(text):
    # fitted, the offset becomes a negative intercept: a step that takes less than no time
    from fitness.scoring import term_kind

    assert term_kind(parse_infix(text)) == "negative time"
    assert term_kind(parse_infix("gemm_time_us + 27.7")) == "efficiency"


@pytest.mark.parametrize(
    "text",
    [
        "2121.7*tp - 15.9*allreduce_calls",  # an all-reduce that saves time
        "tp - 1",  # fitted, a negative intercept
        "n_layers*(batch_size - 2)",
        # hidden where expansion does not reach: tp - allreduce_calls on every dense model
        "pdiv(tp - allreduce_calls, moe_topk_ratio)",
        "pdiv(-1.0, tp)",
        "n_layers*Min(0.5, 1.0 - tp)",
        "Max(tp, 2 - n_layers)",
        "batch_size - num_decode_reqs",  # by its form, though it is num_prefill_reqs
    ],
)
def test_a_count_term_with_a_negative_part_is_a_negative_count(text):
    from fitness.scoring import term_kind

    assert term_kind(parse_infix(text)) == "negative count"


@pytest.mark.parametrize(
    "text", ["2121.7*tp + 15.9*allreduce_calls", "pdiv(tp, n_layers)", "tp*(33.9 + n_layers)", "Max(tp, n_layers)"]
)
def test_a_count_term_without_a_negative_part_is_a_count(text):
    from fitness.scoring import term_kind

    assert term_kind(parse_infix(text)) == "count"  # a division's exponent of -1 is no negative part
    # under an absolute value (psqrt, plog) a difference is no negative part either
    assert term_kind(sp.sqrt(sp.Abs(parse_infix("tp") - parse_infix("n_layers")))) == "count"


def test_a_term_that_subtracts_a_count_scores_worst_and_an_older_archive_s_is_flagged():
    table = planted_table(noise=0.0)
    prog = (OP("add"), V("weight_time_us"), OP("sub"), V("tp"), V("allreduce_calls"))
    assert not score_program(prog, FitnessContext(table)).ok
    hidden = (OP("add"), V("weight_time_us"), OP("pdiv"), OP("sub"), V("tp"), V("allreduce_calls"), V("moe_topk_ratio"))
    assert not score_program(hidden, FitnessContext(table)).ok
    assert score_program((OP("add"), V("weight_time_us"), V("allreduce_calls")), FitnessContext(table)).ok
    # a trace run's front held this one (complexity 21) before the rule
    text = "80.49 + matmul_time_us + weight_time_us + 1.0549*kv_io_time_us + 2121.7*tp - 15.907*allreduce_calls"
    rows = {r["term"]: r for r in term_efficiencies(text, (1.0, 4.0))}
    assert rows["allreduce_calls"]["kind"] == "negative count" and bound_flag(rows["allreduce_calls"]) == "NEGATIVE"
    assert rows["tp"]["kind"] == "count" and bound_flag(rows["tp"]) == ""
    # an older archive's c*(tp - 1): shown as c*tp and a negative intercept, which is flagged
    rows = {r["term"]: r for r in term_efficiencies("-2041.7 + 2121.7*tp + weight_time_us", (1.0, 4.0))}
    assert rows["1"]["kind"] == "negative time" and bound_flag(rows["1"]) == "NEGATIVE"
    assert "1" not in {r["term"] for r in term_efficiencies("20.0 + 2121.7*tp + weight_time_us", (1.0, 4.0))}


def test_models_faster_under_more_work_score_worst():
    # data with a term that falls as the batch grows: pdiv(layers, batch) fits it, but is faster with more work
    table = planted_table(noise=0.0)
    cols = table.columns
    table.cycle_time_us = table.cycle_time_us + 2e4 * cols["n_layers"] / cols["batch_size"]
    probes = PhysicsProbes.build(table.deployments, table.primitive_names, floor_fraction=1e-9)  # monotone only
    bad = (OP("add"), V("weight_time_us"), OP("pdiv"), V("n_layers"), V("batch_size"))
    unchecked = score_program(bad, FitnessContext(table))
    assert unchecked.ok and unchecked.coefficients[1] > 0
    assert not score_program(bad, FitnessContext(table, probes=probes)).ok
    good = (OP("add"), V("weight_time_us"), V("kv_io_time_us"))
    assert score_program(good, FitnessContext(table, probes=probes)).ok
    deps = [R.resolve("llama-2-70b", 4)]
    assert monotone_on_probes("1.1*gemm_time_us + 1.3*decode_attention_time_us + prefill_attention_time_us", deps)
    assert not monotone_on_probes("1000 - 0.1*kv_tokens + weight_time_us", deps)


def test_every_primitive_is_monotone_on_the_probes():
    # every deployment the search probes: a primitive's own wiggle would reject every candidate using it
    deps = R.with_catalog([R.resolve("llama-2-7b", 1)])
    from primitives.registry import PRIMITIVES

    probes = PhysicsProbes.build(deps, [p.name for p in PRIMITIVES])
    for p in PRIMITIVES:
        base, heavy = probes.predictions(lambda cols, n, name=p.name: cols[name])
        assert monotone(base, heavy, probes.base_fits, probes.heavier_fits), p.name
    assert probes.base_fits.any() and not probes.base_fits.all()  # 128 requests of 16k tokens do not fit


def test_a_step_is_never_faster_than_half_its_measured_kernels():
    deps = [R.resolve(m, tp) for m, tp in [("llama-2-7b", 1), ("llama-2-70b", 4)]]
    # weights and KV streamed at full bandwidth, no prefill compute: far too fast for a 2,048-token chunk
    no_prefill = probe_check("1.1*weight_time_us + 1.1*kv_io_time_us + 2000", deps)
    assert no_prefill["monotone"] and no_prefill["kernel_floor_ratio_min"] < 1
    kernels = probe_check("0.6*gemm_time_us + 0.6*decode_attention_time_us + 0.6*prefill_attention_time_us", deps)
    assert kernels["kernel_floor_ratio_min"] == pytest.approx(1.2)
    table = planted_table(noise=0.0)
    probes = PhysicsProbes.build(table.deployments, table.primitive_names)
    fast = (OP("add"), V("weight_time_us"), V("kv_io_time_us"))
    assert (
        score_program(fast, FitnessContext(table)).ok
        and not score_program(fast, FitnessContext(table, probes=probes)).ok
    )


def test_shared_prefixes_count_once_in_blocks_and_per_request_in_kv_tokens():
    # 2 prompts in one group, shared by every user of it: many running requests hold the same prefix
    spec = spec_(stages=((20.0, 4.0),), num_groups=1, num_prompts_per_group=2, system_prompt_len=160, max_num_seqs=8)
    res = simulate(spec, DEP, ConstModel(step_us=20_000), seed=3, kv_capacity_blocks=10_000)
    traj = res.trajectory
    kv = traj.features(["kv_tokens"])["kv_tokens"]
    busy = kv > 0
    assert (traj.step_kv_block_tokens[busy] < kv[busy]).any()  # sharing: fewer distinct tokens
    assert kv_sharing_factor(traj) > 1.2


# the expressions below as programs, where the planted steps hold their columns (they have no per-request detail)
AS_PROGRAMS = {
    "kv_io_time_us - num_prefill_reqs": (OP("sub"), V("kv_io_time_us"), V("num_prefill_reqs")),
    "gemm_time_us*tp": (OP("mul"), V("gemm_time_us"), V("tp")),
    "pdiv(num_prefill_reqs, kv_io_time_us)": (OP("pdiv"), V("num_prefill_reqs"), V("kv_io_time_us")),
    "kv_tokens": (V("kv_tokens"),),
    "batch_size + kv_tokens": (OP("add"), V("batch_size"), V("kv_tokens")),
}


def _scores_worst_beside_a_priced_twin(text: str) -> bool:
    """Weight time plus TEXT scores worst on the planted steps, where weight time plus KV time scores."""
    table = planted_table(noise=0.0)
    twin = (OP("add"), V("weight_time_us"), V("kv_io_time_us"))
    assert score_program(twin, FitnessContext(table)).ok
    return not score_program((OP("add"), V("weight_time_us"), *AS_PROGRAMS[text]), FitnessContext(table)).ok


@pytest.mark.parametrize(
    "text", ["kv_io_time_us - num_prefill_reqs", "gemm_time_us*tp", "pdiv(num_prefill_reqs, kv_io_time_us)"]
)
def test_a_time_mixed_with_counts_scores_worst(text):
    # its coefficient is no efficiency, and as a count it would escape the efficiency bounds
    from fitness.scoring import term_kind
    from primitives.language import parse_infix

    assert term_kind(parse_infix(text)) == "mixed time"
    if "-" not in text:  # an archived expression is expanded: a difference shows as two terms
        rows = term_efficiencies(f"100 + 1.2*weight_time_us + 0.4*{text}")
        assert sorted(r["kind"] for r in rows) == ["efficiency", "mixed time"]
    assert _scores_worst_beside_a_priced_twin(text)


@pytest.mark.parametrize(
    "text", ["kv_tokens", "attention_work*n_layers", "sqrt(max_kv_tokens)", "batch_size + kv_tokens"]
)
def test_kv_and_attention_counts_are_unpriced_work_and_score_worst(text):
    # what a KV token or an attention pair costs depends on the model and GPU: it is priced by
    # kv_io_time_us or the attention primitives, never by one µs-per-token for every model
    from fitness.scoring import term_kind

    assert term_kind(parse_infix(text)) == "unpriced work"
    if text in AS_PROGRAMS:  # attention_work and max_kv_tokens need per-request detail, which the planted steps lack
        assert _scores_worst_beside_a_priced_twin(text)


@pytest.mark.parametrize("text", ["batch_size", "n_layers*num_decode_reqs", "allreduce_calls", "prefill_tokens"])
def test_requests_layers_calls_and_tokens_stay_counts(text):
    from fitness.scoring import term_kind

    assert term_kind(parse_infix(text)) == "count"


def test_the_run_default_bounds_are_the_scoring_default():
    from evolve.config import RunConfig
    from fitness.efficiency import DEFAULT_EFFICIENCY_BOUNDS

    assert tuple(RunConfig().efficiency_bounds) == DEFAULT_EFFICIENCY_BOUNDS == (1.0, 4.0)


def test_work_the_data_never_saw_is_priced_at_its_lower_bound():
    """A decode-only trace never shows prefill: its efficiency term keeps its ideal time (the
    lower bound), not nothing, so the fit still pays for prefill on the probes."""
    import numpy as np

    from fitness.bounded_lsq import bounded_gram

    seen = np.array([1.0, 2.0, 3.0, 5.0])
    a = np.column_stack([seen, np.zeros(4), np.zeros(4), np.ones(4)])  # efficiency, unseen efficiency, unseen count
    b = 2.0 * seen + 5.0
    lower, upper = np.array([1.0, 1.0, 0.0, -np.inf]), np.array([4.0, 4.0, np.inf, np.inf])
    assert bounded_gram(a.T @ a, a.T @ b, lower, upper) == pytest.approx([2.0, 1.0, 0.0, 5.0])
