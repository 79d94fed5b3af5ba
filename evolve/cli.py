"""``python -m evolve``: run a search, browse its archive, score, validate and export models.

Every bad input ends as one line ``error: <message>`` on stderr and exit status 2;
Ctrl-C ends as one line and status 130. Heavy modules (the search, scoring, the Go
exporter, sympy, rich) are imported inside the commands that need them, so that
``--help`` and ``archive list --json`` start fast. What the commands show is
``evolve.report``'s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from archive.entry import ArchiveEntry
from evolve.config import BOUNDS_HELP, parse_bounds
from evolve.report import clean, entry_record, fmt_cell
from primitives.errors import InputError, writable_dir
from primitives.files import atomic_write_text

PROG = "python -m evolve"


# -- argument types (argparse turns ArgumentTypeError into usage + exit 2) -----------
def _number_arg(kind: type, ok: Callable[[float], bool], expected: str, what: str = "a whole number"):
    """An argparse type: parse ``kind``, then check ``ok`` (ArgumentTypeError -> usage, exit 2)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


_positive_int = _number_arg(int, lambda v: v >= 1, "a number >= 1")
_jobs = _number_arg(int, lambda v: v >= 1 or v == -1, "a number >= 1 (or -1 for every core)")
_seed = _number_arg(int, lambda v: v >= 0, "a seed >= 0")
_positive_float = _number_arg(
    float, lambda v: math.isfinite(v) and v > 0, "a positive number of seconds", "a number of seconds"
)


# -- helpers ------------------------------------------------------------------------
def _console():
    from rich.console import Console

    return Console()


def _must_exist(path: str | None, option: str, kind: str = "any") -> None:
    if path is None:
        return
    p = Path(path)
    if kind == "dir" and not p.is_dir():
        raise InputError(p, option, "no such directory" if not p.exists() else "expected a directory")
    if kind == "file" and not p.is_file():
        raise InputError(p, option, "no such file" if not p.exists() else "expected a file")
    if kind == "any" and not p.exists():
        raise InputError(p, option, "no such file or directory")


