"""Go printer, registry code generation, golden vectors and export: the parts that need no Go."""

import math
import re

import numpy as np
import pytest
import sympy as sp

from archive.entry import ArchiveEntry
from primitives.deployment import default_resolver
from primitives.errors import InputError
from primitives.language import parse_infix, pdiv, symbol
from primitives.registry import FEATURES, PRIMITIVES
from translate_go.codegen import (
    CONSTANT_GO_NAMES,
    PRIMITIVE_GO_NAMES,
    expression_primitives,
    features_source,
    step_function_source,
)
from translate_go.export import export_go
from translate_go.goformat import format_go_expr
from translate_go.golden import (
    batch_checksum,
    decode_batches,
    encode_batches,
    python_step_time_us,
    random_batches,
    round_overhead_us,
    round_step_us,
    splitmix_draws,
)
from translate_go.gomod import enclosing_go_mod
from translate_go.gosource import align_rows, comment_lines
from translate_go.printer import (
    GoCodePrinter,
    GoPrintError,
    NameAllocator,
    go_camel,
    go_float_literal,
    go_identifier,
    lower_statements,
)

x, y, z = symbol("x"), symbol("y"), symbol("z")


def go(expr, names=None):
    p = GoCodePrinter(names)
    return p.doprint_expr(expr), p


@pytest.fixture(scope="module")
def llama70():
    return default_resolver().resolve("llama-2-70b", 4)


# --- printer ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, text",
    [
        (1 / 3, "0.3333333333333333"),
        (2.0, "2.0"),
        (1e20, "1e+20"),
        (-1.5e-7, "-1.5e-07"),
        (34488324096.0, "34488324096.0"),
    ],
)
def test_float_literals_round_trip(value, text):
    assert go_float_literal(value) == text
    assert float(text) == value  # Go parses decimal literals correctly rounded too
    assert go_float_literal(float("nan")) == "math.NaN()"
    assert go_float_literal(float("-inf")) == "math.Inf(-1)"


def test_no_integer_division_or_int_literals():
    for expr in (x / 3, sp.Rational(1, 3) * x, 2 * x * y / 3, x + 1, sp.Integer(7), sp.Rational(1, 3)):
        text, _ = go(expr)
        assert not re.search(r"(?<![\w.])\d+(?![\d.e])", text.replace("e+", "").replace("e-", "")), text
    assert go(x / 3)[0] == "0.3333333333333333*x"
    assert go(sp.Rational(1, 3))[0] == "0.3333333333333333"


def test_max_min_nested_and_math_flag():
    text, p = go(sp.Max(x, y, z, 1))
    assert text.count("math.Max(") == 3 and p.uses_math
    text, p = go(sp.Min(x, y))
    assert text == "math.Min(x, y)"
    text, p = go(x + y)
    assert not p.uses_math and not p.uses_pdiv


def test_powers():
    assert go(x**2)[0] == "(x*x)"
    assert go(x**3)[0] == "(x*x*x)"
    assert go(x**-2)[0] == "(1.0/(x*x))"
    assert go(1 / x)[0] == "(1.0/x)"
    assert go(3 * x / y**2)[0] == "3.0*x/(y*y)"
    assert go(x**5)[0] == "math.Pow(x, 5.0)"
    assert go(x**1.5)[0] == "math.Pow(x, 1.5)"
    assert go(sp.sqrt(sp.Abs(x - y)))[0] == "math.Sqrt(math.Abs(x - y))"
    w = sp.Symbol("w")  # no sign assumption: Abs stays
    assert go(sp.log(1 + sp.Abs(w)))[0] == "math.Log(math.Abs(w) + 1.0)"
    assert go((1 - x) ** sp.Max(y, 1))[0] == "math.Pow(1.0 - x, math.Max(1.0, y))"
    assert go(sp.exp(x))[0] == "math.Exp(x)"


def test_pdiv_and_names():
    text, p = go(pdiv(x + y, z), {"x": "weightTimeUs"})
    assert text == "pdiv(weightTimeUs + y, z)" and p.uses_pdiv


def test_unsupported_function_is_a_clear_error():
    with pytest.raises(GoPrintError, match="no Go translation"):
        go(sp.Function("mystery")(x))
    with pytest.raises(GoPrintError, match="lower"):
        go(sp.Piecewise((x, y > 1), (z, True)))


def test_reserved_words_and_camel_case():
    assert go_identifier("range") == "rangeV"
    assert go_identifier("len") == "lenV"
    assert go_identifier("max") == "maxV"
    assert go_identifier("math") == "mathV"
    assert go_camel("kv_bytes_per_token_per_gpu") == "kvBytesPerTokenPerGPU"
    assert go_camel("weight_time_us") == "weightTimeUs"
    assert go(sp.Symbol("type"))[0] == "typeV"
    # registry names are unique Go identifiers, constants never shadowed by primitive locals
    assert len(set(PRIMITIVE_GO_NAMES.values())) == len(PRIMITIVES)
    assert not set(CONSTANT_GO_NAMES.values()) & set(PRIMITIVE_GO_NAMES.values())


