"""What the commands show: the JSON view of an entry, rich tables of entries and scores
(validations: ``evolve.validation_view``; the HTML report: ``evolve.html_report``).

rich, sympy and matplotlib are imported by the functions that draw, so that a command
printing JSON starts without them.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path
from typing import Any

from archive.entry import ArchiveEntry

# Error objectives shown as columns when any entry has them (fractions, shown as %).
ERROR_COLUMNS = (
    ("step_mape", "step MAPE"),
    ("e2e_error", "E2E err"),
    ("ttft_error", "TTFT err"),
    ("itl_error", "ITL err"),
)


def make_console():
    """The commands' rich console. Where the reader goes away (``| head``), rich exits 1;
    this one raises BrokenPipeError, which the command line ends with status 0. A live
    display's refresh thread only marks it (``pipe_broken``): the main thread asks."""
    import threading

    from rich.console import Console

    class _Console(Console):
        pipe_broken = False

        def on_broken_pipe(self) -> None:
            self.quiet = self.pipe_broken = True
            if threading.current_thread() is threading.main_thread():
                raise BrokenPipeError

    return _Console()


TABLE_MAX_WIDTH = 80  # the terminal the tables are laid out for


def titled_table(title: str | None = None, caption: str | None = None, **options):
    """A rich table at least as wide as its title and caption (up to 80 columns): rich wraps
    both to the table's width, which splits a short title over a narrow table."""
    from rich.table import Table

    text = max(len(title or ""), len(caption or ""))
    width = min(text + 4, TABLE_MAX_WIDTH)
    return Table(title=title, caption=caption, caption_justify="left", min_width=width, **options)