def _check_writable_file(path: str | None, option: str) -> None:
    """Fail before the (slow) work when an output file could not be written."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise InputError(p, option, "is a directory; expected a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise InputError(p, option, f"cannot write: {parent} is a file, not a directory")
    if not parent.is_dir():
        raise InputError(p, option, f"cannot write: directory {parent} does not exist")
    probe = parent / f".{p.name}.probe"
    try:  # os.access says yes to root everywhere; a real create tells the truth
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise InputError(p, option, f"cannot write ({exc.strerror or exc})") from None


def _dumps(obj: Any) -> str:
    return json.dumps(clean(obj), indent=2, allow_nan=False, default=str)


def _write_json(path: str, obj: Any, option: str = "--json") -> None:
    p = Path(path)
    try:
        atomic_write_text(p, _dumps(obj) + "\n")  # never leave a half-written result file
    except OSError as exc:
        raise InputError(p, option, f"cannot write ({exc.strerror or exc})") from None


def _open_store(run_dir: str | None):
    from archive.rundir import locate_archive
    from archive.store import ArchiveStore

    return ArchiveStore(locate_archive(run_dir), create=False)


def _get_entry(run_dir: str | None, entry_id: str) -> ArchiveEntry:
    with _open_store(run_dir) as store:
        return store.get(entry_id)


def _front_or_fail(store) -> list[ArchiveEntry]:
    front = store.front()
    if not front:
        raise InputError(store.path, None, "no generation recorded yet; wait for the run's first generation")
    return front


def _resolver(args: argparse.Namespace):
    from primitives.deployment import DeploymentResolver

    _must_exist(getattr(args, "model_configs", None), "--model-configs", "dir")
    _must_exist(getattr(args, "gpu_datasheet", None), "--gpu-datasheet", "file")
    _must_exist(getattr(args, "kernels", None), "--kernels", "dir")
    mc, gd, kd = (getattr(args, k, None) for k in ("model_configs", "gpu_datasheet", "kernels"))
    return DeploymentResolver.from_options(*(Path(v) if v else None for v in (mc, gd, kd)))


# -- commands -----------------------------------------------------------------------
_INTERRUPT_HINT: list[str] = []


def cmd_run(args: argparse.Namespace) -> int:
    from archive.rundir import RunDir, default_run_dir, record_latest
    from evolve.config import RunConfig

    for path in args.data or []:
        _must_exist(path, "--data")
    _must_exist(args.experiments, "--experiments", "dir")
    _must_exist(args.model_configs, "--model-configs", "dir")
    _must_exist(args.gpu_datasheet, "--gpu-datasheet", "file")
    _must_exist(args.kernels, "--kernels", "dir")
    _must_exist(args.resume, "--resume", "dir")
    if args.scheduler and args.backend != "dask":
        raise InputError("--scheduler", None, "a scheduler address needs --backend dask")
    if args.run_dir:
        run_dir = Path(args.run_dir)
    elif args.resume:
        run_dir = Path(args.resume)
    else:
        run_dir = default_run_dir(args.seed)
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(run_dir, "--run-dir", "exists and is not a directory")
    config = RunConfig(
        generations=args.generations,
        population=args.population,
        data=[str(p) for p in (args.data or [])],
        experiments=args.experiments,
        seed=args.seed,
        jobs=args.jobs,
        run_dir=str(run_dir),
        time_limit_s=args.time_limit,
        model_configs=args.model_configs,
        gpu_datasheet=args.gpu_datasheet,
        kernels=args.kernels,
        efficiency_bounds=list(args.efficiency_bounds),
        checkpoint_every=args.checkpoint_every,
        backend=args.backend,
        scheduler=args.scheduler,
        resume=args.resume,
    )
    from evolve.run import run_search
    from evolve.ui import RunUI

    _INTERRUPT_HINT.append(f"; finished generations are kept in {run_dir} (continue with --resume {run_dir})")
    ui = RunUI()
    try:
        # run_search creates the run directory and points runs/LATEST at it once the data
        # has loaded (so a run that fails on bad input does not hide the previous one)
        run_search(config, ui)
    finally:
        ui.close()
        if RunDir(run_dir).archive.is_file():
            record_latest(run_dir)  # idempotent: guarantees LATEST even if run_search did not
    print(f"run directory: {run_dir}  (next: {PROG} archive best)")
    return 0


def cmd_archive_list(args: argparse.Namespace) -> int:
    from archive.select import recommend

    with _open_store(args.run_dir) as store:
        front = _front_or_fail(store)
        entries = store.all_entries() if args.all else front
        try:
            rec_id = recommend(front).id
        except ValueError:
            rec_id = None
    if args.json:
        print(_dumps([{**entry_record(e), "recommended": e.id == rec_id} for e in entries]))
        return 0
    from evolve.report import print_entries

    title = "All archived entries" if args.all else "Pareto front (latest generation)"
    print_entries(_console(), entries, rec_id, title=title)
    return 0


def cmd_archive_best(args: argparse.Namespace) -> int:
    from archive.select import rank

    with _open_store(args.run_dir) as store:
        front = _front_or_fail(store)
        path = store.path
    from archive.select import recommend

    try:
        best = recommend(front)
    except ValueError as exc:
        raise InputError(path, "objectives", str(exc)) from None
    ranked = {r.entry.id: r for r in rank(front)}
    record = {
        **entry_record(best),
        "recommended": True,
        "combined_error": ranked[best.id].error,
        "selection_score": ranked[best.id].score,
    }
    if args.json:
        print(_dumps(record))
        return 0
    from evolve.report import print_entries

    console = _console()
    print_entries(console, [best], best.id, title="Recommended model")
    console.print(
        f"combined (worst-case) error {fmt_cell('error', record['combined_error'])}, "
        f"selection score {record['selection_score']:.4g}; details: {PROG} archive show {best.id}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return 0


def cmd_archive_show(args: argparse.Namespace) -> int:
    from evolve.report import entry_detail

    entry = _get_entry(args.run_dir, args.id)
    console = _console()
    for shown in entry_detail(entry):
        if isinstance(shown, str):
            console.print(shown, markup=False)
        else:
            console.print(shown)
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    for path in args.data:
        _must_exist(path, "--data")
    _check_writable_file(args.json, "--json")
    entry = _get_entry(args.run_dir, args.id)
    resolver = _resolver(args)
    from evolve.report import rows_table
    from fitness.scoring import score_entry

    rows = list(score_entry(entry, [str(p) for p in args.data], resolver))
    result: dict[str, Any] = {
        "id": entry.id,
        "expression": entry.expression,
        "data": list(args.data),
        "experiments": rows,
    }
    n_total = sum(float(r.get("n", 0) or 0) for r in rows)
    if n_total > 0 and all("mape" in r and r["mape"] is not None for r in rows):
        # one headline figure: MAPE over all steps (experiments weighted by their step count)
        result["overall_mape"] = sum(float(r["mape"]) * float(r.get("n", 0) or 0) for r in rows) / n_total
    if args.json:
        _write_json(args.json, result)
    console = _console()
    console.print(rows_table(rows, title=f"Per-step error of {entry.id}"))
    if "overall_mape" in result:
        console.print(f"overall MAPE (step-weighted): {fmt_cell('mape', result['overall_mape'])}", markup=False)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    _must_exist(args.experiments, "--experiments", "dir")
    _check_writable_file(args.json, "--json")
    if args.report and args.mode:
        raise InputError("--report", None, f"the report is of the closed-loop validation; drop --{args.mode}")
    report_dir = writable_dir(args.report, "--report") if args.report else None
    entry = _get_entry(args.run_dir, args.id)
    resolver = _resolver(args)
    from evolve.validation import validate_entry
    from evolve.validation_view import VALIDATE_MODES, print_validation

    console = _console()
    what, kind = VALIDATE_MODES[args.mode]
    with_baseline = bool(args.baseline or report_dir)
    what += " (and the BLIS blackbox baseline's)" if with_baseline else ""
    with console.status(f"{entry.id}: {what} of every experiment under {args.experiments} ..."):
        result = validate_entry(
            entry, str(args.experiments), args.mode, resolver, baseline=with_baseline, plot_dir=report_dir
        )
    if args.json:
        mode = {"mode": args.mode or "closed-loop", "lomo": args.mode == "lomo"}
        _write_json(args.json, {"id": entry.id, "expression": entry.expression, **mode, **dict(result)})
    print_validation(console, result, f"Validation of {entry.id}" + (f" ({kind})" if kind else ""))
    if report_dir is not None:
        from evolve.html_report import write_report

        page = write_report(result, entry, report_dir, str(args.experiments))
        console.print(f"report: {page}", markup=False, highlight=False, soft_wrap=True)
    return 0


def cmd_export_go(args: argparse.Namespace) -> int:
    if (args.model is None) != (args.tp is None):
        raise InputError("--model/--tp", None, "give both --model NAME and --tp N, or neither")
    if (args.out is None) == (args.blis is None):
        raise InputError("--out/--blis", None, "give --out DIR (a Go package) or --blis CHECKOUT (a BLIS backend)")
    if args.name is not None and args.blis is None:
        raise InputError("--name", None, "names a BLIS backend: give it with --blis CHECKOUT")
    from translate_go.targets import check_package_name, choose_deployment

    if args.blis is None:
        check_package_name(args.package)  # before any work
    with _open_store(args.run_dir) as store:
        entry = store.get(args.id)
        run_dir = Path(store.path).parent
    resolver = _resolver(args)
    deployment, how = choose_deployment(entry, run_dir, resolver, args.model, args.tp, args.gpu)
    print(f"deployment: {deployment.model.name} TP{deployment.tp} on {deployment.gpu.name} ({how})")
    if args.blis is not None:
        from translate_go.blis_export import export_blis

        name = args.name or "stepsynth"
        written, changes = export_blis(entry, deployment, Path(args.blis), name, resolver=resolver)
        changes.append(f"backend {name!r}: blis run --latency-model {name} --model M --tp N --hardware GPU")
    else:
        from translate_go.export import export_go

        out = writable_dir(args.out, "--out")
        written, changes = export_go(entry, deployment, out, args.package, args.interface), []
    print("\n".join([f"wrote {path}" for path in written] + changes))
    return 0


# -- parser -------------------------------------------------------------------------
def _add_run_dir(
    p: argparse.ArgumentParser, help: str = "run directory (default: the one named in ./runs/LATEST)"
) -> None:
    p.add_argument("--run-dir", metavar="DIR", help=help)


def _add_resolver_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-configs", metavar="DIR", help="folder of HF config.json folders (default: built-ins)")
    p.add_argument("--gpu-datasheet", metavar="FILE", help="GPU datasheet JSON (default: built-in H100)")
    p.add_argument("--kernels", metavar="DIR", help="the GPU's measured kernel tables (default: built-in H100)")


def _entry_command(sub, name: str, help: str, handler) -> argparse.ArgumentParser:
    """A command on one archived entry that writes results: ID, --run-dir, --json, resolver options."""
    p = sub.add_parser(name, help=help)
    p.add_argument("id", metavar="ID")
    _add_run_dir(p)
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    _add_resolver_options(p)
    p.set_defaults(handler=handler)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Evolve vLLM step-time models and export them to BLIS (Go)."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run a search", description="Run a GP search; results go to a run directory.")
    p.add_argument("--generations", type=_positive_int, required=True, metavar="N", help="generations to evolve")
    p.add_argument("--population", type=_positive_int, default=200, metavar="P", help="individuals per generation")
    p.add_argument(
        "--data",
        nargs="+",
        action="extend",
        metavar="PATH",
        help="step trace files or folders (default: embedded data)",
    )
    p.add_argument("--experiments", metavar="DIR", help="experiment folders for the replayed E2E objectives")
    p.add_argument("--seed", type=_seed, default=0, metavar="S", help="random seed (same seed, same run)")
    p.add_argument("--jobs", type=_jobs, default=1, metavar="J", help="parallel evaluation workers (-1: every core)")
    _add_run_dir(p, help="where to write (default: runs/<UTC time>-seed<S>)")
    p.add_argument("--time-limit", type=_positive_float, metavar="SEC", help="stop after this many seconds")
    _add_resolver_options(p)
    p.add_argument("--backend", choices=("loky", "dask"), default="loky")
    p.add_argument("--scheduler", metavar="ADDRESS", help="dask scheduler address (with --backend dask)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--efficiency-bounds", type=parse_bounds, default=(0.5, 4.0), metavar="LO,HI", help=BOUNDS_HELP)
    p.add_argument(
        "--checkpoint-every", type=_positive_int, default=5, metavar="N", help="generations between checkpoints"
    )
    p.set_defaults(handler=cmd_run)

    pa = sub.add_parser("archive", help="browse a run's archive", description="Browse the archive of a run.")
    asub = pa.add_subparsers(dest="archive_command", required=True, metavar="ACTION")
    q = asub.add_parser("list", help="the Pareto front of the latest generation")
    _add_run_dir(q)
    q.add_argument("--json", action="store_true", help="print JSON instead of a table")
    q.add_argument("--all", action="store_true", help="every archived entry, not only the latest front")
    q.set_defaults(handler=cmd_archive_list)
    q = asub.add_parser("show", help="one entry in detail")
    q.add_argument("id", metavar="ID", help="entry id or a unique prefix of it")
    _add_run_dir(q)
    q.set_defaults(handler=cmd_archive_show)
    q = asub.add_parser("best", help="the recommended model (see archive/select.py)")
    _add_run_dir(q)
    q.add_argument("--json", action="store_true", help="print JSON instead of a table")
    q.set_defaults(handler=cmd_archive_best)

    p = _entry_command(sub, "score", "per-step error of an entry on step traces", cmd_score)
    p.add_argument(
        "--data", nargs="+", action="extend", required=True, metavar="PATH", help="step trace files or folders"
    )

    p = _entry_command(sub, "validate", "replay experiments end to end with an entry", cmd_validate)
    p.add_argument("--experiments", required=True, metavar="DIR")
    transfer = p.add_mutually_exclusive_group()
    for flag, help in [
        ("--lomo", "leave one model out: refit without each model, validate on it"),
        ("--lowo", "leave one workload out: refit without each workload, validate on it"),
        ("--stage-transfer", "refit on the low-rate load stages, validate the high-rate ones"),
    ]:
        transfer.add_argument(flag, dest="mode", action="store_const", const=flag[2:], help=help)
    p.add_argument("--baseline", action="store_true", help="also fit and run the BLIS blackbox baseline (slow)")
    p.add_argument("--report", metavar="DIR", help="write a self-contained HTML report there (implies --baseline)")

    p = sub.add_parser("export-go", help="write the model as Go: a BLIS backend or a stand-alone package")
    p.add_argument("id", metavar="ID")
    p.add_argument("--blis", metavar="CHECKOUT", help="write into this BLIS checkout as a registered backend")
    p.add_argument("--name", metavar="NAME", help="the backend's name with --blis (default: stepsynth)")
    p.add_argument("--out", metavar="DIR", help="write a stand-alone Go package here instead")
    p.add_argument("--package", default="latency", metavar="NAME", help="Go package name with --out (default: latency)")
    p.add_argument(
        "--interface",
        choices=("seed", "blis"),
        default="blis",
        help="with --out: blis: upstream BLIS's four methods (default); seed: the five-method seed interface",
    )
    p.add_argument(
        "--model",
        metavar="NAME",
        help="bake constants for this model (with --tp); with --blis: the golden tests' deployment",
    )
    p.add_argument("--tp", type=_positive_int, metavar="N")
    p.add_argument("--gpu", metavar="NAME", help="GPU for --model (default: the datasheet's / H100)")
    _add_run_dir(p)
    _add_resolver_options(p)
    p.set_defaults(handler=cmd_export_go)
    return parser


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed by argparse
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    _INTERRUPT_HINT.clear()
    try:
        return int(args.handler(args) or 0)
    except InputError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # a missing piece of this build or an optional package: not a user error
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(_one_line("interrupted" + "".join(_INTERRUPT_HINT)), file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (e.g. `| head`); silence the flush at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
