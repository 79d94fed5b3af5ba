"""The run archive: one sqlite file per run directory, safe against a killed process.

The run directory's layout, ``runs/LATEST`` included, is ``archive.rundir``'s.

Why sqlite: every write is one transaction (``BEGIN IMMEDIATE`` inside ``with conn:``),
the database runs in WAL mode with ``synchronous=FULL``, so a SIGKILL (or Ctrl-C) in the
middle of ``record_generation`` leaves the previous generation complete and the file
intact; a reader never sees half a generation.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sqlite3
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

from archive.entry import ArchiveEntry, simplest_per_id
from archive.rundir import ARCHIVE_FILENAME
from archive.store_json import dumps, id_list, json_or_damage
from primitives.errors import InputError

SCHEMA_VERSION = 1


def how_to_find_ids(archive: Path) -> str:
    """Where an id was not found: the command that lists this archive's ids (``--run-dir``
    takes a run's folder, or an archive file of another name itself)."""
    where = shlex.quote(str(archive.parent if archive.name == ARCHIVE_FILENAME else archive))
    return f"list ids with `python -m evolve archive list --run-dir {where}` (add --all for every entry)"


_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    started_at TEXT NOT NULL,
    finished_at TEXT,
    config_json TEXT NOT NULL,
    seed INTEGER NOT NULL,
    dataset_fingerprint TEXT NOT NULL,
    status TEXT NOT NULL,              -- running | finished | interrupted | failed
    summary_json TEXT
);
CREATE TABLE IF NOT EXISTS entries (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    id TEXT NOT NULL,
    generation INTEGER NOT NULL,       -- generation the expression was FIRST found in
    last_generation INTEGER NOT NULL,  -- last generation that recorded it
    complexity INTEGER NOT NULL,
    step_mape REAL,
    on_front INTEGER NOT NULL,         -- on the latest recorded front of its run
    payload TEXT NOT NULL,             -- ArchiveEntry.to_dict() as JSON
    PRIMARY KEY (run_id, id)
);
CREATE INDEX IF NOT EXISTS entries_id ON entries(id);
CREATE TABLE IF NOT EXISTS generations (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    generation INTEGER NOT NULL,
    recorded_at TEXT NOT NULL,
    front_ids TEXT NOT NULL,           -- JSON list of entry ids, by complexity
    best_ids TEXT NOT NULL,            -- JSON list: best entry per complexity
    stats_json TEXT NOT NULL,
    PRIMARY KEY (run_id, generation)
);
"""


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _finite_or_none(value: object) -> float | None:
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


@dataclass(frozen=True)
class RunRecord:
    """One row of the ``runs`` table."""

    run_id: str
    started_at: str
    finished_at: str | None
    status: str
    seed: int
    dataset_fingerprint: str
    config: dict = field(default_factory=dict)
    summary: dict | None = None
    last_generation: int | None = None  # None: no generation recorded yet


class ArchiveStore:
    """Transactional sqlite archive of search runs.

    ``ArchiveStore(path)`` creates the file (and its directory) if needed; pass
    ``create=False`` to open an existing archive only (a missing or foreign file is an
    ``InputError``). Use as a context manager or call ``close()``.
    """

    def __init__(self, path: str | os.PathLike, create: bool = True, read_only: bool = False):
        self.path = Path(path)
        self.read_only = read_only
        if not create and not self.path.is_file():
            raise InputError(self.path, None, "no archive file here; run `python -m evolve run` or pass --run-dir")
        if self.path.is_file() and not os.access(self.path, os.R_OK if read_only else os.R_OK | os.W_OK):
            raise InputError(self.path, None, "permission denied: this user may not open the archive")
        try:
            if create and not read_only:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: we open every transaction ourselves (BEGIN IMMEDIATE).
            # read_only: mode=ro, so that reading a file that is not an archive never turns it into one
            target = f"file:{quote(str(self.path.resolve()))}?mode=ro" if read_only else str(self.path)
            self._conn = sqlite3.connect(target, timeout=30.0, isolation_level=None, uri=read_only)
        except (OSError, sqlite3.Error) as exc:
            raise InputError(self.path, None, f"cannot open the archive ({exc})") from None
        try:
            self._conn.execute("PRAGMA busy_timeout = 30000")
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise InputError(
                    self.path, "schema", f"archive schema {version} is newer than this program's ({SCHEMA_VERSION})"
                )
            if read_only:
                if version < SCHEMA_VERSION:
                    raise InputError(self.path, None, "not an archive of this program (no archive schema)")
                return
            self._conn.execute("PRAGMA journal_mode = WAL")
            # FULL: a committed generation survives even an OS crash, not just a killed process.
            self._conn.execute("PRAGMA synchronous = FULL")
            self._conn.execute("PRAGMA foreign_keys = ON")
            if version < SCHEMA_VERSION:
                with self._tx():
                    # one statement at a time: executescript() would COMMIT mid-transaction
                    for stmt in _SCHEMA.split(";"):
                        if stmt.strip():
                            self._conn.execute(stmt)
                    self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise InputError(self.path, None, f"not a readable archive ({exc})") from None
        except InputError:
            self._conn.close()
            raise

    # -- plumbing -------------------------------------------------------------------
    def close(self) -> None:
        if not self.read_only:
            try:  # back to a rollback journal: a read-only reader of an idle archive then creates no -wal/-shm
                self._conn.execute("PRAGMA journal_mode = DELETE")
            except sqlite3.Error:
                pass  # a reader holds it: it stays in WAL mode, readers find the files there
        self._conn.close()

    def __enter__(self) -> "ArchiveStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[sqlite3.Connection]:
        """One transaction: all of it is committed or none of it (rollback on error/kill).
        A read that sqlite refuses (a table gone, a damaged page) is a one-line InputError."""
        conn = self._conn
        try:
            with conn:  # commits on success, rolls back on an exception
                conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                yield conn
        except sqlite3.DatabaseError as exc:
            if write or isinstance(exc, (sqlite3.ProgrammingError, sqlite3.InterfaceError)):
                raise  # a write's failure is handled by its caller; a malformed query is a bug
            if "locked" in str(exc).lower():
                raise InputError(self.path, None, f"the archive is busy: another process holds it ({exc})") from None
            raise self._damaged(None, exc) from None

    def _damaged(self, what: str | None, exc: Exception) -> InputError:
        return InputError(self.path, what, f"damaged archive, cannot read it ({type(exc).__name__}: {exc})")

    def _run_config(self, run_id: str, config_json: object) -> dict:
        damaged = lambda exc: self._damaged(f"runs.config_json of {run_id}", exc)  # noqa: E731
        config = json_or_damage(config_json, damaged)
        if not isinstance(config, dict):
            raise damaged(ValueError(f"expected a mapping, got {config!r:.60}"))
        return config

    def _run_row(self, conn: sqlite3.Connection, run_id: str) -> tuple:
        row = conn.execute(
            "SELECT run_id, config_json, seed, dataset_fingerprint FROM runs WHERE run_id = ?", (run_id,)
        ).fetchone()
        if row is None:
            known = [r[0] for r in conn.execute("SELECT run_id FROM runs ORDER BY started_at")]
            raise InputError(self.path, "run_id", f"no run {run_id!r} in this archive; runs: {known or 'none'}")
        return row

    def _resolve_run(self, conn: sqlite3.Connection, run_id: str | None) -> str | None:
        if run_id is not None:
            self._run_row(conn, run_id)
            return run_id
        row = conn.execute("SELECT run_id FROM runs ORDER BY started_at DESC, rowid DESC LIMIT 1").fetchone()
        return None if row is None else row[0]

    # -- writing --------------------------------------------------------------------
    def start_run(self, run_id: str, config: dict, seed: int, fingerprint: str) -> None:
        """Register a run (or mark a resumed one running again).

        Resuming a run against different data would mix incomparable scores, so a
        changed dataset fingerprint is refused.
        """
        with self._tx() as conn:
            row = conn.execute("SELECT dataset_fingerprint FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                conn.execute(
                    "INSERT INTO runs (run_id, started_at, config_json, seed, dataset_fingerprint, status)"
                    " VALUES (?, ?, ?, ?, ?, 'running')",
                    (run_id, utc_now(), dumps(config), int(seed), str(fingerprint)),
                )
                return
            if row[0] and fingerprint and row[0] != fingerprint:
                raise InputError(
                    self.path,
                    "dataset_fingerprint",
                    f"run {run_id!r} was made on data {row[0]}, not {fingerprint}; start a new run instead of resuming",
                )
            conn.execute(
                "UPDATE runs SET status = 'running', finished_at = NULL, config_json = ? WHERE run_id = ?",
                (dumps(config), run_id),
            )

    def record_generation(
        self,
        run_id: str,
        generation: int,
        front: list[ArchiveEntry],
        best_by_complexity: list[ArchiveEntry],
        stats: dict,
    ) -> None:
        """Store one generation's front, best-per-complexity list and stats atomically.

        An entry keeps the generation it was first found in: the smallest of the
        generation already stored, ``entry.generation`` and ``generation``. Its payload
        (objectives, per-experiment scores...) is replaced by the newest one.
        Re-recording a generation (after a resume) replaces that generation's row.
        """
        generation = int(generation)
        with self._tx() as conn:
            _, config_json, seed, fingerprint = self._run_row(conn, run_id)
            run_config = self._run_config(run_id, config_json)
            front_ids = _unique_ids(front)
            best_ids = _unique_ids(best_by_complexity)
            # one model per id: the front's copy (simplified; as the run printed it), else the
            # simplest best-by-complexity tree; each list at its simplest tree of the id
            by_id = {e.id: e for e in simplest_per_id(front)}
            by_id.update((e.id, e) for e in simplest_per_id(best_by_complexity) if e.id not in by_id)
            for entry_id, e in by_id.items():
                row = conn.execute(
                    "SELECT generation FROM entries WHERE run_id = ? AND id = ?", (run_id, entry_id)
                ).fetchone()
                first = min(int(e.generation), generation) if int(e.generation) >= 0 else generation
                if row is not None:
                    first = min(first, int(row[0]))
                payload = e.to_dict()
                payload["generation"] = first
                payload["run_id"] = run_id
                payload["on_front"] = entry_id in front_ids
                if not payload.get("dataset_fingerprint"):
                    payload["dataset_fingerprint"] = fingerprint
                if payload.get("run_config") == run_config:
                    payload["run_config"] = {}  # stored once in runs.config_json, re-attached on load
                conn.execute(
                    "INSERT INTO entries"
                    " (run_id, id, generation, last_generation, complexity, step_mape, on_front, payload)"
                    " VALUES (?, ?, ?, ?, ?, ?, 0, ?)"
                    " ON CONFLICT(run_id, id) DO UPDATE SET generation = excluded.generation,"
                    " last_generation = excluded.last_generation, complexity = excluded.complexity,"
                    " step_mape = excluded.step_mape, payload = excluded.payload",
                    (
                        run_id,
                        entry_id,
                        first,
                        generation,
                        int(e.complexity),
                        _finite_or_none(e.objectives.get("step_mape")),
                        dumps(payload),
                    ),
                )
            conn.execute("UPDATE entries SET on_front = 0 WHERE run_id = ? AND on_front = 1", (run_id,))
            conn.executemany(
                "UPDATE entries SET on_front = 1 WHERE run_id = ? AND id = ?", [(run_id, i) for i in front_ids]
            )
            conn.execute(
                "INSERT OR REPLACE INTO generations (run_id, generation, recorded_at, front_ids, best_ids, stats_json)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (run_id, generation, utc_now(), json.dumps(list(front_ids)), json.dumps(list(best_ids)), dumps(stats)),
            )

    def finish_run(self, run_id: str, summary: dict, status: str = "finished") -> None:
        """Close a run with its summary (status: finished | interrupted | failed)."""
        with self._tx() as conn:
            self._run_row(conn, run_id)
            conn.execute(
                "UPDATE runs SET status = ?, finished_at = ?, summary_json = ? WHERE run_id = ?",
                (status, utc_now(), dumps(summary), run_id),
            )

    # -- reading --------------------------------------------------------------------
    def _load(self, conn: sqlite3.Connection, run_id: str, ids: list[str] | None) -> list[ArchiveEntry]:
        _, config_json, seed, fingerprint = self._run_row(conn, run_id)
        if ids is None:
            rows = conn.execute(
                "SELECT id, generation, on_front, payload FROM entries WHERE run_id = ?", (run_id,)
            ).fetchall()
        else:
            rows = []
            for entry_id in ids:
                row = conn.execute(
                    "SELECT id, generation, on_front, payload FROM entries WHERE run_id = ? AND id = ?",
                    (run_id, entry_id),
                ).fetchone()
                if row is None:  # every listed entry is stored with its generation
                    raise self._damaged(f"entry {entry_id}", LookupError("listed by a generation, not stored"))
                rows.append(row)
        config = self._run_config(run_id, config_json)
        out = []
        for entry_id, generation, on_front, payload in rows:
            try:
                d = json.loads(payload)
                d.update(id=entry_id, generation=int(generation), on_front=bool(on_front), run_id=run_id)
                if not d.get("run_config"):
                    d["run_config"] = config
                if not d.get("dataset_fingerprint"):
                    d["dataset_fingerprint"] = fingerprint
                out.append(ArchiveEntry.from_dict(d))
            except (AttributeError, KeyError, TypeError, ValueError) as exc:  # the stored JSON is not an entry
                raise self._damaged(f"entry {entry_id}", exc) from None
        return sorted(out, key=lambda e: (e.complexity, e.id)) if ids is None else out

    def _generation_ids(self, run_id: str | None, column: str) -> list[ArchiveEntry]:
        with self._tx(write=False) as conn:
            run = self._resolve_run(conn, run_id)
            if run is None:
                return []
            row = conn.execute(
                f"SELECT {column} FROM generations WHERE run_id = ? ORDER BY generation DESC LIMIT 1", (run,)
            ).fetchone()
            if row is None:
                return []
            entries = self._load(conn, run, id_list(row[0], lambda exc: self._damaged(f"generations.{column}", exc)))
        return sorted(entries, key=lambda e: (e.complexity, e.id))

    def front(self, run_id: str | None = None) -> list[ArchiveEntry]:
        """Latest recorded front of the run (latest run by default), by complexity."""
        return self._generation_ids(run_id, "front_ids")

    def best_by_complexity(self, run_id: str | None = None) -> list[ArchiveEntry]:
        """Latest recorded best-entry-per-complexity list, by complexity."""
        return self._generation_ids(run_id, "best_ids")

    def all_entries(self, run_id: str | None = None) -> list[ArchiveEntry]:
        """Every entry ever recorded in the run (front or best-by-complexity), by complexity."""
        with self._tx(write=False) as conn:
            run = self._resolve_run(conn, run_id)
            return [] if run is None else self._load(conn, run, None)

    def get(self, entry_id: str, run_id: str | None = None) -> ArchiveEntry:
        """The entry with this id or unique id prefix (latest run's copy if several runs have it)."""
        key = str(entry_id).strip()
        if not key:
            raise InputError(self.path, "id", f"an entry id is required; {how_to_find_ids(self.path)}")
        with self._tx(write=False) as conn:
            if run_id is not None:
                self._run_row(conn, run_id)
            rows = conn.execute(
                "SELECT e.id, e.run_id FROM entries e JOIN runs r ON r.run_id = e.run_id"
                " WHERE substr(e.id, 1, ?) = ? AND (? IS NULL OR e.run_id = ?)"
                " ORDER BY r.started_at DESC, r.rowid DESC",
                (len(key), key, run_id, run_id),
            ).fetchall()
            ids = sorted({r[0] for r in rows})
            if not ids:
                raise InputError(self.path, "id", f"no entry with id {key!r}; {how_to_find_ids(self.path)}")
            if len(ids) > 1:
                shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
                raise InputError(
                    self.path, "id", f"id prefix {key!r} matches {len(ids)} entries ({shown}); give more characters"
                )
            match_run = next(r[1] for r in rows if r[0] == ids[0])
            return self._load(conn, match_run, [ids[0]])[0]

    def runs(self) -> list[RunRecord]:
        """Every run in the archive, oldest first."""
        with self._tx(write=False) as conn:
            rows = conn.execute(
                "SELECT r.run_id, r.started_at, r.finished_at, r.status, r.seed, r.dataset_fingerprint,"
                " r.config_json, r.summary_json, (SELECT max(generation) FROM generations g WHERE g.run_id = r.run_id)"
                " FROM runs r ORDER BY r.started_at, r.rowid"
            ).fetchall()
        return [
            RunRecord(
                run_id=r[0],
                started_at=r[1],
                finished_at=r[2],
                status=r[3],
                seed=int(r[4]),
                dataset_fingerprint=r[5],
                config=self._run_config(r[0], r[6]),
                summary=None
                if r[7] is None
                else json_or_damage(r[7], lambda exc, r=r: self._damaged(f"runs.summary_json of {r[0]}", exc)),
                last_generation=r[8],
            )
            for r in rows
        ]

    def latest_run(self) -> RunRecord | None:
        """The most recently started run, or None for an empty archive."""
        runs = self.runs()
        return runs[-1] if runs else None

    def resumable_run(self, run_token: str | None = None) -> RunRecord:
        """The run a ``--resume`` goes on with (the latest), where sqlite finds the file whole
        and, given RUN_TOKEN (run.json's), the run is that one and not another run's archive."""
        with self._tx(write=False) as conn:
            problem = conn.execute("PRAGMA quick_check").fetchone()[0]
        if problem != "ok":
            raise InputError(self.path, "--resume", f"damaged archive ({problem}); restore a copy or start a new run")
        run = self.latest_run()
        if run is None:
            raise InputError(self.path, "--resume", "the archive holds no run; restore a copy or start a new run")
        theirs = run.config.get("run_token")
        if run_token and theirs and theirs != run_token:  # an archive copied in from another run
            raise InputError(
                self.path,
                "run_token",
                f"holds run {run.run_id!r} of another search, not the run of run.json; "
                "restore this run's archive or start a new run",
            )
        return run

    def last_generation(self, run_id: str | None = None) -> int | None:
        """Highest recorded generation of the run (None if none yet) — where a resume starts."""
        with self._tx(write=False) as conn:
            run = self._resolve_run(conn, run_id)
            if run is None:
                return None
            return conn.execute("SELECT max(generation) FROM generations WHERE run_id = ?", (run,)).fetchone()[0]

    def history(self, run_id: str | None = None) -> list[dict]:
        """Per-generation records: generation, recorded_at, front_ids, best_ids, stats."""
        with self._tx(write=False) as conn:
            run = self._resolve_run(conn, run_id)
            if run is None:
                return []
            rows = conn.execute(
                "SELECT generation, recorded_at, front_ids, best_ids, stats_json FROM generations"
                " WHERE run_id = ? ORDER BY generation",
                (run,),
            ).fetchall()
        return [
            {
                "generation": g,
                "recorded_at": t,
                "front_ids": id_list(f, lambda exc, g=g: self._damaged(f"generations.front_ids of {g}", exc)),
                "best_ids": id_list(b, lambda exc, g=g: self._damaged(f"generations.best_ids of {g}", exc)),
                "stats": json_or_damage(s, lambda exc, g=g: self._damaged(f"generations.stats_json of {g}", exc)),
            }
            for g, t, f, b, s in rows
        ]


def _unique_ids(entries: list[ArchiveEntry]) -> list[str]:
    seen: dict[str, None] = {}
    for e in entries:
        seen.setdefault(e.id, None)
    return list(seen)
