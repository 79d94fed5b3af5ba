"""``python -m evolve``: run a search, browse its archive, score, validate and export models.

Every bad input ends as one line ``error: <message>`` on stderr and exit status 2;
Ctrl-C ends as one line and status 130. Heavy modules (the search, scoring, the Go
exporter, sympy, rich) are imported inside the commands that need them, so that
``--help`` and ``archive list --json`` start fast. What the commands show is
``evolve.report``'s.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

from archive.entry import ArchiveEntry
from evolve.cli_files import (
    check_writable_file,
    dumps,
    must_exist,
    open_store,
    usable_entry,
    with_usable_run,
    write_json,
)
from evolve.cli_files import (
    get_entry as _get_entry,  # one name: tests replace it here
)
from evolve.cli_parser import PROG, build_parser
from evolve.config import REFIT_ROUNDS
from evolve.crash import OutputClosed, kill_workers, output_closed, say, sigterm_as_interrupt, silence_stdout
from evolve.kernel_floor_view import print_floor_note, print_run_floor_note
from evolve.report import entry_record, fill_whole, fmt_cell, make_console, print_coverage_note, short_keys
from primitives.errors import InputError
from primitives.files import writable_dir


# -- helpers ------------------------------------------------------------------------
def _plots_dir(run_dir: str | None) -> Path:
    """Where validate's plot goes without --report: the plots folder of the run directory
    the archive was read from (--run-dir, or the latest run here), or the current
    directory where that one cannot be written (a read-only copy of a run)."""
    from archive.rundir import RunDir, locate_archive

    archive = locate_archive(run_dir)
    try:
        return writable_dir(RunDir(archive.parent).plots, "--run-dir")
    except InputError:
        return Path.cwd()


def _front_or_fail(store) -> list[ArchiveEntry]:
    front = store.front()
    if not front:
        last = store.last_generation()
        why = "no generation recorded yet" if last is None else f"generation {last} recorded an empty front"
        raise InputError(store.path, None, f"{why}; wait for the run's first generation, or resume or rerun it")
    return front


def _resolver(args: argparse.Namespace):
    from primitives.deployment import DeploymentResolver

    must_exist(getattr(args, "model_configs", None), "--model-configs", "dir")
    must_exist(getattr(args, "gpu_datasheet", None), "--gpu-datasheet", "file")
    must_exist(getattr(args, "kernels", None), "--kernels", "dir")
    mc, gd, kd = (getattr(args, k, None) for k in ("model_configs", "gpu_datasheet", "kernels"))
    return DeploymentResolver.from_options(*(Path(v) if v else None for v in (mc, gd, kd)))


# -- commands -----------------------------------------------------------------------
_RUN_DIRS: list[Path] = []  # the run directory of a run command, for the interruption line


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _capped_jobs(jobs: int) -> int:
    """--jobs above the CPUs this process may use is capped (each worker holds its own data)."""
    cpus = _usable_cpus()
    if jobs > cpus:
        print(f"warning: --jobs {jobs} is more than the {cpus} usable CPUs; using {cpus}", file=sys.stderr)
        return cpus
    return jobs


def cmd_run(args: argparse.Namespace) -> int:
    import time

    from archive.rundir import RUNS_DIRNAME, check_latest_writable, default_run_dir, drop_if_unused
    from evolve.config import RunConfig
    from evolve.resume import FIXED_BY_THE_RUN

    started_at = time.perf_counter()  # --time-limit bounds the whole command
    for path in args.data or []:
        must_exist(path, "--data")
    must_exist(args.experiments, "--experiments", "dir")
    must_exist(args.model_configs, "--model-configs", "dir")
    must_exist(args.gpu_datasheet, "--gpu-datasheet", "file")
    must_exist(args.kernels, "--kernels", "dir")
    must_exist(args.resume, "--resume", "dir")
    if args.scheduler and args.backend != "dask":
        raise InputError("--scheduler", None, "a scheduler address needs --backend dask")
    # options given on the command line (a resume checks them against its run.json); dests are field names
    given = {name: getattr(args, name) for name in FIXED_BY_THE_RUN if getattr(args, name) is not None}
    seed = given.get("seed", RunConfig().seed)
    check_latest_writable()  # before a default run directory is made under runs/
    if args.run_dir:
        run_dir = Path(args.run_dir)
    elif args.resume:
        run_dir = Path(args.resume)
    else:  # removed below if the run writes nothing there (and runs/ too if it made it)
        made_runs = not Path(RUNS_DIRNAME).exists()
        run_dir = default_run_dir(seed, reserve=True)
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(run_dir, "--run-dir", "exists and is not a directory")
    config = RunConfig(
        generations=args.generations,
        data=[str(p) for p in (args.data or [])],
        jobs=_capped_jobs(args.jobs if args.jobs != -1 else _usable_cpus()),
        run_dir=str(run_dir) if (args.run_dir or not args.resume) else None,
        time_limit_s=args.time_limit,
        backend=args.backend,
        scheduler=args.scheduler,
        resume=args.resume,
        **{k: (list(v) if isinstance(v, tuple) else v) for k, v in given.items() if k != "data"},
    )
    from evolve.run import run_search
    from evolve.ui import RunUI

    _RUN_DIRS.append(run_dir)
    ui = RunUI()
    try:
        ended = run_search(config, ui, frozenset(given), started_at)
    finally:
        ui.close()
        kill_workers()  # before the directory is looked at: no worker writes there any more
        if not (args.run_dir or args.resume):
            drop_if_unused(run_dir, with_parent=made_runs)
    try:
        where, then = f"run directory: {run_dir}", f"(next: {PROG} archive best)"
        print(where + ("\n" if len(where) + 2 + len(then) > 80 else "  ") + then)  # a long path: two lines
        print_run_floor_note(run_dir)
        sys.stdout.flush()  # a closed output is found here, not at exit
    except BrokenPipeError:
        raise output_closed(run_dir if ended.status == "finished" else None) from None
    return 0


def cmd_archive_list(args: argparse.Namespace) -> int:
    from archive.select import recommend

    with open_store(args.run_dir) as store:
        front = _front_or_fail(store)
        entries = store.all_entries() if args.all else front
        try:
            rec_id = recommend(front).id
        except ValueError:
            rec_id = None
    if args.json:
        print(dumps([{**entry_record(e), "recommended": e.id == rec_id} for e in entries]))
        return 0
    from evolve.front_view import print_entries

    title = "All archived entries" if args.all else "Pareto front (latest generation)"
    print_entries(make_console(), entries, rec_id, title=title)
    return 0


def cmd_archive_best(args: argparse.Namespace) -> int:
    from archive.select import rank

    with open_store(args.run_dir) as store:
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
        print(dumps(record))
        return 0
    from evolve.front_view import print_entries

    console = make_console()
    print_entries(console, [best], best.id, title="Recommended model")
    console.print(
        f"combined (worst-case) error {fmt_cell('error', record['combined_error'])}, "
        f"selection score {record['selection_score']:.4g}\ndetails: {PROG} archive show {best.id}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    resolver = _resolver(args)
    print_coverage_note(best, Path(path).parent, resolver)
    print_floor_note(best, Path(path).parent, resolver)
    return 0


def cmd_archive_show(args: argparse.Namespace) -> int:
    from evolve.kernel_floor_view import catalog_floor, floor_table
    from evolve.report import entry_detail

    with open_store(args.run_dir) as store:
        entry, run_dir = with_usable_run(store, store.get(args.id)), Path(store.path).parent
    ratios = catalog_floor(entry, run_dir, _resolver(args))
    console = make_console()
    for shown in entry_detail(entry) + ([floor_table(ratios)] if ratios else []):
        console.print(shown, markup=not isinstance(shown, str))
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    for path in args.data:
        must_exist(path, "--data")
    if args.experiments:
        must_exist(args.experiments, "--experiments", "dir")
    check_writable_file(args.json, "--json", args)
    entry = _get_entry(args.run_dir, args.id)
    resolver = _resolver(args)
    from evolve.report import batch_bias_table, lodo_report, rows_table
    from fitness.kv_sharing import run_seed
    from fitness.step_errors import score_entry

    seed = run_seed(entry.run_config)
    data = [str(p) for p in args.data]
    held_out = None
    if args.lodo:  # the traces read and priced once for both; one deployment is an error before any output
        from fitness.step_errors import deployment_transfer, entry_step_table, score_table

        prepared = entry_step_table(entry, data, resolver, args.experiments, seed)
        held_out = deployment_transfer(entry, prepared[0], prepared[1])
        rows = score_table(*prepared)
    else:
        rows = list(score_entry(entry, data, resolver, args.experiments, seed))
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
    if held_out is not None:
        result["leave_one_deployment_out"] = held_out
    if args.json:
        write_json(args.json, result)
    console = make_console()
    names = short_keys([r["experiment"] for r in rows])  # as every table names an experiment
    hidden = ("by_batch_size", "kv_sharing")  # tables of their own below
    shown = [{**{k: v for k, v in r.items() if k not in hidden}, "experiment": names[r["experiment"]]} for r in rows]
    console.print(rows_table(shown, title=f"Per-step error of {entry.id}"))
    if "overall_mape" in result:
        overall = fmt_cell("mape", result["overall_mape"])
        # archive show's step MAPE is the temporal holdout's: say these are all the steps
        console.print(f"overall MAPE, every step weighted alike: {overall} (the archive's: holdout only)", markup=False)
    console.print(_kv_count_line(rows, args.experiments, seed), markup=False, highlight=False)
    if any(r.get("by_batch_size") for r in rows):
        console.print(batch_bias_table(rows))
    if held_out is not None:
        for shown_part in lodo_report(held_out):
            console.print(shown_part, markup=False, highlight=False)
    return 0


def _kv_count_line(rows: list[dict], experiments: str | None, seed: int) -> str:
    """How score counted the traces' KV: the sharing factors it applied, or why none."""
    names = short_keys([r["experiment"] for r in rows])  # as the tables above name them
    factors = {names[r["experiment"]]: r["kv_sharing"] for r in rows if r.get("kv_sharing") is not None}
    if factors:
        listed = "".join(f"\n  {name}  x{f:.3f}" for name, f in factors.items())
        return f"KV per request, as the run counts it (sharing measured with seed {seed}):{listed}"
    if experiments:
        return f"KV as the traces count it: no block-counted trace has an experiment under {experiments}"
    return "KV as the traces count it (per block); --experiments DIR counts it per request"


