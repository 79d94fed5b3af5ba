"""``python -m evolve``: run a search, browse its archive, score, validate and export models.

Every bad input ends as one line ``error: <message>`` on stderr and exit status 2;
Ctrl-C ends as one line and status 130. Heavy modules (the search, scoring, the Go
exporter, sympy) are imported only by the commands that need them.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from archive.entry import ArchiveEntry
from primitives.errors import InputError, writable_dir

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
_positive_float = _number_arg(float, lambda v: math.isfinite(v) and v > 0, "a positive number of seconds",
                              "a number of seconds")


# -- helpers ------------------------------------------------------------------------
def _console():
    from rich.console import Console

    return Console()


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """Import ``module.name`` on demand; a missing piece of this build is a one-line error."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise _Unavailable(f"{module}.{name} is not available in this build") from None
        raise
    try:
        return getattr(mod, name)
    except AttributeError:
        raise _Unavailable(f"{module}.{name} is not available in this build") from None


class _Unavailable(Exception):
    """A command's implementation module is missing (not a user error: exit 1)."""


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


def _clean(obj: Any) -> Any:
    """JSON-safe copy: non-finite floats become null, numpy scalars plain numbers."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist") and callable(obj.tolist):  # numpy scalars and arrays
        return _clean(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _dumps(obj: Any) -> str:
    return json.dumps(_clean(obj), indent=2, allow_nan=False, default=str)


def _write_json(path: str, obj: Any, option: str = "--json") -> None:
    text = _dumps(obj) + "\n"
    p = Path(path)
    try:
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, p)  # never leave a half-written result file
    except OSError as exc:
        raise InputError(p, option, f"cannot write ({exc.strerror or exc})") from None


def entry_record(entry: ArchiveEntry) -> dict:
    """The JSON view of an entry used by ``archive list/best --json``."""
    return {
        "id": entry.id,
        "expression": entry.expression,
        "simplified": entry.simplified,
        "complexity": entry.complexity,
        "objectives": dict(entry.objectives),
        "generation": entry.generation,
        "constants": list(entry.constants),
        "overheads": dict(entry.overheads),
        "primitives": list(entry.primitives),
        "on_front": entry.on_front,
        "run_id": entry.run_id,
        "dataset_fingerprint": entry.dataset_fingerprint,
        "seed": entry.seed,
    }


def _open_store(run_dir: str | None):
    from archive.store import ArchiveStore, locate_archive

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
    mc = getattr(args, "model_configs", None)
    gd = getattr(args, "gpu_datasheet", None)
    return DeploymentResolver.from_options(Path(mc) if mc else None, Path(gd) if gd else None)


def _fmt_cell(key: str, value: Any) -> str:
    from evolve.ui import fmt_fraction, fmt_number

    k = key.lower()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (
        "mape" in k or k.endswith("ape") or "error" in k or k.endswith("_err")
    ):
        return fmt_fraction(value)
    if isinstance(value, (dict, list)):
        return json.dumps(_clean(value))
    return fmt_number(value) if not isinstance(value, str) else value


def _rows_table(rows: list[dict], title: str | None = None):
    from rich.table import Table

    columns: list[str] = []
    for r in rows:
        for k in r:
            if k not in columns:
                columns.append(k)
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="left" if c in ("experiment", "name", "model") else "right", overflow="fold")
    for r in rows:
        table.add_row(*[_fmt_cell(c, r[c]) if c in r else "-" for c in columns])
    return table


def _render_result(console, result: dict, title: str) -> None:
    """Show an arbitrary result dict: scalars as one table, lists/dicts of rows as tables."""
    scalars = {k: v for k, v in result.items() if not isinstance(v, (dict, list))}
    if scalars:
        from rich.table import Table

        t = Table(title=title)
        t.add_column("name")
        t.add_column("value", justify="right", overflow="fold")
        for k, v in scalars.items():
            t.add_row(str(k), _fmt_cell(str(k), v))
        console.print(t)
    for k, v in result.items():
        if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            console.print(_rows_table(v, title=str(k)))
        elif isinstance(v, dict) and v and all(isinstance(r, dict) for r in v.values()):
            console.print(_rows_table([{"name": n, **r} for n, r in v.items()], title=str(k)))
        elif isinstance(v, dict) and v:
            console.print(_rows_table([{"name": n, "value": x} for n, x in v.items()], title=str(k)))
        elif isinstance(v, list) and v:
            console.print(f"{k}: {', '.join(map(str, v))}")


# -- commands -----------------------------------------------------------------------
_INTERRUPT_HINT: list[str] = []


def cmd_run(args: argparse.Namespace) -> int:
    from archive.store import RunDir, default_run_dir, record_latest
    from evolve.config import RunConfig
    from evolve.ui import RunUI

    for path in args.data or []:
        _must_exist(path, "--data")
    _must_exist(args.experiments, "--experiments", "dir")
    _must_exist(args.model_configs, "--model-configs", "dir")
    _must_exist(args.gpu_datasheet, "--gpu-datasheet", "file")
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
        checkpoint_every=args.checkpoint_every,
        backend=args.backend,
        scheduler=args.scheduler,
        resume=args.resume,
    )
    run_search = _lazy("evolve.search", "run_search")
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
    from evolve.ui import entries_table

    title = "All archived entries" if args.all else "Pareto front (latest generation)"
    _console().print(entries_table(entries, rec_id, title=title))
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
    record = {**entry_record(best), "recommended": True,
              "combined_error": ranked[best.id].error, "selection_score": ranked[best.id].score}
    if args.json:
        print(_dumps(record))
        return 0
    from evolve.ui import entries_table

    console = _console()
    console.print(entries_table([best], best.id, title="Recommended model"))
    console.print(
        f"combined (worst-case) error {_fmt_cell('error', record['combined_error'])}, "
        f"selection score {record['selection_score']:.4g}; details: {PROG} archive show {best.id}",
        markup=False, highlight=False,
    )
    return 0


def _sympy_form(entry: ArchiveEntry) -> tuple[Any, str]:
    """The entry's simplified form as (sympy expression or None, text to show).

    The archive stores it (``evolve.search.entry_from`` runs
    ``primitives.language.simplify_expression``: constants folded, sympy.simplify where
    cheap); entries without one are simplified here the same way.
    """
    try:
        parse_infix = _lazy("primitives.language", "parse_infix")
        simplify_expression = _lazy("primitives.language", "simplify_expression")
    except _Unavailable as exc:
        return None, entry.simplified or f"(unavailable: {exc})"
    try:
        if entry.simplified:
            return parse_infix(entry.simplified), entry.simplified
        expr = simplify_expression(parse_infix(entry.expression))
        to_infix = _lazy("primitives.language", "to_infix")
        return expr, to_infix(expr)
    except _Unavailable:
        raise
    except Exception as exc:  # display only: a stored text sympy can not read back
        return None, entry.simplified or f"(could not simplify: {type(exc).__name__}: {_one_line(exc)})"


def _term_unit(term: Any) -> str:
    """Unit of a term's coefficient when the term is a constant or one primitive (µs/<unit>)."""
    import sympy

    from primitives.registry import PRIMITIVE_BY_NAME

    if term == 1:
        return "µs"
    if isinstance(term, sympy.Symbol) and term.name in PRIMITIVE_BY_NAME:
        unit = PRIMITIVE_BY_NAME[term.name].unit
        if unit == "us":
            return "× (µs/µs)"
        if unit == "ratio":
            return "µs"
        return "µs/" + (unit[:-1] if unit.endswith("s") else unit)  # tokens -> µs/token
    return ""


