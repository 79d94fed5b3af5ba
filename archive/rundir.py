"""The run directory: where a run keeps its files, and which deployments it trained on.

Layout of a run directory (``python -m evolve run --run-dir DIR``)::

    DIR/run.json          the run's configuration (what ``--resume`` continues)
    DIR/checkpoint.pkl    the search state of the last checkpoint (evolve.search)
    DIR/archive.sqlite    runs, entries and per-generation fronts (archive.store)
    DIR/plots/            figures (``python -m evolve validate``)

``./runs/LATEST`` names the most recent run directory so that ``python -m evolve
archive ...`` works without ``--run-dir``.
"""

from __future__ import annotations

import fcntl
import fnmatch
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from archive.entry import ArchiveEntry
from primitives.errors import InputError
from primitives.files import PROBE_PREFIX, atomic_write_text, probe_create, regular_target

ARCHIVE_FILENAME = "archive.sqlite"
RUN_CONFIG_FILENAME = "run.json"
CHECKPOINT_FILENAME = "checkpoint.pkl"
PLOTS_DIRNAME = "plots"
RUNS_DIRNAME = "runs"
LATEST_FILENAME = "LATEST"
LOCK_FILENAME = ".lock"  # held (flock) by the one process working in the run directory
# what a writer killed mid-write leaves: atomic writes' copies, write probes (primitives.files)
_TEMPORARY_PATTERNS = (f".{CHECKPOINT_FILENAME}.*.tmp", f".{RUN_CONFIG_FILENAME}.*.tmp", f"{PROBE_PREFIX}*.tmp")


@dataclass(frozen=True)
class RunDir:
    """Where a run keeps its files."""

    root: Path

    @property
    def archive(self) -> Path:
        return self.root / ARCHIVE_FILENAME

    @property
    def archive_files(self) -> list[Path]:
        """The archive and the side files sqlite keeps beside it (part of its content)."""
        return [self.archive.with_name(self.archive.name + s) for s in ("", "-wal", "-shm", "-journal")]

    @property
    def run_config(self) -> Path:
        return self.root / RUN_CONFIG_FILENAME

    @property
    def checkpoint(self) -> Path:
        return self.root / CHECKPOINT_FILENAME

    @property
    def plots(self) -> Path:
        return self.root / PLOTS_DIRNAME

    @staticmethod
    def is_temporary(name: str) -> bool:
        """NAME is a half-written copy of the run's files or a write probe (what a killed writer leaves)."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in _TEMPORARY_PATTERNS)

    def remove_stale_temporaries(self) -> None:
        """Remove the half-written copies (``.checkpoint.pkl.*.tmp``) and probes a killed writer
        left; only under the run's lock, when no writer of this directory can be alive."""
        for stale in self.root.iterdir():
            if self.is_temporary(stale.name) and stale.is_file():
                stale.unlink(missing_ok=True)

    def forget_unstarted(self) -> None:
        """Remove what a run wrote before its first checkpoint (run.json, the archive
        and sqlite's side files), so that the directory is unused again: an interrupt there
        leaves nothing to resume, and a rerun must not be refused."""
        for path in (self.run_config, *self.archive_files):
            path.unlink(missing_ok=True)


def refuse_used_dir(root: Path) -> None:
    """A run directory belongs to one run: a fresh run refuses one that holds anything (but its lock)."""
    try:
        used = sorted(p.name for p in Path(root).iterdir() if p.name != LOCK_FILENAME)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise InputError(root, "--run-dir", f"cannot list the directory ({exc.strerror or exc})") from None
    if used:
        listed = f"{', '.join(used[:3])}{', ...' if len(used) > 3 else ''}"
        own = {RUN_CONFIG_FILENAME, *(p.name for p in RunDir(Path(root)).archive_files)}
        if CHECKPOINT_FILENAME in used:
            how = f"continue that run with --resume {root} or choose a new --run-dir"
        elif all(n in own or RunDir.is_temporary(n) for n in used):
            # only what a run that failed before its first checkpoint wrote: it cannot be resumed
            how = "remove them or choose a new --run-dir"
        else:  # somebody's files: never suggest removing them
            how = "choose a new --run-dir"
        raise InputError(root, "--run-dir", f"not empty ({listed}); {how}")


