"""The front as a table (``archive list``, ``archive best``, a run's end): one row per entry,
the expressions beside it where they fit and below it where they do not, and the lines
saying what its marks mean."""

from __future__ import annotations

import textwrap

from archive.entry import ArchiveEntry
from evolve.report import ERROR_COLUMNS, display_expression, fmt_fraction, printed_form, titled_table


def print_entries(console, entries: list[ArchiveEntry], recommended_id: str | None = None, title: str | None = None):
    """The entries table, with the expressions in a column when every one fits beside the
    other columns unwrapped, else below the table, each wrapped at its spaces."""
    longest = max((len(display_expression(e.expression)) for e in entries), default=0)
    marks = entry_marks(entries, recommended_id)
    narrow = entries_table(entries, marks, title, expressions=False)
    room = console.width - console.measure(narrow).maximum - 3  # the column's border and padding
    console.print(entries_table(entries, marks, title) if longest <= room else narrow)
    for line in entries_legend(entries, marks):
        console.print(line, markup=False, highlight=False)
    if longest <= room:
        return
    console.print("expressions (step time, µs; constants to 6 digits, --json: exact):", markup=False, highlight=False)
    for e in entries:
        head = f"{marks[e.id] or ' '} {e.id}  "
        # wrapped at spaces: a coefficient*primitive has none, so it is never split
        text = textwrap.fill(
            display_expression(e.expression),
            max(console.width, 40),
            initial_indent=head,
            subsequent_indent=" " * len(head),
            break_long_words=False,
            break_on_hyphens=False,
        )
        console.print(text, markup=False, highlight=False, soft_wrap=True)


def entries_table(
    entries: list[ArchiveEntry],
    marks: dict[str, str],
    title: str | None = None,
    expressions: bool = True,
):
    """The front as a table: mark (``entry_marks``), id, generation found, complexity, errors
    present, expression (if EXPRESSIONS)."""

    table = titled_table(title, show_lines=False)
    table.add_column("", width=1)
    table.add_column("id", no_wrap=True)
    table.add_column("gen", justify="right")
    table.add_column("cx", justify="right")
    shown = [(key, label) for key, label in ERROR_COLUMNS if any(key in e.objectives for e in entries)]
    for _, label in shown:
        table.add_column(label, justify="right", no_wrap=True)
    if expressions:
        table.add_column("expression", overflow="fold")
    mixed = _mixed_closed_loop(entries)
    for e in entries:
        row = [marks[e.id], e.id, str(e.generation), str(e.complexity)]
        for key, _ in shown:
            text = fmt_fraction(e.objectives.get(key))
            if mixed and key in CLOSED_LOOP_KEYS:  # say which figures are simulated end to end
                text += " c" if e.objectives.get("closed_loop") else "  "
            row.append(text)
        table.add_row(*row, *([display_expression(e.expression)] if expressions else []))
    return table


RECOMMENDED_LEGEND = "* recommended (python -m evolve archive best)"
# a tree with more terms whose fit prints as a simpler entry's: the search keeps it, since a
# refit (the transfer estimates) may weigh the terms fitted to 0 here (docs/RESULTS.md)
COPY_LEGEND = "=: prints as a simpler entry; another tree, whose terms refit otherwise"
CLOSED_LOOP_KEYS = ("e2e_error", "ttft_error", "itl_error")
CLOSED_LOOP_LEGEND = "c: simulated end to end (closed loop); unmarked: the search's estimate"


def _mixed_closed_loop(entries: list[ArchiveEntry]) -> bool:
    """Some entries' E2E errors are closed-loop figures and others the search's estimates."""
    checked = {bool(e.objectives.get("closed_loop")) for e in entries if "e2e_error" in e.objectives}
    return len(checked) == 2


def entry_marks(entries: list[ArchiveEntry], recommended_id: str | None) -> dict[str, str]:
    """Each entry's mark: "*" recommended; "=" its expression prints as a simpler entry's
    (``printed_form``); "" neither."""
    first: dict[str, str] = {}
    for e in sorted(entries, key=lambda e: (e.complexity, e.id)):
        first.setdefault(printed_form(e.expression), e.id)
    return {
        e.id: "*" if e.id == recommended_id else ("=" if first[printed_form(e.expression)] != e.id else "")
        for e in entries
    }


def entries_legend(entries: list[ArchiveEntry], marks: dict[str, str]) -> list[str]:
    """The lines below an entries table: what its marks (``entry_marks``) mean (as lines: a
    caption wraps to the table's width)."""
    lines = [RECOMMENDED_LEGEND] if "*" in marks.values() else []
    lines += [COPY_LEGEND] if "=" in marks.values() else []
    return lines + ([CLOSED_LOOP_LEGEND] if _mixed_closed_loop(entries) else [])
