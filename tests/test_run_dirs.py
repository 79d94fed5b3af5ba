"""A run directory belongs to one run (issue 14, items 3 to 6): reuse and contradicting resumes
are refused without touching run.json, the checkpoint or runs/LATEST; a lock keeps a second
process out; a crash is marked ``failed``; SIGTERM checkpoints and stops; outputs go only
to regular files; read-only commands change nothing; the last net is one line and a log."""

import json
import os
import platform
import signal
import sqlite3
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from conftest import SUBPROCESS_ENV
from error_lines import TINY, assert_one_line_error, call, spawn_evolve

from archive.rundir import RunLock
from evolve.config import NUMERIC_PACKAGES
from evolve.search import Search


def snapshot(root: Path) -> dict:
    """Every file of the run directory and runs/LATEST, byte for byte."""
    files = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    latest = Path("runs/LATEST")
    files[latest] = latest.read_bytes() if latest.exists() else None
    return files


def status_of(root: Path) -> list[str]:
    con = sqlite3.connect(f"file:{root / 'archive.sqlite'}?mode=ro", uri=True)
    try:
        return [s for (s,) in con.execute("SELECT status FROM runs ORDER BY rowid")]
    finally:
        con.close()


def generations_of(root: Path) -> int:
    if not (root / "archive.sqlite").exists():
        return 0
    con = sqlite3.connect(f"file:{root / 'archive.sqlite'}?mode=ro", uri=True)
    try:
        return con.execute("SELECT count(*) FROM generations").fetchone()[0]
    except sqlite3.Error:
        return 0
    finally:
        con.close()


def test_a_used_run_directory_is_refused_and_left_alone(done, capsys):
    before = snapshot(done)
    rc, _, err = call(["run", *TINY, "--run-dir", "runs/a"], capsys)
    assert_one_line_error(rc, err, "runs/a", "not empty", "--resume")
    assert snapshot(done) == before


@pytest.mark.parametrize(
    "flags,needles",
    [
        (["--population", "9"], ["--population", "8"]),
        (["--seed", "3"], ["--seed"]),
        (["--efficiency-bounds", "0.4,4"], ["--efficiency-bounds"]),
        (["--run-dir", "runs/b"], ["--run-dir", "contradicts"]),
    ],
)
def test_a_resume_that_contradicts_the_run_is_refused(flags, needles, done, capsys):
    before = snapshot(done)
    rc, _, err = call(["run", "--generations", "2", "--resume", "runs/a", *flags], capsys)
    assert_one_line_error(rc, err, *needles)
    assert snapshot(done) == before


def test_a_resume_with_the_same_flags_goes_on(done, capsys):
    rc, _, err = call(["run", "--generations", "2", "--resume", "runs/a", "--population", "8"], capsys)
    assert rc == 0, err
    assert Search.peek_checkpoint(done / "checkpoint.pkl").generation == 2


def test_a_run_records_where_it_was_made_and_a_resume_elsewhere_says_so(done, capsys):
    recorded = json.loads((done / "run.json").read_text())["environment"]
    assert recorded["numpy"] == metadata.version("numpy") and recorded["python"] == platform.python_version()
    assert recorded["cpu"] and set(NUMERIC_PACKAGES) <= recorded.keys()
    _edit_run_json(done / "run.json", environment={**recorded, "numpy": "1.0.0"})
    rc, _, err = call(["run", "--generations", "2", "--resume", "runs/a"], capsys)
    assert rc == 0, err
    (warning,) = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert f"numpy 1.0.0 -> {metadata.version('numpy')}" in warning and "runs/a" in warning
    assert Search.peek_checkpoint(done / "checkpoint.pkl").generation == 2
    # a run from before the record resumes without a word about it
    _edit_run_json(done / "run.json", environment=None)
    rc, _, err = call(["run", "--generations", "3", "--resume", "runs/a"], capsys)
    assert rc == 0 and "warning" not in err, err