def _terms_table(expr: Any):
    """The simplified form term by term (coefficient, unit, term), if it is a sum of 3+."""
    import sympy
    from rich.table import Table

    from evolve.ui import fmt_number

    if not isinstance(expr, sympy.Add) or len(expr.args) < 3:
        return None
    table = Table(title="Simplified form, term by term (step time in µs)")
    table.add_column("coefficient", justify="right", no_wrap=True)
    table.add_column("unit", no_wrap=True)
    table.add_column("term", overflow="fold")
    for term in expr.as_ordered_terms():
        coef, rest = term.as_coeff_Mul()
        table.add_row(fmt_number(float(coef)), _term_unit(rest), "1" if rest == 1 else str(rest))
    return table


def _cse_table(expr: Any):
    """sympy.cse of the simplified form, when it has common subexpressions (cse0, cse1, ...
    as the Go export names them)."""
    import sympy
    from rich.table import Table

    try:
        taken = {s.name for s in expr.free_symbols}
        names = (sympy.Symbol(f"cse{i}") for i in range(10**6) if f"cse{i}" not in taken)
        replacements, reduced = sympy.cse(expr, symbols=names)
    except Exception:  # display only
        return None
    if not replacements:
        return None
    table = Table(title="Common subexpressions (sympy.cse)", show_header=False)
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    for sym, sub in replacements:
        table.add_row(f"{sym} =", str(sub))
    table.add_row("step time (µs) =", str(reduced[0]))
    return table


