"""The sqlite run archive: round trip, first-discovery generation, ids, run directories."""

from __future__ import annotations

import math
import os
from datetime import datetime, timezone
from pathlib import Path

import pytest

from archive.entry import ArchiveEntry, entry_id_for
from archive.rundir import RunDir, default_run_dir, locate_archive, record_latest
from archive.store import ArchiveStore
from primitives.errors import InputError


def make_entry(expr: str, complexity: int, step_mape: float, generation: int = 0, **objectives: float) -> ArchiveEntry:
    return ArchiveEntry(
        id=entry_id_for(expr),
        expression=expr,
        simplified=expr,
        complexity=complexity,
        constants=[1.5, 2.0],
        objectives={"step_mape": step_mape, "complexity": complexity, **objectives},
        generation=generation,
        primitives=["decode_tokens"],
        overheads={"gap_us": 120.0},
        per_experiment={"llama-2-70b-tp4-general": {"mape": step_mape, "n": 593}},
    )


CONFIG = {"generations": 10, "population": 50, "seed": 3}


@pytest.fixture
def store(tmp_path: Path):
    with ArchiveStore(tmp_path / "run" / "archive.sqlite") as s:
        yield s


def test_round_trip(store: ArchiveStore):
    a = make_entry("1.5*decode_tokens + 2.0", 5, 0.2, e2e_error=0.1)
    b = make_entry("1.5*decode_tokens + 2.0*kv_tokens", 7, 0.1, e2e_error=float("inf"))
    store.start_run("r1", CONFIG, seed=3, fingerprint="fp1")
    store.record_generation("r1", 0, [a, b], [a, b], {"evals": 100, "best": 0.1})
    front = store.front()
    assert [e.id for e in front] == [a.id, b.id]
    got = front[0]
    assert got.expression == a.expression and got.constants == a.constants
    assert got.objectives == a.objectives and got.overheads == a.overheads
    assert got.per_experiment == a.per_experiment
    assert got.run_id == "r1" and got.dataset_fingerprint == "fp1" and got.run_config == CONFIG
    assert math.isinf(front[1].objectives["e2e_error"])  # non-finite objectives survive
    assert store.get(a.id[:6]).id == a.id
    assert store.best_by_complexity("r1")[1].id == b.id
    store.finish_run("r1", {"best_step_mape": 0.1})
    [run] = store.runs()
    assert run.status == "finished" and run.summary == {"best_step_mape": 0.1}
    assert run.config == CONFIG and run.seed == 3 and run.last_generation == 0
    assert store.latest_run().run_id == "r1"
    assert store.history()[0]["stats"] == {"evals": 100, "best": 0.1}


def test_reopen_reads_same_data(tmp_path: Path):
    path = tmp_path / "archive.sqlite"
    a = make_entry("decode_tokens", 1, 0.5)
    import sqlite3

    with ArchiveStore(path) as s:
        s.start_run("r1", CONFIG, 0, "fp")
        s.record_generation("r1", 0, [a], [a], {})
        assert s._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # while a run writes
    before = path.read_bytes()
    with ArchiveStore(path, create=False, read_only=True) as s:
        assert [e.id for e in s.front()] == [a.id]
    # closed, the archive is back in rollback mode: a read-only reader leaves no -wal/-shm, changes nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["archive.sqlite"]
    assert path.read_bytes() == before
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    conn.close()


def test_generation_of_first_discovery_is_kept(store: ArchiveStore):
    a = make_entry("decode_tokens", 1, 0.5, generation=0)
    b = make_entry("decode_tokens*2.0", 3, 0.3, generation=2)
    store.start_run("r", CONFIG, 0, "fp")
    store.record_generation("r", 0, [a], [a], {})
    store.record_generation("r", 1, [a], [a], {})
    # the search hands the entry again with a later generation and new scores
    a_later = make_entry("decode_tokens", 1, 0.45, generation=4)
    store.record_generation("r", 4, [a_later, b], [a_later, b], {})
    front = {e.id: e for e in store.front()}
    assert front[a.id].generation == 0
    assert front[a.id].objectives["step_mape"] == 0.45  # payload is the newest
    assert front[b.id].generation == 2  # found (per the search) before it was recorded
    # an entry that leaves the front stays archived, marked off-front
    store.record_generation("r", 5, [b], [b], {})
    assert [e.id for e in store.front()] == [b.id]
    old = store.get(a.id)
    assert old.on_front is False and old.generation == 0
    assert {e.id for e in store.all_entries()} == {a.id, b.id}
    assert store.last_generation() == 5


def test_front_defaults_to_latest_run(store: ArchiveStore):
    a, b = make_entry("decode_tokens", 1, 0.5), make_entry("prefill_tokens", 1, 0.4)
    store.start_run("old", CONFIG, 0, "fp")
    store.record_generation("old", 0, [a], [a], {})
    store.start_run("new", CONFIG, 1, "fp")
    assert store.front() == []  # latest run has no generation yet
    store.record_generation("new", 0, [b], [b], {})
    assert [e.id for e in store.front()] == [b.id]
    assert [e.id for e in store.front("old")] == [a.id]
    assert [r.run_id for r in store.runs()] == ["old", "new"]
    with pytest.raises(InputError, match="no run 'nope'"):
        store.front("nope")


def test_resume_with_other_data_is_refused(store: ArchiveStore):
    store.start_run("r", CONFIG, 0, "fp1")
    store.start_run("r", CONFIG, 0, "fp1")  # resuming on the same data is fine
    with pytest.raises(InputError, match="dataset_fingerprint"):
        store.start_run("r", CONFIG, 0, "fp2")