def cmd_validate(args: argparse.Namespace) -> int:
    must_exist(args.experiments, "--experiments", "dir")
    check_writable_file(args.json, "--json", args)
    closed = {"--report": args.report, "--step-time-scale": args.step_time_scale != 1.0, "--headroom": args.headroom}
    if args.mode and (flag := next((f for f, given in closed.items() if given), None)):
        raise InputError(flag, None, f"only with the closed-loop validation; drop --{args.mode}")
    if not args.mode and args.refit_rounds is not None:  # the closed loop refits nothing
        raise InputError("--refit-rounds", None, "only with --lomo, --lowo or --stage-transfer (the folds refit)")
    if args.step_scatter != "none":
        must_exist(args.step_scatter, "--step-scatter", "dir")
    report_dir = writable_dir(args.report, "--report") if args.report else None
    entry = _get_entry(args.run_dir, args.id)
    plot_dir = report_dir or _plots_dir(args.run_dir)
    resolver = _resolver(args)
    from evolve.validation import validate_entry
    from fitness.step_scatter import RUN_SCATTER

    if args.step_scatter is None:
        scatter = RUN_SCATTER
    elif args.step_scatter == "none":
        scatter = None
    else:
        from evolve.validation import measured_step_scatter

        scatter = measured_step_scatter(args.step_scatter, resolver)
    from evolve.validation_view import VALIDATE_MODES, print_validation

    console = make_console()
    what, kind = VALIDATE_MODES[args.mode]
    with_baseline = bool(args.baseline or report_dir)
    what += " (and the BLIS blackbox baseline's)" if with_baseline else ""
    with console.status(f"{entry.id}: {what} of every experiment in {Path(args.experiments).resolve().name}/ ..."):
        result = validate_entry(
            entry,
            str(args.experiments),
            args.mode,
            resolver,
            baseline=with_baseline,
            plot_dir=plot_dir,
            refit_rounds=REFIT_ROUNDS if args.refit_rounds is None else args.refit_rounds,
            seed=args.seed,
            load_draws=args.load_draws,
            step_time_scale=args.step_time_scale,
            step_scatter=scatter,
            headroom=bool(args.headroom or report_dir),
        )
    if args.json:
        mode = {"mode": args.mode or "closed-loop", "lomo": args.mode == "lomo"}
        write_json(args.json, {"id": entry.id, "expression": entry.expression, **mode, **dict(result)})
    scaled = f" (step time x{args.step_time_scale:g})" if args.step_time_scale != 1.0 else ""
    print_validation(console, result, f"Validation of {entry.id}" + (f" ({kind})" if kind else "") + scaled)
    if report_dir is not None:
        from archive.rundir import locate_archive
        from evolve.html_report import write_report

        where = {"run_dir": locate_archive(args.run_dir).parent, "resolver": resolver}  # for the kernel floor
        page = write_report(result, entry, report_dir, str(args.experiments), **where)
        console.print(f"report: {page}", markup=False, highlight=False, soft_wrap=True)
    return 0


