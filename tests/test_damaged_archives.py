"""An archive edited by hand, or made by another version, fails in one line where a command
would price or export one of its models: a run configuration the scoring reads (the seed of
the draws, the efficiency bounds), an expression that is not finite or names no primitive.
A path too long to use is bad input too."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from error_lines import assert_one_line_error, call
from test_cli_archive import entry

from archive.store import ArchiveStore


def _archive(root: Path, config: dict, *entries) -> Path:
    with ArchiveStore(root / "archive.sqlite") as store:
        store.start_run("run-1", {"generations": 1}, 0, "fp")
        store.record_generation("run-1", 0, list(entries), list(entries), {})
        store.finish_run("run-1", {"generations": 1})
    con = sqlite3.connect(root / "archive.sqlite")  # as a hand edit would leave it
    with con:
        con.execute("UPDATE runs SET config_json = ?", (json.dumps({"generations": 1, **config}),))
    con.close()
    return root


GOOD = entry("1.1*gemm_time_us + 1.2*kv_io_time_us", 7, 0.1, 0.1)


@pytest.mark.parametrize(
    "config, needles",
    [
        ({"seed": "abc"}, ["seed", "non-negative integer"]),
        ({"efficiency_bounds": "x"}, ["efficiency_bounds", "[LO, HI]"]),
        ({"efficiency_bounds": [0.5, "four"]}, ["efficiency_bounds", "a number"]),
        ({"efficiency_caps": {"kv_io_time_us": None}}, ["efficiency_caps.kv_io_time_us", "a number"]),
        ({"step_scatter": 3}, ["step_scatter", "a mapping"]),
        ({"step_scatter": {"quantiles": [1.0, 1e308], "steps": 9, "source": "t"}}, ["quantiles[1]", "at most 256"]),
    ],
)
def test_a_damaged_run_configuration_is_one_line(config, needles, work, capsys):
    run = _archive(work / "runs" / "d", config, GOOD)
    rc, _, err = call(["score", GOOD.id, "--data", "good.csv", "--run-dir", run], capsys)
    assert_one_line_error(
        rc, err, "archive.sqlite", f"the run of entry {GOOD.id}", "damaged run configuration", *needles
    )
    rc, _, err = call(["archive", "show", GOOD.id, "--run-dir", run], capsys)  # its efficiency table reads it
    assert_one_line_error(rc, err, "damaged run configuration", *needles)
    assert call(["archive", "list", "--run-dir", run], capsys)[0] == 0  # the list shows it as it is


@pytest.mark.parametrize(
    "expression, needle",
    [("1/0 + tp", "not finite (it divides by zero)"), ("2*flux_us + tp", "not a primitive: flux_us")],
)
@pytest.mark.parametrize("command", ["score", "export-go", "validate"])
def test_an_expression_no_evaluator_can_price_is_one_line(expression, needle, command, work, capsys):
    bad = entry(expression, 5, 0.1, 0.1)
    run = _archive(work / "runs" / "e", {}, bad)
    (work / "exps").mkdir()
    given = {"score": ["--data", "good.csv"], "export-go": ["--out", "go"], "validate": ["--experiments", "exps"]}
    rc, _, err = call([command, bad.id, "--run-dir", run, *given[command]], capsys)
    assert_one_line_error(rc, err, "archive.sqlite", f"entry {bad.id}: expression", needle)
    assert not (work / "go").exists()


def test_a_path_too_long_to_use_is_one_line(work, capsys):
    long_name = "a" * 300
    rc, _, err = call(["archive", "list", "--run-dir", long_name], capsys)
    assert_one_line_error(rc, err, long_name, "file name too long")
    rc, _, err = call(["run", "--generations", "1", "--data", "good.csv", "--run-dir", f"runs/{long_name}"], capsys)
    assert_one_line_error(rc, err, long_name, "--run-dir", "name too long")


def test_refit_rounds_without_a_transfer_check_is_refused(work, capsys):
    """The closed loop refits nothing: the option would be ignored without a word."""
    (work / "exps").mkdir()
    rc, _, err = call(["validate", "abc", "--experiments", "exps", "--refit-rounds", "2"], capsys)
    assert_one_line_error(rc, err, "--refit-rounds", "only with --lomo, --lowo or --stage-transfer")
