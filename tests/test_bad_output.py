"""Outputs that can not be written, and the real process: ONE line on stderr naming the
path and the option; exit status 2; never a traceback (the inputs: ``test_bad_input.py``)."""

import os
from pathlib import Path

import numpy as np
import pytest
from error_lines import assert_one_line_error, call, good_trace, run_args, run_evolve, set_cell

# --- unwritable outputs ---------------------------------------------------------------
needs_proc = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (Linux)")


@needs_proc
def test_score_json_into_proc(archive, work, capsys):
    run_dir, entry_id, data = archive
    rc, _, err = call(["score", entry_id, "--data", data, "--run-dir", run_dir, "--json", "/proc/x.json"], capsys)
    assert_one_line_error(rc, err, "/proc/x.json", "--json", "cannot write")


def test_score_json_below_a_file(archive, work, capsys):
    run_dir, entry_id, data = archive
    rc, _, err = call(["score", entry_id, "--data", data, "--run-dir", run_dir, "--json", "good.csv/x.json"], capsys)
    assert_one_line_error(rc, err, "good.csv/x.json", "--json", "cannot write")


def test_score_json_below_a_file_says_why(archive, work, capsys):
    run_dir, entry_id, data = archive
    rc, _, err = call(["score", entry_id, "--data", data, "--run-dir", run_dir, "--json", "good.csv/x.json"], capsys)
    assert_one_line_error(rc, err, "not a directory")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
def test_score_json_into_a_read_only_directory(archive, read_only_dir, capsys):
    run_dir, entry_id, data = archive
    rc, _, err = call(
        ["score", entry_id, "--data", data, "--run-dir", run_dir, "--json", read_only_dir / "x.json"], capsys
    )
    assert_one_line_error(rc, err, "x.json", "--json", "permission denied")


@needs_proc
@pytest.mark.parametrize("out", ["/proc/stepsynth-go", "good.csv/sub"])
def test_export_go_into_an_unwritable_place(out, archive, work, capsys):
    run_dir, entry_id, _ = archive
    rc, _, err = call(["export-go", entry_id, "--out", out, "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, out, "--out")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
def test_export_go_into_a_read_only_directory(archive, read_only_dir, capsys):
    run_dir, entry_id, _ = archive
    rc, _, err = call(["export-go", entry_id, "--out", read_only_dir, "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, "ro", "--out")


@needs_proc
def test_run_dir_that_cannot_be_created(work, capsys):
    rc, _, err = call(
        ["run", "--generations", "1", "--population", "8", "--data", "good.csv", "--run-dir", "/proc/stepsynth-run"],
        capsys,
    )
    assert_one_line_error(rc, err, "/proc/stepsynth-run", "--run-dir")


# --- the real process: exit status, one stderr line, no traceback ----------------------
@pytest.mark.parametrize("case", ["nan", "unknown_id"])
def test_real_process(case, archive, tmp_path):
    run_dir, _, _ = archive
    if case == "nan":
        set_cell(good_trace(), 4, "batch.decode_tokens", np.nan).to_csv(tmp_path / "bad.csv", index=False)
        args, needles = run_args("bad.csv"), ["bad.csv", "batch.decode_tokens", "NaN"]
    else:
        args, needles = ["archive", "show", "deadbeef", "--run-dir", str(run_dir)], ["'deadbeef'"]
    res = run_evolve(tmp_path, *args)
    assert_one_line_error(res.returncode, res.stderr, *needles)
