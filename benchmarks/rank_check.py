"""Does the fused evaluation rank candidates as the plain one does? The default run, scored both ways.

    python benchmarks/rank_check.py [--generations 50] [--seed 3]

Runs the default search (embedded data) twice in this process, once scoring the plain way
(``score_program(..., fused=False)``: one numpy array per node) and once fused, records
every batch of scores, and prints: how far apart the two errors of one candidate are, the
first batch whose candidates differ (from there on the two searches explore different
trees) and the pairs of candidates that the two rank differently before that; each run
prints its front. Two fits that are equal in exact arithmetic (``55 * x`` and ``x + min(379, x)``
on data where they coincide) get errors that differ in the last bits, in an order that
depends on the summation: NSGA-II then keeps one or the other, and the searches part.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evolve.cli_parser import OneLineParser, positive_int, seed_arg  # noqa: E402


def _run(fused: bool, generations: int, seed: int, run_dir: str) -> list:
    """The search's own output (its front) goes to stdout; returns every batch of scores."""
    from evolve import evaluator
    from evolve.cli import main as cli_main
    from fitness.scoring import score_program
    from primitives.language import canonical

    batches: list = []
    original = evaluator.Evaluator.score

    def score(self, programs):
        res = original(self, programs)
        batches.append([(canonical(p), s.train_error, s.complexity) for p, s in zip(programs, res, strict=True)])
        return res

    def plain_many(programs, ctx):
        return [score_program(p, ctx, fused=False) for p in programs]

    evaluator.Evaluator.score = score
    many = evaluator.score_many
    if not fused:
        evaluator.score_many = plain_many
    try:
        args = ["run", "--generations", str(generations), "--seed", str(seed), "--run-dir", run_dir]
        rc = cli_main(args)
        if rc:  # the search said why, in one line
            raise SystemExit(rc)
    finally:
        evaluator.Evaluator.score = original
        evaluator.score_many = many
    return batches


def main(argv: list[str] | None = None) -> None:
    ap = OneLineParser(prog="python benchmarks/rank_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--generations", type=positive_int, default=50, metavar="N")
    ap.add_argument("--seed", type=seed_arg, default=3, metavar="S")
    args = ap.parse_args(argv)
    # in a temporary folder: the searches' runs/LATEST goes there, not into the caller's runs/
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        plain = _run(False, args.generations, args.seed, f"{tmp}/plain")
        fused = _run(True, args.generations, args.seed, f"{tmp}/fused")
    first = next(
        (i for i, (a, b) in enumerate(zip(plain, fused, strict=False)) if [x[0] for x in a] != [x[0] for x in b]),
        None,
    )
    shared = plain[:first] if first is not None else plain
    seen_p: dict = {}
    seen_f: dict = {}
    worst = 0.0
    complexity_differs = []
    for bp, bf in zip(shared, fused, strict=False):
        for (key, ep, cp), (_, ef, cf) in zip(bp, bf, strict=True):
            seen_p[key], seen_f[key] = (ep, cp), (ef, cf)
            if ep < 1e9:
                worst = max(worst, abs(ep - ef) / ep)
            if cp != cf:
                complexity_differs.append((key, cp, cf))
    keys = list(seen_p)
    swaps = []
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            (pa, _), (pb, _) = seen_p[a], seen_p[b]
            (fa, _), (fb, _) = seen_f[a], seen_f[b]
            if (pa > pb) - (pa < pb) != (fa > fb) - (fa < fb):
                swaps.append((abs(pa - pb) / min(pa, pb), a, b))
    print(f"{len(plain)} scoring batches plain, {len(fused)} fused")
    print(f"first batch whose candidates differ: {first} (the searches part there)")
    print(f"{len(keys)} distinct candidates before it; largest relative difference of one error: {worst:.1e}")
    print(f"pairs ranked differently: {len(swaps)}, errors at most {max((s[0] for s in swaps), default=0):.1e} apart")
    for gap, a, b in sorted(swaps, reverse=True)[:5]:
        print(f"  {gap:.1e}  {a}  vs  {b}")
    print(
        f"complexity differs (a coefficient at 0 in one, ~1e-15 of its share in the other): {len(complexity_differs)}"
    )
    for key, cp, cf in complexity_differs[:5]:
        print(f"  {key}: {cp} plain, {cf} fused")


if __name__ == "__main__":
    main()