@pytest.mark.parametrize(
    "damage,needles",
    [
        (lambda d: _edit_run_json(d / "run.json", environment=["numpy"]), ["run.json", "environment", "mapping"]),
        (lambda d: (d / "checkpoint.pkl").unlink(), ["checkpoint.pkl", "no checkpoint"]),
        (lambda d: (d / "checkpoint.pkl").write_bytes(b"\x80\x05junk"), ["checkpoint.pkl", "damaged"]),
        (lambda d: _flip_a_byte(d / "checkpoint.pkl"), ["checkpoint.pkl", "damaged"]),
        (lambda d: (d / "run.json").write_text("[200, 200]"), ["run.json", "JSON object"]),
        (lambda d: (d / "run.json").write_text('{"generations": 1}'), ["run.json", "population", "missing"]),
        (lambda d: _swap_token(d / "run.json"), ["checkpoint.pkl", "run_token", "another run"]),
        (lambda d: (d / "archive.sqlite").unlink(), ["archive.sqlite", "--resume", "missing"]),
        (lambda d: (d / "archive.sqlite").write_bytes(b""), ["archive.sqlite", "no archive schema"]),
        (lambda d: _garble_a_page(d / "archive.sqlite"), ["archive.sqlite", "damaged", "malformed"]),
        # every field a resumed search reads is held to what the command line would take
        (lambda d: _edit_run_json(d / "run.json", checkpoint_every=None), ["checkpoint_every", "missing"]),
        (lambda d: _edit_run_json(d / "run.json", max_depth=0), ["run.json", "max_depth", "positive"]),
        (lambda d: _edit_run_json(d / "run.json", efficiency_bounds=[4, 1]), ["efficiency_bounds", "LO <= HI"]),
        (lambda d: _edit_run_json(d / "run.json", validation_fraction=1.0), ["validation_fraction", "[0, 1)"]),
        (lambda d: _edit_run_json(d / "run.json", replay_weight="x"), ["replay_weight", "expected a number"]),
        (lambda d: _edit_run_json(d / "run.json", efficiency_caps={"nope": 1.2}), ["efficiency_caps.nope", "µs"]),
        (lambda d: _edit_run_json(d / "run.json", data=[1]), ["run.json", "data[0]", "path"]),
        (lambda d: ((d / "run.json").unlink(), (d / "run.json").mkdir()), ["--resume", "run.json is not a file"]),
        (lambda d: _edit_run_json(d / "run.json", data=["/gone/t.csv"]), ["run.json", "data[0]", "/gone/t.csv"]),
        (
            lambda d: _edit_run_json(
                d / "run.json", efficiency_caps={"kv_io_time_us": 1.16}, efficiency_floors={"kv_io_time_us": 5.0}
            ),
            ["efficiency_floors.kv_io_time_us", "above its cap"],
        ),
    ],
)
def test_a_resume_never_restarts_from_zero_silently(damage, needles, done, capsys):
    damage(done)
    before = snapshot(done)
    rc, _, err = call(["run", "--generations", "2", "--resume", "runs/a"], capsys)
    assert_one_line_error(rc, err, *needles)
    assert snapshot(done) == before


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _garble_a_page(path: Path) -> None:
    """sqlite's page 2 (a table's b-tree) overwritten: the header still opens, a read fails."""
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page : 2 * page] = b"\xab" * page
    path.write_bytes(bytes(data))


def test_a_resume_of_a_finished_run_with_nothing_to_do_writes_nothing(done, capsys):
    """Its front was scored by the code that made it: re-recording it would change it silently.
    LATEST names it again, so that `archive best` shows it."""
    assert call(["run", *TINY, "--run-dir", "runs/b", "--seed", "1"], capsys)[0] == 0
    before = {k: v for k, v in snapshot(done).items() if k != Path("runs/LATEST")}
    rc, out, err = call(["run", "--generations", "1", "--resume", "runs/a"], capsys)
    assert rc == 0 and "finished at generation 1; give more --generations" in out + err, out + err
    assert all(len(line) <= 80 or line.startswith("run directory:") for line in (out + err).splitlines())
    assert {k: v for k, v in snapshot(done).items() if k != Path("runs/LATEST")} == before
    assert Path("runs/LATEST").read_text().strip().endswith("a")


def test_a_checkpoint_interval_the_command_line_takes_resumes(work, capsys):
    assert call(["run", *TINY, "--run-dir", "runs/c", "--checkpoint-every", "2000000"], capsys)[0] == 0
    rc, _, err = call(["run", "--generations", "2", "--resume", "runs/c"], capsys)
    assert rc == 0, err
    assert json.loads((work / "runs" / "c" / "run.json").read_text())["checkpoint_every"] == 2_000_000
    assert Search.peek_checkpoint(work / "runs" / "c" / "checkpoint.pkl").generation == 2  # the end saves anyway