def test_piecewise_lowering_and_cse():
    expr = sp.Piecewise(
        (x + 1, x > y), (sp.Piecewise((y, (y < 1) | (z > 2)), (z, True)), sp.And(x < 2, y >= 3)), (0, True)
    ) + sp.Max(x + y, 2) * pdiv(x + y, sp.sqrt(x + y))
    p = GoCodePrinter()
    lines, result = lower_statements(expr, p, NameAllocator())
    text = "\n".join(lines)
    assert "cse0 := x + y" in text
    assert "var pw0 float64" in text and "var pw1 float64" in text
    assert "} else if " in text and "?" not in text
    assert "pw1" in result and "cse0" in result and p.uses_pdiv
    # no default branch: sympy's Piecewise is nan there
    lines, _ = lower_statements(sp.Piecewise((x, x > 1)), GoCodePrinter(), NameAllocator())
    assert any("math.NaN()" in line for line in lines)


# --- gofmt layout emulation ------------------------------------------------------
@pytest.mark.parametrize(
    "src, want",
    [
        ("a + b*c", "a + b*c"),
        ("math.Max(a, b + c)", "math.Max(a, b+c)"),
        ("((x*x))", "(x * x)"),
        ("a*(b + c)", "a * (b + c)"),
        ("f(a + b)", "f(a + b)"),
        ("x - -2.0", "x - -2.0"),
        ("a < b && c >= d || !e", "a < b && c >= d || !e"),
    ],
)
def test_goformat(src, want):
    assert format_go_expr(src) == want


def test_align_rows():
    rows = align_rows([("a", "float64", "= 1.0", "// x"), ("bbbb", "float64", "= 10.25", "// y")])
    assert rows == ["\ta    float64 = 1.0   // x", "\tbbbb float64 = 10.25 // y"]


# --- registry code generation ------------------------------------------------------
def test_every_primitive_and_feature_prints(llama70):
    for p in PRIMITIVES:
        src = step_function_source("f_" + p.name, symbol(p.name)).text
        go = PRIMITIVE_GO_NAMES[p.name]  # computed once, from the registry's own definition, and returned
        assert f"func f_{p.name}(batch []*Request) float64 {{" in src, src
        assert f"\t{go} := " in src and src.rstrip().endswith(f"\treturn {go}\n}}"), src
    feats = features_source([f.name for f in FEATURES])
    assert "func reduceBatch(batch []*Request) batchFeatures" in feats.text
    assert "progress < inputLen" in feats.text  # the registry's phase relational
    assert "if v := newTokens + progress; v > f.maxKVTokens {" in feats.text
    # only the request fields used are declared (unused locals do not compile)
    assert "outputLen" not in feats.text
    only_kv = features_source(["kv_tokens"]).text
    assert "inputLen" not in only_kv and "inPrefill" not in only_kv


def test_unknown_symbol_rejected():
    with pytest.raises(GoPrintError, match="not primitives"):
        expression_primitives(symbol("weight_time_us") + sp.Symbol("bogus"))