def cmd_archive_show(args: argparse.Namespace) -> int:
    from rich.table import Table

    from evolve.ui import fmt_number, mapping_table

    entry = _get_entry(args.run_dir, args.id)
    simplified, simplified_text = _sympy_form(entry)
    console = _console()
    head = Table(title=f"Entry {entry.id}", show_header=False)
    head.add_column("field", style="bold")
    head.add_column("value", overflow="fold")
    head.add_row("run", entry.run_id)
    head.add_row("first found in generation", str(entry.generation))
    head.add_row("on latest front", "yes" if entry.on_front else "no")
    head.add_row("complexity", str(entry.complexity))
    head.add_row("expression", entry.expression)
    same = " ".join(simplified_text.split()) == " ".join(entry.expression.split())
    head.add_row("simplified (sympy)", "(same as the expression)" if same else simplified_text)
    head.add_row("constants", ", ".join(fmt_number(c) for c in entry.constants) or "-")
    head.add_row("primitives", ", ".join(entry.primitives) or "-")
    head.add_row("dataset fingerprint", entry.dataset_fingerprint or "-")
    console.print(head)
    if simplified is not None:
        for table in (_terms_table(simplified), _cse_table(simplified)):
            if table is not None:
                console.print(table)
    objectives = Table(title="Objectives")
    objectives.add_column("objective")
    objectives.add_column("value", justify="right")
    for k, v in entry.objectives.items():
        objectives.add_row(k, fmt_number(v) if k == "complexity" else _fmt_cell(k, v))
    console.print(objectives)
    if entry.overheads:
        console.print(mapping_table(entry.overheads, title="Overheads (µs)", key_label="term", value_label="µs"))
    if entry.per_experiment:
        rows = [{"experiment": name, **metrics} for name, metrics in sorted(entry.per_experiment.items())]
        console.print(_rows_table(rows, title="Per-experiment errors"))
    else:
        console.print("no per-experiment scores archived for this entry", markup=False)
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    for path in args.data:
        _must_exist(path, "--data")
    _check_writable_file(args.json, "--json")
    entry = _get_entry(args.run_dir, args.id)
    resolver = _resolver(args)
    score_entry = _lazy("fitness.scoring", "score_entry")
    rows = list(score_entry(entry, [str(p) for p in args.data], resolver))
    result: dict[str, Any] = {"id": entry.id, "expression": entry.expression, "data": list(args.data), "experiments": rows}
    n_total = sum(float(r.get("n", 0) or 0) for r in rows)
    if n_total > 0 and all("mape" in r and r["mape"] is not None for r in rows):
        # one headline figure: MAPE over all steps (experiments weighted by their step count)
        result["overall_mape"] = sum(float(r["mape"]) * float(r.get("n", 0) or 0) for r in rows) / n_total
    if args.json:
        _write_json(args.json, result)
    console = _console()
    console.print(_rows_table(rows, title=f"Per-step error of {entry.id}"))
    if "overall_mape" in result:
        console.print(f"overall MAPE (step-weighted): {_fmt_cell('mape', result['overall_mape'])}", markup=False)
    return 0


