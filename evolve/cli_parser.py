"""The command line of ``python -m evolve``: argument types and the parser.

A usage error is one line ending in where to find the usage (``error: ... (usage: ...
--help)``), not argparse's whole usage block; ``--help`` prints the usage as usual.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, NoReturn

from evolve.config import BOUNDS_HELP, MAX_LOAD_DRAWS, REFIT_ROUNDS, parse_bounds
from evolve.resume import MAX_SEED

PROG = "python -m evolve"


class OneLineParser(argparse.ArgumentParser):
    """argparse, with usage errors as one line plus where to find the usage."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {' '.join(message.split())} (usage: {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # named by the command they were given to, whose --help lists its options
            parser: argparse.ArgumentParser = self
            while True:
                sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
                chosen = sub.choices.get(getattr(parsed, sub.dest, None) or "") if sub else None
                if chosen is None:
                    break
                parser = chosen
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


# -- argument types (argparse turns ArgumentTypeError into usage + exit 2) -----------
# (public: the benchmarks' command lines take their numbers with these too)
def number_arg(kind: type, ok: Callable[[float], bool], expected: str, what: str = "a whole number"):
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


positive_int = number_arg(int, lambda v: v >= 1, "a number >= 1")
nonnegative_int = number_arg(int, lambda v: v >= 0, "a number >= 0")
_jobs = number_arg(int, lambda v: v >= 1 or v == -1, "a number >= 1 (or -1 for every core)")
seed_arg = number_arg(int, lambda v: 0 <= v <= MAX_SEED, f"a seed in 0..{MAX_SEED}")
_scale = number_arg(float, lambda v: 0.1 <= v <= 10, "a factor in 0.1..10", "a number")
load_draws_arg = number_arg(int, lambda v: 1 <= v <= MAX_LOAD_DRAWS, f"a number in 1..{MAX_LOAD_DRAWS}")
positive_float = number_arg(
    float, lambda v: math.isfinite(v) and v > 0, "a positive number of seconds", "a number of seconds"
)


# -- parser -------------------------------------------------------------------------
def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("stepsynth")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def _add_run_dir(
    p: argparse.ArgumentParser, help: str = "run directory (default: the one named in ./runs/LATEST)"
) -> None:
    p.add_argument("--run-dir", metavar="DIR", help=help)


def _add_resolver_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-configs", metavar="DIR", help="folder of HF config.json folders (default: built-ins)")
    p.add_argument("--gpu-datasheet", metavar="FILE", help="GPU datasheet JSON (default: built-in H100)")
    p.add_argument("--kernels", metavar="DIR", help="the GPU's measured kernel tables (default: built-in H100)")


ID_HELP = "entry id or a unique prefix of it (python -m evolve archive list)"


def _entry_command(sub, name: str, help: str, handler) -> argparse.ArgumentParser:
    """A command on one archived entry that writes results: ID, --run-dir, --json, resolver options."""
    p = sub.add_parser(name, help=help)
    p.add_argument("id", metavar="ID", help=ID_HELP)
    _add_run_dir(p)
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    _add_resolver_options(p)
    p.set_defaults(handler=handler)
    return p