# -- formatting -----------------------------------------------------------------------
def clean(obj: Any) -> Any:
    """JSON-safe copy: non-finite floats become null, numpy scalars plain numbers."""
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist") and callable(obj.tolist):  # numpy scalars and arrays
        return clean(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def fmt_fraction(value: object) -> str:
    """A relative error stored as a fraction, shown as a percentage ('-' if missing)."""
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "-"
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{100.0 * v:.2f}%"


def fmt_number(value: object) -> str:
    if value is None or isinstance(value, int):  # bool is an int
        return str(value)
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(value)
    return f"{v:.6g}" if math.isfinite(v) else str(v)


# A float literal in an expression's text (not a digit inside a name such as x1).
_FLOAT_LITERAL = re.compile(r"(?<![\w.])\d+\.\d+(?:[eE][+-]?\d+)?(?![\w.])")


def display_expression(expression: str) -> str:
    """An expression as a person reads it: its literals to 6 significant digits, as the
    constants are shown (the archive and every --json keep them exact)."""
    return _FLOAT_LITERAL.sub(lambda m: fmt_number(float(m.group())), expression)


def expression_terms(expression: str) -> list[str]:
    """An expression's text split into its additive terms outside brackets, minus kept (``-2*x``)."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(expression):
        depth += (ch in "([") - (ch in ")]")
        if depth == 0 and expression[i - 1 : i + 2] in (" + ", " - "):
            terms.append(expression[start:i])
            start = i + 2 if ch == "+" else i  # a minus stays with its term
    terms.append(expression[start:])
    return [re.sub(r"^- ", "-", " ".join(t.split())) for t in terms]


def printed_form(expression: str) -> str:
    """EXPRESSION as the tables print it, its terms sorted: trees whose fits print alike share it."""
    return " + ".join(sorted(expression_terms(display_expression(expression))))


def fmt_cell(key: str, value: Any) -> str:
    """A table cell: errors (by their key) as percentages, rows as JSON, numbers to 6 digits."""
    k = key.lower()
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and ("mape" in k or k.endswith("ape") or "error" in k or k.endswith("_err"))
    ):
        return fmt_fraction(value)
    if isinstance(value, (dict, list)):
        return json.dumps(clean(value))
    return fmt_number(value) if not isinstance(value, str) else value


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


def fill_whole(text: str, width: int = 80, keep: tuple[str, ...] = (), **options) -> str:
    """``textwrap.fill`` that splits no phrase of KEEP (a command to copy), no option from its
    value (``--tp 2``) and no name at its hyphens."""
    for phrase in keep:  # textwrap breaks at ASCII whitespace only
        text = text.replace(phrase, phrase.replace(" ", "\xa0"))
    glued = re.sub(r"(--[\w-]+) (?=-?\d|[^-\s])", "\\1\xa0", text)  # a value, negative too
    return textwrap.fill(glued, width, break_long_words=False, break_on_hyphens=False, **options).replace("\xa0", " ")


# -- generic tables -------------------------------------------------------------------
MIN_FITTED_DEPLOYMENTS = 3  # fewer cannot tell a step constant from per-GPU, per-layer or weight costs


def coverage_note(fitted: list[tuple[str, int, float]], entry_id: str) -> str | None:
    """A warning for ``archive best`` and ``export-go`` where a model's fit saw fewer than
    MIN_FITTED_DEPLOYMENTS deployments (FITTED: model, TP and weight bytes per GPU of each):
    the terms constant within a deployment are pinned by that many points, and by fewer
    where the deployments hold the same weight bytes per GPU (the real traces' two do)."""
    n = len(fitted)
    if n >= MIN_FITTED_DEPLOYMENTS or n == 0:
        return None
    names = ", ".join(f"{model} TP{tp}" for model, tp, _ in fitted)
    weight_bytes = [w for _, _, w in fitted]
    same = n > 1 and max(weight_bytes) <= 1.05 * min(weight_bytes)
    held = f" holding about the same weights per GPU ({', '.join(f'{w / 1e9:.1f}' for w in weight_bytes)} GB)"
    check = f"python -m evolve score {entry_id} --data DIR --lodo"
    text = (
        f"note: fitted on {n} deployment{'s' if n > 1 else ''} ({names}){held if same else ''}: its "
        "per-deployment terms (intercept, tp, n_layers, weight streaming) may not carry to other "
        "deployments" + (f"; {check} checks." if n > 1 else ".")
    )
    return fill_whole(text, 80, keep=(check,))


def print_coverage_note(entry: ArchiveEntry, run_dir: Path, resolver) -> None:
    """``coverage_note`` of the deployments ENTRY's fit saw; nothing where they cannot be
    found or resolved (the warning is a courtesy, never an error)."""
    from archive.rundir import fitted_deployments
    from primitives.errors import InputError

    try:
        fitted = [(d.model, d.tp, resolver.resolve(d.model, d.tp, d.gpu)) for d in fitted_deployments(entry, run_dir)]
    except (InputError, OSError, TypeError, ValueError):  # data moved or damaged: say nothing
        return
    # a trace names a model "llama-2-70b", an experiment by its HF id: one deployment
    unique = {(dep.model.name, dep.tp): (m, tp, dep.weight_bytes_per_gpu) for m, tp, dep in fitted}
    note = coverage_note(list(unique.values()), entry.id)
    if note:
        print(note)


def mapping_table(mapping: dict, title: str | None = None, key_label: str = "name", value_label: str = "value"):
    """Names and values; numbers right-aligned, a list as its items, a mapping a line per key."""
    table = titled_table(title)
    table.add_column(key_label)
    numeric = all(isinstance(v, (int, float)) for v in mapping.values())
    table.add_column(value_label, justify="right" if numeric else "left", overflow="fold")
    for k, v in mapping.items():
        table.add_row(str(k), _mapping_value(v))
    return table


def _mapping_value(value: Any) -> str:
    if isinstance(value, dict):  # experiments (kv_sharing) by their short names, other keys as they are
        names = short_keys([str(k) for k in value])
        return "\n".join(f"{names[str(k)]}: {fmt_number(v)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "none"
    return fmt_number(value)


def short_keys(keys: list[str]) -> dict[str, str]:
    """Experiments (folder names with their date) by short name where none of KEYS shares it; others as they are."""
    short = {k: short_experiment_name(k) if _DATE_PREFIX.match(k) else k for k in keys}
    return {k: s if list(short.values()).count(s) == 1 else k for k, s in short.items()}


_DATE_PREFIX = re.compile(r"^\d{8}-\d{6}-")  # an experiment folder's start time


# parts of a model's folder name that tell no experiment of a run from another
_NAME_NOISE = re.compile(r"-hf(?= tp)|-v\d+(?:-\d+)*(?= tp)")


def short_experiment_name(name: str) -> str:
    """An experiment's folder name without its date prefix, and without an ``-hf`` or version
    suffix on the model, with spaces where it may wrap (every command names it so):
    ``20260218-141024-mixtral-8x7b-v0-1-tp2-roleplay`` -> ``mixtral-8x7b tp2 roleplay``."""
    name = _DATE_PREFIX.sub("", name)
    head, _, workload = name.rpartition("-")
    return _NAME_NOISE.sub("", f"{head.replace('-tp', ' tp')} {workload}") if head else name


# archive show's per-experiment columns: (header, key); closed-loop errors replace the
# search's first-order estimates where the entry was checked
PER_EXPERIMENT_COLUMNS = (
    ("E2E", "e2e_error"),
    ("TTFT", "ttft_error"),
    ("ITL", "itl_error"),
    ("step MAPE", "step_mape"),
)


def per_experiment_table(per_experiment: dict[str, dict]):
    """An entry's errors per experiment, narrow enough for 80 columns (names wrap at spaces);
    keys it does not know are shown after them."""
    closed = any(k.endswith("_closed_loop") for m in per_experiment.values() for k in m)
    shown = [(h, k if k == "step_mape" or not closed else f"{k}_closed_loop") for h, k in PER_EXPERIMENT_COLUMNS]
    known = {k for _, k in PER_EXPERIMENT_COLUMNS} | {f"{k}_closed_loop" for _, k in PER_EXPERIMENT_COLUMNS}
    extra = sorted({k for m in per_experiment.values() for k in m} - known - {"step_mape_train"})
    rows = [
        {
            "experiment": short_experiment_name(name),
            **{h: fmt_fraction(m[k]) if m.get(k) is not None else "-" for h, k in shown},
            **{k: m[k] for k in extra if k in m},
        }
        for name, m in sorted(per_experiment.items())
    ]
    for header, _ in shown:  # a column with nothing in it (no experiments, or no traces) is left out
        if all(r[header] == "-" for r in rows):
            for r in rows:
                del r[header]
    what = "in the closed loop" if closed else "the search's estimates"
    steps = "; step MAPE: trace holdout" if rows and "step MAPE" in rows[0] else ""
    return rows_table(rows, title=f"Per-experiment errors ({what}{steps})")


NUMBER_CELL = re.compile(r"^(?:[-+]?[\d.,]+(?:e[-+]?\d+)?\s?(?:%|x|ms|s|µs)?|-|—|)$")


def rows_table(rows: list[dict], title: str | None = None, caption: str | None = None):
    """Rows of dicts as one table; the columns are every key, in order of appearance."""

    columns: list[str] = []
    for r in rows:
        for k in r:
            if k not in columns:
                columns.append(k)
    cells = [[fmt_cell(c, r[c]) if c in r else "-" for c in columns] for r in rows]
    table = titled_table(title, caption)
    # the narrowest each column can go without splitting a word: does the table fit so?
    narrowest = [
        max(len(w) for text in [c] + [row[i] for row in cells] for w in text.split() or [""])
        for i, c in enumerate(columns)
    ]
    fits = sum(narrowest) + 3 * len(columns) + 1 <= TABLE_MAX_WIDTH  # cells, padding and borders
    for i, c in enumerate(columns):
        numeric = all(NUMBER_CELL.match(row[i]) for row in cells)
        # where everything fits, a column of single words (names) is never split and prose
        # wraps at its spaces; where not, rich folds (it cuts an unwrappable cell short)
        words = fits and not numeric and all(" " not in row[i] for row in cells)
        table.add_column(c, justify="right" if numeric else "left", no_wrap=words, overflow="fold")
    for row in cells:
        table.add_row(*row)
    return table


def lodo_report(held_out: list[dict]) -> list:
    """``score --lodo``'s table (``fitness.step_errors.deployment_transfer`` rows), and a line
    on what "pinned: no" means where a refit is not pinned."""
    rows = [
        {
            "deployment": r["deployment"],
            "n": r["n"],
            "mape as stored": r["mape_stored"],
            "mape refitted": "failed" if r["mape_refit"] is None else r["mape_refit"],
            "pinned": "yes" if r["pinned"] else "no",
        }
        for r in held_out
    ]
    shown: list = [rows_table(rows, title="Leave one deployment out: constants refitted on the others' steps")]
    if not all(r["pinned"] for r in held_out):
        shown.append(
            "pinned no: its intercept and the terms constant within a deployment (tp, n_layers, ...)"
            " outnumber the deployments fitted on; the refit is one split of their constant among many"
        )
    return shown


def batch_bias_table(rows: list[dict]):
    """``score``'s signed error by batch size: one row per experiment and quantile of the
    requests per step (``fitness.step_errors.error_by_quantile``); experiments by ``short_keys``."""
    table = titled_table("Signed step error by batch size (quantiles of the steps)")
    names = short_keys([r["experiment"] for r in rows])
    table.add_column("experiment", overflow="fold")
    for c in ("requests", "steps", "bias", "MAPE"):
        table.add_column(c, justify="right")
    for r in rows:
        for i, b in enumerate(r.get("by_batch_size") or []):
            span = f"{b['from']:g}" if b["from"] == b["to"] else f"{b['from']:g}-{b['to']:g}"
            name = names[r["experiment"]] if i == 0 else ""
            table.add_row(name, span, str(b["n"]), f"{b['bias'] * 100:+.1f}%", fmt_cell("mape", b["mape"]))
    return table


# -- one entry in detail (archive show) -------------------------------------------------
def sympy_form(entry: ArchiveEntry) -> tuple[Any, str]:
    """The entry's simplified form as (sympy expression or None, text to show).

    The archive stores it (``evolve.records.entry_from`` runs
    ``primitives.language.simplify_expression``: constants folded, sympy.simplify where
    cheap); entries without one are simplified here the same way.
    """
    from primitives.language import parse_infix, simplify_expression, to_infix

    try:
        if entry.simplified:
            return parse_infix(entry.simplified), entry.simplified
        expr = simplify_expression(parse_infix(entry.expression))
        return expr, to_infix(expr)
    except Exception as exc:  # display only: a stored text sympy can not read back
        reason = " ".join(str(exc).split())
        return None, entry.simplified or f"(could not simplify: {type(exc).__name__}: {reason})"


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

    if not isinstance(expr, sympy.Add) or len(expr.args) < 3:
        return None
    table = titled_table("Simplified form, term by term (step time in µs)")
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

    try:
        taken = {s.name for s in expr.free_symbols}
        names = (sympy.Symbol(f"cse{i}") for i in range(10**6) if f"cse{i}" not in taken)
        replacements, reduced = sympy.cse(expr, symbols=names)
    except Exception:  # display only
        return None
    if not replacements:
        return None
    table = titled_table("Common subexpressions (sympy.cse)", show_header=False)
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    for sym, sub in replacements:
        table.add_row(f"{sym} =", str(sub))
    table.add_row("step time (µs) =", str(reduced[0]))
    return table


def entry_detail(entry: ArchiveEntry) -> list:
    """What ``archive show`` prints: the entry, its terms, objectives, overheads and per-experiment errors."""

    simplified, simplified_text = sympy_form(entry)
    head = titled_table(f"Entry {entry.id}", show_header=False)
    head.add_column("field", style="bold")
    head.add_column("value", overflow="fold")
    head.add_row("run", entry.run_id)
    head.add_row("first found in generation", str(entry.generation))
    head.add_row("on latest front", "yes" if entry.on_front else "no")
    head.add_row("complexity", str(entry.complexity))
    head.add_row("expression", display_expression(entry.expression))
    same = " ".join(simplified_text.split()) == " ".join(entry.expression.split())
    head.add_row("simplified (sympy)", "(same as the expression)" if same else display_expression(simplified_text))
    head.add_row("constants", _tree_constants(entry.constants))
    used = set(re.findall(r"[A-Za-z_]\w*", entry.expression))
    left_out = [p for p in entry.primitives if p not in used]
    shown_primitives = [p if p in used else f"{p} (not in the expression)" for p in entry.primitives]
    head.add_row("primitives", ", ".join(shown_primitives) or "-")
    nonzero = sum(1 for c in entry.constants if c != 0)
    summed = entry.constants and nonzero > len(expression_terms(entry.expression))  # like terms, summed
    if left_out or 0 in entry.constants[1:] or summed:
        note = "complexity, constants, primitives: the evolved tree's; the expression sums like terms, drops 0s"
        head.add_row("note", note)
    head.add_row("dataset fingerprint", entry.dataset_fingerprint or "-")
    shown: list = [head]
    if simplified is not None:
        shown += [t for t in (_terms_table(simplified), _cse_table(simplified)) if t is not None]
    shown.append(efficiency_table(entry))
    objectives = titled_table("Objectives")
    objectives.add_column("objective")
    objectives.add_column("value", justify="right")
    for k, v in entry.objectives.items():
        objectives.add_row(k, fmt_number(v) if k == "complexity" else fmt_cell(k, v))
    shown.append(objectives)
    if entry.overheads:
        shown.append(mapping_table(entry.overheads, title="Overheads (µs)", key_label="term", value_label="µs"))
    if entry.per_experiment:
        shown.append(per_experiment_table(entry.per_experiment))
    else:
        shown.append("no per-experiment scores archived for this entry")
    return shown


def _tree_constants(constants: list[float]) -> str:
    """An entry's fitted constants: the tree's intercept, then each of its additive terms' coefficients."""
    if not constants:
        return "-"
    terms = ", ".join(fmt_number(c) for c in constants[1:])
    return f"intercept {fmt_number(constants[0])}" + (f"; terms {terms}" if terms else "")


def efficiency_table(entry: ArchiveEntry):
    """Each term's fitted coefficient and kind; an efficiency on or outside its bounds is flagged."""
    from fitness.efficiency import run_efficiency_bounds
    from fitness.physics_check import bound_flag, term_efficiencies

    bounds = run_efficiency_bounds(entry.run_config)
    rows = [
        {
            "term": r["term"],
            "kind": r["kind"],
            "coefficient": fmt_number(r["coefficient"]),
            "flag": bound_flag(r),
        }
        for r in term_efficiencies(entry.expression, bounds)
    ]
    if not rows:
        return "no terms: the expression is a constant"
    return rows_table(rows, "Fitted efficiencies", f"bounds: µs terms {bounds.describe()}")