class RunLock:
    """An exclusive lock on ``DIR/.lock`` while a process works in the run directory DIR.

    flock: released by the kernel when the process dies, however it dies, so a killed run
    never leaves a stale lock behind.
    """

    def __init__(self, root: Path):
        self.path = Path(root) / LOCK_FILENAME
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise InputError(self.path.parent, "--run-dir", f"cannot lock ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise InputError(
                self.path.parent, "--run-dir", f"another run (pid {holder}) is working in this directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the flock
            self.fd = None


def default_run_dir(
    seed: int, base: str | os.PathLike | None = None, now: datetime | None = None, reserve: bool = False
) -> Path:
    """``<base>/runs/<UTC timestamp>-seed<S>`` (base: the current directory); never an existing one.
    RESERVE creates it (atomically), so that two runs started in the same second take two names;
    ``drop_if_unused`` removes it again when the run wrote nothing there."""
    root = Path(base) if base is not None else Path.cwd()
    stamp = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    for n in range(1, 10_000):
        candidate = root / RUNS_DIRNAME / (f"{stamp}-seed{int(seed)}" + (f"-{n}" if n > 1 else ""))
        if not reserve:
            if not candidate.exists():
                return candidate
            continue
        for _ in range(10):  # runs/ may go as it is made (an unused run removing it): the same name again
            try:
                candidate.mkdir(parents=True)
                return candidate
            except FileNotFoundError:
                continue
            except FileExistsError:  # two runs in the same second: the next name (or runs/ is no directory)
                if not candidate.parent.is_dir():
                    raise InputError(candidate.parent, None, "is not a directory; pass --run-dir") from None
                break
            except OSError as exc:
                raise InputError(
                    candidate, "--run-dir", f"cannot create the directory ({exc.strerror or exc})"
                ) from None
        else:
            raise InputError(candidate.parent, None, "keeps vanishing as it is created; pass --run-dir")
    raise InputError(root / RUNS_DIRNAME, None, f"too many runs started at {stamp}; pass --run-dir")


def drop_if_unused(root: Path, with_parent: bool = False) -> None:
    """Remove a reserved run directory that holds nothing but its lock (the run wrote nothing),
    and WITH_PARENT its parent (``runs/``, which the reservation created) if that is empty then."""
    try:
        if {p.name for p in root.iterdir()} <= {LOCK_FILENAME}:
            (root / LOCK_FILENAME).unlink(missing_ok=True)
            root.rmdir()
            if with_parent:
                root.parent.rmdir()  # refused while another run's directory is in it
    except OSError:  # gone already, not empty, or not ours to remove
        pass


def check_latest_writable(base: str | os.PathLike | None = None) -> None:
    """Refuse before a run's work what would stop it naming itself in ``runs/LATEST`` at its end."""
    runs = (Path(base) if base is not None else Path.cwd()) / RUNS_DIRNAME
    if (runs.exists() or runs.is_symlink()) and not runs.is_dir():  # a file, or a link to nowhere
        raise InputError(runs, None, f"is not a directory; a run names itself in {RUNS_DIRNAME}/{LATEST_FILENAME}")
    regular_target(runs / LATEST_FILENAME)
    where = runs if runs.is_dir() else runs.parent  # where LATEST, or runs/ itself, will be created
    try:
        probe_create(where)
    except OSError as exc:
        why = f"cannot write there ({(exc.strerror or str(exc)).lower()})"
        how = f"a run names itself in {RUNS_DIRNAME}/{LATEST_FILENAME}: start it from a writable directory"
        raise InputError(where, None, f"{why}; {how}") from None


def record_latest(run_dir: str | os.PathLike, base: str | os.PathLike | None = None) -> Path:
    """Point ``<base>/runs/LATEST`` at run_dir, atomically.

    The path is stored relative to ``base`` when the run lies under it (so the
    project folder can move), absolute otherwise.
    """
    root = (Path(base) if base is not None else Path.cwd()).resolve()
    target = Path(run_dir).resolve()
    try:
        text = str(target.relative_to(root))
    except ValueError:
        text = str(target)
    latest = root / RUNS_DIRNAME / LATEST_FILENAME
    try:
        latest.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(latest, text + "\n")
    except OSError as exc:
        raise InputError(latest, None, f"cannot record the latest run ({exc.strerror or exc})") from None
    return latest


def locate_archive(run_dir: str | os.PathLike | None, base: str | os.PathLike | None = None) -> Path:
    """The archive file of ``run_dir``, or of the run named by ``./runs/LATEST``.

    ``run_dir`` may also be the archive file itself. Raises ``InputError`` when there
    is no archive to read.
    """
    if run_dir is not None:
        given = Path(run_dir)
        if given.is_file():
            return given
        if not given.is_dir():
            why = "not a run directory (nor an archive file)" if given.exists() else "no such run directory"
            raise InputError(given, "--run-dir", why)
        archive = RunDir(given).archive
        if not archive.is_file():
            raise InputError(
                given,
                "--run-dir",
                f"no {ARCHIVE_FILENAME} in this directory; pass the directory of a `python -m evolve run`",
            )
        return archive
    root = Path(base) if base is not None else Path.cwd()
    latest = root / RUNS_DIRNAME / LATEST_FILENAME
    if not latest.is_file():
        raise InputError(
            root, None, "no run found in this directory; run `python -m evolve run` first or pass --run-dir"
        )
    try:
        text = latest.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise InputError(latest, None, f"cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise InputError(latest, None, "is not a run directory's path (not UTF-8 text); pass --run-dir") from None
    if not text:
        raise InputError(latest, None, "is empty; pass --run-dir")
    target = Path(text)
    if not target.is_absolute():
        target = root / target
    archive = RunDir(target).archive
    if not archive.is_file():
        raise InputError(latest, None, f"points to {target}, which has no {ARCHIVE_FILENAME}; pass --run-dir")
    return archive


# --- provenance: which deployments a run trained on (export-go bakes in the first) -------
@dataclass(frozen=True)
class RunDeployment:
    """A deployment an archived run trained on: one experiment's model and TP."""

    experiment: str
    model: str  # as the data names it: a trace name ("llama-2-70b") or an HF id
    tp: int
    gpu: str | None  # the trace's gpu column, if any
    source: str  # the trace file or experiment directory it was read from


_TRACE_ID_COLUMNS = ("experiment_id", "model", "tp")


def _run_base_dirs(config: dict, run_dir: Path | None) -> list[Path]:
    """Directories relative data paths of a run may be relative to.

    The run recorded its paths as typed, relative to where ``evolve run`` was started;
    that directory is recovered from the recorded ``run_dir`` and where the run lives
    now (``runs/<id>`` started in P -> P). The current directory is tried first.
    """
    bases = [Path.cwd()]
    if run_dir is not None:
        here = Path(run_dir).resolve()
        recorded = Path(str(config.get("run_dir") or ""))
        if str(recorded) not in ("", ".") and not recorded.is_absolute():
            parts = recorded.parts
            if len(parts) <= len(here.parts) and here.parts[-len(parts) :] == parts:
                bases.append(Path(*here.parts[: len(here.parts) - len(parts)]))
        bases += [here, here.parent, here.parent.parent]
    unique: list[Path] = []
    for b in bases:
        if b not in unique:
            unique.append(b)
    return unique


def _locate(path: str, bases: list[Path]) -> Path | None:
    p = Path(path).expanduser()
    if p.is_absolute():
        return p if p.exists() else None
    return next((b / p for b in bases if (b / p).exists()), None)


def _trace_deployments(path: Path) -> list[RunDeployment]:
    """(experiment, model, tp, gpu) of a step trace, reading only those columns."""
    from primitives.data.traces import step_table_path

    step_file = step_table_path(path)  # the table the run read, as the run found it
    try:
        import pandas as pd

        if step_file.suffix == ".parquet":
            import pyarrow.parquet as pq

            names = pq.read_schema(step_file).names
            wanted = [c for c in (*_TRACE_ID_COLUMNS, "gpu") if c in names]
            df = pd.read_parquet(step_file, columns=wanted)
        elif step_file.suffix == ".csv":
            df = pd.read_csv(step_file, usecols=lambda c: c in (*_TRACE_ID_COLUMNS, "gpu"))
        else:
            raise InputError(step_file, None, "unsupported file type; expected .parquet or .csv")
    except InputError:
        raise
    except Exception as exc:  # pyarrow/pandas parse errors: one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(step_file, None, f"cannot read the trace's deployments ({first[:120]})") from None
    missing = [c for c in _TRACE_ID_COLUMNS if c not in df.columns]
    if missing:
        raise InputError(step_file, missing[0], "missing column; cannot tell which deployment the run used")
    if "gpu" not in df.columns:
        df["gpu"] = ""
    df = df.dropna(subset=list(_TRACE_ID_COLUMNS)).drop_duplicates("experiment_id")
    out = []
    for row in df.itertuples(index=False):
        try:
            tp = int(row.tp)
        except (TypeError, ValueError):
            continue
        gpu = str(row.gpu) if isinstance(row.gpu, str) and row.gpu.strip() and row.gpu != "nan" else None
        out.append(RunDeployment(str(row.experiment_id), str(row.model), tp, gpu, str(step_file)))
    return sorted(out, key=lambda d: d.experiment)


def _trace_data_deployments(config: dict, bases: list[Path], tried: list[str]) -> list[RunDeployment]:
    """The deployments of a run's step traces (none recorded: the embedded default data)."""
    from primitives.data.roots import default_data_dir
    from primitives.data.traces import STEP_FILE_NAMES

    found: list[RunDeployment] = []
    data = config.get("data") or []
    if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
        tried.append(f"data {data!r:.40} (not a list of paths)")
        return found
    if data:
        for p in data:
            path = _locate(p, bases)
            if path is None:
                tried.append(f"data {p} (not found)")
            else:
                found += _trace_deployments(path)
    else:
        default = default_data_dir()
        if any((default / n).is_file() for n in STEP_FILE_NAMES):
            found += _trace_deployments(default)
        else:
            tried.append(f"the embedded default data ({default}: not there)")
    return found


def _experiment_deployments(config: dict, bases: list[Path], tried: list[str]) -> list[RunDeployment]:
    """The deployments of a replay run's experiment directories (none for a run without)."""
    if not config.get("experiments"):
        return []
    path = _locate(str(config["experiments"]), bases)
    if path is None:
        tried.append(f"experiments {config['experiments']} (not found)")
        return []
    from primitives.data.experiments import find_experiments

    return [RunDeployment(s.name, s.model, int(s.tp), None, str(s.path)) for s in find_experiments(path)]


def fitted_deployments(entry: ArchiveEntry, run_dir: str | Path | None = None) -> list[RunDeployment]:
    """Every deployment ENTRY's fit saw, one per (model, TP) as the data names it: its run's
    step traces' and, for a replay run, its experiments' (``run_deployments`` stops at the
    traces). Empty where some of the run's data is no longer found: then nobody can tell."""
    config = dict(entry.run_config or {})
    bases = _run_base_dirs(config, Path(run_dir) if run_dir is not None else None)
    tried: list[str] = []
    found = _trace_data_deployments(config, bases, tried) + _experiment_deployments(config, bases, tried)
    return [] if tried else list({(d.model, d.tp): d for d in found}.values())


def run_deployments(entry: ArchiveEntry, run_dir: str | Path | None = None) -> list[RunDeployment]:
    """The deployments ENTRY's run trained on, the one to bake in by default first.

    From the run's step traces (``run_config['data']``; none recorded means the
    embedded default data, ``primitives.data.roots.default_data_dir()``), else from its
    experiment directories (``run_config['experiments']``). Experiments ENTRY was scored
    on come first, then by name. RUN_DIR (where the run lives now) helps find data the
    run named by relative paths. Raises InputError when none can be found.
    """
    config = dict(entry.run_config or {})
    bases = _run_base_dirs(config, Path(run_dir) if run_dir is not None else None)
    tried: list[str] = []
    found = _trace_data_deployments(config, bases, tried) or _experiment_deployments(config, bases, tried)
    if not found:
        raise InputError(
            f"archive entry {entry.id}",
            "run_config",
            "cannot tell which deployment the run used (tried "
            + (", ".join(tried) or "nothing: the entry records no run configuration")
            + "); pass --model NAME --tp N",
        )
    scored = set(entry.per_experiment or {})
    seen, unique = set(), []
    for d in sorted(found, key=lambda d: (d.experiment not in scored, d.experiment)):
        if d.experiment not in seen:
            seen.add(d.experiment)
            unique.append(d)
    return unique