def build_parser(handlers: dict[str, Callable]) -> argparse.ArgumentParser:
    """The command line; HANDLERS: the function of each command (``run``, ``archive_list``, ...)."""
    parser = OneLineParser(prog=PROG, description="Evolve vLLM step-time models and export them to BLIS (Go).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run a search", description="Run a GP search; results go to a run directory.")
    p.add_argument("--generations", type=positive_int, required=True, metavar="N", help="generations to evolve")
    p.add_argument("--population", type=positive_int, metavar="P", help="individuals per generation (default 200)")
    p.add_argument(
        "--data",
        nargs="+",
        action="extend",
        metavar="PATH",
        help="step trace files, or folders holding step_traces.parquet or one table (default: embedded data)",
    )
    p.add_argument(
        "--experiments", metavar="DIR", help="folder of experiment folders (any depth) for the replayed E2E objectives"
    )
    p.add_argument("--seed", type=seed_arg, metavar="S", help="random seed (same seed, same run; default 0)")
    p.add_argument(
        "--jobs", type=_jobs, default=1, metavar="J", help="parallel evaluation workers (default 1; -1: every core)"
    )
    _add_run_dir(p, help="where to write (default: runs/<UTC time>-seed<S>)")
    p.add_argument("--time-limit", type=positive_float, metavar="SEC", help="stop after this many seconds")
    _add_resolver_options(p)
    p.add_argument(
        "--backend", choices=("loky", "dask"), default="loky", help="where workers run (default: loky, this machine)"
    )
    p.add_argument("--scheduler", metavar="ADDRESS", help="dask scheduler address (with --backend dask)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--efficiency-bounds", type=parse_bounds, metavar="LO,HI", help=BOUNDS_HELP)
    p.add_argument(
        "--step-scatter",
        dest="scatter_steps",
        action="store_const",
        const=True,
        help="simulated steps scatter as the step data's steps do around their neighbours (measured"
        " once; validate uses it too)",
    )
    p.add_argument(
        "--load-draws",
        type=load_draws_arg,
        metavar="N",
        help="fit the replayed means to the mean of N draws of each experiment's load (seeds S, S+1, ...)"
        " and check the front on as many (default 1)",
    )
    p.add_argument(
        "--checkpoint-every", type=positive_int, metavar="N", help="generations between checkpoints (default 5)"
    )
    p.set_defaults(handler=handlers["run"])

    pa = sub.add_parser("archive", help="browse a run's archive", description="Browse the archive of a run.")
    asub = pa.add_subparsers(dest="archive_command", required=True, metavar="ACTION")
    q = asub.add_parser("list", help="the Pareto front of the latest generation")
    _add_run_dir(q)
    q.add_argument("--json", action="store_true", help="print JSON instead of a table")
    q.add_argument("--all", action="store_true", help="every archived entry, not only the latest front")
    q.set_defaults(handler=handlers["archive_list"])
    q = asub.add_parser("show", help="one entry in detail")
    q.add_argument("id", metavar="ID", help="entry id or a unique prefix of it")
    _add_run_dir(q)
    q.set_defaults(handler=handlers["archive_show"])
    q = asub.add_parser("best", help='the recommended model (README, "Model selection")')
    _add_run_dir(q)
    q.add_argument("--json", action="store_true", help="print JSON instead of a table")
    q.set_defaults(handler=handlers["archive_best"])

    p = _entry_command(sub, "score", "per-step error of an entry on step traces", handlers["score"])
    p.add_argument(
        "--data",
        nargs="+",
        action="extend",
        required=True,
        metavar="PATH",
        help="step trace files, or folders holding step_traces.parquet or one table",
    )
    p.add_argument(
        "--experiments",
        metavar="DIR",
        help="count the KV of block-counted traces per request, as run --experiments does (KV sharing"
        " measured on these experiments' workloads): the run's figures, if it ran with the same DIR",
    )
    p.add_argument(
        "--lodo",
        action="store_true",
        help="leave one deployment out: refit the constants without each deployment's steps, score it",
    )

    p = _entry_command(sub, "validate", "replay experiments end to end with an entry", handlers["validate"])
    p.add_argument(
        "--experiments", required=True, metavar="DIR", help="a folder of experiment folders (exp-config.yaml, ...)"
    )
    transfer = p.add_mutually_exclusive_group()
    for flag, help in [
        ("--lomo", "leave one model out: refit without each model, validate on it"),
        ("--lowo", "leave one workload out: refit without each workload, validate on it"),
        ("--stage-transfer", "refit on the low-rate load stages, validate the high-rate ones"),
    ]:
        transfer.add_argument(flag, dest="mode", action="store_const", const=flag[2:], help=help)
    p.add_argument(
        "--refit-rounds",
        type=nonnegative_int,
        metavar="N",
        help=f"transfer checks: re-record each fold's training runs with its refit N times (default: {REFIT_ROUNDS})",
    )
    p.add_argument(
        "--load-draws",
        type=load_draws_arg,
        default=1,
        metavar="N",
        help="simulate each experiment with N draws of the load (arrival times, prompt lengths) and"
        " compare their mean; the JSON"
        " and the report give their range (default: 1)",
    )
    p.add_argument(
        "--seed",
        type=seed_arg,
        default=0,
        metavar="S",
        help="the load generator's seed: draws S, S+1, ... (default 0; a run's --seed is the draw it fitted on)",
    )
    p.add_argument(
        "--step-time-scale",
        type=_scale,
        default=1.0,
        metavar="F",
        help="what-if: every step takes F times the model's step time (closed loop only; default 1)",
    )
    p.add_argument(
        "--step-scatter",
        metavar="DIR|none",
        help="each simulated step scatters around the model's time as the real steps in these traces"
        " do around their neighbours; none: no scatter (default: the scatter the entry's run measured)",
    )
    p.add_argument(
        "--headroom",
        action="store_true",
        help="closed loop: per experiment, the factor on step time and on load at which more than 1%%"
        " of the requests time out (bisection: about 16 s more for 16 experiments, one draw)",
    )
    p.add_argument("--baseline", action="store_true", help="also fit and run the BLIS blackbox baseline (slow)")
    p.add_argument(
        "--report", metavar="DIR", help="write a self-contained HTML report there (implies --baseline, --headroom)"
    )

    p = sub.add_parser("export-go", help="write the model as Go: a BLIS backend or a stand-alone package")
    p.add_argument("id", metavar="ID", help=ID_HELP)
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
    p.add_argument("--tp", type=positive_int, metavar="N", help="tensor-parallel degree for --model")
    p.add_argument("--gpu", metavar="NAME", help="GPU for --model (default: the datasheet's / H100)")
    _add_run_dir(p)
    _add_resolver_options(p)
    p.set_defaults(handler=handlers["export_go"])
    _refuse_blank_values(parser)
    return parser


def _nonblank(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a value, got an empty one")
    return text


def _refuse_blank_values(parser: argparse.ArgumentParser) -> None:
    """Every option taking text (a path, a name, an id) refuses an empty value: --out ""
    would otherwise write into the current directory, --report "" write nothing, silently."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in set(action.choices.values()):
                _refuse_blank_values(command)
        elif isinstance(action, (argparse._StoreAction, argparse._AppendAction)) and action.type is None:
            action.type = _nonblank
