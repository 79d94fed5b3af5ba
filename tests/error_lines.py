"""What the bad-input tests share: calling the CLI and checking its one-line error.

A malformed input gives ONE line on stderr naming the file, the field and what was
expected; exit status 2; never a traceback.
"""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
from conftest import SUBPROCESS_ENV, small_trace

from evolve.cli import main

N_ROWS = 40
TINY = ["--generations", "1", "--population", "8", "--data", "good.csv"]  # a run of seconds, in `work`


def good_trace() -> pd.DataFrame:
    return small_trace(N_ROWS)


def set_cell(df: pd.DataFrame, row: int, col: str, value) -> pd.DataFrame:
    df = df.astype({col: object})
    df.loc[row, col] = value
    return df


def call(args, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, f"exit status {rc}, stderr: {err!r}"
    assert "Traceback" not in err
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


def run_args(data, *extra):
    return ["run", "--generations", "1", "--population", "8", "--data", data, "--run-dir", "runs/x", *extra]


def run_evolve(cwd: Path, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m evolve ARGS`` as a user runs it, in ``cwd``."""
    command = [sys.executable, "-m", "evolve", *map(str, args)]
    return subprocess.run(command, cwd=cwd, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=timeout)


def spawn_evolve(
    cwd: Path, *args, stdout=subprocess.DEVNULL, env: dict | None = None, stderr=subprocess.PIPE
) -> subprocess.Popen:
    """``python -m evolve ARGS`` started in ``cwd``, to signal or read while it runs (stderr piped,
    or STDERR: ``subprocess.STDOUT`` for one pipe of both); ENV: variables beside the tests' own."""
    command = [sys.executable, "-m", "evolve", *map(str, args)]
    env = {**SUBPROCESS_ENV, **(env or {})}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True)


def tiny_run(directory: Path) -> tuple[Path, str, Path]:
    """A real (tiny) run directory in ``directory``, the id of an entry on its front, its trace."""
    good_trace().to_csv(directory / "good.csv", index=False)
    res = run_evolve(directory, *run_args("good.csv"), timeout=180)
    assert res.returncode == 0, res.stderr
    out = run_evolve(directory, "archive", "list", "--json", "--run-dir", "runs/x", timeout=60)
    assert out.returncode == 0, out.stderr
    return directory / "runs" / "x", json.loads(out.stdout)[0]["id"], directory / "good.csv"