def cmd_export_go(args: argparse.Namespace) -> int:
    if (args.model is None) != (args.tp is None):
        raise InputError("--model/--tp", None, "give both --model NAME and --tp N, or neither")
    if (args.out is None) == (args.blis is None):
        raise InputError("--out/--blis", None, "give one of --out DIR (a Go package) and --blis CHECKOUT (a backend)")
    if args.name is not None and args.blis is None:
        raise InputError("--name", None, "names a BLIS backend: give it with --blis CHECKOUT")
    from translate_go.targets import check_package_name, choose_deployment

    with open_store(args.run_dir) as store:
        entry = usable_entry(store, args.id)
        run_dir = Path(store.path).parent
    resolver = _resolver(args)
    deployment, how = choose_deployment(entry, run_dir, resolver, args.model, args.tp, args.gpu)
    if args.blis is not None:  # the target is checked (and --out made) once all else holds
        from translate_go.blis_checkout import check_backend_name, check_checkout
        from translate_go.blis_export import export_blis

        name = check_backend_name(args.name or "stepsynth")
        check_checkout(Path(args.blis))
        written, changes = export_blis(entry, deployment, Path(args.blis), name, resolver=resolver)
        changes.append(f"backend {name!r}: blis run --latency-model {name} --model M --tp N --hardware GPU")
    else:
        from translate_go.export import export_go

        check_package_name(args.package)
        out = writable_dir(args.out, "--out")
        written, changes = export_go(entry, deployment, out, args.package, args.interface), []
    chosen = f"deployment: {deployment.model.name} TP{deployment.tp} on {deployment.gpu.name} ({how})"
    print(fill_whole(chosen, 80, subsequent_indent="  "))  # the other deployments' list can be long
    print("\n".join([f"wrote {path}" for path in written] + changes))
    print_coverage_note(entry, run_dir, resolver)
    print_floor_note(entry, run_dir, resolver, deployment, primary_only=args.blis is None)
    return 0


