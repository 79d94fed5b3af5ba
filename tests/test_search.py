"""The search: seeds, determinism for a fixed seed, recovery of a planted law, a short run."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import SUBPROCESS_ENV, small_trace, tiny_replay_rows

from evolve.config import RunConfig
from evolve.evaluator import Evaluator
from evolve.search import Search
from evolve.toolbox import build_pset, tree_to_program
from fitness.dataset import StepTable
from fitness.scoring import FitnessContext, score_program
from primitives.compute import constant_columns, kernel_binding, primitive_columns
from primitives.deployment import default_resolver
from primitives.language import canonical
from primitives.registry import AGGREGATE_FEATURES, supported_primitives
from seeds import SEEDS, seeds_for


def planted_table(n=3000, seed=0, noise=0.02):
    """Steps of four deployments whose cycle time follows a known physics law."""
    rng = np.random.default_rng(seed)
    r = default_resolver()
    deployments = [("llama-2-7b", 1), ("llama-2-70b", 4), ("codellama-34b", 2), ("mixtral-8x7b-v0-1", 2)]
    deps = [r.resolve(m, tp) for m, tp in deployments]
    exp = rng.integers(0, 4, n)
    decode = rng.integers(1, 128, n).astype(float)
    feats = {
        "decode_tokens": decode,
        "num_decode_reqs": decode,
        "prefill_tokens": rng.choice([0.0, 16.0, 1500.0], n),
        "num_prefill_reqs": rng.integers(0, 2, n).astype(float),
        "kv_tokens": decode * rng.uniform(300, 900, n),
    }
    names = supported_primitives(AGGREGATE_FEATURES)
    cols = primitive_columns(feats, constant_columns(deps, exp), names, kernel_binding(names, deps, exp))
    truth = 1.3 * cols["weight_time_us"] + 1.5 * cols["kv_io_time_us"] + 40 * cols["allreduce_calls"] + 1500.0
    target = truth * rng.lognormal(0, noise, n)
    order = np.arange(n)
    return StepTable(
        cols, target, exp, ["a", "b", "c", "d"], order < int(0.8 * n), names, deps, [0, 1, 2, 3], "planted"
    )


def test_seeds_parse_and_score():
    table = planted_table()
    pset = build_pset(table.primitive_names)
    from deap import gp

    avail = seeds_for(table.primitive_names)
    assert "blis_blackbox" in avail and "roofline_aggregate" in avail and "trained_physics_aggregate" in avail
    assert "roofline" not in avail  # needs attention_time_us, a per-request primitive
    for text in avail.values():
        prog = tree_to_program(gp.PrimitiveTree.from_string(text, pset))
        assert score_program(prog, FitnessContext(table)).ok
    assert set(SEEDS) >= {"blis_blackbox", "roofline", "trained_physics"}


def test_least_squares_recovers_planted_coefficients():
    table = planted_table(noise=0.0)
    prog = (
        ("op", "add"),
        ("op", "add"),
        ("var", "weight_time_us"),
        ("var", "kv_io_time_us"),
        ("var", "allreduce_calls"),
    )
    s = score_program(prog, FitnessContext(table))
    assert s.coefficients == pytest.approx([1.3, 1.5, 40.0], rel=1e-6)
    assert s.intercept == pytest.approx(1500.0, rel=1e-6)
    assert s.objectives["step_mape"] < 1e-9


def test_nan_and_inf_candidates_get_the_worst_score_not_a_crash():
    table = planted_table()
    bad = (("op", "mul"), ("const", 1e300), ("op", "mul"), ("const", 1e300), ("var", "weight_time_us"))
    assert not score_program(bad, FitnessContext(table)).ok


def _run(seed, jobs):
    table = planted_table(n=1500)
    cfg = RunConfig(generations=4, population=40, seed=seed, jobs=jobs)
    with Evaluator(FitnessContext(table), jobs) as ev:
        s = Search(cfg, FitnessContext(table), table.primitive_names, ev)
        s.initialise()
        for _ in range(cfg.generations):
            s.step()
        return [(canonical(p), round(sc.train_error, 12)) for p, sc in s.front()]


def test_same_seed_same_front_and_jobs_do_not_matter():
    a = _run(3, 1)
    assert a == _run(3, 1)
    assert a == _run(3, 2)
    assert a != _run(4, 1)


def test_short_end_to_end_run_writes_an_archive(tmp_path):
    # a small trace in the real flat schema, written as CSV
    small_trace().to_csv(tmp_path / "trace.csv", index=False)
    # the planted law (8000 + 60*decode) prices a 2,048-token prefill below Llama-2-7B's measured
    # matmuls: only with a floor at half the kernels do models near it pass the physics probes
    cmd = [sys.executable, "-m", "evolve", "run", "--generations", "3", "--population", "24", "--data", "trace.csv"]
    cmd += ["--efficiency-bounds", "0.5,4"]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=SUBPROCESS_ENV)
    assert res.returncode == 0, res.stderr
    out = subprocess.run(
        [sys.executable, "-m", "evolve", "archive", "list", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
    )
    assert out.returncode == 0, out.stderr
    front = json.loads(out.stdout)
    assert front and all({"id", "expression", "complexity", "objectives"} <= set(e) for e in front)
    best = min(front, key=lambda e: e["objectives"]["step_mape"])
    assert best["objectives"]["step_mape"] < 0.05  # cycle = 8000 + 60*decode exactly: easy to find


def test_unique_candidates_count_across_trajectory_refreshes():
    # a refresh empties the memo (scores change with the trajectories), not the count of
    # candidates the run has seen, which run.json reports as unique_candidates
    table = planted_table(n=300)
    a = (("var", "weight_time_us"),)
    b = (("op", "add"), ("var", "weight_time_us"), ("var", "kv_io_time_us"))
    with Evaluator(FitnessContext(table), 1) as ev:
        ev.score([a, b, a])
        ev.reset(FitnessContext(table))
        assert not ev.memo
        ev.score([a])
        assert len(ev.seen) == 2 and len(ev.memo) == 1


def test_an_interrupt_while_rescoring_under_new_rows_leaves_the_search_as_it_was():
    """A trajectory refresh rescored the hall in place: an interrupt halfway left a hall
    half rescored, which the run then archived and checkpointed. Now it stays whole."""
    table = planted_table(n=1500)
    cfg = RunConfig(generations=2, population=40, seed=3, jobs=1)
    ctx = FitnessContext(table)
    with Evaluator(ctx, 1) as ev:
        s = Search(cfg, ctx, table.primitive_names, ev)
        s.initialise()
        s.step()
        before = [(canonical(p), sc.train_error) for p, sc in s.front()]
        real_score = ev.score

        def interrupted(programs):
            real_score(programs[: len(programs) // 2])  # half the work done, then Ctrl-C
            raise KeyboardInterrupt("signal 2")

        ev.score = interrupted
        new_ctx = FitnessContext(planted_table(n=1500, seed=1))
        with pytest.raises(KeyboardInterrupt):
            s.replace_context(new_ctx)
        assert s.ctx is ctx and ev.ctx is ctx
        assert [(canonical(p), sc.train_error) for p, sc in s.front()] == before  # the same front, same scores
        ev.score = real_score
        s.replace_context(new_ctx)  # uninterrupted, it takes the new rows
        assert s.ctx is new_ctx and [canonical(p) for p, _ in s.front()]


def test_a_step_only_search_keeps_one_candidate_per_objective_vector():
    """Two programs that fit the same (a refitted coefficient absorbs 2 against 3) are one
    phenotype: a step-only search keeps one and makes room for another structure; a search
    with replayed experiments, whose every new candidate costs simulations, keeps both."""
    table = planted_table(n=1500)
    twice = (("op", "mul"), ("const", 2.0), ("var", "weight_time_us"))
    thrice = (("op", "mul"), ("const", 3.0), ("var", "weight_time_us"))
    other = (("op", "add"), ("var", "decode_tokens"), ("op", "mul"), ("const", 2.0), ("var", "kv_tokens"))
    ctx = FitnessContext(table)
    cfg = RunConfig(generations=1, population=2, seed=0, jobs=1)
    with Evaluator(ctx, 1) as ev:
        s = Search(cfg, ctx, table.primitive_names, ev)
        a, b, c = ev.score([twice, thrice, other])
        assert (a.train_error, a.complexity) == pytest.approx((b.train_error, b.complexity), rel=1e-12)
        assert a.train_error < c.train_error and a.complexity < c.complexity  # other is dominated
        assert set(s._select([twice, thrice, other], 2)) == {twice, other}
        s.distinct_objectives = False  # as with replayed experiments
        assert set(s._select([twice, thrice, other], 2)) == {twice, thrice}
        with_replay = FitnessContext(table, replay=tiny_replay_rows())
        assert not Search(cfg, with_replay, table.primitive_names, ev).distinct_objectives


def test_a_resumed_run_scores_each_form_as_the_interrupted_run_did():
    """A fit follows its program's term order, so two mirrored copies of one canonical form
    differ in the last bits. The memo holds the copy scored first; a resumed run, whose memo
    starts empty, scored whichever copy came first after the resume, and took other branches
    on those bits (a front that differed at complexity 7 and 9). The checkpoint now carries
    the scored copies."""
    table = planted_table(n=1500)
    ab = (("op", "add"), ("var", "weight_time_us"), ("var", "kv_io_time_us"))
    ba = (("op", "add"), ("var", "kv_io_time_us"), ("var", "weight_time_us"))
    assert canonical(ab) == canonical(ba)
    ctx = FitnessContext(table)
    with Evaluator(ctx, 1) as ev:
        (first,) = ev.score([ab])
    with Evaluator(ctx, 1) as fresh:
        (mirror,) = fresh.score([ba])
    assert mirror.objectives != first.objectives  # apart in the last bits: what the resume lost
    with Evaluator(ctx, 1) as resumed:
        resumed.scored_copies.update({canonical(ab): ab})
        (again,) = resumed.score([ba])
    assert again == first


def test_a_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_run(tmp_path):
    table = planted_table(n=1500)
    cfg = RunConfig(generations=6, population=40, seed=5, jobs=1)
    ctx = FitnessContext(table)

    def front(s):
        return [(canonical(p), sc.train_error, tuple(sc.coefficients)) for p, sc in s.front()]

    with Evaluator(ctx, 1) as ev:
        whole = Search(cfg, ctx, table.primitive_names, ev)
        whole.initialise()
        for _ in range(6):
            whole.step()
    with Evaluator(ctx, 1) as ev:
        first = Search(cfg, ctx, table.primitive_names, ev)
        first.initialise()
        for _ in range(3):
            first.step()
        first.save_checkpoint(tmp_path / "checkpoint.pkl")
    with Evaluator(ctx, 1) as ev:
        resumed = Search(cfg, ctx, table.primitive_names, ev)
        resumed.load_checkpoint(tmp_path / "checkpoint.pkl")
        for _ in range(3):
            resumed.step()
    assert front(resumed) == front(whole)
    assert resumed.state.population == whole.state.population
