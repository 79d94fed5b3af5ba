"""A run whose reader goes away (``evolve run | head``) stops as an interrupt does: exit 141,
one line on stderr saying where its results are, never a traceback or a run marked failed.
A finished run says it finished; one stopped early (time limit, or mid-search) says how to
go on. The plain lines and the rich display (FORCE_COLOR) alike."""

import errno
import io
import os
import sqlite3
import subprocess

import pytest
from error_lines import TINY, call, spawn_evolve

from evolve.run import Termination


class ClosingStdout(io.StringIO):
    """Standard output whose reader goes away at the first write holding WHEN; its descriptor
    is /dev/null's, so that silencing it (as the tool does) is exercised and harmless."""

    def __init__(self, when: str):
        super().__init__()
        self.when, self.gone = when, False
        self.fd = os.open(os.devnull, os.O_WRONLY)

    def write(self, text: str) -> int:
        if self.gone or self.when in text:
            self.gone = True
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        return super().write(text)

    def fileno(self) -> int:
        return self.fd


def _statuses(run_dir) -> list[str]:
    con = sqlite3.connect(f"file:{run_dir / 'archive.sqlite'}?mode=ro", uri=True)
    try:
        return [s for (s,) in con.execute("SELECT status FROM runs")]
    finally:
        con.close()


def _run_into(stdout: ClosingStdout, args, capsys, monkeypatch) -> tuple[int, str]:
    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.setattr("sys.stdout", stdout)
        try:
            rc, _, err = call(args, capsys)
        finally:
            os.close(stdout.fd)
    assert stdout.gone, "the output never closed"
    return rc, err


@pytest.mark.parametrize("when", ["on the front", "run directory:"])
def test_a_finished_run_whose_output_closes_says_where_its_results_are(when, work, capsys, monkeypatch):
    rc, err = _run_into(ClosingStdout(when), ["run", *TINY, "--run-dir", "runs/f"], capsys, monkeypatch)
    assert rc == 141 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "after the run finished; its results are in runs/f" in err and "--resume" not in err, err
    assert _statuses(work / "runs" / "f") == ["finished"]


def test_a_run_the_time_limit_stopped_is_not_said_to_have_finished(work, capsys, monkeypatch):
    monkeypatch.setattr(Termination, "reason", lambda self, generation: "time-limit" if generation else None)
    args = ["run", "--generations", "5", *TINY[2:], "--run-dir", "runs/t"]
    rc, err = _run_into(ClosingStdout("on the front"), args, capsys, monkeypatch)
    assert rc == 141 and len(err.strip().splitlines()) == 1, err
    assert "finished" not in err.split(";")[0] and "continue with --resume runs/t" in err, err
    assert _statuses(work / "runs" / "t") == ["interrupted"]


def test_the_rich_display_closed_at_the_front_says_so_too(work, capsys, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")  # the live progress bar and tables, into a pipe
    rc, err = _run_into(ClosingStdout("Pareto front"), ["run", *TINY, "--run-dir", "runs/r"], capsys, monkeypatch)
    assert rc == 141 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "after the run finished; its results are in runs/r" in err, err


def _reader_gone(work, run_dir: str, read, env: dict | None = None, stderr=subprocess.PIPE) -> tuple[int, str]:
    """A 50-generation run whose reader takes READ(stdout) and goes away: its exit status and
    stderr (STDERR=subprocess.STDOUT: both into the pipe that closed, so none)."""
    args = ("run", *TINY[:1], "50", *TINY[2:], "--run-dir", run_dir)
    proc = spawn_evolve(work, *args, stdout=subprocess.PIPE, env=env, stderr=stderr)
    try:
        read(proc.stdout)
        proc.stdout.close()
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, proc.stderr.read() if proc.stderr else ""


def _closed_mid_search(work, run_dir: str, read, env: dict | None = None) -> str:
    """A 50-generation run whose reader takes READ(stdout) and goes away: its stderr (exit 141, one line)."""
    rc, err = _reader_gone(work, run_dir, read, env)
    assert rc == 141 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("stopped: its standard output was closed"), err
    return err


def test_a_run_whose_output_is_closed_stops_resumable(work):
    """`evolve run | head -1`: the run stops as an interrupt does (checkpoint, status
    interrupted, one line on stderr naming --resume, exit 141 as SIGPIPE gives), not failed."""

    def first_line(stdout):
        assert stdout.readline().startswith("search:")

    assert "--resume runs/p" in _closed_mid_search(work, "runs/p", first_line)
    assert _statuses(work / "runs" / "p") == ["interrupted"]


def test_a_run_whose_output_and_errors_share_the_closed_pipe_stops_resumable_too(work):
    """`evolve run 2>&1 | head -1`: the one line has nowhere to go, but the exit status is still
    141 (not 1 from printing it into the closed pipe) and the run is resumable."""

    def first_line(stdout):
        assert stdout.readline().startswith("search:")

    rc, _ = _reader_gone(work, "runs/b", first_line, stderr=subprocess.STDOUT)
    assert rc == 141
    assert _statuses(work / "runs" / "b") == ["interrupted"] and (work / "runs" / "b" / "checkpoint.pkl").is_file()


def test_the_rich_display_closed_mid_search_still_says_so(work):
    """`FORCE_COLOR=1 evolve run | head -c 10`: the live display's refresh thread meets the
    closed pipe; the run stops with its one line on stderr (rich had stderr redirected)."""

    def ten_bytes(stdout):
        assert len(stdout.read(10)) == 10

    err = _closed_mid_search(work, "runs/q", ten_bytes, env={"FORCE_COLOR": "1"})
    # how to go on, or (closed before the first checkpoint) that nothing was kept
    assert "--resume runs/q" in err or "nothing was written" in err, err


def test_the_rich_display_into_a_pipe_closed_before_it_starts(work):
    """`FORCE_COLOR=1 evolve run | true`: the display's first write (hiding the cursor) fails;
    the run stops in one line, exit 141 (not rich's IndexError on stopping what never started)."""
    err = _closed_mid_search(work, "runs/z", lambda stdout: None, env={"FORCE_COLOR": "1"})
    assert "--resume runs/z" in err or "nothing was written" in err, err


def test_a_finished_run_resumed_for_nothing_names_itself_latest_even_if_its_output_closes(work, capsys, monkeypatch):
    for name in ("f", "g"):  # LATEST names g
        assert call(["run", *TINY, "--run-dir", f"runs/{name}"], capsys)[0] == 0
    args = ["run", "--generations", "1", "--resume", "runs/f"]
    rc, err = _run_into(ClosingStdout("finished at generation 1"), args, capsys, monkeypatch)
    assert rc == 141 and "after the run finished; its results are in runs/f" in err, err
    assert (work / "runs" / "LATEST").read_text().strip() == "runs/f"
