"""What a command writes never replaces what it reads, and a run directory is either a run
that can go on or unused: --json refuses the run's files and the inputs; --resume refuses an
archive copied in from another run; an interrupt before the first generation leaves the
directory reusable; runs started in one second take two default names."""

import json
import shutil
import sqlite3
from datetime import datetime, timezone
from pathlib import Path

import pytest
from error_lines import TINY, assert_one_line_error, call

from archive.rundir import default_run_dir, drop_if_unused
from evolve.search import Search


def _first_id(done: Path, capsys) -> str:
    return json.loads(call(["archive", "list", "--json", "--run-dir", done], capsys)[1])[0]["id"]


@pytest.mark.parametrize(
    "target, needle",
    [("runs/a/archive.sqlite", "the run's archive"), ("runs/a/run.json", "the run's settings"), ("good.csv", "--data")],
)
def test_json_never_replaces_what_the_command_reads(target, needle, done, work, capsys):
    entry = _first_id(done, capsys)
    before = Path(target).read_bytes()
    rc, _, err = call(["score", entry, "--data", "good.csv", "--run-dir", done, "--json", target], capsys)
    assert_one_line_error(rc, err, target, "--json", "would overwrite", needle)
    assert Path(target).read_bytes() == before
    rc, _, err = call(["score", entry, "--data", "good.csv", "--run-dir", done, "--json", "score.json"], capsys)
    assert rc == 0 and json.loads(Path("score.json").read_text())["id"] == entry, err


def test_json_never_goes_inside_an_input_directory(done, work, capsys):
    (work / "exps").mkdir()
    rc, _, err = call(
        ["validate", _first_id(done, capsys), "--experiments", "exps", "--run-dir", done, "--json", "exps/out.json"],
        capsys,
    )
    assert_one_line_error(rc, err, "exps/out.json", "an input of --experiments")
    assert not (work / "exps" / "out.json").exists()


def test_a_resume_refuses_the_archive_of_another_run(done, work, capsys):
    assert call(["run", *TINY, "--run-dir", "runs/b", "--seed", "1"], capsys)[0] == 0
    shutil.copyfile(work / "runs" / "b" / "archive.sqlite", done / "archive.sqlite")
    before = (done / "archive.sqlite").read_bytes()
    rc, _, err = call(["run", "--generations", "2", "--resume", "runs/a"], capsys)
    assert_one_line_error(rc, err, "archive.sqlite", "run_token", "holds run 'b' of another search")
    assert (done / "archive.sqlite").read_bytes() == before


def _interrupt_at_once(monkeypatch) -> None:
    """Ctrl-C while the first population is scored: no checkpoint yet."""

    def interrupted(search):
        raise KeyboardInterrupt

    monkeypatch.setattr(Search, "initialise", interrupted)


def test_an_interrupt_before_the_first_generation_leaves_the_directory_unused(work, capsys, monkeypatch):
    _interrupt_at_once(monkeypatch)
    rc, _, err = call(["run", *TINY, "--run-dir", "runs/i"], capsys)
    assert rc == 130 and err.strip() == "interrupted; nothing was written", err
    assert [p.name for p in (work / "runs" / "i").iterdir()] == [".lock"]  # the lock is not a run
    assert not (work / "runs" / "LATEST").exists()
    monkeypatch.undo()
    monkeypatch.chdir(work)
    rc, _, err = call(["run", *TINY, "--run-dir", "runs/i"], capsys)  # the same name runs again
    assert rc == 0, err
    assert Search.peek_checkpoint(work / "runs" / "i" / "checkpoint.pkl").generation == 1


def test_an_interrupted_run_in_a_default_directory_leaves_no_directory(work, capsys, monkeypatch):
    _interrupt_at_once(monkeypatch)
    rc, _, err = call(["run", *TINY], capsys)
    assert rc == 130 and "nothing was written" in err, err
    assert not (work / "runs").exists()  # nor the runs/ the reservation made
    (work / "runs").mkdir()
    rc, _, err = call(["run", *TINY], capsys)
    assert rc == 130 and list((work / "runs").iterdir()) == []  # a runs/ that was there stays


def test_a_directory_holding_somebodys_files_is_not_offered_for_removal(work, capsys):
    (work / "mine").mkdir()
    (work / "mine" / "notes.txt").write_text("keep me")
    rc, _, err = call(["run", *TINY, "--run-dir", "mine"], capsys)
    assert_one_line_error(rc, err, "mine", "not empty (notes.txt); choose a new --run-dir")
    assert "remove" not in err and (work / "mine" / "notes.txt").read_text() == "keep me"


def test_a_runs_folder_that_cannot_be_written_is_refused_before_the_search(work, capsys, monkeypatch):
    import errno

    import primitives.files

    real = primitives.files.tempfile.mkstemp

    def read_only_runs(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).name == "runs":
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    (work / "runs").mkdir()
    monkeypatch.setattr(primitives.files.tempfile, "mkstemp", read_only_runs)
    monkeypatch.setattr(Search, "initialise", lambda self: pytest.fail("the search started"))
    rc, _, err = call(["run", *TINY, "--run-dir", "elsewhere"], capsys)
    assert_one_line_error(rc, err, "runs: cannot write there (read-only file system)", "runs/LATEST")


def test_json_never_replaces_the_name_of_the_latest_run_or_the_archives_side_files(done, work, capsys):
    entry = _first_id(done, capsys)
    (done / "archive.sqlite-wal").write_bytes(b"")
    for target, what in (("runs/LATEST", "the name of the latest run"), ("runs/a/archive.sqlite-wal", "archive")):
        before = Path(target).read_bytes()
        rc, _, err = call(["score", entry, "--data", "good.csv", "--json", target], capsys)
        assert_one_line_error(rc, err, target, "--json", "would overwrite", what)
        assert Path(target).read_bytes() == before