def _validation_table(result: dict, title: str):
    """Predicted against observed per experiment: the figures a user checks first."""
    from rich.table import Table

    def pct(v):
        if v is None:
            return "—"
        colour = "green" if abs(v) <= 0.10 else ("yellow" if abs(v) <= 0.15 else "red")
        return f"[{colour}]{v * 100:+.1f}%[/]"

    def num(v, scale=1.0, fmt="{:.3f}"):
        return "—" if v is None else fmt.format(v * scale)

    t = Table(title=title)
    for col, just in [("experiment", "left"), ("E2E s pred/obs", "right"), ("err", "right"),
                      ("TTFT ms pred/obs", "right"), ("err", "right"), ("ITL ms pred/obs", "right"),
                      ("err", "right"), ("failures pred/obs", "right")]:
        t.add_column(col, justify=just)
    for it in result.get("experiments", []):
        name = it["name"].split("-", 2)[-1] if it["name"][:8].isdigit() else it["name"]
        if it.get("held_out_model"):
            name += " (held out)"
        t.add_row(
            name,
            f"{num(it['e2e_mean_pred_s'])} / {num(it['e2e_mean_obs_s'])}", pct(it["e2e_error"]),
            f"{num(it['ttft_mean_pred_s'], 1e3, '{:.1f}')} / {num(it['ttft_mean_obs_s'], 1e3, '{:.1f}')}",
            pct(it["ttft_error"]),
            f"{num(it['itl_mean_pred_s'], 1e3, '{:.2f}')} / {num(it['itl_mean_obs_s'], 1e3, '{:.2f}')}",
            pct(it["itl_error"]),
            f"{it['failures_pred']} / {'—' if it['failures_obs'] is None else it['failures_obs']}",
        )
    return t


def cmd_validate(args: argparse.Namespace) -> int:
    _must_exist(args.experiments, "--experiments", "dir")
    _check_writable_file(args.json, "--json")
    entry = _get_entry(args.run_dir, args.id)
    resolver = _resolver(args)
    validate_entry = _lazy("fitness.validate", "validate_entry")
    console = _console()
    what = "leave-one-model-out refits and closed-loop runs" if args.lomo else "closed-loop runs"
    with console.status(f"{entry.id}: {what} of every experiment under {args.experiments} ..."):
        result = validate_entry(entry, str(args.experiments), bool(args.lomo), resolver)
    if args.json:
        _write_json(args.json, {"id": entry.id, "expression": entry.expression, "lomo": bool(args.lomo), **dict(result)})
    title = f"Validation of {entry.id}" + (" (leave one model out)" if args.lomo else "")
    console.print(_validation_table(result, title))
    summary = result.get("summary", {})
    console.print(_rows_table([{"name": k, "value": v} for k, v in summary.items() if not isinstance(v, dict)],
                              title="summary (absolute errors over experiments with results)"))
    if result.get("plot"):
        console.print(f"plot: {result['plot']}")
    return 0