# --- golden vectors ---------------------------------------------------------------------
def test_splitmix_matches_reference():
    # SplitMix64 seeded with 0: the published first outputs
    assert [int(v) for v in splitmix_draws(0, 0, 2)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


def test_random_batches_shape_and_determinism():
    a, b = random_batches(200, seed=3), random_batches(200, seed=3)
    assert all((u == v).all() for u, v in zip(a, b, strict=True))
    c = random_batches(200, seed=4)
    assert any((u != v).any() if u.shape == v.shape else True for u, v in zip(a, c, strict=True))
    rows = np.concatenate(a)
    sizes = [len(u) for u in a]
    assert min(sizes) >= 1 and max(sizes) <= 128
    prefill = rows[:, 0] < rows[:, 2]
    assert 0.2 < prefill.mean() < 0.8
    assert (rows[:, 0] + rows[:, 1]).max() <= 4096 and rows.min() >= 0
    assert (rows[~prefill, 1] == 1).all() and (rows[prefill, 1] <= 2048).all()
    assert any(s == 0 for s in [int((u[:, 0] < u[:, 2]).sum()) for u in a])  # all-decode batches occur
    assert batch_checksum(a[0]) == int(a[0].sum())
    assert all((u == v).all() for u, v in zip(a, decode_batches(encode_batches(a)), strict=True))


def test_python_reference_matches_hand_computation(llama70):
    c = llama70.constants
    batch = np.array([[0, 100, 200, 0], [300, 1, 250, 51]])  # one prefill chunk, one decode
    expr = parse_infix("weight_time_us + 2*kv_io_time_us + attention_work + pdiv(1, decode_tokens - 1)")
    got = python_step_time_us(expr, llama70, [batch, np.zeros((0, 4), dtype=np.int64)])
    kv = (0 + 100) + (300 + 1)
    total = 101
    attention_work = 100 * (0 + 50) + 1 * (300 + 0.5)
    want = (
        c["weight_bytes_per_gpu"] / c["hbm_bytes_per_us"]
        + 2 * c["kv_bytes_per_token_per_gpu"] * (kv + total) / c["hbm_bytes_per_us"]
        + attention_work
    )
    assert got[0] == pytest.approx(want, rel=1e-12)
    assert got[1] == pytest.approx(c["weight_bytes_per_gpu"] / c["hbm_bytes_per_us"] - 1, rel=1e-12)


def test_rounding_mirrors_go():
    assert round_step_us(float("nan")) == 1
    assert round_step_us(-3) == 1 and round_step_us(0.2) == 1
    assert round_step_us(1.5) == 2 and round_step_us(2.5) == 3 and round_step_us(2.4999) == 2
    assert round_step_us(1e30) == 2**63 - 1
    assert round_step_us(2.0**52 + 1) == 2**52 + 1
    assert round_overhead_us(-1) == 0 and round_overhead_us(0.5) == 1


# --- export (no Go needed) -----------------------------------------------------------
def _entry(text, overheads=None):
    return ArchiveEntry(
        id="e1",
        expression=text,
        simplified=text,
        complexity=5,
        constants=[],
        objectives={"step_mape": 0.1},
        generation=2,
        primitives=[],
        overheads=overheads or {},
        run_id="run",
        dataset_fingerprint="fp",
    )


def test_export_writes_files_and_header(tmp_path, llama70):
    entry = _entry("1.1*weight_time_us + pdiv(attention_time_us, batch_size)")
    paths = export_go(entry, llama70, tmp_path, interface="seed", n_golden=20)
    names = sorted(p.name for p in paths)
    assert names == ["go.mod", "step_time.go", "step_time_test.go"]
    src = (tmp_path / "step_time.go").read_text()
    assert "1.1*weight_time_us + pdiv(attention_time_us, batch_size)" in src
    assert "Archive entry: e1" in src and "Data fingerprint: fp" in src and "step_mape=0.1" in src
    prose = " ".join(line.lstrip("/ ") for line in src.splitlines())  # comments unwrapped
    assert "carries none, so every non-step term is BLIS's default 0 µs" in prose
    assert re.search(r"weightBytesPerGPU\s+float64 = 34488324096.0 // bytes", src)
    assert "func pdiv(x, y float64) float64" in src
    assert "SchedulingProcessingTime() int64" in src and "PostDecodeFixedOverhead" not in src.split("package")[1]
    assert (tmp_path / "go.mod").read_text().startswith("module steptime\n")
    test_src = (tmp_path / "step_time_test.go").read_text()
    assert test_src.count("\n\t{") >= 20 and "BenchmarkStepTime" in test_src
    # the second export into a module keeps its go.mod
    (tmp_path / "go.mod").write_text("module custom\n\ngo 1.22\n")
    sub = tmp_path / "sub"
    paths = export_go(_entry("weight_time_us"), llama70, sub, interface="blis", n_golden=5)
    assert sorted(p.name for p in paths) == ["step_time.go", "step_time_test.go"]
    assert enclosing_go_mod(sub) == tmp_path / "go.mod"
    blis = (sub / "step_time.go").read_text()
    assert "PostDecodeFixedOverhead() int64" in blis and "SchedulingProcessingTime() int64" not in blis
    assert "roundStepUs(stepTimeUs(batch) + schedulingProcessingUs)" in blis
    assert "func pdiv" not in blis  # helpers only when used


def test_export_is_deterministic(tmp_path, llama70):
    e = _entry("Max(matmul_time_us, weight_time_us) + 3", {"queueing_base_us": 10.0})
    a = [p.read_text() for p in export_go(e, llama70, tmp_path / "a", n_golden=30, seed=7)]
    b = [p.read_text() for p in export_go(e, llama70, tmp_path / "b", n_golden=30, seed=7)]
    assert a == b


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"interface": "grpc"}, "interface"),
        ({"package": "Step-Time"}, "package"),
        ({"n_golden": 0}, "n_golden"),
    ],
)
def test_export_bad_arguments(tmp_path, llama70, kwargs, field):
    with pytest.raises(InputError, match=field):
        export_go(_entry("weight_time_us"), llama70, tmp_path, **kwargs)


def test_export_bad_entries(tmp_path, llama70):
    with pytest.raises(InputError, match="expression"):
        export_go(_entry("weight_time_us +* 2"), llama70, tmp_path)
    with pytest.raises(InputError, match="not primitives"):
        export_go(_entry("weight_time_us + bogus"), llama70, tmp_path)
    with pytest.raises(InputError, match="overheads"):
        export_go(_entry("weight_time_us", {"queueing_typo_us": 1.0}), llama70, tmp_path)
    with pytest.raises(InputError, match="finite"):
        export_go(_entry("weight_time_us", {"queueing_base_us": math.inf}), llama70, tmp_path)


def test_comment_wrapping_avoids_gofmt_list_markers():
    lines = comment_lines("aaaa bbbb 0. cccc - dddd 12) eeee # ffff", width=9)
    assert not any(re.match(r"^([-*+]|\d+[.)]|#)(\s|$)", line) for line in lines)
    assert " ".join(lines) == "aaaa bbbb 0. cccc - dddd 12) eeee # ffff"
