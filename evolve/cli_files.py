"""What the command line reads and writes: inputs that must exist, the archived entry a command
prices (whole, or one line saying what is damaged), and outputs that may be written without
replacing anything the command reads. Each failure is one InputError line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from archive.entry import ArchiveEntry
from evolve.report import clean
from primitives.errors import InputError
from primitives.files import atomic_write_text, probe_create, regular_target


def must_exist(path: str | None, option: str, kind: str = "any") -> None:
    if path is None:
        return
    p = Path(path)
    if kind == "dir" and not p.is_dir():
        raise InputError(p, option, "no such directory" if not p.exists() else "expected a directory")
    if kind == "file" and not p.is_file():
        raise InputError(p, option, "no such file" if not p.exists() else "expected a file")
    if kind == "any" and not p.exists():
        raise InputError(p, option, "no such file or directory")


def check_writable_file(path: str | None, option: str, args: argparse.Namespace | None = None) -> None:
    """Fail before the (slow) work when an output file could not be written, or (given the
    command's ARGS) would replace what the command reads."""
    if path is None:
        return
    p = regular_target(path, option)
    parent = p.parent if str(p.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise InputError(p, option, f"cannot write: {parent} is a file, not a directory")
    if not parent.is_dir():
        raise InputError(p, option, f"cannot write: directory {parent} does not exist")
    try:
        probe_create(parent)
    except OSError as exc:
        raise InputError(p, option, f"cannot write ({exc.strerror or exc})") from None
    if args is not None:
        check_not_an_input(path, option, args)


def check_not_an_input(path: str | None, option: str, args: argparse.Namespace) -> None:
    """An output file must not replace what the command reads: the run's own files (its
    archive, run.json, checkpoint) or an input file or anything under an input directory."""
    if path is None:
        return
    from archive.rundir import LATEST_FILENAME, RUNS_DIRNAME, RunDir, locate_archive

    target = Path(path).resolve()
    kept = [(Path(RUNS_DIRNAME) / LATEST_FILENAME, "the name of the latest run")]  # read without --run-dir
    try:
        run = RunDir(locate_archive(args.run_dir).parent)
        kept += [(f, "the run's archive") for f in run.archive_files]
        kept += [(run.run_config, "the run's settings"), (run.checkpoint, "the run's checkpoint")]
    except InputError:  # no run: the command says so when it reads the entry
        pass
    kept += [(Path(p), f"an input of {opt}") for opt, p in input_paths(args)]
    for protected, what in kept:
        protected = protected.resolve()
        if target == protected or protected in target.parents:
            raise InputError(path, option, f"would overwrite {what} ({protected}); choose another file")


def input_paths(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(option, path) of every file or directory the command reads."""
    given = [("--data", p) for p in getattr(args, "data", None) or []]
    for option in ("experiments", "step_scatter", "model_configs", "gpu_datasheet", "kernels"):
        value = getattr(args, option, None)
        if value and value != "none":
            given.append((f"--{option.replace('_', '-')}", value))
    return given


def dumps(obj: Any) -> str:
    return json.dumps(clean(obj), indent=2, allow_nan=False, default=str)


def write_json(path: str, obj: Any, option: str = "--json") -> None:
    p = Path(path)
    try:
        atomic_write_text(p, dumps(obj) + "\n")  # never leave a half-written result file
    except OSError as exc:
        raise InputError(p, option, f"cannot write ({exc.strerror or exc})") from None


def open_store(run_dir: str | None):
    from archive.rundir import locate_archive
    from archive.store import ArchiveStore

    return ArchiveStore(locate_archive(run_dir), create=False, read_only=True)


def get_entry(run_dir: str | None, entry_id: str) -> ArchiveEntry:
    with open_store(run_dir) as store:
        return usable_entry(store, entry_id)


def usable_entry(store, entry_id: str) -> ArchiveEntry:
    """The entry, to be priced: once its expression parses to a finite formula of known primitives
    and its run's configuration holds what pricing reads (an archive edited or made by another
    version fails here in one line, not deep inside). ``archive list``/``best`` show such an
    expression as it is; ``archive show`` checks the run's configuration (``with_usable_run``)."""
    from primitives.language import parse_step_formula

    entry = store.get(entry_id)
    try:
        parse_step_formula(entry.expression)
    except ValueError as exc:
        raise InputError(store.path, f"entry {entry.id}: expression", f"{exc}: {entry.expression!r:.60}") from None
    return with_usable_run(store, entry)


def with_usable_run(store, entry: ArchiveEntry) -> ArchiveEntry:
    """ENTRY, once its run's stored configuration holds what pricing and its efficiency table read."""
    from archive.entry import check_run_config
    from fitness.step_scatter import run_scatter

    try:
        check_run_config(entry.run_config or {})
        run_scatter(entry.run_config)  # every field of a recorded scatter
    except ValueError as exc:
        problem = str(exc)
    except InputError as exc:
        problem = f"{exc.field}: {exc.expected}"
    else:
        return entry
    raise InputError(store.path, f"the run of entry {entry.id}", f"damaged run configuration: {problem}")