def test_the_ids_hint_names_a_command_that_works():
    from archive.store import how_to_find_ids

    # a run's folder; an archive file of another name is given itself; a space is quoted
    assert "--run-dir runs/x`" in how_to_find_ids(Path("runs/x/archive.sqlite"))
    assert "--run-dir saved/copy.sqlite`" in how_to_find_ids(Path("saved/copy.sqlite"))
    assert "--run-dir 'my runs/x'`" in how_to_find_ids(Path("my runs/x/archive.sqlite"))


def test_get_unknown_and_ambiguous_ids(store: ArchiveStore):
    store.start_run("r", CONFIG, 0, "fp")
    entries = [make_entry(f"decode_tokens*{k}", 3, 0.1 * k) for k in range(1, 40)]
    store.record_generation("r", 0, entries, entries, {})
    with pytest.raises(InputError) as info:
        store.get("zzzz")
    err = info.value
    assert err.path == str(store.path) and err.field == "id"
    assert "archive list" in str(err) and "\n" not in str(err)
    # 39 hex ids: some one-character prefix is shared by several of them
    first = [e.id[0] for e in entries]
    shared = next(c for c in first if first.count(c) > 1)
    with pytest.raises(InputError, match="matches"):
        store.get(shared)
    with pytest.raises(InputError, match="required"):
        store.get("  ")


def test_failed_write_leaves_nothing(store: ArchiveStore):
    a = make_entry("decode_tokens", 1, 0.5)
    store.start_run("r", CONFIG, 0, "fp")
    store.record_generation("r", 0, [a], [a], {})
    b = make_entry("kv_tokens", 1, 0.4)
    with pytest.raises(TypeError):
        store.record_generation("r", 1, [b], [b], {"bad": object()})  # stats not JSON-able
    assert store.last_generation() == 0
    assert [e.id for e in store.all_entries()] == [a.id]


def test_numpy_values_are_stored(store: ArchiveStore):
    np = pytest.importorskip("numpy")
    a = make_entry("decode_tokens", 1, 0.5)
    a.objectives["step_mape"] = np.float32(0.25)
    store.start_run("r", CONFIG, 0, "fp")
    store.record_generation("r", np.int64(0), [a], [a], {"evals": np.int64(7), "hist": np.arange(3)})
    assert store.front()[0].objectives["step_mape"] == pytest.approx(0.25)
    assert store.history()[0]["stats"] == {"evals": 7, "hist": [0, 1, 2]}


def test_not_an_archive(tmp_path: Path):
    bad = tmp_path / "archive.sqlite"
    bad.write_text("this is not sqlite " * 100)
    with pytest.raises(InputError, match="not a readable archive"):
        ArchiveStore(bad, create=False)
    with pytest.raises(InputError, match="no archive file"):
        ArchiveStore(tmp_path / "missing.sqlite", create=False)


def test_an_archive_this_user_may_not_open_says_so(store: ArchiveStore, monkeypatch):
    """Root reads through permission bits, so os.access is what refuses here."""
    import archive.store

    monkeypatch.setattr(archive.store.os, "access", lambda path, mode: False)
    with pytest.raises(InputError, match="permission denied"):
        ArchiveStore(store.path, create=False, read_only=True)


def test_run_dirs_and_latest(tmp_path: Path):
    now = datetime(2024, 5, 6, 7, 8, 9, tzinfo=timezone.utc)
    d = default_run_dir(7, base=tmp_path, now=now)
    assert d == tmp_path / "runs" / "20240506T070809Z-seed7"
    d.mkdir(parents=True)
    assert default_run_dir(7, base=tmp_path, now=now).name == "20240506T070809Z-seed7-2"
    with pytest.raises(InputError, match="no run found in this directory"):
        locate_archive(None, base=tmp_path)
    latest = record_latest(d, base=tmp_path)
    assert latest.read_text().strip() == os.path.join("runs", "20240506T070809Z-seed7")  # relative: movable
    with pytest.raises(InputError, match="has no archive.sqlite"):
        locate_archive(None, base=tmp_path)
    with ArchiveStore(RunDir(d).archive):
        pass
    assert locate_archive(None, base=tmp_path) == tmp_path / "runs" / "20240506T070809Z-seed7" / "archive.sqlite"
    assert locate_archive(str(d)) == RunDir(d).archive
    assert locate_archive(str(RunDir(d).archive)) == RunDir(d).archive
    with pytest.raises(InputError, match="no such run directory"):
        locate_archive(str(tmp_path / "nope"))
    other = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    record_latest(other, base=tmp_path)
    assert Path(latest.read_text().strip()).is_absolute()
    assert not list(latest.parent.glob(".LATEST.*"))  # no temp files left behind


def test_two_trees_of_one_model_are_archived_at_the_simpler(store: ArchiveStore):
    # trees of complexity 13 and 15 that fold to one expression (one id), both on the front by
    # a rounding of their errors: one model, kept as its simpler tree whatever the order
    simple = make_entry("2603.52 + gemm_time_us", 13, 0.0870)
    bigger = make_entry("2603.52 + gemm_time_us", 15, 0.0870 - 1e-16)
    store.start_run("r1", CONFIG, seed=3, fingerprint="fp1")
    store.record_generation("r1", 0, [simple, bigger], [bigger, simple], {})
    assert [(e.id, e.complexity) for e in store.front()] == [(simple.id, 13)]
    store.record_generation("r1", 1, [bigger], [simple, bigger], {})  # the front holds the bigger tree only
    assert [(e.id, e.complexity) for e in store.front()] == [(simple.id, 15)]  # as the run printed it
