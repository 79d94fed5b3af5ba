"""benchmarks/*.py: bad command-line input is refused as the main CLI refuses it.

ONE line on stderr, ``error: `` first, naming the option (or file) and what was expected;
exit status 2; never a traceback; and before any slow work (every call here returns in
about a second). Each script runs as a user runs it: ``python benchmarks/X.py ...`` in a
directory of its own, with no shared data to fall back on (STEPSYNTH_SHARED points
nowhere), so a check that regressed fails here instead of starting a benchmark.
"""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, SUBPROCESS_ENV, load_benchmark
from error_lines import assert_one_line_error

NO_SHARED = "no-shared"  # below the working directory; never created

BAD = [
    ("bench_fitness", ["--rows", "-5"], "--rows"),
    ("bench_fitness", ["--population", "0"], "--population"),
    ("bench_go", ["--tp", "0"], "--tp"),
    ("bench_go", ["--run-dir", "nowhere"], "--run-dir"),
    ("bench_go", ["--run-dir", "full"], "--run-dir"),
    ("bench_go", ["--benchtime", "abc"], "--benchtime"),
    ("bench_go", ["--benchtime", "0x"], "--benchtime"),
    ("bench_go", ["--model", "llama-2-7b", "--tp", "1"], "--run-dir"),  # the default mode ignored them
    ("bench_search", ["--generations", "0"], "--generations"),
    ("bench_search", ["--jobs", "0"], "--jobs"),
    ("bench_search", ["--data", "nowhere"], "--data"),
    ("bench_search", ["--data", "afile", "--experiments", "afile"], "--experiments"),
    ("bench_simulator", ["--seed", "x"], "--seed"),
    ("bench_simulator", ["--experiments", "nowhere"], "nowhere"),
    ("peers", ["--budget", "-1"], "--budget"),
    ("peers", ["--jobs", "0"], "--jobs"),
    ("peers", ["--systems", "nobody"], "--systems"),
    ("peers", ["--systems", "stepsynth", "--json", "afile/out.json"], "--json"),
    ("peers", ["--systems", "stepsynth"], "STEPSYNTH_SHARED"),  # no shared step traces
    ("peers_blis", ["--merge", "nowhere.json"], "--merge"),
    ("peers_blis", ["--merge", "empty.json"], "--merge"),
    ("peers_blis", ["--merge", "notjson.json"], "--merge"),
    ("peers_blis", ["--merge", "list.json"], "--merge"),
    ("peers_blis", ["--jobs", "0"], "--jobs"),
    ("peers_blis", ["--experiments", "full", "--run-dir", "nowhere"], "--run-dir"),
    ("primitives_table", ["--shared", "nowhere"], "--shared"),
    ("rank_check", ["--generations", "-1"], "--generations"),
    ("front_spread", ["--run-dir", "x", "--experiments", "y", "--max-e2e", "-1"], "--max-e2e"),
    ("front_spread", ["--run-dir", "x", "--experiments", "y", "--jobs", "0"], "--jobs"),
    ("fresh_server", ["--run-dir", "full", "--id", "x"], "--run-dir"),
    ("knee_whatif", ["--run-dir", "full", "--id", "x"], "--run-dir"),
    ("trace_checks", ["--id", "x"], "--run-dir"),
    ("trace_checks", ["--data", "nowhere.parquet"], "--data"),
    ("ttft_load", ["nowhere.json"], "nowhere.json"),
    ("stage_stalls", ["--experiments", "nowhere"], "nowhere"),
    ("stage_stalls", [], NO_SHARED),  # the default: the shared folder, absent here
    ("trace_model", ["--help"], "trace_checks.py"),  # helper modules: they say what to run instead
    ("trace_queue", ["--help"], "trace_checks.py"),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A directory holding a plain file, an empty and a non-JSON file, and a non-empty folder."""
    d = tmp_path_factory.mktemp("bench_args")
    (d / "afile").write_text("x\n")
    (d / "empty.json").write_text("")
    (d / "notjson.json").write_text("not json\n")
    (d / "list.json").write_text('[{"experiment": "x"}]\n')
    (d / "full").mkdir()
    (d / "full" / "something").write_text("x\n")
    return d


def run_benchmark(cwd: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args]
    env = {**SUBPROCESS_ENV, "STEPSYNTH_SHARED": str(cwd / NO_SHARED)}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name, args, needle", BAD, ids=[f"{n} {' '.join(a)}" for n, a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(workdir, name, args, needle):
    res = run_benchmark(workdir, name, *args)
    assert res.stdout == "", res.stdout[-2000:]
    assert_one_line_error(res.returncode, res.stderr, needle)


def test_go_benchtime_takes_what_go_test_takes():
    go = load_benchmark("bench_go")
    for good in ("200000x", "1x", "2s", "1.5s", "100ms", "1m30s", ".5s"):
        assert go.benchtime_arg(good) == good
    for bad in ("", "x", "0x", "-1x", "2", "0s", "2 s", "2sec", "1.5x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected Nx"):
            go.benchtime_arg(bad)


def test_bench_search_reads_the_callers_paths_and_runs_outside_the_checkout(tmp_path, monkeypatch):
    search = load_benchmark("bench_search")
    monkeypatch.chdir(tmp_path)
    args = search.parse_args(["--data", "steps", "--experiments", "../exps", "--generations", "3"])
    cmd, cwd = search.search_command(args, tmp_path / "tmp")
    assert cmd[cmd.index("--data") + 1] == str(tmp_path / "steps")  # the caller's, not the checkout's
    assert cmd[cmd.index("--experiments") + 1] == str(tmp_path / ".." / "exps")
    assert cmd[cmd.index("--run-dir") + 1] == str(tmp_path / "tmp" / "run")
    assert cwd == tmp_path / "tmp"  # its runs/LATEST lands in the temporary folder, never in the checkout's runs/
    assert cmd[1:5] == ["-m", "evolve", "run", "--generations"] and cmd[5] == "3"
    default, _ = search.search_command(search.parse_args(["--default"]), tmp_path / "tmp")
    assert "--data" not in default and "--experiments" not in default