def cmd_export_go(args: argparse.Namespace) -> int:
    if (args.model is None) != (args.tp is None):
        raise InputError("--model/--tp", None, "give both --model NAME and --tp N, or neither")
    with _open_store(args.run_dir) as store:
        entry = store.get(args.id)
        run_dir = Path(store.path).parent
    resolver = _resolver(args)
    if args.model:
        deployment = resolver.resolve(args.model, args.tp, args.gpu)
        print(f"deployment: {deployment.model.name} TP{deployment.tp} on {deployment.gpu.name} (--model/--tp)")
    else:
        # No deployment named: bake in the first one the entry's run trained on.
        run_deployments = _lazy("translate_go.export", "run_deployments")
        known = run_deployments(entry, run_dir)
        first = known[0]
        deployment = resolver.resolve(first.model, first.tp, args.gpu or first.gpu)
        others = sorted({f"{d.model} --tp {d.tp}" for d in known} - {f"{first.model} --tp {first.tp}"})
        print(
            f"deployment: {deployment.model.name} TP{deployment.tp} on {deployment.gpu.name} "
            f"(the run's first deployment, experiment {first.experiment}; "
            + (f"others: --model {', --model '.join(others)})" if others else "the run's only one)")
        )
    out = writable_dir(args.out, "--out")
    export_go = _lazy("translate_go.export", "export_go")
    written = export_go(entry, deployment, out, args.package, args.interface)
    if isinstance(written, (str, os.PathLike)):
        written = [written]
    for path in written or []:
        print(f"wrote {path}")
    if not written:
        print(f"exported {entry.id} to {out}")
    return 0


# -- parser -------------------------------------------------------------------------
def _add_run_dir(p: argparse.ArgumentParser, help: str = "run directory (default: the one named in ./runs/LATEST)") -> None:
    p.add_argument("--run-dir", metavar="DIR", help=help)


def _add_resolver_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-configs", metavar="DIR", help="folder of HF config.json folders (default: built-ins)")
    p.add_argument("--gpu-datasheet", metavar="FILE", help="GPU datasheet JSON (default: built-in H100)")


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
    parser = argparse.ArgumentParser(prog=PROG, description="Evolve vLLM step-time models and export them to BLIS (Go).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run a search", description="Run a GP search; results go to a run directory.")
    p.add_argument("--generations", type=_positive_int, required=True, metavar="N", help="generations to evolve")
    p.add_argument("--population", type=_positive_int, default=200, metavar="P", help="individuals per generation")
    p.add_argument("--data", nargs="+", action="extend", metavar="PATH", help="step trace files or folders (default: embedded data)")
    p.add_argument("--experiments", metavar="DIR", help="experiment folders for the replayed E2E objectives")
    p.add_argument("--seed", type=_seed, default=0, metavar="S", help="random seed (same seed, same run)")
    p.add_argument("--jobs", type=_jobs, default=1, metavar="J", help="parallel evaluation workers (-1: every core)")
    _add_run_dir(p, help="where to write (default: runs/<UTC time>-seed<S>)")
    p.add_argument("--time-limit", type=_positive_float, metavar="SEC", help="stop after this many seconds")
    _add_resolver_options(p)
    p.add_argument("--backend", choices=("loky", "dask"), default="loky")
    p.add_argument("--scheduler", metavar="ADDRESS", help="dask scheduler address (with --backend dask)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--checkpoint-every", type=_positive_int, default=5, metavar="N", help="generations between checkpoints")
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
    p.add_argument("--data", nargs="+", action="extend", required=True, metavar="PATH", help="step trace files or folders")

    p = _entry_command(sub, "validate", "replay experiments end to end with an entry", cmd_validate)
    p.add_argument("--experiments", required=True, metavar="DIR")
    p.add_argument("--lomo", action="store_true", help="leave one model out: refit per held-out model")

    p = sub.add_parser("export-go", help="write step_time.go for BLIS")
    p.add_argument("id", metavar="ID")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--package", default="latency", metavar="NAME", help="Go package name (default: latency)")
    p.add_argument("--interface", choices=("seed", "blis"), default="seed", help="seed: the five-method interface (default); blis: upstream BLIS's four methods")
    p.add_argument("--model", metavar="NAME", help="bake constants for this model (with --tp)")
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
    except _Unavailable as exc:
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
