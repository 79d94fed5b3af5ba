"""The command line of ``python -m fitness.emulator``: regenerate the embedded synthetic dataset."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from fitness.emulator.experiment import DEFAULT_SEED
from fitness.emulator.generate import DEFAULT_DATA_DIR, generate
from fitness.emulator.physics import EmulatorPhysics
from fitness.emulator.workloads import DURATION_SCALE
from primitives.errors import InputError


def main(argv: list[str] | None = None) -> int:
    """Parse ARGV, generate; 0 on success, 2 on bad input (one line on stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m fitness.emulator",
        description="Regenerate the embedded synthetic step-trace dataset (deterministic for a seed).",
    )
    parser.add_argument("--out", default=str(DEFAULT_DATA_DIR), help="output directory (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="master seed (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel experiments (default: %(default)s)")
    parser.add_argument(
        "--duration-scale",
        type=float,
        default=DURATION_SCALE,
        help="fraction of each load stage's real duration (default: %(default)s)",
    )
    parser.add_argument(
        "--noise-sigma",
        type=float,
        default=EmulatorPhysics().noise_sigma,
        help="lognormal sigma of the cycle noise (default: %(default)s)",
    )
    parser.add_argument(
        "--experiments",
        nargs="*",
        default=None,
        help="only these experiment ids, model names or workloads (default: all 16)",
    )
    args = parser.parse_args(argv)
    try:
        if not 0.0 < args.duration_scale <= 1.0:
            raise InputError("--duration-scale", None, f"expected a fraction in (0, 1], got {args.duration_scale}")
        if not 0.0 <= args.noise_sigma < 1.0:
            raise InputError("--noise-sigma", None, f"expected a sigma in [0, 1), got {args.noise_sigma}")
        if args.jobs < 1:
            raise InputError("--jobs", None, f"expected a positive number of jobs, got {args.jobs}")
        generate(
            args.out,
            args.seed,
            args.jobs,
            replace(EmulatorPhysics(), noise_sigma=args.noise_sigma),
            args.duration_scale,
            experiments=args.experiments,
        )
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