def test_runs_started_in_one_second_take_two_names(tmp_path):
    now = datetime(2026, 11, 28, 13, 0, 0, tzinfo=timezone.utc)
    first, second = (default_run_dir(3, base=tmp_path, now=now, reserve=True) for _ in range(2))
    assert (first.name, second.name) == ("20261128T130000Z-seed3", "20261128T130000Z-seed3-2")
    assert first.is_dir() and second.is_dir()
    (second / "run.json").write_text("{}")
    drop_if_unused(first)
    drop_if_unused(second)
    assert not first.exists() and second.is_dir()  # only a directory with nothing of a run goes


def test_a_directory_whose_run_failed_before_a_checkpoint_says_how_to_reuse_it(work, capsys, monkeypatch):
    def boom(self):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(Search, "initialise", boom)  # before the first checkpoint
    rc, _, err = call(["run", *TINY, "--run-dir", "runs/c"], capsys)
    assert rc == 1
    Path(err.strip().rsplit("traceback in ", 1)[1]).unlink()
    con = sqlite3.connect(f"file:{work / 'runs' / 'c' / 'archive.sqlite'}?mode=ro", uri=True)
    assert [s for (s,) in con.execute("SELECT status FROM runs")] == ["failed"]  # the failure is kept
    con.close()
    monkeypatch.undo()
    monkeypatch.chdir(work)
    rc, _, err = call(["run", *TINY, "--run-dir", "runs/c"], capsys)
    assert_one_line_error(rc, err, "runs/c", "not empty", "remove them or choose a new --run-dir")


def test_a_full_disk_outside_a_run_does_not_speak_of_the_archive(work, capsys, monkeypatch):
    import errno

    import evolve.cli

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(evolve.cli, "cmd_export_go", full)
    rc, _, err = call(["export-go", "x", "--out", "go"], capsys)
    assert (
        rc == 1
        and err.strip() == "error: disk full ([Errno 28] No space left on device); free some space and run it again"
    )


@pytest.mark.parametrize("damage, needle", [("file", "runs: is not a directory"), ("dir", "LATEST: is a directory")])
def test_a_runs_folder_latest_cannot_name_is_refused_before_the_search(damage, needle, work, capsys, monkeypatch):
    if damage == "file":
        (work / "runs").write_text("")
    else:
        (work / "runs" / "LATEST").mkdir(parents=True)
    monkeypatch.setattr(Search, "initialise", lambda self: pytest.fail("the search started"))
    rc, _, err = call(["run", *TINY], capsys)
    assert_one_line_error(rc, err, needle)


def test_a_resume_removes_what_a_killed_writer_left_half_written(done, capsys):
    stale = done / ".checkpoint.pkl.k1ll3d.tmp"
    stale.write_bytes(b"half a checkpoint")
    rc, _, err = call(["run", "--generations", "2", "--resume", "runs/a"], capsys)
    assert rc == 0, err
    assert not stale.exists() and not list(done.glob(".*.tmp"))


def test_sigterm_ends_any_command_in_one_line(work, capsys, monkeypatch):
    import os
    import signal
    import time

    import evolve.cli

    def terminated(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal arrives first
        pytest.fail("SIGTERM did not stop the command")

    monkeypatch.setattr(evolve.cli, "cmd_validate", terminated)
    before = signal.getsignal(signal.SIGTERM)
    rc, _, err = call(["validate", "x", "--experiments", "."], capsys)
    assert rc == 130 and err.strip() == "interrupted", err
    assert signal.getsignal(signal.SIGTERM) is before  # the command's handler is gone with it


def test_a_directory_on_a_read_only_mount_says_so(tmp_path, monkeypatch):
    """Root writes through permission bits, not through a read-only mount: a real create decides."""
    import errno
    import tempfile

    from primitives.errors import InputError
    from primitives.files import writable_dir

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(InputError) as caught:
        writable_dir(tmp_path, "--resume")
    assert str(caught.value) == f"{tmp_path}: --resume: cannot write there (read-only file system)"


@pytest.mark.parametrize(
    "names, how",
    [
        (["run.json", ".probe.k3j2.tmp", ".checkpoint.pkl.x9.tmp"], "remove them or choose a new --run-dir"),
        (["run.json", "plots"], "choose a new --run-dir"),  # plots: a run writes none before a checkpoint
        (["notes.probe.tmp"], "choose a new --run-dir"),
    ],
)
def test_only_what_a_failed_run_leaves_is_offered_for_removal(tmp_path, names, how):
    from archive.rundir import RunDir, refuse_used_dir
    from primitives.errors import InputError

    for name in names:
        (tmp_path / name).mkdir() if name == "plots" else (tmp_path / name).write_text("")
    with pytest.raises(InputError, match=how) as refused:
        refuse_used_dir(tmp_path)
    assert ("remove them" in str(refused.value)) == how.startswith("remove")
    RunDir(tmp_path).remove_stale_temporaries()  # under the lock: a killed writer's leftovers go
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n for n in names if not n.endswith(".tmp") or n.startswith("notes")
    )


def test_a_runs_link_to_nowhere_is_one_line(work, capsys):
    (work / "runs").symlink_to(work / "gone")
    rc, _, err = call(["run", *TINY], capsys)
    assert_one_line_error(rc, err, "runs: is not a directory")
