"""A writer SIGKILLed at random moments never corrupts the archive or leaves half a generation."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SUBPROCESS_ENV

from archive.store import ArchiveStore

REPO = Path(__file__).resolve().parents[1]
PER_GENERATION = 150  # new entries per generation: big enough that a kill lands mid-transaction

WRITER = r"""
import sys
from archive.entry import ArchiveEntry
from archive.store import ArchiveStore

path, m = sys.argv[1], int(sys.argv[2])
store = ArchiveStore(path)
store.start_run("r", {"generations": 10**6}, 0, "fp")
g = store.last_generation()
g = -1 if g is None else g
print("ready", flush=True)
per_experiment = {f"exp{k:02d}": {"mape": 0.1 * k, "median_ape": 0.05 * k, "n": 600} for k in range(40)}
while True:
    g += 1
    new = [
        ArchiveEntry(
            id=f"g{g:06d}e{k:04d}", expression=f"decode_tokens*{k}", simplified=f"{k}*decode_tokens",
            complexity=3 + k, constants=[float(k)], objectives={"step_mape": 1.0 / (k + 1)},
            generation=g, primitives=["decode_tokens"], per_experiment=per_experiment,
        )
        for k in range(m)
    ]
    store.record_generation("r", g, new, new[:10], {"generation": g, "n_front": m})
"""


def check_consistent(path: Path) -> int:
    """Integrity ok and the last committed generation complete; returns that generation (-1: none)."""
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "generations" not in tables:
            return -1  # killed before the schema was committed
        last = conn.execute("SELECT max(generation) FROM generations").fetchone()[0]
        n_entries = conn.execute("SELECT count(*) FROM entries").fetchone()[0]
        if last is None:
            assert n_entries == 0
            return -1
        # every generation adds PER_GENERATION entries: no entry of an uncommitted generation is visible
        assert n_entries == PER_GENERATION * (last + 1)
        front_ids, stats = conn.execute(
            "SELECT front_ids, stats_json FROM generations WHERE generation = ?", (last,)
        ).fetchone()
        front_ids = json.loads(front_ids)
        assert len(front_ids) == PER_GENERATION and json.loads(stats)["generation"] == last
        on_front = conn.execute("SELECT id, generation FROM entries WHERE on_front = 1").fetchall()
        assert sorted(front_ids) == sorted(i for i, _ in on_front)
        assert {g for _, g in on_front} == {last}
        gens = [r[0] for r in conn.execute("SELECT generation FROM generations ORDER BY generation")]
        assert gens == list(range(last + 1))
        return last
    finally:
        conn.close()


def _start_writer(path: Path) -> subprocess.Popen:
    """A process that writes generations into the archive at PATH until it is killed."""
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(PER_GENERATION)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=SUBPROCESS_ENV,
    )


@pytest.mark.skipif(sys.platform == "win32", reason="needs SIGKILL")
def test_sigkill_during_writes_never_corrupts(tmp_path: Path):
    path = tmp_path / "archive.sqlite"
    rng = random.Random(20240506)  # fixed: the same kill schedule every run
    last = -1
    for attempt in range(10):  # a fixed number of kills, however fast the machine (pytest-timeout guards a hang)
        proc = _start_writer(path)
        try:
            if attempt == 0:
                time.sleep(rng.uniform(0.0, 0.08))  # maybe during schema creation / start_run
            else:
                assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
                time.sleep(rng.uniform(0.01, 0.35))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        now = check_consistent(path)
        assert now >= last  # committed generations never disappear
        last = now
    if last < 1:  # a slow (loaded) machine: let one writer commit, then kill it mid-stream
        proc = _start_writer(path)
        try:
            until = time.monotonic() + 30.0
            while time.monotonic() < until and check_consistent(path) < 1:
                time.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        now = check_consistent(path)
        assert now >= last
        last = now
    assert last >= 1, "the writer never committed a generation"
    with ArchiveStore(path, create=False) as store:  # and the archive still works
        front = store.front()
        assert len(front) == PER_GENERATION and all(e.generation == last for e in front)
        assert len(store.best_by_complexity()) == 10
