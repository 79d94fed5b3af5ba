"""The last net under every command: what an unexpected failure looks like to the user.

Not a traceback: one line naming a crash log that holds it (in the temp folder, so that
read-only commands never write beside the user's files), and exit status 1. A full disk
is named as such, without a log (there may be no room for one).

Signals: SIGTERM is handled as Ctrl-C is (the run checkpoints and stops), and the worker
processes are killed on the way out rather than left to idle out.
"""

from __future__ import annotations

import errno
import os
import signal
import sqlite3
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def is_disk_full(exc: BaseException) -> bool:
    """A write failed for want of space (an OSError, or sqlite's own words for it)."""
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        return True
    return isinstance(exc, sqlite3.OperationalError) and "disk is full" in str(exc).lower()


def write_crash_log(exc: BaseException, argv: list[str]) -> Path | None:
    """The traceback of EXC (and the command) in a new file of the temp folder; None if it cannot be written."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    text = f"command: python -m evolve {' '.join(argv)}\n\n" + "".join(
        traceback.format_exception(type(exc), exc, exc.__traceback__)
    )
    try:
        fd, path = tempfile.mkstemp(prefix=f"stepsynth-crash-{stamp}-", suffix=".log")
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
    except OSError:
        return None
    return Path(path)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _quiet_pool_manager(previous):
    """A ``threading.excepthook`` that keeps loky's pool-manager thread quiet, others as before.

    An interrupt (Ctrl-C, SIGTERM) that lands while the main thread hands the pool a task
    can leave the manager thread looking up a task that is gone (a KeyError in loky's
    ``add_call_item_to_queue``) and printing a traceback, after the run has already said in
    one line that it stopped. A real failure of the pool still reaches the main thread:
    loky marks the pool broken and the next call raises there.
    """

    if getattr(previous, "quiets_pool_manager", False):  # once: every command of a process installs it
        return previous

    def hook(args):
        if args.thread is not None and args.thread.name.startswith("ExecutorManagerThread"):
            return
        previous(args)

    hook.quiets_pool_manager = True
    return hook


@contextmanager
def sigterm_as_interrupt():
    """Inside: SIGTERM takes Ctrl-C's path (checkpoint, mark the run interrupted, exit 130),
    and the worker pool's manager thread does not print over the one-line message."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    # left in place on the way out: the manager thread can fail while the workers are killed
    threading.excepthook = _quiet_pool_manager(threading.excepthook)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def kill_workers() -> None:
    """Kill the pool's worker processes now (only if one was started)."""
    module = sys.modules.get("joblib.externals.loky.reusable_executor")
    executor = getattr(module, "_executor", None)
    if executor is not None:
        executor.shutdown(wait=True, kill_workers=True)


def interrupt_behind(exc: BaseException) -> BaseException | None:
    """EXC itself if it is an interrupt (Ctrl-C, SIGTERM, the time limit: a KeyboardInterrupt,
    or SystemExit), or the interrupt behind a SystemError: a signal handled just as compiled
    (numba) code returns surfaces as one ("returned a result with an exception set"),
    chained to the interrupt, one SystemError per compiled frame it passed through. None
    for any other failure, also one raised while an interrupt was being handled (a full
    disk while checkpointing stays a full disk)."""
    seen = 0
    while isinstance(exc, SystemError) and seen < 1000:  # numba nests one per compiled frame
        # the direct cause only ("returned a result with an exception set" is raised from it);
        # a SystemError raised while an interrupt was handled has it as context, and stays one
        exc, seen = exc.__cause__, seen + 1
    return exc if isinstance(exc, (KeyboardInterrupt, SystemExit)) else None


class TimeLimitReached(KeyboardInterrupt):
    """``--time-limit`` ran out outside the generation loop (set-up, final checks): taken as an interrupt."""


class OutputClosed(KeyboardInterrupt):
    """The reader of the run's standard output went away (``| head``): taken as an interrupt, so
    the finished generations are checkpointed and resumable, and the run is not marked failed."""

    def __init__(self, finished_in: object = None) -> None:
        # FINISHED_IN: the run directory, when the output closed after the run had finished
        self.finished_in = finished_in
        super().__init__("its standard output was closed")


def _to_devnull(stream) -> None:
    """Point STREAM's descriptor at /dev/null: what is still to print, and the flush at exit,
    go nowhere once its reader has gone (a stream without a descriptor is left as it is)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def silence_stdout() -> None:
    """Standard output to /dev/null (``_to_devnull``)."""
    _to_devnull(sys.stdout)


def say(line: str) -> None:
    """Print LINE on standard error, the command's last word; where standard error is a pipe
    whose reader has gone too (``2>&1 | head``), it goes nowhere: the exit status still tells."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError) as exc:
        if isinstance(exc, ValueError) and not getattr(sys.stderr, "closed", False):
            raise  # not a closed stream (an encoding error): not to be silenced
        try:
            _to_devnull(sys.stderr)  # the flush at exit goes nowhere too
        except OSError:
            pass


def output_closed(finished_in: object = None, stream: object = None) -> OutputClosed:
    """The interrupt for a write that found its reader gone; STREAM (default: standard output)
    is silenced if it is standard output. FINISHED_IN: the run directory of a finished run."""
    if stream is None or stream is sys.stdout:
        silence_stdout()
    return OutputClosed(finished_in)


def is_time_limit(exc: BaseException) -> bool:
    """EXC is the time limit running out, directly or from inside compiled code."""
    return isinstance(interrupt_behind(exc), TimeLimitReached)


@contextmanager
def time_limit_alarm(remaining_s: float | None, what: str):
    """Inside: raise :class:`TimeLimitReached` once REMAINING_S have passed (None: no limit)."""
    if remaining_s is None:
        yield
        return

    def expire(signum, frame):
        raise TimeLimitReached(f"the time limit was reached during {what}")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(remaining_s, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
