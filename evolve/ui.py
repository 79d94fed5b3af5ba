"""What a search run shows while it runs: a rich progress bar on a terminal, plain lines otherwise.

``evolve.run.run_search(config, ui)`` drives a ``RunUI``::

    ui.start(total_generations, time_limit_s)
    ui.update(generation, best_error, front_size, evals_per_s)   # after each generation
    ui.log("checkpoint written")                                  # any one-line note
    ui.finish(front_entries, summary)                             # summary table

Without a terminal (CI, tests, a pipe) the same calls print plain, rate-limited
lines, so logs stay readable.
"""

from __future__ import annotations

import math
import sys
import textwrap
import time
from typing import IO, Iterable

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

from archive.entry import ArchiveEntry
from evolve.crash import OutputClosed, output_closed
from evolve.front_view import COPY_LEGEND, entry_marks, print_entries
from evolve.report import (
    ERROR_COLUMNS,
    display_expression,
    fmt_fraction,
    fmt_number,
    make_console,
    mapping_table,
)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def _recommended_id(entries: list[ArchiveEntry]) -> str | None:
    from archive.select import recommend

    try:
        return recommend(entries).id
    except ValueError:
        return None


class RunUI:
    """Progress of a search run; ``quiet`` (default: no terminal) prints plain lines instead.

    ``min_interval_s`` rate-limits the plain lines (the first and last generation are
    always printed).
    """

    def __init__(
        self,
        console: Console | None = None,
        quiet: bool | None = None,
        min_interval_s: float = 5.0,
        stream: IO[str] | None = None,
    ):
        self.console = console or make_console()
        self.quiet = (not self.console.is_terminal) if quiet is None else quiet
        self.min_interval_s = min_interval_s
        self._stream = stream
        self._progress: Progress | None = None
        self._task = None
        self._total = 0
        self._time_limit_s: float | None = None
        self._t0 = time.monotonic()
        self._last_line = -math.inf

    @property
    def stream(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stdout

    def _plain(self, text: str) -> None:
        try:
            print(text, file=self.stream, flush=True)
        except BrokenPipeError:
            raise output_closed(stream=self.stream) from None

    def _rich(self, write, *args, **kwargs):
        """WRITE (a rich call) and its result: a reader gone, now or in the live display's
        thread, is OutputClosed."""
        self._raise_if_pipe_broken()
        try:
            return write(*args, **kwargs)
        except BrokenPipeError:
            raise output_closed(stream=self.console.file) from None

    def _raise_if_pipe_broken(self) -> None:
        """OutputClosed if the live display's refresh thread found the reader gone (make_console)."""
        if getattr(self.console, "pipe_broken", False):
            raise output_closed(stream=self.console.file)

    def start(self, total_generations: int, time_limit_s: float | None = None) -> None:
        self._total = int(total_generations)
        self._time_limit_s = time_limit_s
        self._t0 = time.monotonic()
        self._last_line = -math.inf
        limit = f", time limit {fmt_duration(time_limit_s)}" if time_limit_s else ""
        if self.quiet:
            self._plain(f"search: {self._total} generations{limit}")
            return
        progress = Progress(
            SpinnerColumn(),
            TextColumn("gen {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("holdout {task.fields[best]}"),  # the front's lowest held-out step error
            TextColumn("front {task.fields[front]}"),
            TextColumn("{task.fields[rate]} evals/s"),
            TextColumn("ETA {task.fields[eta]}"),
            console=self.console,
            transient=False,
        )
        # kept to stop only once started: a start the closed pipe broke has nothing to stop
        # (rich's stop would pop a render hook never pushed), or stops itself
        self._rich(progress.start)
        self._progress = progress
        fields = {"best": "-", "front": "-", "rate": "-", "eta": "?"}
        self._task = self._rich(self._progress.add_task, "search", total=self._total, **fields)  # it redraws

    def eta_s(self, generation: int) -> float | None:
        """Seconds left: by the generation rate so far, capped by the time limit."""
        elapsed = time.monotonic() - self._t0
        done = max(int(generation), 0)
        estimates = []
        if done > 0 and self._total:
            estimates.append(elapsed / done * max(self._total - done, 0))
        if self._time_limit_s:
            estimates.append(max(self._time_limit_s - elapsed, 0.0))
        return min(estimates) if estimates else None

    def update(self, generation: int, best_error: float, front_size: int, evals_per_s: float) -> None:
        """After a generation (counted from 1; 0 is the initial population)."""
        eta = fmt_duration(self.eta_s(generation))
        rate = f"{evals_per_s:.0f}" if evals_per_s is not None and math.isfinite(evals_per_s) else "-"
        if self.quiet:
            now = time.monotonic()
            last = generation >= self._total
            if last or generation <= 1 or now - self._last_line >= self.min_interval_s:
                self._last_line = now
                self._plain(
                    f"gen {generation}/{self._total} holdout {fmt_fraction(best_error)} front {front_size}"
                    f" {rate} evals/s ETA {eta}"
                )
            return
        if self._progress is not None:
            self._rich(
                self._progress.update,
                self._task,
                completed=min(int(generation), self._total),
                best=fmt_fraction(best_error),
                front=str(front_size),
                rate=rate,
                eta=eta,
            )

    def log(self, message: str) -> None:
        if self.quiet or self._progress is None:
            self._plain(message)
        else:
            self._rich(self._progress.console.print, message, markup=False, highlight=False)

    def close(self) -> None:
        """Stop the live display (idempotent; safe after an exception: a closed output is the
        next write's to report)."""
        try:
            self._stop_live()
        except OutputClosed:
            pass

    def _stop_live(self) -> None:
        progress, self._progress = self._progress, None
        if progress is None:
            return
        try:  # always, so not through _rich: stop() ends the refresh thread and gives sys.stdout and sys.stderr back
            progress.stop()
        except BrokenPipeError:
            raise output_closed(stream=self.console.file) from None
        self._raise_if_pipe_broken()

    def finish(self, entries: Iterable[ArchiveEntry], summary: dict) -> None:
        """Stop the progress display and print the front and the run summary."""
        self._stop_live()
        entries = sorted(entries, key=lambda e: (e.complexity, e.id))
        took = f"{fmt_duration(time.monotonic() - self._t0)} after set-up"  # from start(): the search and its checks
        if "wall_time_s" in summary:
            took = f"{fmt_duration(summary['wall_time_s'])} in all, {took}"
        if self.quiet:
            rec = _recommended_id(entries)
            models = f"{len(entries)} model{'s' if len(entries) != 1 else ''}"
            ended = "finished" if summary.get("status", "finished") == "finished" else f"stopped ({summary['status']})"
            self._plain(textwrap.fill(f"search {ended}: {models} on the front; {took}", 80, subsequent_indent="  "))
            marks = entry_marks(entries, rec)
            for e in entries:
                errs = " ".join(f"{k}={fmt_fraction(e.objectives[k])}" for k, _ in ERROR_COLUMNS if k in e.objectives)
                line = f"{marks[e.id] or ' '} {e.id} cx={e.complexity} {errs} {display_expression(e.expression)}"
                # at 80 columns, wrapped at spaces: a coefficient*primitive has none, so it is never split
                self._plain(
                    textwrap.fill(line, 80, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)
                )
            if "=" in marks.values():
                self._plain(COPY_LEGEND)
            for k, v in summary.items():
                text = f"{k}: {fmt_number(v) if not isinstance(v, (dict, list)) else v}"
                # a list or mapping wraps at 80 columns; a path or an expression stays whole
                self._plain(textwrap.fill(text, 80, subsequent_indent="  ") if isinstance(v, (dict, list)) else text)
            return
        self._rich(print_entries, self.console, entries, _recommended_id(entries), title="Pareto front")
        self._rich(self.console.print, mapping_table(dict(summary), title=f"Run summary ({took})"))