def _interruption(exc: KeyboardInterrupt) -> str:
    from archive.rundir import RunDir
    from evolve.crash import TimeLimitReached

    what = f"stopped: {exc}" if isinstance(exc, (TimeLimitReached, OutputClosed)) else "interrupted"
    if isinstance(exc, OutputClosed) and exc.finished_in is not None:
        return f"{what} after the run finished; its results are in {exc.finished_in} ({PROG} archive best)"
    kept = [d for d in _RUN_DIRS if RunDir(d).checkpoint.is_file()]
    if kept:
        return f"{what}; finished generations are kept in {kept[0]} (continue with --resume {kept[0]})"
    return f"{what}; nothing was written" if _RUN_DIRS else what


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# a path that cannot be used as given (too long, a file where a directory must be, a loop of links,
# a read-only file system): said in one line like any bad input
_BAD_PATH_ERRNOS = {errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.EROFS}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        {
            "run": cmd_run,
            "archive_list": cmd_archive_list,
            "archive_show": cmd_archive_show,
            "archive_best": cmd_archive_best,
            "score": cmd_score,
            "validate": cmd_validate,
            "export_go": cmd_export_go,
        }
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, one line), already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    _RUN_DIRS.clear()
    # loky's resource tracker (a process of its own, which reads this at start) may report a
    # semaphore of a finished worker pool as leaked when the process exits: noise, not news
    os.environ.setdefault("PYTHONWARNINGS", "ignore:resource_tracker:UserWarning")
    # loky, when an idle worker timed out as jobs arrived: they are resubmitted (a worker
    # that really dies raises TerminatedWorkerError), so the two-line warning is noise too
    warnings.filterwarnings("ignore", message="A worker stopped while some jobs were given", category=UserWarning)
    try:
        try:
            with sigterm_as_interrupt():  # SIGTERM ends every command as Ctrl-C does: one line, 130
                return int(args.handler(args) or 0)
        finally:
            kill_workers()  # a pool of simulations (validate) or of the search: none outlives the command
    except InputError as exc:
        say(f"error: {_one_line(exc)}")
        return 2
    except PermissionError as exc:  # a path given that this user may not open: bad input too
        if not exc.filename:  # no path: a process or a semaphore, not the user's input
            return _crashed(exc, argv)
        say(f"error: {exc.filename}: permission denied")
        return 2
    except ModuleNotFoundError as exc:  # a missing piece of this build or an optional package: not a user error
        say(f"error: {_one_line(exc)}")
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, the time limit or a run's output closed
        say(_one_line(_interruption(exc)))
        return 141 if isinstance(exc, OutputClosed) else 130  # 141: as SIGPIPE would end it
    except BrokenPipeError:  # the reader went away (e.g. `| head`): the flush at exit too
        silence_stdout()
        return 0
    except OSError as exc:
        if exc.filename and exc.errno in _BAD_PATH_ERRNOS:  # a path given that cannot be used: bad input
            say(f"error: {exc.filename}: {exc.strerror.lower()}")
            return 2
        return _crashed(exc, argv)
    except Exception as exc:  # the last net: one line and a crash log, never a bare traceback
        return _crashed(exc, argv)


def _crashed(exc: Exception, argv: Sequence[str] | None) -> int:
    """An unexpected error: one line naming a crash log (an interrupt or a full disk say so)."""
    from evolve.crash import interrupt_behind, is_disk_full, write_crash_log

    interrupt = interrupt_behind(exc)
    if isinstance(interrupt, KeyboardInterrupt):  # a signal handled inside compiled code
        say(_one_line(_interruption(interrupt)))
        return 130
    if is_disk_full(exc):
        kept = "the archive keeps its last whole generation" if _RUN_DIRS else "free some space and run it again"
        say(f"error: disk full ({_one_line(exc)}); {kept}")
        return 1
    log = write_crash_log(exc, list(argv if argv is not None else sys.argv[1:]))
    where = f"; traceback in {log}" if log else ""
    say(f"error: unexpected {type(exc).__name__}: {_one_line(exc)[:300]}{where}")
    return 1
