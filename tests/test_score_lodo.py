"""`score --lodo`: leave one deployment out, refit the entry's constants on the others' steps
(fitness.step_errors.deployment_transfer)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import small_trace
from error_lines import assert_one_line_error, call
from test_search import planted_table

from fitness.step_errors import deployment_transfer
from primitives.errors import InputError
from primitives.language import parse_infix


def _entry(expression: str) -> SimpleNamespace:
    return SimpleNamespace(expression=expression, run_config={})


def test_a_law_every_deployment_shares_carries_to_each_left_out():
    table = planted_table(noise=0.0)  # 1.3*weight_time_us + 1.5*kv_io_time_us + 40*allreduce_calls + 1500
    law = "1500 + 1.3*weight_time_us + 1.5*kv_io_time_us + 40*allreduce_calls"
    rows = deployment_transfer(_entry(law), parse_infix(law), table)
    assert [r["deployment"] for r in rows] == [f"{d.model.name} tp{d.tp} {d.gpu.name}" for d in table.deployments]
    assert all(r["pinned"] for r in rows)  # intercept, weights and all-reduces: 3 constants, 3 deployments
    assert sum(r["n"] for r in rows) == table.n
    for r in rows:
        assert r["mape_stored"] == pytest.approx(0.0, abs=1e-9)
        assert r["mape_refit"] == pytest.approx(0.0, abs=1e-6)
        assert parse_infix(r["refit"]).free_symbols == parse_infix(law).free_symbols


def test_a_per_gpu_stand_in_fits_in_place_and_misses_a_deployment_left_out():
    from deap import gp

    from evolve.toolbox import build_pset, tree_to_program
    from fitness.scoring import FitnessContext, score_program

    table = planted_table(noise=0.0)
    # a cost per GPU stands in for the all-reduces (TP1 has none; TP4 more than TP2): fitted
    # on all four deployments it is close, and left out, a deployment shows what it missed
    names = ["kv_io_time_us", "weight_time_us", "tp"]
    program = gp.PrimitiveTree.from_string(
        "add(add(kv_io_time_us, weight_time_us), tp)", build_pset(table.primitive_names)
    )
    fitted = score_program(tree_to_program(program), FitnessContext(table))
    expression = f"{fitted.intercept} + " + " + ".join(
        f"{c}*{t}" for c, t in zip(fitted.coefficients, names, strict=True)
    )
    rows = deployment_transfer(_entry(expression), parse_infix(expression), table)
    stored = max(r["mape_stored"] for r in rows)
    refit = max(r["mape_refit"] for r in rows)
    assert stored < 0.1 and refit > 2 * stored


def test_constants_one_deployment_cannot_split_are_not_pinned():
    table = planted_table(noise=0.0)
    two = table.subset(table.experiment <= 1)  # Llama-2-7B TP1 and Llama-2-70B TP4
    expression = "1000 + 2000*tp + 1.3*weight_time_us + 1.5*kv_io_time_us"
    rows = deployment_transfer(_entry(expression), parse_infix(expression), two)
    assert len(rows) == 2 and not any(r["pinned"] for r in rows)  # tp and the weights: constant per deployment
    varying = "1000 + 1.5*kv_io_time_us"  # the intercept alone is pinned by one deployment
    assert all(r["pinned"] for r in deployment_transfer(_entry(varying), parse_infix(varying), two))


def test_one_deployment_is_a_one_line_error(work, capsys, archive):
    run_dir, entry_id, trace = archive
    with pytest.raises(InputError, match="two or more deployments"):
        table = planted_table(noise=0.0)
        one = table.subset(table.experiment == 0)
        deployment_transfer(_entry("weight_time_us"), parse_infix("weight_time_us"), one)
    rc, out, err = call(["score", entry_id, "--data", trace, "--run-dir", run_dir, "--lodo"], capsys)
    assert_one_line_error(rc, err, "--lodo", "two or more deployments")
    assert out == ""  # nothing printed before the error


def test_the_command_prints_and_writes_each_deployment_left_out(work, capsys, archive):
    run_dir, entry_id, _ = archive
    small_trace(300, experiment="20260101-000000-llama-2-7b-tp1-general").to_csv(work / "a.csv", index=False)
    other = small_trace(300, experiment="20260101-000001-llama-2-70b-tp4-general", model="llama-2-70b", tp=4)
    other["step.ts_start_ns"] = other["step.ts_start_ns"] * 2  # a slower deployment
    other.to_csv(work / "b.csv", index=False)
    args = ["score", entry_id, "--data", "a.csv", "b.csv", "--run-dir", run_dir, "--lodo", "--json", "out.json"]
    rc, out, err = call(args, capsys)
    assert rc == 0, err
    assert "Leave one deployment out" in out and "tp4" in out
    held = json.loads((work / "out.json").read_text())["leave_one_deployment_out"]
    assert [r["deployment"].split()[1] for r in held] == ["tp1", "tp4"]
    assert all(set(r) == {"deployment", "n", "mape_stored", "mape_refit", "refit", "pinned"} for r in held)
    assert all(r["n"] > 0 and np.isfinite(r["mape_stored"]) for r in held)
    assert max(len(line) for line in out.splitlines()) <= 80