def test_a_renamed_run_directory_resumes_its_own_run(done, work, capsys):
    """The run keeps its id (not the directory's new name), so its front and data check go on."""
    done.rename(work / "runs" / "moved")
    rc, _, err = call(["run", "--generations", "2", "--resume", "runs/moved"], capsys)
    assert rc == 0, err
    con = sqlite3.connect(f"file:{work / 'runs' / 'moved' / 'archive.sqlite'}?mode=ro", uri=True)
    try:
        assert con.execute("SELECT run_id, status FROM runs").fetchall() == [("a", "finished")]
    finally:
        con.close()
    assert generations_of(work / "runs" / "moved") == 2


def _swap_token(path: Path) -> None:
    _edit_run_json(path, run_token="someone-else")


def _edit_run_json(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_a_resume_over_changed_data_says_so(done, work, capsys):
    lines = (work / "good.csv").read_text().splitlines(keepends=True)
    (work / "good.csv").write_text("".join(lines[:-1]))  # one step row fewer
    rc, _, err = call(["run", "--generations", "2", "--resume", "runs/a"], capsys)
    assert_one_line_error(rc, err, "checkpoint.pkl", "fingerprint", "the run's data changed since it was made")


def test_a_checkpoint_of_another_run_is_refused(done, work, capsys):
    assert call(["run", *TINY, "--run-dir", "runs/b", "--seed", "1"], capsys)[0] == 0
    (done / "checkpoint.pkl").write_bytes((work / "runs" / "b" / "checkpoint.pkl").read_bytes())
    rc, _, err = call(["run", "--generations", "2", "--resume", "runs/a"], capsys)
    assert_one_line_error(rc, err, "checkpoint.pkl", "another run")


def test_the_lock_keeps_a_second_process_out(work, capsys):
    root = work / "runs" / "locked"
    root.mkdir(parents=True)
    with RunLock(root):  # as another process would hold it (flock: per open file)
        rc, _, err = call(["run", *TINY, "--run-dir", root], capsys)
    assert_one_line_error(rc, err, "locked", "another run", f"pid {os.getpid()}")
    assert sorted(p.name for p in root.iterdir()) == [".lock"]


def test_two_runs_started_at_once_in_one_directory(work):
    procs = [spawn_evolve(work, "run", *TINY, "--population", "30", "--run-dir", "runs/both") for _ in range(2)]
    results = [(p.wait(timeout=180), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    refused = next(err for rc, err in results if rc == 2)
    assert len(refused.strip().splitlines()) == 1 and ("not empty" in refused or "another run" in refused)
    assert status_of(work / "runs" / "both") == ["finished"]  # one run, not two merged


def test_a_crash_marks_the_run_failed_and_keeps_latest(done, work, capsys, monkeypatch):
    def boom(self):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(Search, "step", boom)
    latest = Path("runs/LATEST").read_text()
    rc, _, err = call(["run", *TINY, "--run-dir", "runs/c"], capsys)
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "ZeroDivisionError" in lines[0], err
    log = Path(lines[0].rsplit("traceback in ", 1)[1])
    assert "Traceback" in log.read_text() and "boom" in log.read_text()
    log.unlink()
    assert status_of(work / "runs" / "c") == ["failed"]
    assert Path("runs/LATEST").read_text() == latest


def test_a_full_disk_is_one_line_and_the_archive_stays_whole(work, capsys, monkeypatch):
    """ENOSPC from the checkpoint write after the first generation (as a full disk gives it)."""
    import errno

    saves = []

    def full(self, path, owner=None):
        saves.append(path)
        if len(saves) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Search, "save_checkpoint", full)
    rc, _, err = call(["run", *TINY[:1], "3", *TINY[2:], "--checkpoint-every", "1", "--run-dir", "runs/f"], capsys)
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("error: disk full"), err
    assert status_of(work / "runs" / "f") == ["failed"]
    con = sqlite3.connect(f"file:{work / 'runs' / 'f' / 'archive.sqlite'}?mode=ro", uri=True)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()


def test_a_kill_during_run_json_replacement_leaves_old_or_new(tmp_path):
    """SIGKILL a writer of run.json at staggered moments: the file is always one whole version."""
    script = (
        "import sys\nfrom primitives.files import atomic_write_json\n"
        "i = 0\nwhile True:\n    i += 1\n    atomic_write_json(sys.argv[1], {'n': i, 'pad': 'x' * 200000})\n"
    )
    path = tmp_path / "run.json"
    for delay in (0.3, 0.45, 0.61, 0.77):
        proc = subprocess.Popen([sys.executable, "-c", script, str(path)], env=SUBPROCESS_ENV)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if path.exists():
            assert json.loads(path.read_text())["pad"] == "x" * 200000


def test_sigterm_checkpoints_and_stops_in_the_generation_it_meets(work):
    """SIGTERM stops the run where it is: at most the generation under way is archived after it,
    with a checkpoint, and no worker is left behind. (The wait's limit only guards against a hang.)"""
    proc = spawn_evolve(
        work, "run", "--generations", "500", "--population", "40", "--data", "good.csv", "--run-dir", "runs/t",
        "--jobs", "2", "--checkpoint-every", "1",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not generations_of(work / "runs" / "t"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        time.sleep(1.0)
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        archived_before = generations_of(work / "runs" / "t")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:  # a failed check leaves no run behind on the cores
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert generations_of(work / "runs" / "t") <= archived_before + 1  # not the 500 asked for
    err = proc.stderr.read()
    assert rc == 130 and len(err.strip().splitlines()) == 1 and "--resume" in err, err
    assert status_of(work / "runs" / "t") == ["interrupted"]
    assert Search.peek_checkpoint(work / "runs" / "t" / "checkpoint.pkl").generation >= 1
    assert workers and Path(f"/proc/{workers[0]}").parent.is_dir(), "no worker seen, or no /proc to look in"
    gone_by = time.monotonic() + 30  # the workers are killed; loky's resource tracker exits on its own
    while (alive := [w for w in workers if _running(w)]) and time.monotonic() < gone_by:
        time.sleep(0.2)
    assert not alive, f"child processes still running 30 s after the run ended: {alive}"


def _running(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] not in "ZX"  # zombies are gone
    except (OSError, IndexError):
        return False


# --- outputs and read-only commands ------------------------------------------------------
@pytest.mark.parametrize("target", ["/dev/full", "fifo", "link"])
def test_json_output_only_to_a_regular_file(target, done, work, capsys):
    if target == "/dev/full" and not Path(target).exists():
        pytest.skip("this system has no /dev/full (the test would create a regular file there)")
    if target == "fifo":
        os.mkfifo(work / "fifo")
    if target == "link":
        (work / "kept.txt").write_text("mine")
        (work / "link").symlink_to(work / "kept.txt")
    entry = json.loads(call(["archive", "list", "--json", "--run-dir", done], capsys)[1])[0]["id"]
    rc, _, err = call(["score", entry, "--data", "good.csv", "--run-dir", done, "--json", target], capsys)
    assert_one_line_error(rc, err, target, "--json", "expected a regular file")
    assert not Path(target).exists() or not Path(target).is_file() or (work / "kept.txt").read_text() == "mine"
    assert Path(target).is_symlink() or not Path(target).is_file()


def test_read_only_commands_change_nothing(done, work, capsys):
    (work / "some.txt").write_text("")
    rc, _, err = call(["archive", "list", "--run-dir", "some.txt"], capsys)
    assert_one_line_error(rc, err, "some.txt", "not an archive")
    assert (work / "some.txt").read_bytes() == b""
    before = snapshot(done)
    for command in (["archive", "list"], ["archive", "best"], ["archive", "list", "--all", "--json"]):
        assert call([*command, "--run-dir", done], capsys)[0] == 0
    assert snapshot(done) == before


# --- resources and the command line ---------------------------------------------------------
@pytest.mark.parametrize("seed", [str(2**63), "-1", "1e3"])
def test_seeds_outside_sqlite_integers_are_refused(seed, work, capsys):
    rc, _, err = call(["run", *TINY, "--seed", seed], capsys)
    assert_one_line_error(rc, err, "--seed", "usage:")
    assert not (work / "runs").exists()


def test_jobs_above_the_cpu_count_are_capped_with_one_warning(work, capsys):
    rc, _, err = call(["run", *TINY, "--jobs", "999", "--run-dir", "runs/j"], capsys)
    assert rc == 0
    assert [ln for ln in err.splitlines() if ln.strip()] == [
        ln for ln in err.splitlines() if ln.startswith("warning: --jobs 999")
    ]
    assert json.loads((work / "runs" / "j" / "run.json").read_text())["jobs"] <= os.cpu_count()


@pytest.mark.parametrize(
    "args,hint",
    [
        (["run"], "evolve run --help"),
        (["run", "--generations", "x"], "evolve run --help"),
        (["nonsense"], "evolve --help"),
        (["archive"], "evolve archive --help"),
        (["archive", "list", "--bogus"], "evolve archive list --help"),  # the command given the option
        (["run", "--generations", "1", "--bogus", "x"], "evolve run --help"),
    ],
)
def test_usage_errors_are_one_line_with_a_hint(args, hint, work, capsys):
    rc, _, err = call(args, capsys)
    assert_one_line_error(rc, err, hint)


def test_the_pool_manager_thread_stays_quiet_inside_a_run_and_other_threads_do_not():
    import threading

    from evolve.crash import _quiet_pool_manager

    seen = []
    hook = _quiet_pool_manager(lambda args: seen.append(args.thread.name))

    def args_of(name):
        try:
            raise KeyError(285)
        except KeyError as exc:
            return threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, threading.Thread(name=name)))

    hook(args_of("ExecutorManagerThread"))  # loky's race on an interrupt: no traceback over the one line
    hook(args_of("worker-1"))
    assert seen == ["worker-1"]
    assert _quiet_pool_manager(hook) is hook  # installed by every command: wrapped once, not once per command


def test_an_interrupt_raised_inside_compiled_code_stops_the_run_as_ctrl_c_does(work, monkeypatch, capsys):
    """A signal handled just as a numba function returns surfaces as a SystemError chained
    to the KeyboardInterrupt: the run is interrupted (checkpoint, status, exit 130), not failed."""
    import evolve.run

    real = evolve.run.run_generations

    def one_generation_then_signal(search, termination, callbacks):
        termination.generations = 1
        real(search, termination, callbacks)
        try:
            raise KeyboardInterrupt("signal 2")
        except KeyboardInterrupt as exc:
            raise SystemError("CPUDispatcher(<function f>) returned a result with an exception set") from exc

    monkeypatch.setattr(evolve.run, "run_generations", one_generation_then_signal)
    rc, _, err = call(
        ["run", "--generations", "5", "--population", "20", "--data", "good.csv", "--run-dir", "runs/t"], capsys
    )
    assert rc == 130 and len(err.strip().splitlines()) == 1 and err.startswith("interrupted") and "--resume" in err, err
    assert status_of(work / "runs" / "t") == ["interrupted"]
    assert Search.peek_checkpoint(work / "runs" / "t" / "checkpoint.pkl").generation >= 1


def test_a_genuine_system_error_is_a_failure_not_an_interrupt(work, monkeypatch, capsys, private_temp_folder):
    import evolve.run

    def broken(search, termination, callbacks):
        raise SystemError("a C extension failed")

    monkeypatch.setattr(evolve.run, "run_generations", broken)
    rc, _, err = call(
        ["run", "--generations", "5", "--population", "20", "--data", "good.csv", "--run-dir", "runs/t"], capsys
    )
    assert rc == 1 and "unexpected SystemError" in err and len(err.strip().splitlines()) == 1, err
    assert status_of(work / "runs" / "t") == ["failed"]
    logs = list(private_temp_folder.glob("stepsynth-crash-*.log"))
    assert any(str(log) in err and "SystemError: a C extension failed" in log.read_text() for log in logs), err


def test_a_full_disk_while_checkpointing_after_ctrl_c_stays_a_full_disk(work, monkeypatch, capsys):
    import errno

    import evolve.run

    def interrupted(search, termination, callbacks):
        raise KeyboardInterrupt("signal 2")

    def no_room(self, search):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(evolve.run, "run_generations", interrupted)
    monkeypatch.setattr(evolve.run.Checkpointer, "save", no_room)
    rc, _, err = call(
        ["run", "--generations", "5", "--population", "20", "--data", "good.csv", "--run-dir", "runs/t"], capsys
    )
    assert rc == 1 and err.startswith("error: disk full"), err


def test_the_plain_summary_and_front_wrap_at_80_columns(work, capsys):
    rc, out, err = call(["run", *TINY, "--run-dir", "runs/w"], capsys)
    assert rc == 0, err
    lines = (out + err).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("primitives: ["))
    wrapped = [lines[start]] + [line for line in lines[start + 1 :] if line.startswith("  '")]
    assert len(wrapped) > 1 and all(len(line) <= 80 for line in wrapped), wrapped
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)  # the front's expressions too
